"""The record of prepared claims, shared by every driver instance on the node, for this boot.

The kubelet may send Unprepare to a different process than the one that prepared (restart,
rolling update) and does not resend the claim, so everything unprepare needs lives here. The
file is versioned as every state file is (`driver.fsutil`): a field a newer release added never
breaks this reader, and is kept on rewrite (`ClaimRecord.extra`); a file of a newer format
version, like a corrupt one, is moved aside with an error instead of crash-looping the daemon.

A file moved aside (or missing) loses the record of claims that may still be prepared: the
checkpoint is then `incomplete`, and says so in the file (so the other instance of a rolling
update and the next start know it too), until start-up reconciliation has rebuilt what is still
in use from the files on disk and the API server (`mark_complete`).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import logging
import os
import re
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from cdi import atomic_write
from driver.claims.vocabulary import PrepareState, Sharing, TimeSliceInterval, member_of
from driver.config import is_uid
from driver.fsutil import PREPARED_STATE_DURABLE, Upgrade, locked, parse_state, set_aside, unchanged
from driver.kube.types import NetworkDeviceData
from driver.model import MigPlacement

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
UPGRADES: Mapping[int, Upgrade] = {0: unchanged}  # a file without a version has version 1's layout
# An instance ID as `InstanceLock` users make them (`<pod UID>-<8 hex digits>`): one plain file name.
_INSTANCE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9-]{0,127}")


@dataclass(frozen=True)
class DeviceRecord:
    request_names: tuple[str, ...]
    pool: str
    device: str
    cdi_device_ids: tuple[str, ...] = ()
    share_id: str | None = None
    admin_access: bool = False
    # What the claim status and metadata say about a NIC, so a later address change can be
    # told apart and written again; `exclusive` NICs live in the pod and cannot be followed.
    network_data: NetworkDeviceData | None = field(default=None, hash=False)
    exclusive: bool = False
    # Dynamic MIG: the GPU instance this device is made as. Recorded before it is made and removed
    # only after it is destroyed, so a crash at any step leaves a record of what may exist.
    mig: MigPlacement | None = None
    # Consumable capacity: what this share consumed (the allocation's consumedCapacity), and how
    # the GPU is shared (MPS: its control daemon runs while a record says so, `driver.claims.gpu.mps`).
    consumed: dict[str, str] = field(default_factory=dict, hash=False)
    sharing: Sharing | None = None
    # TimeSlicing: the GPU's time-slice interval this claim set (`driver.claims.gpu.time_slices`), recorded
    # before it is applied.
    time_slice: TimeSliceInterval | None = None

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> DeviceRecord:
        nd = raw.get("networkData")
        mig = raw.get("migPlacement")
        return cls(
            request_names=tuple(raw.get("requestNames", ())),
            pool=str(raw["pool"]),
            device=str(raw["device"]),
            cdi_device_ids=tuple(raw.get("cdiDeviceIDs", ())),
            share_id=raw.get("shareID"),
            admin_access=bool(raw.get("adminAccess", False)),
            network_data=cast(NetworkDeviceData, dict(nd)) if isinstance(nd, dict) else None,
            exclusive=bool(raw.get("exclusive", False)),
            mig=MigPlacement(str(mig["parentUUID"]), int(mig["profileID"]), int(mig["start"]), int(mig["size"]))
            if isinstance(mig, dict)
            else None,
            consumed={str(k): str(v) for k, v in (raw.get("consumedCapacity") or {}).items()},
            sharing=member_of(Sharing, str(raw["sharing"]), "sharing") if raw.get("sharing") else None,
            time_slice=member_of(TimeSliceInterval, str(raw["timeSliceInterval"]), "timeSliceInterval")
            if raw.get("timeSliceInterval")
            else None,
        )

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"requestNames": list(self.request_names), "pool": self.pool, "device": self.device}
        if self.cdi_device_ids:
            out["cdiDeviceIDs"] = list(self.cdi_device_ids)
        if self.share_id is not None:
            out["shareID"] = self.share_id
        if self.admin_access:
            out["adminAccess"] = True
        if self.network_data is not None:
            out["networkData"] = self.network_data
        if self.exclusive:
            out["exclusive"] = True
        if self.mig is not None:
            m = self.mig
            out["migPlacement"] = {
                "parentUUID": m.parent_uuid,
                "profileID": m.profile_id,
                "start": m.start,
                "size": m.size,
            }
        if self.consumed:
            out["consumedCapacity"] = dict(self.consumed)
        if self.sharing:
            out["sharing"] = self.sharing
        if self.time_slice:
            out["timeSliceInterval"] = self.time_slice
        return out


@dataclass(frozen=True)
class ClaimRecord:
    namespace: str
    name: str
    uid: str
    state: PrepareState = PrepareState.COMPLETED
    devices: tuple[DeviceRecord, ...] = ()
    # The driver instance that wrote a PrepareStarted record: only that instance may be mid-prepare.
    owner: str = ""
    # The pods (in the claim's namespace) its `status.reservedFor` named when it was prepared, for
    # `tandemctl`'s "who holds this device"; a record of an older release has none.
    pods: tuple[str, ...] = ()
    # Fields written by a newer driver version, kept so that a rewrite by this version loses nothing.
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    @classmethod
    def from_json(cls, uid: str, raw: dict[str, Any]) -> ClaimRecord:
        known = {"namespace", "name", "state", "devices", "owner", "pods"}
        return cls(
            namespace=str(raw["namespace"]),
            name=str(raw["name"]),
            uid=uid,
            state=member_of(PrepareState, str(raw.get("state", PrepareState.COMPLETED)), "state"),
            devices=tuple(DeviceRecord.from_json(d) for d in raw.get("devices", ())),
            owner=str(raw.get("owner", "")),
            pods=tuple(str(p) for p in raw.get("pods", ())),
            extra={k: v for k, v in raw.items() if k not in known},
        )

    @functools.cached_property
    def json_text(self) -> str:
        """Encoded once per record: every checkpoint write re-emits all unchanged records, so a
        prepare must not pay for encoding the others (O(1) encoding instead of O(claims))."""
        return json.dumps(self.to_json(), separators=(",", ":"))

    def to_json(self) -> dict[str, Any]:
        return {
            **self.extra,
            "namespace": self.namespace,
            "name": self.name,
            "state": self.state,
            "devices": [d.to_json() for d in self.devices],
            **({"owner": self.owner} if self.owner else {}),
            **({"pods": list(self.pods)} if self.pods else {}),
        }


class Checkpoint:
    """`<data dir>/checkpoint.json`, guarded by a thread lock and `<data dir>/serialize.lock` (flock).

    Every transaction re-reads the file under the lock, so two daemon instances on one node
    (rolling update) always see each other's writes.
    """

    def __init__(self, data_dir: Path, boot_id: str) -> None:
        self.path = data_dir / "checkpoint.json"
        self._lock_path = data_dir / "serialize.lock"
        self._boot_id = boot_id
        self._mutex = threading.Lock()
        self._cache: tuple[tuple[int, int, int, int], dict[str, ClaimRecord]] | None = None
        self._cache_fd: int | None = None
        self._incomplete = False

    @property
    def incomplete(self) -> bool:
        """As of the last read: claims may be prepared that no record names (see the module docstring)."""
        return self._incomplete

    def _locked(self) -> contextlib.AbstractContextManager[None]:
        return locked(self._mutex, self._lock_path)

    def _load(self) -> dict[str, ClaimRecord]:
        """The claims on disk; parsed again only when the file changed since this process last saw it.

        Without the cache every transaction would decode every claim, making a prepare cost grow
        with the number of prepared claims while the lock is held.
        """
        try:
            st = self.path.stat()
        except FileNotFoundError:
            self._incomplete = True  # never written, or moved aside: what is prepared is unknown
            return {}
        if self._cache is not None and self._cache[0] == _identity(st):
            return dict(self._cache[1])
        claims = self._parse()
        self._remember(claims)
        return claims

    def _remember(self, claims: dict[str, ClaimRecord]) -> None:
        """Cache what the file holds now, keeping it open: while this process holds the inode, a
        later file (the other instance's atomic rewrite) cannot get the same inode number, so a
        changed file is always noticed, even within one timestamp tick."""
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            return
        if self._cache_fd is not None:
            os.close(self._cache_fd)
        self._cache_fd = fd
        self._cache = (_identity(os.fstat(fd)), dict(claims))

    def _parse(self) -> dict[str, ClaimRecord]:
        try:
            raw = parse_state(self.path.read_bytes(), FORMAT_VERSION, UPGRADES)
            if not isinstance(raw.get("claims", {}), dict):
                raise ValueError("top level has no 'claims' object")
            if self._boot_id and raw.get("bootID") not in (None, "", self._boot_id):
                log.warning(
                    "checkpoint is from an earlier boot; its %d claims are no longer prepared",
                    len(raw.get("claims", {})),
                )
                self._incomplete = False  # nothing of an earlier boot is prepared now
                return {}
            claims = {}
            for uid, c in raw.get("claims", {}).items():
                if not is_uid(uid):  # never written by a driver: prepare validates every UID first
                    log.error("checkpoint record under %r dropped: not a claim UID", uid[:80])
                    continue
                claims[uid] = ClaimRecord.from_json(uid, c)
            self._incomplete = raw.get("incomplete") is True
            return claims
        except FileNotFoundError:
            self._incomplete = True
            return {}
        except Exception as e:  # any shape or version we cannot read: never a reason to crash-loop
            set_aside(
                self.path,
                "checkpoint",
                e,
                "the prepared claims are rebuilt at the next start-up from the files on disk and the API server",
            )
            self._incomplete = True
            return {}

    def _store(self, claims: dict[str, ClaimRecord]) -> None:
        top: dict[str, Any] = {"version": FORMAT_VERSION, "bootID": self._boot_id}
        if self._incomplete:
            top["incomplete"] = True
        head = json.dumps(top, separators=(",", ":"))
        body = ",".join(f"{json.dumps(uid)}:{c.json_text}" for uid, c in sorted(claims.items()))
        # Atomic, not durable: the record is discarded at the next boot (`driver.fsutil`).
        atomic_write(
            self.path, f'{head[:-1]},"claims":{{{body}}}}}'.encode(), mode=0o600, durable=PREPARED_STATE_DURABLE
        )
        self._remember(claims)

    def read(self) -> dict[str, ClaimRecord]:
        with self._locked():
            return self._load()

    def mark_complete(self) -> None:
        """Every prepared claim has its record again: drop the `incomplete` mark from the file."""
        with self._locked():
            claims = self._load()
            if self._incomplete:
                self._incomplete = False
                self._store(claims)

    @contextlib.contextmanager
    def transaction(self) -> Iterator[dict[str, ClaimRecord]]:
        """Yields the current claims; stores them atomically when the block ends without error."""
        with self._locked():
            claims = self._load()
            before = dict(claims)
            yield claims
            if claims != before:
                self._store(claims)


def _identity(st: os.stat_result) -> tuple[int, int, int, int]:
    return (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)


class InstanceLock:
    """Held (flock) for the whole life of a driver instance, so others can tell it is alive.

    During a rolling update two instances share the data dir. A PrepareStarted record left by a
    crashed instance must be rolled back, but one of a live instance is a prepare in flight; the
    lock tells which, without relying on PIDs (pods do not share a PID namespace).
    """

    def __init__(self, data_dir: Path, instance_id: str) -> None:
        self.instance_id = instance_id
        self._dir = data_dir / "instances"
        self._dir.mkdir(parents=True, exist_ok=True)
        self._fd = self._lock_own_file(self._dir / f"{instance_id}.lock")
        for other in self._dir.glob("*.lock"):  # tidy the locks of instances that died
            self.is_alive(other.name.removesuffix(".lock"))

    @staticmethod
    def _lock_own_file(path: Path) -> int:
        """Created and locked in two steps: an instance starting beside this one may find the file
        unlocked in between, take this instance for dead and remove it. A lock on a file no name
        leads to says nothing to others, so then it starts again with a new file."""
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            try:
                if os.stat(path).st_ino == os.fstat(fd).st_ino:
                    return fd
            except FileNotFoundError:
                pass
            os.close(fd)

    def is_alive(self, instance_id: str) -> bool:
        if instance_id == self.instance_id:
            return True
        if not _INSTANCE_ID.fullmatch(instance_id):  # no instance has it; and it is no file name of ours
            return False
        path = self._dir / f"{instance_id}.lock"
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)
        path.unlink(missing_ok=True)  # its owner is gone: tidy up
        return False

    def release(self) -> None:
        os.close(self._fd)
        (self._dir / f"{self.instance_id}.lock").unlink(missing_ok=True)
