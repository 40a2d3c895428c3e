"""Reset XIDs held until evidence (`resets`), kept across a restart of the daemon.

A reset-class XID on a driver that reports no recovery action is held until there is evidence of
a reset. The evidence is an event the daemon sees happen, so a daemon that forgot the hold when it
restarted would offer the GPU to the scheduler with no evidence at all: the held set is kept in
`<data dir>/held-resets.json`, rewritten (atomically) whenever it changes and read when the GPU
health monitor starts.

What an entry names, and why:

* the XID number, not the condition: the condition is made again by the policy in force, so a
  `--taint-effect` or `--ignored-xids` changed across the restart applies to it (an XID no longer
  held under the new policy is dropped);
* the UUID the condition is about (the GPU's, or a MIG device's) and the GPU's own UUID and PCI
  address. A GPU found again with that UUID *at another address* was taken out and seated in
  another slot, which is service (it lost power): its entries are dropped. A GPU of another UUID
  at that address is another GPU (the old one was replaced): the old one's entries are dropped.
  The minor number and device name are not used: they follow enumeration order and can change.
* the boot: a reboot resets every GPU (the driver initialises them anew), which is evidence, so an
  entry of an earlier boot is dropped. That is also why the file is not fsynced: a power loss is
  a reboot.

A GPU of an entry that is not in the inventory yet (NVML did not enumerate it at start-up: it may
still be off the bus) keeps its entry, applied as soon as the GPU is found; while the daemon runs,
a held GPU that leaves the inventory and comes back starts clean, as before (that is evidence:
`resets`). A GPU that never comes back keeps its entry, harmlessly (it taints nothing), until
another GPU is found at its address or the node reboots.

Only the GPU health monitor's thread uses this: no lock. The two instances of a rolling update
share the file; each writes the set it holds, which the same NVML events made.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cdi import atomic_write
from driver.fsutil import read_json_state
from driver.health.gpu.policy import XID, GpuDevices, GpuHealthPolicy
from driver.model import Condition

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
FILE_NAME = "held-resets.json"


@dataclass(frozen=True, order=True)
class Held:
    """One held reset XID of one subject."""

    gpu: str  # the physical GPU's UUID
    pci: str  # its PCI address when the XID was held
    subject: str  # the UUID the condition is recorded against: the GPU's, or a MIG device's
    xid: int

    def to_json(self) -> dict[str, Any]:
        return {"gpu": self.gpu, "pci": self.pci, "subject": self.subject, "xid": self.xid}

    @classmethod
    def from_json(cls, raw: Any) -> Held:
        if not isinstance(raw, dict):
            raise TypeError("an entry is an object")
        gpu, pci, subject, xid = (raw.get(k) for k in ("gpu", "pci", "subject", "xid"))
        if not (isinstance(gpu, str) and gpu and isinstance(pci, str) and isinstance(subject, str) and subject):
            raise TypeError("gpu and subject are non-empty strings, pci a string")
        if type(xid) is not int or not 0 <= xid < 2**32:
            raise TypeError("xid is a whole number below 2^32")
        return cls(gpu, pci, subject, xid)


class HeldResets:
    """The held set on disk, and the GPUs of loaded entries that this daemon has not found yet."""

    def __init__(self, data_dir: Path, boot: str) -> None:
        self.path = data_dir / FILE_NAME
        self._boot = boot
        self._waiting: dict[str, list[Held]] = {}  # GPU UUID -> its loaded entries, until it is found
        self._saved: list[Held] = []

    def load(self, policy: GpuHealthPolicy) -> list[tuple[str, Condition]]:
        """The (subject, condition) pairs to hold again, from the file of this boot."""
        doc = read_json_state(self.path, "held reset XIDs", "held", dict, version=FORMAT_VERSION)
        entries = []
        for item in doc.get("entries", []) if isinstance(doc.get("entries"), list) else []:
            try:
                entries.append(Held.from_json(item))
            except TypeError as e:
                log.error("%s: ignoring the entry %r: %s", self.path, item, e)
        if entries and doc.get("boot") != self._boot:
            log.warning("%d held reset XID(s) of an earlier boot dropped: a reboot resets every GPU", len(entries))
            entries = []
        kept = [h for h in entries if policy.needs_reset(h.xid, None)]
        for h in sorted(set(entries) - set(kept)):
            log.warning("GPU %s: XID %d is no longer held until a reset under this configuration", h.gpu, h.xid)
        self._waiting = {}
        for h in kept:
            self._waiting.setdefault(h.gpu, []).append(h)
            log.warning(
                "GPU %s (%s): XID %d still held from before this start, until evidence of a reset",
                h.gpu,
                h.pci or "no PCI address",
                h.xid,
            )
        self._saved = sorted(kept)
        return [(h.subject, policy.xid(h.xid, None)) for h in kept]

    def found(self, gpus: Mapping[str, GpuDevices]) -> list[str]:
        """Takes note of the inventory's GPUs: the subjects whose loaded entries no longer apply
        (their GPU is at another address, or another GPU is at theirs: module docstring)."""
        at = {gpu.pci: uuid for uuid, gpu in gpus.items() if gpu.pci}
        dropped = []
        for uuid, entries in list(self._waiting.items()):
            pci = entries[0].pci
            if uuid in gpus:
                if pci and gpus[uuid].pci and gpus[uuid].pci != pci:
                    log.warning(
                        "GPU %s is at %s now, not %s: moved to another slot, it was serviced; "
                        "its held reset XIDs are dropped",
                        uuid,
                        gpus[uuid].pci,
                        pci,
                    )
                    dropped += [h.subject for h in entries]
            elif pci and at.get(pci, uuid) != uuid:
                log.warning("GPU %s at %s was replaced by %s; its held reset XIDs are dropped", uuid, pci, at[pci])
                dropped += [h.subject for h in entries]
            else:
                continue  # not found yet
            del self._waiting[uuid]
        return dropped

    def waiting(self) -> set[str]:
        """The subjects of loaded entries whose GPU has not been found yet: not gone, only not here yet."""
        return {h.subject for entries in self._waiting.values() for h in entries}

    def save(
        self, held: Mapping[str, frozenset[Condition]], gpus: Mapping[str, GpuDevices], policy: GpuHealthPolicy
    ) -> None:
        """Writes the held set when it changed: `held` is each subject's held conditions."""
        owner = {s: (uuid, gpu.pci) for uuid, gpu in gpus.items() for s in (uuid, *gpu.instances.values()) if s}
        owner.update({h.subject: (h.gpu, h.pci) for entries in self._waiting.values() for h in entries})
        entries = sorted(
            Held(*owner[subject], subject, int(c.value))
            for subject, conds in held.items()
            if subject in owner
            for c in conds
            if c.key == policy.key(XID) and c.value.isdigit()
        )
        if entries == self._saved:
            return
        doc = {"version": FORMAT_VERSION, "held": {"boot": self._boot, "entries": [h.to_json() for h in entries]}}
        try:
            atomic_write(self.path, json.dumps(doc, indent=1).encode(), mode=0o600, durable=False)
        except OSError as e:  # the hold stands in memory; the next change writes again
            log.error("cannot write %s: %s; a restart now would forget the held reset XIDs", self.path, e)
            return
        self._saved = entries


def held_gpus(data_dir: Path, boot: str) -> set[str]:
    """The GPUs (UUIDs) with reset XIDs held now, as the GPU monitor last wrote them (it writes at
    every change of the held set): `tandemctl clear` has nothing to clear on any other GPU."""
    doc = read_json_state(data_dir / FILE_NAME, "held reset XIDs", "held", dict, version=FORMAT_VERSION)
    entries = doc.get("entries") if doc.get("boot") == boot else None
    return {e["gpu"] for e in entries or [] if isinstance(e, dict) and isinstance(e.get("gpu"), str)}
