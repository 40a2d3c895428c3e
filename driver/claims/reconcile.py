"""Start-up reconciliation: the checkpoint against the files on disk, before the kubelet can call.

Removes the temporary files of writes a `kill -9` interrupted, rolls back prepares whose owning
instance died (PrepareStarted records, `driver.claims.prepare`), finishes unprepares a crash cut short
after the files went (dynamic MIG: the MIG devices go too, `driver.claims.gpu.mig`), and removes
the files no record accounts for. After the checkpoint was lost (`Checkpoint.incomplete`: found unreadable or
missing), files without a record may belong to claims that pods still use, whose containers need
them on every (re)start: they count as unused only once the API server says so, and the claims
still in use get their records back by being prepared again. Once every record is back, the GPU
instances Tandem made for claims no record names are destroyed (`MigPartitions.collect`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from driver.claims.allocation import ClaimAPI, ClaimError, ClaimRef, PrepareSettings, allocated_devices, validate_ref
from driver.claims.checkpoint import Checkpoint, ClaimRecord, InstanceLock
from driver.claims.files import ClaimFiles
from driver.claims.gpu.mig import MigError, MigPartitions
from driver.claims.prepare import PrepareResult
from driver.claims.vocabulary import PrepareState
from driver.kube.api import NotFound

log = logging.getLogger(__name__)

_CTX = {"op": "reconcile"}


class Reconciler:
    def __init__(
        self,
        api: ClaimAPI,
        checkpoint: Checkpoint,
        instance: InstanceLock,
        settings: PrepareSettings,
        files: ClaimFiles,
        prepare: Callable[[Sequence[ClaimRef]], dict[str, PrepareResult]],
        partitions: MigPartitions,
    ) -> None:
        self._api = api
        self._checkpoint = checkpoint
        self._instance = instance
        self._s = settings
        self._files = files
        self._prepare = prepare
        self._partitions = partitions

    def run(self) -> None:
        for path in self._files.remove_temp_files(self._checkpoint.path.parent):
            log.info("removed %s, left by a write that was killed", path, extra=_CTX)
        with self._checkpoint.transaction() as claims:
            specs = self._files.spec_uids()
            for uid, record in list(claims.items()):
                if record.state == PrepareState.STARTED and not self._instance.is_alive(record.owner):
                    log.warning(
                        "rolling back prepare of claim %s/%s interrupted by a crash",
                        record.namespace,
                        record.name,
                        extra={**_CTX, "claim": uid},
                    )
                    self._files.remove(uid)
                    if self._destroy_partitions(record):
                        del claims[uid]
                elif record.state == PrepareState.COMPLETED and uid not in specs and any(d.mig for d in record.devices):
                    # Unprepare removes the files first: its MIG devices are finished off now.
                    log.warning(
                        "finishing an unprepare of claim %s/%s interrupted by a crash",
                        record.namespace,
                        record.name,
                        extra={**_CTX, "claim": uid},
                    )
                    if self._destroy_partitions(record):
                        del claims[uid]
            # A claim is prepared on this node exactly while its CDI spec exists; without one,
            # metadata files are leftovers whatever the checkpoint lost.
            unverified = self._files.spec_uids() - set(claims) if self._checkpoint.incomplete else set()
            for uid in sorted(self._files.uids() - set(claims) - unverified):
                log.info("removing the orphaned files of claim %s", uid, extra={**_CTX, "claim": uid})
                self._files.remove(uid)
        if self._checkpoint.incomplete:
            self._recover(unverified)
        if not self._checkpoint.incomplete:  # every claim in use has its record again
            self._partitions.collect(set(self._checkpoint.read()), self._instance.is_alive)

    def _destroy_partitions(self, record: ClaimRecord) -> bool:
        """Destroy the MIG devices the record says were (maybe) made; False, with the record kept
        for the next start or the kubelet's next call, when NVML refuses."""
        try:
            self._partitions.destroy(record.uid, [d.mig for d in record.devices if d.mig is not None])
        except MigError as e:
            log.error(
                "claim %s/%s: %s; its record is kept",
                record.namespace,
                record.name,
                e,
                extra={**_CTX, "claim": record.uid},
            )
            return False
        return True

    def _recover(self, uids: set[str]) -> None:
        """A claim with a CDI spec on disk is in use while the API server has it allocated on
        this node and reserved for a pod; it is then prepared again, which rebuilds its record and
        leaves its unchanged files as they are. A claim that is gone, replaced, deallocated or
        reserved for no pod is unused: its files go. One the API server cannot tell about keeps
        its files, and the checkpoint stays incomplete so that the next start asks again (the
        kubelet's Unprepare, which removes files by UID, may come first).

        Claims are prepared again grouped by the first pod they are reserved for, as the kubelet
        first prepared them (one call per pod), so their specs keep the same pairing and NIC lists.
        """
        in_use: dict[str, list[ClaimRef]] = {}
        unknown = 0
        for uid in sorted(uids):
            found = self._claim_of(uid)
            if found is None:
                unknown += 1
            elif isinstance(found, str):
                log.info("removing the files of claim %s: %s", uid, found, extra={**_CTX, "claim": uid})
                with self._checkpoint.transaction() as claims:
                    if uid not in claims:
                        self._files.remove(uid)
            else:
                in_use.setdefault(found[1], []).append(found[0])
        for refs in in_use.values():
            for uid, result in self._prepare(refs).items():
                if result.error:
                    unknown += 1
                    log.warning("claim still in use, not recovered: %s", result.error, extra={**_CTX, "claim": uid})
                else:
                    log.info("claim still in use: its record is rebuilt", extra={**_CTX, "claim": uid})
        if unknown == 0:
            self._checkpoint.mark_complete()

    def _claim_of(self, uid: str) -> tuple[ClaimRef, str] | str | None:
        """The claim of `uid` and the first pod it is reserved for, when it is in use on this node;
        else why it is unused; None when that cannot be told. The claim is read by the name its
        device metadata records: one GET per claim, which the driver may do anyway, rather than
        a list of every claim in the cluster (claims have no field selector by node)."""
        ctx = {**_CTX, "claim": uid}
        names = self._files.metadata.claim_names(uid)
        if len(names) != 1:
            log.warning(
                "claim %s has a CDI spec but no device metadata that names it: its files are kept", uid, extra=ctx
            )
            return None
        ref = ClaimRef(*names.pop(), uid)
        try:
            validate_ref(ref)
            claim = self._api.get_claim(ref.namespace, ref.name)
        except NotFound:
            return f"claim {ref.namespace}/{ref.name} no longer exists"
        except Exception as e:
            log.warning(
                "cannot tell whether claim %s/%s is in use (%s): its files are kept",
                ref.namespace,
                ref.name,
                e,
                extra=ctx,
            )
            return None
        try:
            allocated = allocated_devices(claim, ref, self._s.driver_name, self._s.pool)
        except ClaimError as e:
            return str(e)
        reserved = (claim.get("status") or {}).get("reservedFor") or []
        if not allocated or not reserved:
            return f"claim {ref.namespace}/{ref.name} is not in use on this node"
        return ref, str(reserved[0].get("uid", ""))
