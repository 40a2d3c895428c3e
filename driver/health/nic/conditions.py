"""What the NIC health monitor keeps of each NIC it watches, and the conditions that makes.

Per NIC: the parts of its inventory entry that are watched, one debounced signal each for its
link, its RDMA ports and its PCI function (`signals`), and the conditions last published.
Conditions: `<domain>/link-down`, `<domain>/rdma-port-down` and `<domain>/nic-lost`, one for
each signal whose fault has settled, with the taint effect the node configured (NoSchedule by
default, NoExecute for `nic-lost`) and a message that says which netdev, RDMA device or PCI
function and since when.

Kept apart from the monitor's thread (`driver.health.nic.monitor`), which reads the signals and
publishes, so that what a settled fault looks like as a condition is read in one place.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from driver.health.faults import Fault
from driver.health.nic.signals import LINK_DOWN, NIC_LOST, RDMA_PORT_DOWN, Debounced
from driver.model import Condition, NicInfo, TaintEffect
from driver.resource_api import rfc3339


@dataclass(frozen=True)
class NicView:
    """The parts of an inventory NIC the monitor watches; a change of any means a re-read."""

    name: str
    pci_address: str
    ifname: str
    rdma_device: str
    present: bool

    @classmethod
    def of(cls, name: str, info: NicInfo) -> NicView:
        return cls(name, info.pci_address, info.ifname, info.rdma_device, info.present)


@dataclass
class WatchedNic:
    nic: NicView
    link: Debounced | None = None  # None while the link is unobservable
    link_ifname: str = ""  # the netdev name when the link fault was first seen, for the message
    ifindex: int = 0
    ports: dict[int, Debounced] = field(default_factory=dict)
    lost: Debounced | None = None  # None until its PCI function is first looked for
    published: frozenset[Condition] = frozenset()

    def signals(self) -> list[Debounced]:
        return [d for d in (self.link, self.lost) if d is not None] + list(self.ports.values())


class NicConditions:
    """The condition keys of `domain` and their taint effects: `effects` overrides one per full
    key (e.g. `tandem.dev/link-down`); an unknown key is a ValueError."""

    def __init__(self, domain: str, effects: Mapping[str, TaintEffect] | None = None) -> None:
        self.link_key = f"{domain}/{LINK_DOWN}"
        self.port_key = f"{domain}/{RDMA_PORT_DOWN}"
        self.lost_key = f"{domain}/{NIC_LOST}"
        self.effects = {
            self.link_key: TaintEffect.NO_SCHEDULE,
            self.port_key: TaintEffect.NO_SCHEDULE,
            self.lost_key: TaintEffect.NO_EXECUTE,
        }
        for key, effect in (effects or {}).items():
            if key not in self.effects:
                raise ValueError(f"unknown NIC health condition {key!r}; known: {sorted(self.effects)}")
            self.effects[key] = TaintEffect(effect)

    def of(self, w: WatchedNic) -> frozenset[Condition]:
        """The conditions of the NIC's settled faults."""
        out = []
        if w.link is not None and w.link.reported is not None:
            f = w.link.reported
            out.append(self._condition(self.link_key, f, f"{w.link_ifname}: {f.reason}", w.link.reported_since_wall))
        if w.lost is not None and w.lost.reported is not None:
            f = w.lost.reported
            out.append(
                self._condition(self.lost_key, f, f"{w.nic.pci_address}: {f.reason}", w.lost.reported_since_wall)
            )
        for d in w.ports.values():
            if d.reported is not None:
                message = f"{w.nic.rdma_device}: {d.reported.reason}"
                out.append(self._condition(self.port_key, d.reported, message, d.reported_since_wall))
        return frozenset(out)

    def _condition(self, key: str, fault: Fault, message: str, since: float) -> Condition:
        return Condition(key, self.effects[key], fault.value, f"{message} since {rfc3339(since)}", unhealthy=True)
