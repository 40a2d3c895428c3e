"""Keeps prepared claims current when a prepared NIC's name, MAC or addresses change.

Pods read their NIC's addresses from the device metadata and the claim status; a DHCP renewal or
a renumbered fabric must not leave them stale until the pod restarts. Run by the daemon's
"nic-address-refresh" thread after inventory changes, under the same per-claim locks as prepare.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

from driver.backoff import Backoff, Retry
from driver.claims.allocation import ClaimAPI, ClaimLocks, PrepareSettings
from driver.claims.checkpoint import Checkpoint, ClaimRecord, DeviceRecord
from driver.claims.metadata import MetadataWriter
from driver.claims.metadata_format import MetadataDevice, MetadataError, attributes_json
from driver.claims.opaque_config import RequestConfig
from driver.claims.planned import PlannedDevice
from driver.claims.status import current_devices, network_data, status_entries
from driver.claims.vocabulary import PrepareState
from driver.kube.api import ApiError, NotFound
from driver.logs import log_context
from driver.model import Device
from driver.resource_api import rfc3339

log = logging.getLogger(__name__)

# A claim whose refresh failed for a reason that may pass (the API server unreachable or
# overloaded, a write in between) is tried again, a few times: passes run on inventory changes
# only, and the NIC may not change again for days. Briefly: the waits of one pass, a server's
# Retry-After included, end within RETRY_WAIT seconds, as the daemon's stop waits 5 s for a pass.
RETRIES = 3
RETRY_BACKOFF = Backoff(initial=0.5, maximum=2.0)
RETRY_WAIT = 4.0


class NetworkDataRefresh:
    """Rewrites the metadata (in place) and the claim status of claims whose shared-mode NICs changed."""

    def __init__(
        self,
        api: ClaimAPI,
        checkpoint: Checkpoint,
        settings: PrepareSettings,
        lookup_device: Callable[[str], Device | None],
        metadata: MetadataWriter,
        locks: ClaimLocks,
        wait: Callable[[float], object] = time.sleep,
    ) -> None:
        """`wait` sleeps before a retry (the pass runs in a thread of its own; tests count instead)."""
        self._api = api
        self._checkpoint = checkpoint
        self._s = settings
        self._lookup = lookup_device
        self._metadata = metadata
        self._locks = locks
        self._wait = wait

    def run(self) -> int:
        """Rewrite the metadata (in place) and claim status of prepared claims whose shared-mode
        NICs changed name, MAC or addresses since; returns how many claims were updated.

        Pods read their NIC's addresses from these; a DHCP renewal or a renumbered fabric must not
        leave them stale until the pod restarts. Exclusive NICs live in the pod: not followed.
        A claim that fails is logged and leaves the others to be updated; one whose failure may
        pass is tried again after a backoff (or the longer wait the server asked for), RETRIES
        times at most and within RETRY_WAIT seconds of waiting.
        """
        updated = 0
        retry = Retry(RETRY_BACKOFF)
        waited = 0.0
        pending = list(self._checkpoint.read())
        while True:
            failed = []
            asked = 0.0
            for uid in pending:
                with log_context(claim=uid, op="refresh"):
                    try:
                        updated += self._refresh(uid)
                    except ApiError as e:
                        again = e.retryable and retry.attempt < RETRIES and waited < RETRY_WAIT
                        if again:
                            failed.append(uid)
                            asked = max(asked, e.retry_after)
                        then = "will retry" if again else "left stale until the NIC changes again"
                        log.warning("updating the claim's network data failed (%s): %s", then, e)
                    except Exception:
                        log.exception("updating the claim's network data failed")
            if not failed:
                return updated
            delay = min(retry.next(asked), RETRY_WAIT - waited)
            self._wait(delay)
            waited += delay
            pending = failed

    def _refresh(self, uid: str) -> bool:
        """Update one claim, if its NICs changed; whether it was."""
        with self._locks.hold(uid):
            record = self._checkpoint.read().get(uid)
            if record is None or record.state != PrepareState.COMPLETED:
                return False
            fresh = tuple(self._fresh_network_data(d) for d in record.devices)
            if fresh == record.devices:
                return False
            self._rewrite_network_data(record, fresh)
            return True

    def _fresh_network_data(self, record: DeviceRecord) -> DeviceRecord:
        device = self._lookup(record.device)
        if record.network_data is None or record.exclusive or device is None or device.nic is None:
            return record
        if not device.nic.present:
            return record  # not visible on the host right now: keep what was said
        nd = network_data(PlannedDevice(device, record.request_names, RequestConfig(), record.share_id))
        return record if nd == record.network_data else dataclasses.replace(record, network_data=nd)

    def _rewrite_network_data(self, record: ClaimRecord, fresh: tuple[DeviceRecord, ...]) -> None:
        log.info("NIC addresses changed; updating the claim's metadata and status")
        for request in sorted({n for d in fresh if d.network_data is not None for n in d.request_names}):
            devices = []
            for d in fresh:
                device = self._lookup(d.device)
                if request in d.request_names and device is not None:
                    devices.append(MetadataDevice(request, d.pool, d.device, attributes_json(device), d.network_data))
            try:
                self._metadata.update(record.namespace, record.name, record.uid, request, devices)
            except (OSError, MetadataError) as e:
                log.warning("device metadata of request %s not updated: %s", request, e)
        try:
            claim = self._api.get_claim(record.namespace, record.name)
        except NotFound:
            claim = {}
        if (claim.get("metadata") or {}).get("uid") == record.uid:
            self._api.apply_claim_status(
                record.namespace,
                record.name,
                status_entries(self._s, fresh, rfc3339(), current_devices(claim)),
                field_manager=self._s.driver_name,
                uid=record.uid,
            )
        else:  # the server would refuse the apply (404, or 409 for the UID); the metadata is done
            log.info("the claim was deleted (its Unprepare is yet to come): its status is not updated")
        with self._checkpoint.transaction() as claims:
            if uid_record := claims.get(record.uid):
                claims[record.uid] = dataclasses.replace(uid_record, devices=fresh)
