"""What the driver writes into a prepared claim's `status.devices`: a Ready condition per device,
and for a NIC its `networkData` (interface name, MAC, addresses) as the pod will see it.

Written by server-side apply with the driver's own field manager, so only our entries change
(docs/reference/resource-api.md, 'Writing claim status'). Every apply sends the whole entry, so
the Ready condition's `lastTransitionTime` is carried over from the status as last read: it says
when the device became ready and must change only when the condition's status does.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence

from driver.claims.allocation import PrepareSettings
from driver.claims.checkpoint import DeviceRecord
from driver.claims.planned import PlannedDevice
from driver.kube.types import AllocatedDeviceStatus, NetworkDeviceData, ResourceClaim
from driver.resource_api import MAX_NETWORK_IPS


def canonical_cidr(address: str) -> str:
    """`fd00:0::a/64` -> `fd00::a/64`: the API server rejects non-canonical forms in networkData."""
    return ipaddress.ip_interface(address).compressed


def network_data(planned: PlannedDevice) -> NetworkDeviceData | None:
    """What the pod will see of a NIC: its in-pod name in exclusive mode, the host name otherwise."""
    nic = planned.device.nic
    if nic is None:
        return None
    exclusive = planned.config.nic.exclusive
    out: NetworkDeviceData = {"interfaceName": planned.config.nic.interface_name if exclusive else nic.ifname}
    if nic.mac:
        out["hardwareAddress"] = nic.mac
    # In exclusive mode the claim's own addresses, if it sets any, replace the host's in the pod.
    addresses = planned.config.nic.addresses if exclusive and planned.config.nic.addresses else (*nic.ipv4, *nic.ipv6)
    ips = [canonical_cidr(a) for a in addresses][:MAX_NETWORK_IPS]
    if ips:
        out["ips"] = ips
    return out


def status_entries(
    settings: PrepareSettings, records: Sequence[DeviceRecord], now: str, current: Sequence[AllocatedDeviceStatus]
) -> list[AllocatedDeviceStatus]:
    """Our entries for `records`; `current` is the claim's `status.devices` as last read."""
    ready_since = _ready_since(settings, current)
    out = []
    for r in records:
        entry: AllocatedDeviceStatus = {
            "driver": settings.driver_name,
            "pool": settings.pool,
            "device": r.device,
            "conditions": [
                {
                    "type": "Ready",
                    "status": "True",
                    "reason": "Prepared",
                    "message": f"prepared on node {settings.pool}" + (_EXCLUSIVE_NOTE if r.exclusive else ""),
                    "lastTransitionTime": ready_since.get((r.device, r.share_id), now),
                }
            ],
        }
        if r.share_id is not None:
            entry["shareID"] = r.share_id
        if r.network_data is not None:
            entry["networkData"] = r.network_data
        out.append(entry)
    return out


# What exclusive mode does and does not move (docs/scenarios.md, 'Opaque configuration', "What
# moves, exactly"; docs/deployment.md, 'Exclusive NICs: what the node needs'), said where users
# look: CDI netDevices moves the netdev; no runtime moves the RDMA device.
_EXCLUSIVE_NOTE = (
    "; the netdev moves into the pod under networkData.interfaceName; the RDMA device is not moved: "
    "the pod uses it through the kernel's shared RDMA namespace"
)


def _ready_since(
    settings: PrepareSettings, current: Sequence[AllocatedDeviceStatus]
) -> dict[tuple[str, str | None], str]:
    """(device, share ID) -> when our Ready condition of that device became True."""
    out = {}
    for entry in current:
        if entry.get("driver") != settings.driver_name or entry.get("pool") != settings.pool:
            continue
        for c in entry.get("conditions") or []:
            since = c.get("lastTransitionTime")
            if c.get("type") == "Ready" and c.get("status") == "True" and isinstance(since, str):
                out[(entry.get("device"), entry.get("shareID"))] = since
    return out


def current_devices(claim: ResourceClaim) -> list[AllocatedDeviceStatus]:
    """A claim object's `status.devices` (every driver's entries)."""
    return list((claim.get("status") or {}).get("devices") or [])
