"""NodePrepareResources / NodeUnprepareResources: from a claim reference to prepared devices.

One implementation behind both DRAPlugin versions. Every claim gets its own answer: a bad claim
is an error string for that claim, never a failed RPC that would hold back the pod's other claims.
Claim names, namespaces and UIDs come from the kubelet but name API objects and, later, files:
they are validated before anything else sees them.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

from driver.checkpoint import STATE_COMPLETED, Checkpoint, ClaimRecord, DeviceRecord
from driver.config import is_dns_label, is_dns_subdomain, is_uid
from driver.model import Device

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ClaimRef:
    namespace: str
    name: str
    uid: str


@dataclass(frozen=True)
class PrepareResult:
    devices: tuple[DeviceRecord, ...] = ()
    error: str = ""


class ClaimReader(Protocol):
    def get_claim(self, namespace: str, name: str) -> dict[str, Any]: ...


class ClaimError(Exception):
    """This claim cannot be prepared; the message goes back to the kubelet for this claim only."""


def validate_ref(ref: ClaimRef) -> None:
    if not is_dns_label(ref.namespace):
        raise ClaimError(f"invalid claim namespace {ref.namespace[:80]!r}")
    if not is_dns_subdomain(ref.name):
        raise ClaimError(f"invalid claim name {ref.name[:80]!r}")
    if not is_uid(ref.uid):
        raise ClaimError(f"invalid claim UID {ref.uid[:80]!r}")


def strip_subrequest(request: str) -> str:
    """`gpu/large` -> `gpu`: the kubelet matches containers against the parent request name."""
    return request.split("/", 1)[0]


def allocated_devices(claim: dict[str, Any], ref: ClaimRef, driver_name: str, pool: str) -> list[DeviceRecord]:
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
        names = (strip_subrequest(r["request"]),)
        old = by_device.get(key)
        if old is not None:  # one device serving several requests
            names = tuple(dict.fromkeys(old.request_names + names))
        by_device[key] = DeviceRecord(
            request_names=names,
            pool=r["pool"],
            device=r["device"],
            share_id=r.get("shareID"),
            admin_access=bool(r.get("adminAccess", False)),
        )
    return list(by_device.values())


class Preparer:
    """Prepares and unprepares claims. Concurrent calls for different claims run in parallel."""

    def __init__(
        self,
        claims: ClaimReader,
        checkpoint: Checkpoint,
        driver_name: str,
        pool: str,
        lookup_device: Callable[[str], Device | None],
        workers: int = 16,
    ) -> None:
        self._claims = claims
        self._checkpoint = checkpoint
        self._driver = driver_name
        self._pool = pool
        self._lookup = lookup_device
        self._pool_exec = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="claim")
        self._claim_locks: dict[str, threading.Lock] = {}
        self._claim_locks_guard = threading.Lock()

    def close(self) -> None:
        self._pool_exec.shutdown(wait=True)

    def _claim_lock(self, uid: str) -> threading.Lock:
        with self._claim_locks_guard:
            return self._claim_locks.setdefault(uid, threading.Lock())

    def prepare(self, refs: Sequence[ClaimRef]) -> dict[str, PrepareResult]:
        return dict(zip([r.uid for r in refs], self._pool_exec.map(self._prepare_one, refs), strict=True))

    def unprepare(self, refs: Sequence[ClaimRef]) -> dict[str, str]:
        return dict(zip([r.uid for r in refs], self._pool_exec.map(self._unprepare_one, refs), strict=True))

    def _prepare_one(self, ref: ClaimRef) -> PrepareResult:
        ctx = {"claim": ref.uid, "op": "prepare", "claim_namespace": ref.namespace, "claim_name": ref.name}
        try:
            validate_ref(ref)
            claim = self._claims.get_claim(ref.namespace, ref.name)
            devices = allocated_devices(claim, ref, self._driver, self._pool)
            with self._claim_lock(ref.uid):
                result = self._record(ref, devices)
            log.info("prepared %d device(s)", len(result.devices), extra=ctx)
            return result
        except ClaimError as e:
            log.warning("prepare failed: %s", e, extra=ctx)
            return PrepareResult(error=str(e))
        except Exception as e:  # an API or disk failure fails this claim only; the kubelet retries
            log.exception("prepare failed", extra=ctx)
            return PrepareResult(error=f"prepare of claim {ref.namespace}/{ref.name} failed: {e}")

    def _record(self, ref: ClaimRef, devices: list[DeviceRecord]) -> PrepareResult:
        for d in devices:
            if self._lookup(d.device) is None:
                raise ClaimError(f"device {d.device!r} is not (or no longer) present on this node")
        with self._checkpoint.transaction() as claims:
            existing = claims.get(ref.uid)
            if existing is not None and existing.state == STATE_COMPLETED:
                return PrepareResult(devices=existing.devices)  # idempotent: same answer again
            self._check_not_in_use(ref, devices, claims)
            claims[ref.uid] = ClaimRecord(
                namespace=ref.namespace, name=ref.name, uid=ref.uid, state=STATE_COMPLETED, devices=tuple(devices)
            )
        return PrepareResult(devices=tuple(devices))

    @staticmethod
    def _check_not_in_use(ref: ClaimRef, devices: list[DeviceRecord], claims: dict[str, ClaimRecord]) -> None:
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

    def _unprepare_one(self, ref: ClaimRef) -> str:
        ctx = {"claim": ref.uid, "op": "unprepare", "claim_namespace": ref.namespace, "claim_name": ref.name}
        try:
            validate_ref(ref)
        except ClaimError as e:
            # Nothing with such a reference can have been prepared: succeed so the kubelet stops asking.
            log.warning("unprepare of an invalid claim reference, nothing to do: %s", e, extra=ctx)
            return ""
        try:
            with self._claim_lock(ref.uid), self._checkpoint.transaction() as claims:
                if claims.pop(ref.uid, None) is None:
                    log.info("claim was not prepared here; nothing to do", extra=ctx)
                    return ""
            log.info("unprepared", extra=ctx)
            return ""
        except Exception as e:
            log.exception("unprepare failed", extra=ctx)
            return f"unprepare of claim {ref.namespace}/{ref.name} failed: {e}"

    def prepared(self) -> dict[str, ClaimRecord]:
        return self._checkpoint.read()
