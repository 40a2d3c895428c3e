"""NodePrepareResources / NodeUnprepareResources: from a claim reference to prepared devices.

One implementation behind both DRAPlugin versions. Every claim gets its own answer: a bad claim
is an error string for that claim, never a failed RPC that would hold back the pod's other claims.
Claim references are validated first (`driver.claims`).

Prepare is two-phase so that kill -9 at any line is recoverable. The checkpoint records
PrepareStarted *before* any file is written and PrepareCompleted after the last one; unprepare
removes files before the record. So a file on disk always has a record, and a PrepareStarted
record means "maybe half done": the next prepare of that claim redoes every (idempotent) step,
and start-up (`reconcile`) rolls back those whose owning instance is dead.

What goes into the claim status is `driver.claim_status`; keeping it current when a NIC's
addresses change later is `driver.claim_refresh`.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import cdi
from driver.checkpoint import STATE_COMPLETED, STATE_STARTED, Checkpoint, ClaimRecord, DeviceRecord, InstanceLock
from driver.claim_cdi import CLAIM_CLASS, ClaimSpecError, PlannedDevice, claim_spec, claim_spec_filename, claim_vendor
from driver.claim_status import network_data, status_entries
from driver.claims import (
    POD_CLAIM_NAME_ANNOTATION,
    ClaimAPI,
    ClaimError,
    ClaimLocks,
    ClaimRef,
    PrepareSettings,
    allocated_devices,
    validate_ref,
)
from driver.config_api import ConfigDecodeError, opaque_entries, resolve
from driver.discovery.nvidia_files import DriverFiles
from driver.logs import log_context
from driver.metadata import MetadataDevice, MetadataError, MetadataWriter, assign_metadata_ids, attributes_json
from driver.model import Device
from driver.resource_api import rfc3339

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PrepareResult:
    devices: tuple[DeviceRecord, ...] = ()
    error: str = ""


class Preparer:
    """Prepares and unprepares claims. Calls for different claims run in parallel; each claim
    is serialised by its own lock, and the checkpoint by a short file lock per transaction."""

    def __init__(
        self,
        api: ClaimAPI,
        checkpoint: Checkpoint,
        instance: InstanceLock,
        settings: PrepareSettings,
        lookup_device: Callable[[str], Device | None],
        driver_files: Callable[[], DriverFiles],
        metadata: MetadataWriter,
        workers: int = 16,
    ) -> None:
        self._api = api
        self._checkpoint = checkpoint
        self._instance = instance
        self._s = settings
        self._lookup = lookup_device
        self._driver_files = driver_files
        self._metadata = metadata
        self._pool_exec = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="claim")
        self.claim_locks = ClaimLocks()

    def close(self) -> None:
        self._pool_exec.shutdown(wait=True, cancel_futures=True)

    def prepare(self, refs: Sequence[ClaimRef], alive: Callable[[], bool] = lambda: True) -> dict[str, PrepareResult]:
        """`alive` says whether the kubelet still waits for the answer (its call has a deadline)."""
        results = self._pool_exec.map(lambda r: self._prepare_one(r, alive), refs)
        return dict(zip([r.uid for r in refs], results, strict=True))

    def unprepare(self, refs: Sequence[ClaimRef]) -> dict[str, str]:
        return dict(zip([r.uid for r in refs], self._pool_exec.map(self._unprepare_one, refs), strict=True))

    # --- prepare ------------------------------------------------------------------------------

    def _prepare_one(self, ref: ClaimRef, alive: Callable[[], bool]) -> PrepareResult:
        ctx = {"claim": ref.uid, "op": "prepare", "claim_namespace": ref.namespace, "claim_name": ref.name}
        with log_context(**ctx):
            return self._prepare_logged(ref, ctx, alive)

    def _prepare_logged(self, ref: ClaimRef, ctx: dict[str, str], alive: Callable[[], bool]) -> PrepareResult:
        try:
            validate_ref(ref)
            # The claim lock covers the GET too: an Unprepare that arrives while a slow GET is in
            # flight (the kubelet gave up on this call) then waits, and cleans up after us.
            with self.claim_locks.get(ref.uid):
                claim = self._api.get_claim(ref.namespace, ref.name)
                records = allocated_devices(claim, ref, self._s.driver_name, self._s.pool)
                planned = self._plan(claim, records)
                if not alive():
                    raise ClaimError("the kubelet cancelled this call; nothing was prepared")
                result = self._prepare_locked(ref, claim, records, planned, ctx)
            log.info("prepared %d device(s)", len(result.devices), extra=ctx)
            return result
        except ClaimError as e:
            log.warning("prepare failed: %s", e, extra=ctx)
            return PrepareResult(error=str(e))
        except Exception as e:  # an API or disk failure fails this claim only; the kubelet retries
            log.exception("prepare failed", extra=ctx)
            return PrepareResult(error=f"prepare of claim {ref.namespace}/{ref.name} failed: {e}")

    def _plan(self, claim: dict[str, Any], records: list[DeviceRecord]) -> list[PlannedDevice]:
        entries = opaque_entries(claim["status"]["allocation"], self._s.driver_name)
        planned = []
        for r in records:
            device = self._lookup(r.device)
            if device is None:
                raise ClaimError(f"device {r.device!r} is not (or no longer) present on this node")
            try:
                config = resolve(entries, r.request_names[0])
            except ConfigDecodeError as e:
                raise ClaimError(f"invalid opaque configuration: {e}") from e
            planned.append(PlannedDevice(device, r.request_names, config, r.share_id))
        return planned

    def _prepare_locked(
        self,
        ref: ClaimRef,
        claim: dict[str, Any],
        records: list[DeviceRecord],
        planned: list[PlannedDevice],
        ctx: dict[str, str],
    ) -> PrepareResult:
        try:
            spec, ids = claim_spec(self._s.driver_name, ref.uid, planned, self._s.dev_root, self._driver_files())
        except (ClaimSpecError, cdi.SpecError) as e:
            raise ClaimError(f"claim {ref.namespace}/{ref.name} cannot be given to a container: {e}") from e
        # Phase 1: claim the devices in the checkpoint before touching anything else.
        with self._checkpoint.transaction() as claims:
            existing = claims.get(ref.uid)
            if existing is not None and existing.state == STATE_COMPLETED:
                return PrepareResult(devices=existing.devices)  # idempotent: same answer again
            if existing is not None:
                log.info("completing a prepare that was interrupted", extra=ctx)
            self._check_not_in_use(ref, records, claims)
            claims[ref.uid] = ClaimRecord(
                namespace=ref.namespace,
                name=ref.name,
                uid=ref.uid,
                state=STATE_STARTED,
                devices=tuple(records),
                owner=self._instance.instance_id,
            )
        # Phase 2: idempotent side effects (files are rewritten whole, status is an apply).
        if spec is not None:
            cdi.write_spec(self._s.cdi_root, spec, claim_spec_filename(self._s.driver_name, ref.uid))
        metadata_ids = self._write_metadata(ref, claim, planned, ctx)
        done = _with_network_data(_with_cdi_ids(records, ids, metadata_ids), planned)
        self._api.apply_claim_status(
            ref.namespace,
            ref.name,
            status_entries(self._s, done, rfc3339()),
            field_manager=self._s.driver_name,
            uid=ref.uid,
        )
        with self._checkpoint.transaction() as claims:
            mine = claims.get(ref.uid)
            if mine is None or mine.state != STATE_STARTED or mine.owner != self._instance.instance_id:
                # The other instance of a rolling update unprepared the claim meanwhile: the
                # kubelet no longer wants it, so what this call wrote must not outlive it.
                self._remove_files(ref.uid, ClaimRecord(namespace=ref.namespace, name=ref.name, uid=ref.uid))
                raise ClaimError(f"claim {ref.namespace}/{ref.name} was unprepared while being prepared")
            claims[ref.uid] = ClaimRecord(
                namespace=ref.namespace, name=ref.name, uid=ref.uid, state=STATE_COMPLETED, devices=done
            )
        return PrepareResult(devices=done)

    def _write_metadata(
        self, ref: ClaimRef, claim: dict[str, Any], planned: list[PlannedDevice], ctx: dict[str, str]
    ) -> dict[str, str]:
        # Metadata names requests as allocated ("req/sub"), as the reference library does; the
        # kubelet's response uses the parent name only.
        refs: dict[tuple[str, str | None], list[str]] = {}
        for r in claim["status"]["allocation"]["devices"].get("results") or []:
            if r.get("driver") == self._s.driver_name:
                refs.setdefault((r["device"], r.get("shareID")), []).append(r["request"])
        pod_claim_name = ((claim.get("metadata") or {}).get("annotations") or {}).get(POD_CLAIM_NAME_ANNOTATION, "")
        devices = [
            MetadataDevice(
                request=request,
                pool=self._s.pool,
                name=p.device.name,
                attributes=attributes_json(p.device),
                network_data=network_data(p),
            )
            for p in planned
            for request in refs.get((p.device.name, p.share_id), list(p.request_names))
        ]
        try:
            return self._metadata.write(ref.namespace, ref.name, ref.uid, pod_claim_name, devices)
        except (OSError, MetadataError):
            # As the reference library does: metadata is a convenience, not a reason to fail the pod.
            log.exception("device metadata not written; the claim is prepared without it", extra=ctx)
            return {}

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

    # --- unprepare ----------------------------------------------------------------------------

    def _unprepare_one(self, ref: ClaimRef) -> str:
        ctx = {"claim": ref.uid, "op": "unprepare", "claim_namespace": ref.namespace, "claim_name": ref.name}
        with log_context(**ctx):
            return self._unprepare_logged(ref, ctx)

    def _unprepare_logged(self, ref: ClaimRef, ctx: dict[str, str]) -> str:
        try:
            validate_ref(ref)
        except ClaimError as e:
            # Nothing with such a reference can have been prepared: succeed so the kubelet stops asking.
            log.warning("unprepare of an invalid claim reference, nothing to do: %s", e, extra=ctx)
            return ""
        try:
            with self.claim_locks.get(ref.uid):
                record = self._checkpoint.read().get(ref.uid)
                if record is None:
                    log.info("claim was not prepared here; nothing to do", extra=ctx)
                    return ""
                # Files are keyed by UID and by the recorded name, never by what this call says:
                # a late Unprepare of an old claim must not touch a new claim of the same name.
                self._remove_files(ref.uid, record)
                self._clear_status(ref, ctx)
                with self._checkpoint.transaction() as claims:
                    claims.pop(ref.uid, None)
            self.claim_locks.forget(ref.uid)
            log.info("unprepared", extra=ctx)
            return ""
        except Exception as e:
            log.exception("unprepare failed", extra=ctx)
            return f"unprepare of claim {ref.namespace}/{ref.name} failed: {e}"

    def _remove_files(self, uid: str, record: ClaimRecord | None = None) -> None:
        """The claim's CDI spec and metadata specs (by UID) and, with its record, its metadata dir."""
        cdi.remove_spec(self._s.cdi_root, claim_spec_filename(self._s.driver_name, uid))
        self._metadata.remove_specs(uid)
        if record is not None:
            self._metadata.remove_claim_dir(record.namespace, record.name)

    def _clear_status(self, ref: ClaimRef, ctx: dict[str, str]) -> None:
        """Withdraw our status.devices entries; the claim may already be gone, which is fine."""
        try:
            self._api.apply_claim_status(ref.namespace, ref.name, [], field_manager=self._s.driver_name, uid=ref.uid)
        except Exception as e:
            log.info("claim status not cleared (%s); it goes with the claim", e, extra=ctx)

    # --- start-up reconciliation --------------------------------------------------------------

    def reconcile(self) -> None:
        """Roll back prepares interrupted by a dead instance; remove files no record accounts for."""
        with self._checkpoint.transaction() as claims:
            for uid, record in list(claims.items()):
                if record.state == STATE_STARTED and not self._instance.is_alive(record.owner):
                    log.warning(
                        "rolling back prepare of claim %s/%s interrupted by a crash",
                        record.namespace,
                        record.name,
                        extra={"claim": uid, "op": "reconcile"},
                    )
                    self._remove_files(uid, record)
                    del claims[uid]
            known_uids = set(claims)
            known_names = {(c.namespace, c.name) for c in claims.values()}
            for path in cdi.list_specs(self._s.cdi_root, claim_vendor(self._s.driver_name), CLAIM_CLASS):
                uid = path.name.rsplit("_", 1)[-1].removesuffix(".json")
                if uid not in known_uids:
                    log.info("removing orphaned CDI spec %s", path, extra={"op": "reconcile"})
                    path.unlink(missing_ok=True)
            for uid in self._metadata.owned_spec_uids() - known_uids:
                log.info("removing orphaned metadata CDI spec of claim %s", uid, extra={"op": "reconcile"})
                self._metadata.remove_specs(uid)
            for namespace, name in self._metadata.owned_claims() - known_names:
                log.info("removing orphaned device metadata of %s/%s", namespace, name, extra={"op": "reconcile"})
                self._metadata.remove_claim_dir(namespace, name)


def _with_network_data(records: tuple[DeviceRecord, ...], planned: list[PlannedDevice]) -> tuple[DeviceRecord, ...]:
    by_device = {(p.device.name, p.share_id): p for p in planned}
    out = []
    for r in records:
        p = by_device[(r.device, r.share_id)]
        out.append(dataclasses.replace(r, network_data=network_data(p), exclusive=p.config.nic.mode == "exclusive"))
    return tuple(out)


def _with_cdi_ids(
    records: list[DeviceRecord], ids: dict[str, list[str]], metadata_ids: dict[str, str]
) -> tuple[DeviceRecord, ...]:
    """Claim-spec IDs per device (one per share ID, in order), plus the metadata IDs."""
    remaining = {name: list(v) for name, v in ids.items()}
    extra = assign_metadata_ids([r.request_names for r in records], metadata_ids)
    out = []
    for r, meta in zip(records, extra, strict=True):
        own = remaining.get(r.device, [])
        out.append(
            DeviceRecord(
                request_names=r.request_names,
                pool=r.pool,
                device=r.device,
                cdi_device_ids=(*own[:1], *meta),
                share_id=r.share_id,
                admin_access=r.admin_access,
            )
        )
        del own[:1]
    return tuple(out)
