"""NodeUnprepareResources for one claim, a preparation its claim's new allocation left behind
undone before the claim is prepared again, and taking a claim's files away while its status goes.

The other half of the two-phase protocol of `driver.claims.prepare`: unprepare removes files
before the record, so a file on disk always has a record and a crash between the two is retried
(by the kubelet, or rolled forward at start-up by `driver.claims.reconcile`). Everything is found
by the claim's UID alone (`driver.claims.files`).

Our `status.devices` entries are withdrawn by a server-side apply sent before the file removals
and answered after them: the server works while we remove, on the calling thread. A withdrawal
that fails is no reason to fail the unprepare: the entries go with the claim. A prepare that finds
its claim unprepared under it meanwhile takes its files and status away the same way
(`Unpreparer.take_away`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

from driver.claims.allocation import ClaimAPI, ClaimError, ClaimRef, PendingApply
from driver.claims.checkpoint import Checkpoint, DeviceRecord
from driver.claims.files import ClaimFiles
from driver.claims.gpu.mig import MigPartitions
from driver.claims.gpu.sharing import GpuSharing
from driver.errors import Kind, error_kind
from driver.logs import log_context

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Unprepared:
    """One claim's unprepare as the kubelet and the metrics see it."""

    error: str = ""  # for the kubelet, which retries
    error_kind: Kind | None = None  # with an error: whose problem it was (driver/errors.py), for metrics


class Unpreparer:
    """Unprepares one claim per call; the caller (`Preparer.unprepare`) holds the claim's lock."""

    def __init__(
        self,
        api: ClaimAPI,
        checkpoint: Checkpoint,
        files: ClaimFiles,
        partitions: MigPartitions,
        sharing: GpuSharing,
        driver_name: str,
    ) -> None:
        self._api = api
        self._checkpoint = checkpoint
        self._files = files
        self._partitions = partitions
        self._sharing = sharing
        self._driver_name = driver_name

    def unprepare(self, ref: ClaimRef) -> Unprepared:
        """The claim unprepared, or why not."""
        ctx = {"claim": ref.uid, "op": "unprepare", "claim_namespace": ref.namespace, "claim_name": ref.name}
        with log_context(**ctx):
            try:
                # Everything is found by the UID alone: a late Unprepare of an old claim never
                # touches a new claim of the same name. The files go even without a record: the
                # kubelet says the claim is no longer needed, whatever the checkpoint lost.
                record = self._checkpoint.read().get(ref.uid)
                # Our status entries are withdrawn while the files go (module docstring); without
                # a record too: a prepare rolled back after its apply (kill -9, then start-up) or a
                # lost checkpoint leaves no record, but may have left a Ready status.
                self.take_away(ref, ctx)
                # Before the record goes (a crash here is retried); also what the MIG note gives it.
                self._partitions.destroy(ref.uid, [d.mig for d in record.devices if d.mig] if record else [])
                if record is None:
                    log.info("claim has no record here: only its files and status, if any, were removed", extra=ctx)
                    return Unprepared()
                with self._checkpoint.transaction() as claims:
                    claims.pop(ref.uid, None)
                if any(d.sharing for d in record.devices):
                    self._sharing.released()  # its GPU's MPS daemon, if no other claim needs it
                log.info("unprepared", extra=ctx)
                return Unprepared()
            except Exception as e:
                log.exception("unprepare failed", extra=ctx)
                return Unprepared(f"unprepare of claim {ref.namespace}/{ref.name} failed: {e}", error_kind(e))

    def undo_if_reallocated(self, ref: ClaimRef, allocated: Iterable[DeviceRecord], ctx: dict[str, str]) -> None:
        """Before a prepare: a record of the claim's UID for other devices than the claim is
        allocated now is unprepared first. The claim was deallocated and allocated again while its
        preparation here outlived it (an unprepare the kubelet never sent, a kubelet that lost its
        own record); trusted, the record would answer with the old devices and skip the in-use
        check of the new ones. Raises ClaimError when the old preparation cannot be undone."""
        record = self._checkpoint.read().get(ref.uid)
        if record is None or _identities(record.devices) == _identities(allocated):
            return
        log.warning(
            "claim was prepared here for %s but is allocated %s now: the old preparation is unprepared first",
            sorted(d.device for d in record.devices),
            sorted(d.device for d in allocated),
            extra=ctx,
        )
        undone = self.unprepare(ref)
        if undone.error:
            raise ClaimError(
                f"claim {ref.namespace}/{ref.name} is allocated other devices than it was prepared for here, "
                f"and the old preparation could not be undone: {undone.error}"
            )

    def take_away(self, ref: ClaimRef, ctx: dict[str, str]) -> None:
        """The claim's files removed while the server withdraws our status entries (module docstring)."""
        clearing = self._send_clear(ref, ctx)
        try:
            self._files.remove(ref.uid)
        finally:
            _cleared(clearing, ctx)

    def _send_clear(self, ref: ClaimRef, ctx: dict[str, str]) -> PendingApply | None:
        """Send the withdrawal of our status.devices entries; the claim may already be gone, which is fine."""
        try:
            return self._api.send_claim_status(
                ref.namespace, ref.name, [], field_manager=self._driver_name, uid=ref.uid
            )
        except Exception as e:
            _not_cleared(e, ctx)
            return None


def _not_cleared(error: Exception, ctx: dict[str, str]) -> None:
    """A withdrawal that failed (to be sent or answered) is no reason to fail the unprepare."""
    log.info("claim status not cleared (%s); it goes with the claim", error, extra=ctx)


def _cleared(clearing: PendingApply | None, ctx: dict[str, str]) -> None:
    """The answer to a withdrawal `_send_clear` sent, if it sent one."""
    if clearing is not None and (error := clearing.wait()) is not None:
        _not_cleared(error, ctx)


def _identities(devices: Iterable[DeviceRecord]) -> frozenset[tuple[str, str, str | None]]:
    """What an allocation gave a claim, by device identity: pool, device and share."""
    return frozenset((d.pool, d.device, d.share_id) for d in devices)
