"""NodePrepareResources / NodeUnprepareResources: from a claim reference to prepared devices.

One implementation behind both DRAPlugin versions. Every claim gets its own answer: a bad claim
is an error string for that claim, never a failed RPC that would hold back the pod's other claims.
Claim references are validated first (`driver.claims.allocation`).

The kubelet sends the claims of one pod that are not prepared yet, for this driver, in one call
(docs/reference/kubelet-plugin.md, 'Batching'). So the claims of a call are read and
planned first, then prepared together: the GPU-NIC pairing and NIC lists in every claim's CDI
spec describe all of them (`driver.claims.cdi_spec`, `pod_devices`), and a container that gets several
of the pod's claims sees one consistent environment.

Prepare is two-phase so that kill -9 at any line is recoverable. The checkpoint records
PrepareStarted *before* any file is written and PrepareCompleted after the last one; unprepare
(`driver.claims.unprepare`) removes files before the record. So a file on disk always has a
record, and a PrepareStarted record means "maybe half done": the next prepare of that claim redoes
every (idempotent) step, and start-up (`driver.claims.reconcile`) rolls back those whose owning
instance is dead. Every file of a claim is named by its UID (`driver.claims.files`), so nothing
done for one claim touches another claim of the same name.

What goes into the claim status is `driver.claims.status`; keeping it current when a NIC's
addresses change later is `driver.claims.nic.network_data`. The status apply is a round trip to the API
server that depends on nothing written here, so it is sent before the file writes of phase 2 and
its answer read after them (the status withdrawal likewise around the file removals of
unprepare): the server works while we write, on the calling thread, and the claim's status is as
true when the kubelet gets the answer as if they had run one after the other.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import cdi
from driver.claims.allocation import (
    POD_CLAIM_NAME_ANNOTATION,
    ClaimAPI,
    ClaimError,
    ClaimLocks,
    ClaimRef,
    PrepareSettings,
    allocated_devices,
    check_not_in_use,
    consumer_pods,
    validate_ref,
)
from driver.claims.cdi_spec import ClaimSpecError, claim_spec, pairing_metadata, pod_pairs
from driver.claims.checkpoint import Checkpoint, ClaimRecord, DeviceRecord, InstanceLock
from driver.claims.device_nodes import DeviceNodes
from driver.claims.files import ClaimFiles
from driver.claims.gpu.mig import MigError, MigPartitions, with_placements
from driver.claims.gpu.sharing import GpuSharing, check_time_slices, with_sharing
from driver.claims.metadata import assign_metadata_ids
from driver.claims.metadata_format import MetadataDevice, MetadataError, attributes_json
from driver.claims.nic.homes import NicHomes
from driver.claims.nic.modes import check_nic_modes
from driver.claims.opaque_config import ConfigDecodeError, opaque_entries, resolve
from driver.claims.planned import PlannedDevice
from driver.claims.status import current_devices, network_data, status_entries
from driver.claims.unprepare import Unprepared, Unpreparer
from driver.claims.vocabulary import PrepareState
from driver.errors import Kind, error_kind
from driver.kube.types import ResourceClaim
from driver.logs import log_context
from driver.model import Device
from driver.node.driver_root import DriverFiles
from driver.resource_api import rfc3339

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PrepareResult:
    devices: tuple[DeviceRecord, ...] = ()
    error: str = ""
    error_kind: Kind | None = None  # with an error: whose problem it was (driver/errors.py), for metrics


@dataclass(frozen=True)
class _Planned:
    """A claim read and planned, to be prepared together with the other claims of its call."""

    ref: ClaimRef
    claim: ResourceClaim
    records: list[DeviceRecord]
    planned: list[PlannedDevice]
    ctx: dict[str, str]


class Preparer:
    """Prepares and unprepares claims. Calls for different claims run in parallel; each claim is
    serialised by its own lock, held by the calling thread for the whole call (so the worker pool
    never waits for a lock), and the checkpoint by a short file lock per transaction."""

    def __init__(
        self,
        api: ClaimAPI,
        checkpoint: Checkpoint,
        instance: InstanceLock,
        settings: PrepareSettings,
        lookup_device: Callable[[str], Device | None],
        driver_files: Callable[[], DriverFiles],
        files: ClaimFiles,
        partitions: MigPartitions,
        workers: int = 16,
        report_failure: Callable[[ClaimRef, str], None] = lambda _ref, _error: None,
        nic_homes: NicHomes | None = None,
        sharing: GpuSharing | None = None,
    ) -> None:
        self._api = api
        self._sharing = sharing or GpuSharing(None)  # shared GPUs: MPS limits and daemons, time slices
        self._report_failure = report_failure  # a Kubernetes Event on the claim (`driver.events`)
        self._nic_homes = nic_homes  # exclusive NICs' host identity, given back after the pod
        self._partitions = partitions
        self._checkpoint = checkpoint
        self._instance = instance
        self._s = settings
        self._lookup = lookup_device
        self._driver_files = driver_files
        self._files = files
        self._pool_exec = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="claim")
        self._unpreparer = Unpreparer(api, checkpoint, files, partitions, self._sharing, settings.driver_name)
        self.claim_locks = ClaimLocks()

    def close(self) -> None:
        self._pool_exec.shutdown(wait=True, cancel_futures=True)

    def prepare(self, refs: Sequence[ClaimRef], alive: Callable[[], bool] = lambda: True) -> dict[str, PrepareResult]:
        """The claims of one call, prepared together (module docstring). The claim locks cover the
        GETs too: an Unprepare that arrives while a slow GET is in flight (the kubelet gave up on
        this call) then waits, and cleans up after us. `alive` says whether the kubelet still
        waits for the answer (its call has a deadline)."""
        valid, results = self._valid_refs(refs, "prepare")
        with self.claim_locks.hold_all(valid):
            plans = self._each(self._plan_one, valid.values())
            ready = [p for p in plans if isinstance(p, _Planned)]
            results.update(
                (r.uid, p) for r, p in zip(valid.values(), plans, strict=True) if isinstance(p, PrepareResult)
            )
            pod_devices = [d for p in ready for d in p.planned]
            prepared = self._each(lambda p: self._prepare_one(p, pod_devices, alive), ready)
            results.update(zip([p.ref.uid for p in ready], prepared, strict=True))
        for ref in valid.values():
            if results[ref.uid].error:
                self._report_failure(ref, results[ref.uid].error)
        return {r.uid: results[r.uid] for r in refs}

    def unprepare(self, refs: Sequence[ClaimRef]) -> dict[str, Unprepared]:
        valid, invalid = self._valid_refs(refs, "unprepare")
        # Nothing with an invalid reference can have been prepared: succeed so the kubelet stops asking.
        results = dict.fromkeys(invalid, Unprepared())
        with self.claim_locks.hold_all(valid):
            results.update(zip(valid, self._each(self._unpreparer.unprepare, valid.values()), strict=True))
        return {r.uid: results[r.uid] for r in refs}

    def _each(self, fn: Callable[[Any], Any], items: Iterable[Any]) -> list[Any]:
        """`fn` over `items`, on the claim pool when there are several. One claim (the usual call:
        one pod with one claim of this driver) runs on the calling gRPC thread: two thread
        hand-offs less per call, a tenth of its CPU."""
        items = list(items)
        if len(items) <= 1:
            return [fn(i) for i in items]
        return list(self._pool_exec.map(fn, items))

    @staticmethod
    def _valid_refs(refs: Sequence[ClaimRef], op: str) -> tuple[dict[str, ClaimRef], dict[str, PrepareResult]]:
        """The valid references by UID (once each), and an error result for every invalid one."""
        valid: dict[str, ClaimRef] = {}
        invalid: dict[str, PrepareResult] = {}
        for ref in refs:
            try:
                validate_ref(ref)
            except ClaimError as e:
                log.warning("%s of an invalid claim reference: %s", op, e, extra={"op": op})
                invalid[ref.uid] = PrepareResult(error=str(e), error_kind=e.kind)
                continue
            valid.setdefault(ref.uid, ref)
        return valid, invalid

    # --- prepare ------------------------------------------------------------------------------

    def _plan_one(self, ref: ClaimRef) -> _Planned | PrepareResult:
        ctx = {"claim": ref.uid, "op": "prepare", "claim_namespace": ref.namespace, "claim_name": ref.name}
        with log_context(**ctx):
            try:
                claim = self._api.get_claim(ref.namespace, ref.name)
                records = allocated_devices(claim, ref, self._s.driver_name, self._s.pool)
                return _Planned(ref, claim, records, self._plan(claim, records), ctx)
            except Exception as e:
                return _failed(ref, ctx, e)

    def _prepare_one(self, p: _Planned, pod_devices: list[PlannedDevice], alive: Callable[[], bool]) -> PrepareResult:
        with log_context(**p.ctx):
            try:
                if not alive():
                    raise ClaimError("the kubelet cancelled this call; nothing was prepared")
                result = self._prepare_planned(p, pod_devices)
                log.info("prepared %d device(s)", len(result.devices), extra=p.ctx)
                return result
            except Exception as e:
                return _failed(p.ref, p.ctx, e)

    def _plan(self, claim: ResourceClaim, records: list[DeviceRecord]) -> list[PlannedDevice]:
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
            planned.append(PlannedDevice(device, r.request_names, config, r.share_id, r.consumed))
        check_nic_modes(planned)
        return self._sharing.plan(planned)

    def _spec(
        self, ref: ClaimRef, planned: list[PlannedDevice], pod_devices: list[PlannedDevice]
    ) -> tuple[cdi.Spec | None, dict[str, list[str]]]:
        try:
            nodes = DeviceNodes(self._s.dev_root, self._s.proc_root)
            return claim_spec(
                self._s.driver_name, ref.uid, planned, nodes, self._driver_files(), pod_devices=pod_devices
            )
        except (ClaimSpecError, cdi.SpecError) as e:
            raise ClaimError(f"claim {ref.namespace}/{ref.name} cannot be given to a container: {e}") from e

    def _realised(self, p: _Planned, retry: bool) -> list[PlannedDevice]:
        """Dynamic MIG: the claim's MIG devices made after phase 1 recorded them; found made only
        when an earlier call for this claim recorded them first (`retry`). A failure that left the
        node as it was rolls phase 1 back: a record naming nothing made must not outlive the call
        (unprepare would destroy whatever is at those placements, someone else's included)."""
        try:
            planned = [d.device for d in p.planned]
            devices = self._partitions.realise(planned, p.ref.uid, retry, lambda: p.ref.uid in self._checkpoint.read())
        except MigError as e:
            if e.nothing_left:
                with self._checkpoint.transaction() as claims:
                    mine = claims.get(p.ref.uid)
                    if mine and mine.state == PrepareState.STARTED and mine.owner == self._instance.instance_id:
                        del claims[p.ref.uid]
            raise ClaimError(f"claim {p.ref.namespace}/{p.ref.name}: {e}") from e
        return [dataclasses.replace(d, device=m) for d, m in zip(p.planned, devices, strict=True)]

    def _prepare_planned(self, p: _Planned, pod_devices: list[PlannedDevice]) -> PrepareResult:
        ref = p.ref
        self._unpreparer.undo_if_reallocated(p.ref, p.records, p.ctx)
        records = with_sharing(with_placements(p.records, {d.device.name: d.device for d in p.planned}), p.planned)
        dynamic = any(r.mig for r in records)  # its spec needs the MIG devices, made after phase 1
        spec, ids = (None, {}) if dynamic else self._spec(ref, p.planned, pod_devices)
        # Phase 1: claim the devices in the checkpoint before touching anything else.
        with self._checkpoint.transaction() as claims:
            existing = claims.get(ref.uid)
            retry = existing is not None
            if existing is not None and existing.state == PrepareState.COMPLETED:
                completed = existing
            else:
                completed = None
                if existing is not None:
                    log.info("completing a prepare that was interrupted", extra=p.ctx)
                check_not_in_use(ref, records, claims)
                check_time_slices(ref.uid, records, claims)  # the interval is the whole GPU's
                claims[ref.uid] = ClaimRecord(
                    namespace=ref.namespace,
                    name=ref.name,
                    uid=ref.uid,
                    state=PrepareState.STARTED,
                    devices=tuple(records),
                    owner=self._instance.instance_id,
                    pods=consumer_pods(p.claim),
                )
        self._sharing.realise(f"{ref.namespace}/{ref.name}", records)  # MPS daemons, time slices: after the record
        if dynamic:
            spec, ids = self._spec(ref, self._realised(p, retry), pod_devices)
        if completed is not None and self._files.has_spec(ref.uid):
            # The same answer again. Only the spec may differ, when this call prepares the claim
            # with other claims than before (a retry after one of them failed): it follows them.
            if self._files.write_spec(ref.uid, spec):
                with self._checkpoint.transaction() as claims:
                    self._check_still_prepared(p, claims, PrepareState.COMPLETED)
            return PrepareResult(devices=completed.devices)
        # Phase 2: idempotent side effects (files are rewritten whole, status is an apply), the
        # files written while the server applies (module docstring). Also for a claim prepared
        # before whose spec an unprepare that failed afterwards took away (unprepare removes the
        # spec first): its files and status come back, so that every ID of the answer resolves.
        if self._nic_homes is not None:
            self._nic_homes.remember(d.device for d in p.planned if d.device.nic and d.config.nic.exclusive)
        networked = _with_network_data(tuple(records), p.planned)  # the status's and the record's
        status = status_entries(self._s, networked, rfc3339(), current_devices(p.claim))
        applying = self._api.send_claim_status(
            ref.namespace, ref.name, status, field_manager=self._s.driver_name, uid=ref.uid
        )
        try:
            self._files.write_spec(ref.uid, spec)
            metadata_ids = self._write_metadata(ref, p.claim, p.planned, p.ctx, pod_devices)
        finally:
            # Answered even when a file failed: an apply landing after this call returned could
            # land after the Unprepare that follows, and leave a Ready status on an unprepared claim.
            applying.wait()
        applying.result()
        done = _with_cdi_ids(networked, ids, metadata_ids)
        with self._checkpoint.transaction() as claims:
            self._check_still_prepared(p, claims, PrepareState.STARTED if completed is None else PrepareState.COMPLETED)
            pods = consumer_pods(p.claim)
            claims[ref.uid] = ClaimRecord(ref.namespace, ref.name, ref.uid, PrepareState.COMPLETED, done, pods=pods)
        return PrepareResult(devices=done)

    def _check_still_prepared(self, p: _Planned, claims: dict[str, ClaimRecord], state: PrepareState) -> None:
        """After writing files: the record must still be the one this call wrote (or found). The
        other instance of a rolling update may have acted on the claim meanwhile (the kubelet
        turned to it when this call took too long). If it unprepared the claim, the kubelet no
        longer wants it: what this call wrote and applied must not outlive it (removed under the
        checkpoint lock, before any new prepare of the claim can begin). If it prepared the
        claim, the files are the same and now its own: they stay, and its answer counts."""
        ref, mine = p.ref, claims.get(p.ref.uid)
        ours = mine is not None and (state == PrepareState.COMPLETED or mine.owner == self._instance.instance_id)
        if mine is not None and mine.state == state and ours:
            return
        if mine is not None:
            raise ClaimError(
                f"claim {ref.namespace}/{ref.name} was prepared by another instance of the driver meanwhile"
            )
        self._unpreparer.take_away(ref, p.ctx)
        raise ClaimError(f"claim {ref.namespace}/{ref.name} was unprepared while being prepared")

    def _write_metadata(
        self,
        ref: ClaimRef,
        claim: ResourceClaim,
        planned: list[PlannedDevice],
        ctx: dict[str, str],
        pod_devices: list[PlannedDevice],
    ) -> dict[str, str]:
        # Metadata names requests as allocated ("req/sub"), as the reference library does; the
        # kubelet's response uses the parent name only.
        refs: dict[tuple[str, str | None], list[str]] = {}
        for r in claim["status"]["allocation"]["devices"].get("results") or []:
            if r.get("driver") == self._s.driver_name:
                refs.setdefault((r["device"], r.get("shareID")), []).append(r["request"])
        pod_claim_name = ((claim.get("metadata") or {}).get("annotations") or {}).get(POD_CLAIM_NAME_ANNOTATION, "")
        paired = pairing_metadata(pod_pairs(pod_devices))  # which NIC each GPU got, and why
        devices = [
            MetadataDevice(
                request=request,
                pool=self._s.pool,
                name=p.device.name,
                attributes={**attributes_json(p.device), **paired.get(p.device.name, {})},
                network_data=network_data(p),
            )
            for p in planned
            for request in refs.get((p.device.name, p.share_id), list(p.request_names))
        ]
        try:
            return self._files.metadata.write(ref.namespace, ref.name, ref.uid, pod_claim_name, devices)
        except (OSError, MetadataError):
            # As the reference library does: metadata is a convenience, not a reason to fail the pod.
            log.exception("device metadata not written; the claim is prepared without it", extra=ctx)
            return {}


def _failed(ref: ClaimRef, ctx: dict[str, str], e: Exception) -> PrepareResult:
    """A claim that cannot be prepared: the error goes back to the kubelet for this claim only."""
    if isinstance(e, ClaimError):
        log.warning("prepare failed: %s", e, extra=ctx)
        return PrepareResult(error=str(e), error_kind=error_kind(e))
    # An API or disk failure fails this claim only; the kubelet retries.
    log.exception("prepare failed", extra=ctx)
    return PrepareResult(error=f"prepare of claim {ref.namespace}/{ref.name} failed: {e}", error_kind=error_kind(e))


def _with_network_data(records: tuple[DeviceRecord, ...], planned: list[PlannedDevice]) -> tuple[DeviceRecord, ...]:
    by_device = {(p.device.name, p.share_id): p for p in planned}
    out = []
    for r in records:
        p = by_device[(r.device, r.share_id)]
        out.append(dataclasses.replace(r, network_data=network_data(p), exclusive=p.config.nic.exclusive))
    return tuple(out)


def _with_cdi_ids(
    records: Sequence[DeviceRecord], ids: dict[str, list[str]], metadata_ids: dict[str, str]
) -> tuple[DeviceRecord, ...]:
    """Claim-spec IDs per device (one per share ID, in order), plus the metadata IDs."""
    remaining = {name: list(v) for name, v in ids.items()}
    extra = assign_metadata_ids([r.request_names for r in records], metadata_ids)
    out = []
    for r, meta in zip(records, extra, strict=True):
        own = remaining.get(r.device, [])
        out.append(dataclasses.replace(r, cdi_device_ids=(*own[:1], *meta)))
        del own[:1]
    return tuple(out)
