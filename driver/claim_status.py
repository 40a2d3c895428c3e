"""What the driver writes into a prepared claim's `status.devices`: a Ready condition per device,
and for a NIC its `networkData` (interface name, MAC, addresses) as the pod will see it.

Written by server-side apply with the driver's own field manager, so only our entries change
(docs/reference/resource-api.md, 'Writing claim status').
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from typing import Any

from driver.checkpoint import DeviceRecord
from driver.claim_cdi import PlannedDevice
from driver.claims import PrepareSettings
from driver.resource_api import MAX_NETWORK_IPS


def canonical_cidr(address: str) -> str:
    """`fd00:0::a/64` -> `fd00::a/64`: the API server rejects non-canonical forms in networkData."""
    return ipaddress.ip_interface(address).compressed


def network_data(planned: PlannedDevice) -> dict[str, Any] | None:
    """What the pod will see of a NIC: its in-pod name in exclusive mode, the host name otherwise."""
    nic = planned.device.nic
    if nic is None:
        return None
    exclusive = planned.config.nic.mode == "exclusive"
    out: dict[str, Any] = {"interfaceName": planned.config.nic.interface_name if exclusive else nic.ifname}
    if nic.mac:
        out["hardwareAddress"] = nic.mac
    ips = [canonical_cidr(a) for a in (*nic.ipv4, *nic.ipv6)][:MAX_NETWORK_IPS]
    if ips:
        out["ips"] = ips
    return out


def status_entries(settings: PrepareSettings, records: Sequence[DeviceRecord], now: str) -> list[dict[str, Any]]:
    out = []
    for r in records:
        entry: dict[str, Any] = {
            "driver": settings.driver_name,
            "pool": settings.pool,
            "device": r.device,
            "conditions": [
                {
                    "type": "Ready",
                    "status": "True",
                    "reason": "Prepared",
                    "message": f"prepared on node {settings.pool}",
                    "lastTransitionTime": now,
                }
            ],
        }
        if r.share_id is not None:
            entry["shareID"] = r.share_id
        if r.network_data is not None:
            entry["networkData"] = r.network_data
        out.append(entry)
    return out
