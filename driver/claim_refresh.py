"""Keeps prepared claims current when a prepared NIC's name, MAC or addresses change.

Pods read their NIC's addresses from the device metadata and the claim status; a DHCP renewal or
a renumbered fabric must not leave them stale until the pod restarts. Run by the daemon's
"nic-address-refresh" thread after inventory changes, under the same per-claim locks as prepare.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

from driver.checkpoint import STATE_COMPLETED, Checkpoint, ClaimRecord, DeviceRecord
from driver.claim_cdi import PlannedDevice
from driver.claim_status import current_devices, network_data, status_entries
from driver.claims import ClaimAPI, ClaimLocks, PrepareSettings
from driver.config_api import RequestConfig
from driver.logs import log_context
from driver.metadata import MetadataDevice, MetadataError, MetadataWriter, attributes_json
from driver.model import Device
from driver.resource_api import rfc3339

log = logging.getLogger(__name__)


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
    ) -> None:
        self._api = api
        self._checkpoint = checkpoint
        self._s = settings
        self._lookup = lookup_device
        self._metadata = metadata
        self._locks = locks

    def run(self) -> int:
        """Rewrite the metadata (in place) and claim status of prepared claims whose shared-mode
        NICs changed name, MAC or addresses since; returns how many claims were updated.

        Pods read their NIC's addresses from these; a DHCP renewal or a renumbered fabric must not
        leave them stale until the pod restarts. Exclusive NICs live in the pod: not followed.
        """
        updated = 0
        for uid in list(self._checkpoint.read()):
            with self._locks.hold(uid), log_context(claim=uid, op="refresh"):
                record = self._checkpoint.read().get(uid)
                if record is None or record.state != STATE_COMPLETED:
                    continue
                fresh = tuple(self._fresh_network_data(d) for d in record.devices)
                if fresh == record.devices:
                    continue
                self._rewrite_network_data(record, fresh)
                updated += 1
        return updated

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
        claim = self._api.get_claim(record.namespace, record.name)
        current = current_devices(claim) if (claim.get("metadata") or {}).get("uid") == record.uid else []
        self._api.apply_claim_status(
            record.namespace,
            record.name,
            status_entries(self._s, fresh, rfc3339(), current),
            field_manager=self._s.driver_name,
            uid=record.uid,
        )
        with self._checkpoint.transaction() as claims:
            if uid_record := claims.get(record.uid):
                claims[record.uid] = dataclasses.replace(uid_record, devices=fresh)
