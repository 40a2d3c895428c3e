"""Binding conditions as data: which published devices carry them, and how they read and are
written in a claim's status.

Pure, and apart from the worker that makes devices ready (`driver.claims.binding`): the slice
publisher marks the devices it publishes (`PublishedDevices`) whether or not a worker runs, and
what a claim's status says of its binding conditions is a function of the claim alone, testable
without a thread, an API server or a GPU.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from driver.claims.allocation import PrepareSettings
from driver.kube.types import AllocatedDeviceStatus, DeviceRequestAllocationResult, ResourceClaim
from driver.model import Device
from driver.resource_api import rfc3339


@dataclass(frozen=True)
class ConditionTypes:
    """The condition types of one driver name (condition types are label names: a domain we own)."""

    partition_ready: str
    partition_failed: str
    nic_ready: str
    nic_failed: str

    @classmethod
    def of(cls, driver_name: str) -> ConditionTypes:
        d = driver_name
        return cls(f"{d}/partition-ready", f"{d}/partition-failed", f"{d}/nic-ready", f"{d}/nic-failed")

    def for_device(self, device: Device) -> tuple[str, str] | None:
        """(ready, failed) for a device that carries binding conditions, else None."""
        if device.gpu is not None and device.gpu.placement is not None:
            return self.partition_ready, self.partition_failed
        if device.nic is not None:
            return self.nic_ready, self.nic_failed
        return None


def with_binding_conditions(devices: Sequence[Device], driver_name: str, mig: bool, nic: bool) -> list[Device]:
    """The devices as published: dynamic-MIG partitions (`mig`, the whole GPU of a dynamic-MIG
    GPU too: it is made as its one GPU instance) and NICs (`nic`) with binding conditions. Other
    GPUs, MIG devices an administrator made and shared GPUs get none: nothing slow happens
    before their use."""
    types = ConditionTypes.of(driver_name)
    out = []
    for d in devices:
        pair = types.for_device(d)
        wanted = pair is not None and (mig if d.gpu is not None else nic)
        out.append(
            replace(d, binding_conditions=(pair[0],), binding_failure_conditions=(pair[1],)) if wanted and pair else d
        )
    return out


class PublishedDevices:
    """`with_binding_conditions` over `devices()`, for the slice publisher: while the inventory
    hands out the same device objects, the same marked copies come back, so the publisher's
    check that nothing changed stays a comparison by identity, not by value of every device."""

    def __init__(self, devices: Callable[[], list[Device]], driver_name: str, mig: bool, nic: bool) -> None:
        self._devices = devices
        self._args = (driver_name, mig, nic)
        self._seen: list[Device] = []
        self._marked: list[Device] = []

    def __call__(self) -> list[Device]:
        current = self._devices()
        if len(current) != len(self._seen) or any(a is not b for a, b in zip(current, self._seen, strict=True)):
            self._seen, self._marked = current, with_binding_conditions(current, *self._args)
        return list(self._marked)


def binding_results(claim: ResourceClaim, settings: PrepareSettings) -> list[DeviceRequestAllocationResult]:
    """The claim's allocation results in this driver's pool that carry binding conditions."""
    results = (((claim.get("status") or {}).get("allocation") or {}).get("devices") or {}).get("results") or []
    return [
        r
        for r in results
        if r.get("driver") == settings.driver_name and r.get("pool") == settings.pool and r.get("bindingConditions")
    ]


def decided(claim: ResourceClaim, results: Sequence[DeviceRequestAllocationResult], settings: PrepareSettings) -> str:
    """ "ready" when every result's binding conditions are True already (an earlier instance
    set them), "failed" when a failure condition is, else ""."""
    entries = {
        (e.get("device"), e.get("shareID")): {c.get("type"): c.get("status") for c in e.get("conditions") or []}
        for e in (claim.get("status") or {}).get("devices") or []
        if e.get("driver") == settings.driver_name and e.get("pool") == settings.pool
    }
    ready = True
    for r in results:
        conds = entries.get((r["device"], r.get("shareID")), {})
        if any(conds.get(t) == "True" for t in r.get("bindingFailureConditions") or []):
            return "failed"
        ready = ready and all(conds.get(t) == "True" for t in r.get("bindingConditions") or [])
    return "ready" if ready else ""


def status_entries(
    results: Sequence[DeviceRequestAllocationResult], ready: bool, reason: str, message: str, pool: str
) -> list[AllocatedDeviceStatus]:
    """The claim's `status.devices[]` entries that set the results' binding conditions (`ready`)
    or their failure conditions True."""
    now = rfc3339()
    out: list[AllocatedDeviceStatus] = []
    for r in results:
        kinds = r.get("bindingConditions") if ready else r.get("bindingFailureConditions")
        entry: AllocatedDeviceStatus = {
            "driver": r["driver"],
            "pool": r["pool"],
            "device": r["device"],
            "conditions": [
                {
                    "type": t,
                    "status": "True",
                    "reason": reason,
                    "message": message or f"ready on node {pool}",
                    "lastTransitionTime": now,
                }
                for t in kinds or []
            ],
        }
        if r.get("shareID"):
            entry["shareID"] = r["shareID"]
        out.append(entry)
    return out
