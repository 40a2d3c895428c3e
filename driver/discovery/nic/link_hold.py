"""The link-hold state machine: a NIC's link facts are published only once they have held.

Link facts (`state`, `speed`, `portState`) change on every flap of a bad cable; published as they
are, each flap would be a ResourceSlice write seen by every scheduler. A new value is published
once it has held for `hold` seconds (health taints do the same, in `driver.health.nic.signals`).
Discovery only samples; with netlink, `link_events` counts the link messages between two samples,
so a link that went down and up again unseen still restarts the hold.

Pure apart from the injected clock and link-event counter; not thread-safe: the discovery that
owns it serialises calls.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

from driver.model import AttrValue, Device

LINK_FACTS = ("state", "speed", "portState")


@dataclass
class _HeldLink:
    published: dict[str, AttrValue | None]
    candidate: dict[str, AttrValue | None] | None = None
    since: float = 0.0
    events: int = 0


class LinkHold:
    """Per PCI function: the link facts last published, and a changed value waiting out its hold."""

    def __init__(self, hold: float, clock: Callable[[], float], link_events: Callable[[str], int]) -> None:
        self.hold = hold
        self._clock = clock
        self._link_events = link_events
        self._held: dict[str, _HeldLink] = {}

    def pending_until(self) -> float | None:
        """When a held change becomes due (clock time): rediscover then to publish it."""
        due = [h.since + self.hold for h in self._held.values() if h.candidate is not None]
        return min(due) if due else None

    def apply(self, devices: Mapping[str, Device]) -> dict[str, Device]:
        """The devices (by PCI address) as published now; functions not among them are forgotten."""
        held = {bdf: self._hold_link_facts(bdf, d) for bdf, d in devices.items()}
        self._held = {bdf: h for bdf, h in self._held.items() if bdf in devices}
        return held

    def _hold_link_facts(self, bdf: str, device: Device) -> Device:
        facts = {k: device.attributes.get(k) for k in LINK_FACTS}
        held = self._held.get(bdf)
        now = self._clock()
        events = self._link_events(device.nic.ifname) if device.nic else 0
        if held is None or self.hold <= 0 or not (device.nic and device.nic.present):
            self._held[bdf] = _HeldLink(facts, events=events)  # first sight, no hold, or moved away: at once
            return device
        if facts == held.published:
            held.candidate = None
        elif facts != held.candidate or events != held.events:
            held.candidate, held.since = facts, now
        held.events = events
        if held.candidate is not None and now - held.since >= self.hold:
            held.published, held.candidate = held.candidate, None
        attrs = {k: v for k, v in device.attributes.items() if k not in LINK_FACTS}
        attrs.update({k: v for k, v in held.published.items() if v is not None})
        return replace(device, attributes=attrs)
