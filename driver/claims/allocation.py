"""A claim as the prepare path sees it: the kubelet's reference, validated, and the devices the
scheduler allocated to this driver in this node's pool, none of them prepared for another claim.

Claim names, namespaces and UIDs come from the kubelet but name API objects and files: they are
validated before anything else sees them. Shared by the prepare transaction and the NIC
network-data refresh, which also share the per-claim locks (`ClaimLocks`).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from cdi import is_dns_label, is_dns_subdomain
from driver.claims.checkpoint import ClaimRecord, DeviceRecord
from driver.config import is_uid
from driver.errors import InvalidInput
from driver.kube.types import AllocatedDeviceStatus, ResourceClaim
from driver.untrusted import shown

POD_CLAIM_NAME_ANNOTATION = "resource.kubernetes.io/pod-claim-name"


@dataclass(frozen=True)
class ClaimRef:
    namespace: str
    name: str
    uid: str


class PendingApply(Protocol):
    """A status apply sent, its answer not read yet (`driver.kube.api.Pending`)."""

    def wait(self) -> Exception | None:
        """Read the answer; its error, if any. With an answer (error or not) the server is done
        with the apply; after a timeout or a broken connection it may still carry it out."""

    def result(self) -> None:
        """`wait`, raising the error."""


class ClaimAPI(Protocol):
    """What the prepare path needs of the API server (`driver.kube.api.KubeAPI`)."""

    def get_claim(self, namespace: str, name: str) -> ResourceClaim: ...

    def apply_claim_status(
        self, namespace: str, name: str, devices: list[AllocatedDeviceStatus], field_manager: str, *, uid: str
    ) -> None:
        """`uid` is required: with it the server refuses to write to a claim that was deleted and
        recreated under the same name, so a late call about the old claim cannot touch the new one."""

    def send_claim_status(
        self, namespace: str, name: str, devices: list[AllocatedDeviceStatus], field_manager: str, *, uid: str
    ) -> PendingApply:
        """`apply_claim_status`, sent now and answered later, so that a prepare's files are written
        while the server applies."""


class ClaimError(InvalidInput):
    """This claim cannot be prepared; the message goes back to the kubelet for this claim only."""


@dataclass(frozen=True)
class PrepareSettings:
    driver_name: str
    pool: str  # this node's pool = node name
    cdi_root: Path
    dev_root: Path
    # The kernel's device majors and the NVIDIA driver's proc files, for making missing device nodes.
    proc_root: Path = Path("/proc")


def validate_ref(ref: ClaimRef) -> None:
    if not is_dns_label(ref.namespace):
        raise ClaimError(f"invalid claim namespace {shown(ref.namespace)}")
    if not is_dns_subdomain(ref.name):
        raise ClaimError(f"invalid claim name {shown(ref.name)}")
    if not is_uid(ref.uid):
        raise ClaimError(f"invalid claim UID {shown(ref.uid)}")


def strip_subrequest(request: str) -> str:
    """`gpu/large` -> `gpu`: the kubelet matches containers against the parent request name."""
    return request.split("/", 1)[0]


def consumer_pods(claim: ResourceClaim) -> tuple[str, ...]:
    """The pods `status.reservedFor` names (all in the claim's namespace), for the record that
    tells an SRE who holds a device; names that are not DNS subdomains are left out, not trusted."""
    reserved = (claim.get("status") or {}).get("reservedFor") or []
    names = (r.get("name", "") for r in reserved if isinstance(r, dict) and r.get("resource") == "pods")
    return tuple(n for n in names if isinstance(n, str) and is_dns_subdomain(n))


def allocated_devices(claim: ResourceClaim, ref: ClaimRef, driver_name: str, pool: str) -> list[DeviceRecord]:
    """This driver's devices in this node's pool, from a claim object read from the API server."""
    meta = claim.get("metadata") or {}
    if meta.get("uid") != ref.uid:
        raise ClaimError(
            f"claim {ref.namespace}/{ref.name} has UID {meta.get('uid')!r}, not {ref.uid!r}: it was replaced"
        )
    allocation = (claim.get("status") or {}).get("allocation")
    if not allocation:
        raise ClaimError(f"claim {ref.namespace}/{ref.name} is not allocated")
    results = ((allocation.get("devices") or {}).get("results")) or []
    by_device: dict[tuple[str, str, str | None], DeviceRecord] = {}
    for r in results:
        if r.get("driver") != driver_name:
            continue
        if r.get("pool") != pool:
            raise ClaimError(
                f"claim {ref.namespace}/{ref.name}: device {r.get('device')!r} is in pool {r.get('pool')!r}, "
                f"not this node's pool {pool!r}"
            )
        key = (r["pool"], r["device"], r.get("shareID"))
        names: tuple[str, ...] = (strip_subrequest(r["request"]),)
        admin = bool(r.get("adminAccess", False))
        old = by_device.get(key)
        if old is not None:  # one device serving several requests; any ordinary one makes it ordinary
            names = tuple(dict.fromkeys(old.request_names + names))
            admin = admin and old.admin_access
        by_device[key] = DeviceRecord(
            request_names=names,
            pool=r["pool"],
            device=r["device"],
            share_id=r.get("shareID"),
            admin_access=admin,
            consumed={str(k): str(v) for k, v in (r.get("consumedCapacity") or {}).items()},
        )
    return list(by_device.values())


def check_not_in_use(ref: ClaimRef, devices: list[DeviceRecord], claims: dict[str, ClaimRecord]) -> None:
    """Last line of defence against scheduler races and force-deleted pods."""
    for d in devices:
        if d.admin_access or d.share_id is not None:
            continue
        for other in claims.values():
            if other.uid == ref.uid:
                continue
            for od in other.devices:
                if od.device == d.device and not od.admin_access and od.share_id is None:
                    raise ClaimError(
                        f"device {d.device!r} is already prepared for claim {other.namespace}/{other.name} "
                        f"({other.uid})"
                    )


class _ClaimLock:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.users = 0  # threads holding or waiting for `lock`; changed under ClaimLocks._guard


class ClaimLocks:
    """One lock per claim UID: calls about different claims run in parallel, calls about one claim
    (prepare, unprepare, a network-data refresh) one after the other.

    A lock lives in the table exactly as long as some thread holds it or waits for it, so the
    table stays as small as the number of claims being worked on, and no caller can ever get a
    fresh lock while another thread still holds or awaits the old one of the same claim.
    """

    def __init__(self) -> None:
        self._locks: dict[str, _ClaimLock] = {}
        self._guard = threading.Lock()

    @contextlib.contextmanager
    def hold(self, uid: str) -> Iterator[None]:
        with self._guard:
            entry = self._locks.setdefault(uid, _ClaimLock())
            entry.users += 1
        try:
            with entry.lock:
                yield
        finally:
            with self._guard:
                entry.users -= 1
                if entry.users == 0:
                    del self._locks[uid]

    @contextlib.contextmanager
    def hold_all(self, uids: Iterable[str]) -> Iterator[None]:
        """Every claim's lock, taken in UID order, so that two callers holding several never deadlock."""
        with contextlib.ExitStack() as stack:
            for uid in sorted(set(uids)):
                stack.enter_context(self.hold(uid))
            yield

    def held(self) -> set[str]:
        """The claims some thread holds or waits for now (for tests and diagnostics)."""
        with self._guard:
            return set(self._locks)
