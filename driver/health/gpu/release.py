"""Letting go of NVML for GPU resets and driver upgrades: `tandemctl release` and `reacquire`.

A GPU reset (`nvidia-smi -r`, which Tandem's own NoExecute taints ask for) needs no process
holding the GPU, and a driver upgrade needs no process holding NVML; the GPU health monitor holds
NVML for the daemon's life. So an SRE releases one GPU or all of NVML, and takes it back after.
nvmlInit opens every GPU (`node.nvml`), so either way Tandem lets go of NVML as a whole:

* `node.nvml.NvmlAccess` refuses new nvmlInit calls, has the open sessions closed and waits
  until every one is shut down; a release answers only then, or says that it timed out and the
  GPU is not safe to reset yet. Until the reacquire nothing initialises NVML: GPU discovery keeps
  the devices as last found, the health monitor keeps their last verdicts;
* the released GPU's devices carry the condition `released` (NoSchedule, unhealthy: the device is
  not monitored and about to be reset), whose message says who released it, when, why and how to
  take it back, in the slice, the kubelet's health stream and `tandemctl`; after a release of one
  GPU the others stay schedulable and carry `unmonitored` (effect None), which says why;
* a reacquire lifts the conditions, lets NVML be initialised again and rediscovers the GPUs (a
  driver upgrade changes their attributes); the monitor's next probe judges the GPUs afresh, and
  it is evidence of a reset (`resets`) for the GPUs taken back: the window for `nvidia-smi -r`;
* `tandemctl clear <device> --reason` is the operator's word that the GPU was reset or is healthy
  (`clear`): evidence too, recorded with who, why and when in `<data dir>/cleared.json` (the last
  `MAX_CLEARS`) before it takes effect.

Releases are durable in `<data dir>/released.json`, written before they take effect: a daemon
restarted in the middle of a reset or an upgrade must not take NVML back behind the SRE's back
(fail closed). Such a daemon discovers no GPUs until the reacquire, since it cannot enumerate them
without NVML, and `tandemctl health` says so.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cdi import atomic_write
from driver.errors import InvalidInput, NodeError
from driver.fsutil import Upgrade, boot_id, locked, read_json_state, unchanged
from driver.health.cordon import MAX_BY, MAX_REASON, check_text, unknown_device
from driver.health.gpu.held import held_gpus
from driver.health.gpu.policy import UNMONITORED
from driver.health.gpu.resets import EVERY_GPU, RESET_EVIDENCE, ResetEvidence
from driver.inventory.store import Inventory
from driver.model import Condition, TaintEffect
from driver.node.nvml import NVML_ACCESS, NvmlAccess
from driver.resource_api import rfc3339

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
UPGRADES: Mapping[int, Upgrade] = {0: unchanged}  # a file without a version has version 1's layout
RELEASE_TIMEOUT = 20.0  # seconds a release waits for NVML's sessions to close
EVERYTHING = EVERY_GPU  # the key (and `gpu`) of a release of all of NVML
MAX_CLEARS = 100  # the clears `cleared.json` keeps, the newest


class ReleaseError(InvalidInput):
    """A release or reacquire that is refused; the message is meant for the SRE who asked."""


class ReleaseTimeout(NodeError):
    """Released, but NVML still held a session when the wait ended: the GPU is not safe to reset."""


@dataclass(frozen=True)
class Release:
    gpu: str  # the GPU's UUID; EVERYTHING for all of NVML
    device: str  # the device the SRE named ("" for all): reacquire finds it by that name after a restart
    reason: str
    by: str = ""
    since: str = ""  # RFC 3339, UTC

    @property
    def target(self) -> str:
        """What to give `tandemctl reacquire` to take this back."""
        return (self.device or self.gpu) if self.gpu else "--all"

    def to_json(self) -> dict[str, str]:
        return {"gpu": self.gpu, "device": self.device, "reason": self.reason, "by": self.by, "since": self.since}

    @classmethod
    def from_json(cls, raw: Any) -> Release:
        if not isinstance(raw, dict) or not all(isinstance(raw.get(k, ""), str) for k in cls.__dataclass_fields__):
            raise TypeError("a release is an object of strings")
        return cls(**{k: raw.get(k, "") for k in cls.__dataclass_fields__})

    def message(self) -> str:
        what = "NVML released" if not self.gpu else "released"
        who = f" by {self.by}" if self.by else ""
        return f"{what}{who} at {self.since}: {self.reason}; not monitored until `tandemctl reacquire {self.target}`"


class GpuReleases:
    def __init__(
        self,
        data_dir: Path,
        inventory: Inventory,
        *,
        domain: str = "tandem.dev",
        source: str = "release",
        access: NvmlAccess = NVML_ACCESS,
        on_reacquire: Callable[[], None] = lambda: None,
        timeout: float = RELEASE_TIMEOUT,
        evidence: ResetEvidence = RESET_EVIDENCE,
        held: Callable[[], set[str]] | None = None,
    ) -> None:
        """`on_reacquire` runs after a reacquire took something back (the daemon rediscovers GPUs);
        `held`: the GPUs whose reset XIDs wait for evidence now (default: as the GPU monitor wrote
        them, `held.held_gpus`)."""
        self._held = held or (lambda: held_gpus(data_dir, boot_id()))
        self.path = data_dir / "released.json"
        self.clears_path = data_dir / "cleared.json"
        self._evidence = evidence
        self._lock_path = data_dir / "released.lock"
        self._inventory = inventory
        self._key = f"{domain}/released"
        self._unmonitored = f"{domain}/{UNMONITORED}"
        self._source = source
        self._access = access
        self._on_reacquire = on_reacquire
        self._timeout = timeout
        self._ops = threading.Lock()  # one release or reacquire at a time, through its wait
        self._file = threading.Lock()
        self._releases: dict[str, Release] = {}  # by GPU UUID; EVERYTHING for all of NVML

    # --- requests --------------------------------------------------------------------------------

    def load(self) -> list[Release]:
        """At start-up, before anything initialises NVML: what was released stays released."""
        with self._ops:
            with locked(self._file, self._lock_path):
                self._releases = self._read()
            self._access.set_released(self._released(), self._timeout)  # nothing is open yet
            self._apply()
        for r in self._releases.values():
            log.warning("%s stays released from before this start: %s", r.device or "NVML", r.message())
        return self.current()

    def release(self, device: str, reason: str, by: str = "") -> list[str]:
        """Release one GPU (named by any of its devices) or, with `device` "", all of NVML; the
        devices now tainted. Returns once NVML let go; ReleaseTimeout when it did not in time."""
        reason = check_text("reason", reason, MAX_REASON, required=True)
        by = check_text("by", by, MAX_BY, required=False)
        with self._ops:
            gpu = self._gpu_of(device) if device else EVERYTHING
            release = Release(gpu, device, reason, by, rfc3339())
            with locked(self._file, self._lock_path):
                releases = self._read()
                releases[gpu] = release
                self._write(releases)  # durable before it takes effect
            self._releases = releases
            self._apply()
            start = time.monotonic()
            let_go = self._access.set_released(self._released(), self._timeout)
        if not let_go:
            raise ReleaseTimeout(
                f"{device or 'NVML'} is released, but {self._access.open_sessions()} NVML session(s) were still open "
                f"after {self._timeout:g}s: do not reset yet; see the daemon's log, then run the release again"
            )
        log.warning(
            "%s released by %s (NVML let go in %.2fs): %s",
            device or "NVML",
            by or "unknown",
            time.monotonic() - start,
            reason,
        )
        return self._devices_of(gpu)

    def reacquire(self, device: str) -> list[Release]:
        """Take back one GPU (by a device name, the name it was released by, or its UUID) or, with
        `device` "", everything; the releases that ended (none: it was not released)."""
        with self._ops:
            with locked(self._file, self._lock_path):
                releases = self._read()
                keys = list(releases) if not device else [k for k in releases if device in (releases[k].device, k)]
                if device and not keys and (d := self._inventory.get(device)) is not None and d.gpu is not None:
                    keys = [k for k in (d.gpu.parent_uuid or d.gpu.uuid,) if k in releases]
                ended = [releases.pop(k) for k in keys]
                if ended:
                    self._write(releases)
            for r in ended:  # before NVML is let back: the monitor's first probe finds the evidence
                self._evidence.report(
                    r.gpu, f"reacquired after a release by {r.by or 'unknown'} at {r.since}: {r.reason}"
                )
            self._releases = releases
            self._access.set_released(self._released(), self._timeout)  # nothing was open to wait for
            self._apply()
        for r in ended:
            log.warning("%s reacquired (was released: %s)", r.device or "NVML", r.reason)
        if ended:
            self._on_reacquire()
        return ended

    def clear(self, device: str, reason: str, by: str = "") -> list[str]:
        """The operator's word that the GPU of `device` was reset or is healthy: what waits for a
        reset (`resets`) clears. Recorded durably first; the GPU's devices."""
        reason = check_text("reason", reason, MAX_REASON, required=True)
        by = check_text("by", by, MAX_BY, required=False)
        with self._ops:
            record = Release(self._gpu_of(device), device, reason, by, rfc3339())
            if record.gpu not in self._held():
                raise ReleaseError(
                    f"nothing to clear: no reset XID of {device}'s GPU waits for a reset (its other taints clear "
                    "on their own, or by `tandemctl reacquire` or `uncordon`); nothing was recorded"
                )
            with locked(self._file, self._lock_path):
                entries = read_json_state(self.clears_path, "clear", "clears", list, version=FORMAT_VERSION)
                doc = {"version": FORMAT_VERSION, "clears": [*entries, record.to_json()][-MAX_CLEARS:]}
                atomic_write(self.clears_path, json.dumps(doc, indent=1).encode(), mode=0o600)
        log.warning("%s cleared by %s: %s", device, by or "unknown", reason)
        self._evidence.report(record.gpu, f"cleared by {by or 'unknown'} at {record.since}: {reason}")
        return self._devices_of(record.gpu)

    def current(self) -> list[Release]:
        """What this daemon holds released now."""
        with self._ops:
            return sorted(self._releases.values(), key=lambda r: (r.gpu != EVERYTHING, r.device, r.gpu))

    def problems(self) -> list[str]:
        """For `tandemctl health`: every release makes the node degraded, and says why."""
        out = []
        for r in self.current():
            out.append(f"{'NVML' if not r.gpu else r.device or r.gpu}: {r.message()}")
        if out:
            out.append("GPUs are not rediscovered while anything is released")
        return out

    # --- the inventory ---------------------------------------------------------------------------

    def _gpu_of(self, device: str) -> str:
        d = self._inventory.get(device)
        if d is None:
            raise unknown_device(self._inventory, device)
        if d.gpu is None or not (d.gpu.parent_uuid or d.gpu.uuid):  # a MIG partition not made yet has no UUID
            raise ReleaseError(f"{device} is not a GPU: only GPUs are held through NVML")
        return d.gpu.parent_uuid or d.gpu.uuid

    def _devices_of(self, gpu: str) -> list[str]:
        return sorted(
            d.name
            for d in self._inventory.devices()
            if d.gpu is not None and (gpu == EVERYTHING or gpu in (d.gpu.uuid, d.gpu.parent_uuid))
        )

    def _released(self) -> str:
        """Why NVML is released, for whoever is refused an nvmlInit; "" when nothing is."""
        if EVERYTHING in self._releases:
            return "NVML is released (tandemctl release --all)"
        names = sorted(r.device or r.gpu for r in self._releases.values())
        return f"NVML is released while {', '.join(names)} is released (tandemctl release)" if names else ""

    def _apply(self) -> None:
        """Makes the inventory's "release" conditions exactly those of the releases in force: the
        released GPUs' devices are `released`, the other GPUs' `unmonitored` (NVML is let go)."""
        everything = self._releases.get(EVERYTHING)
        unmonitored = f"not monitored: {self._released()}"
        wanted: dict[str, Condition] = {}
        for d in self._inventory.devices():
            if d.gpu is None or not self._releases:
                continue
            release = self._releases.get(d.gpu.parent_uuid or d.gpu.uuid) or everything
            if release is None:
                wanted[d.name] = Condition(self._unmonitored, TaintEffect.NONE, "", unmonitored, unhealthy=False)
            else:
                value = "nvml" if release is everything else "gpu"
                wanted[d.name] = Condition(self._key, TaintEffect.NO_SCHEDULE, value, release.message(), unhealthy=True)
        for name in self._inventory.conditions(self._source).keys() - wanted.keys():
            self._inventory.set_conditions(self._source, name, ())
        for name, cond in wanted.items():
            self._inventory.set_conditions(self._source, name, [cond])

    # --- the file --------------------------------------------------------------------------------

    def _read(self) -> dict[str, Release]:
        """The releases on disk; a corrupt file is moved aside (and logged), as a corrupt cordon file is."""
        entries = read_json_state(self.path, "release", "releases", list, version=FORMAT_VERSION, upgrades=UPGRADES)
        out = {}
        for entry in entries:
            try:
                release = Release.from_json(entry)
            except TypeError as e:
                log.error("release file %s: ignoring the entry %r: %s", self.path, entry, e)
                continue
            out[release.gpu] = release
        return out

    def _write(self, releases: dict[str, Release]) -> None:
        doc = {"version": FORMAT_VERSION, "releases": [r.to_json() for _, r in sorted(releases.items())]}
        # Durable (fsynced): a released GPU must stay released across a reboot, a power loss included.
        atomic_write(self.path, json.dumps(doc, indent=1).encode(), mode=0o600)
