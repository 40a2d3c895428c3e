"""Manual cordons: an SRE takes one device out of scheduling without touching the rest of the node.

A cordon is a NoSchedule condition from the health source "cordon". It does not mark the device
unhealthy (the device works; someone wants it left alone), so running workloads keep it. Cordons
live in `<data dir>/cordons.json` and outlive the daemon: the file is written before the
inventory changes, so a cordon that was acknowledged is never lost to a crash. A cordon names a
device, not a discovery result, so one whose device is absent (drained GPU, NIC moved) stays in
the file and applies again when the device returns.

Every change re-reads the file under a lock (thread + flock), so two daemon instances sharing
the data dir during a rolling update never drop each other's cordons.
"""

from __future__ import annotations

import contextlib
import difflib
import json
import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cdi import atomic_write
from driver.errors import InvalidInput
from driver.fsutil import Upgrade, locked, read_json_state, unchanged
from driver.inventory.store import Inventory
from driver.model import Condition, TaintEffect
from driver.resource_api import rfc3339

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
UPGRADES: Mapping[int, Upgrade] = {0: unchanged}  # a file without a version has version 1's layout
TAINT_VALUE = "manual"
MAX_REASON = 256
MAX_NAME = 64  # the name a client gives (`tandemctl --by`)
MAX_BY = 96  # that name and the kernel's word on the client ("alice (uid 0, pid 4194304)")


class CordonError(InvalidInput):
    """A cordon request that is refused; the message is meant for the SRE who made it."""


class UnknownDevice(CordonError):
    pass


@dataclass(frozen=True)
class Cordon:
    device: str
    reason: str
    by: str = ""
    since: str = ""  # RFC 3339, UTC

    def to_json(self) -> dict[str, str]:
        return {"device": self.device, "reason": self.reason, "by": self.by, "since": self.since}

    @classmethod
    def from_json(cls, device: str, raw: Any) -> Cordon:
        if not isinstance(raw, dict):
            raise TypeError("entry is not an object")
        fields = {k: raw.get(k, "") for k in ("reason", "by", "since")}
        if not all(isinstance(v, str) for v in fields.values()) or not fields["reason"]:
            raise TypeError("reason, by and since must be strings, reason non-empty")
        return cls(device=device, **fields)

    def message(self) -> str:
        who = f" by {self.by}" if self.by else ""
        return f"cordoned{who} at {self.since}: {self.reason}"


def unknown_device(inventory: Inventory, device: str) -> UnknownDevice:
    """The error for a device name the inventory does not know, with the closest names."""
    known = [d.name for d in inventory.devices()]
    close = difflib.get_close_matches(device, known, n=3, cutoff=0.5)
    hint = f"; did you mean {', '.join(close)}?" if close else f"; known devices: {', '.join(known) or 'none'}"
    return UnknownDevice(f"unknown device {device!r}{hint}")


def check_text(what: str, text: str, limit: int, required: bool) -> str:
    """One line of printable text an SRE typed (a reason, a name), stripped and within `limit`."""
    text = text.strip()
    if required and not text:
        raise CordonError(f"{what} must not be empty")
    if len(text) > limit:
        raise CordonError(f"{what} is {len(text)} characters, over the limit of {limit}")
    if any(not c.isprintable() for c in text):
        raise CordonError(f"{what} must be one line of printable characters")
    return text


class CordonStore:
    def __init__(
        self, data_dir: Path, inventory: Inventory, domain: str = "tandem.dev", source: str = "cordon"
    ) -> None:
        self.path = data_dir / "cordons.json"
        self._lock_path = data_dir / "cordons.lock"
        self._inventory = inventory
        self._key = f"{domain}/cordoned"
        self._source = source
        self._mutex = threading.Lock()

    def condition(self, cordon: Cordon) -> Condition:
        return Condition(
            key=self._key,
            effect=TaintEffect.NO_SCHEDULE,
            value=TAINT_VALUE,
            message=cordon.message(),
            unhealthy=False,
        )

    def _locked(self) -> contextlib.AbstractContextManager[None]:
        return locked(self._mutex, self._lock_path)

    def _read(self) -> dict[str, Cordon]:
        """The cordons on disk; a corrupt file is moved aside (and logged) rather than crash the daemon."""
        entries = read_json_state(self.path, "cordon", "cordons", dict, version=FORMAT_VERSION, upgrades=UPGRADES)
        out = {}
        for device, entry in entries.items():
            try:
                out[device] = Cordon.from_json(device, entry)
            except TypeError as e:
                log.error("cordon file %s: ignoring the entry for %r: %s", self.path, device, e)
        return out

    def _write(self, cordons: dict[str, Cordon]) -> None:
        doc = {
            "version": FORMAT_VERSION,
            "cordons": {
                name: {k: v for k, v in c.to_json().items() if k != "device"} for name, c in sorted(cordons.items())
            },
        }
        # Durable (fsynced): a cordon must outlive a reboot, and a power loss is one.
        atomic_write(self.path, json.dumps(doc, indent=1).encode(), mode=0o600)

    def _apply(self, cordons: dict[str, Cordon]) -> None:
        """Makes the inventory's "cordon" conditions exactly those of `cordons`."""
        for name in self._inventory.conditions(self._source).keys() - cordons.keys():
            self._inventory.set_conditions(self._source, name, ())
        for name, cordon in cordons.items():
            self._inventory.set_conditions(self._source, name, [self.condition(cordon)])

    def load(self) -> list[Cordon]:
        with self._locked():
            cordons = self._read()
            self._apply(cordons)
        if cordons:
            log.info("cordons in effect: %s", ", ".join(sorted(cordons)))
        return sorted(cordons.values(), key=lambda c: c.device)

    def cordon(self, device: str, reason: str, by: str = "") -> Cordon:
        reason = check_text("reason", reason, MAX_REASON, required=True)
        by = check_text("by", by, MAX_BY, required=False)
        if self._inventory.get(device) is None:
            raise unknown_device(self._inventory, device)
        new = Cordon(device=device, reason=reason, by=by, since=rfc3339())
        with self._locked():
            cordons = self._read()
            cordons[device] = new
            self._write(cordons)
            self._apply(cordons)
        log.warning("device %s cordoned by %s: %s", device, by or "unknown", reason)
        return new

    def uncordon(self, device: str) -> bool:
        """Lifts a cordon; True if there was one. Works for absent devices too, so a retired one can be cleaned up."""
        with self._locked():
            cordons = self._read()
            removed = cordons.pop(device, None)
            if removed is not None:
                self._write(cordons)
            self._apply(cordons)
        if removed is not None:
            log.warning("device %s uncordoned (was: %s)", device, removed.reason)
        return removed is not None

    def list(self) -> list[Cordon]:
        with self._locked():
            cordons = self._read()
        return sorted(cordons.values(), key=lambda c: c.device)
