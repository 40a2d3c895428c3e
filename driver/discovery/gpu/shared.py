"""A full GPU published for sharing (`--gpu-sharing`): consumable capacity instead of one owner.

The GPU stays one device, `gpu-<minor>`, now with `allowMultipleAllocations` (consumable capacity,
docs/reference/resource-api.md), so the scheduler may give it to many claims at once while its
capacities last, each allocation with a `shareID` of its own and the amounts it consumed:

* `memory`: bytes of GPU memory, requested in MiB steps from 1 GiB up to all of it;
* `computePercent`: the percentage of the GPU's streaming multiprocessors a share may keep busy
  (MPS's active-thread percentage), 1 to 100 in whole percent.

A request that names neither consumes the defaults, which are **all** of both: a claim that asks
for nothing holds the whole GPU, exactly as before sharing (and `nvidia.com/gpu` pods keep
working). A share names both; naming one leaves the other at all of it, which makes the claim the
GPU's only user in practice (docs/scenarios.md, 'Sharing a GPU'). What a share may do with its
amounts (MPS limits, or a refusal where nothing can enforce them) is decided at prepare
(`driver.claims.gpu.sharing`), from the allocation's `consumedCapacity`.

A GPU in MIG mode is not shared this way: its MIG devices are the partitions, and MPS limits on a
MIG device are refused at prepare.
"""

from __future__ import annotations

import dataclasses

from driver.discovery.gpu.attributes import MIB, binary_quantity
from driver.model import Device, RequestPolicy
from driver.resource_api import parse_quantity

MEMORY = "memory"
COMPUTE = "computePercent"
_MIN_MEMORY = 2**30  # a share smaller than this could not even hold a CUDA context
_ALL_COMPUTE = "100"


def shareable(device: Device) -> Device:
    """The full GPU `device` as a multi-allocatable device with `memory` and `computePercent`
    capacities (module docstring); unchanged when it has no known memory size to divide."""
    total = device.capacity.get(MEMORY)
    if total is None:
        return device
    whole = int(parse_quantity(total)) // MIB * MIB  # whole MiB: the step of every share
    low = min(_MIN_MEMORY, whole)
    if whole <= 0:
        return device
    capacity = {**device.capacity, COMPUTE: _ALL_COMPUTE}
    policies = {
        MEMORY: RequestPolicy(
            default=binary_quantity(whole), min=binary_quantity(low), max=binary_quantity(whole), step="1Mi"
        ),
        COMPUTE: RequestPolicy(default=_ALL_COMPUTE, min="1", max=_ALL_COMPUTE, step="1"),
    }
    return dataclasses.replace(device, capacity=capacity, allow_multiple_allocations=True, request_policies=policies)
