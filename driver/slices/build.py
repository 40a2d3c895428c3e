"""The node's devices as ResourceSlice objects: pure, so a test checks them without a server.

One pool per node, named after the node, cut into slices within the API's per-slice limits and
named the way the Go kubeletplugin library names them (docs/reference/kubelet-plugin.md,
'Publishing ResourceSlices'). What a server that lacks a feature gate cannot store (list-typed
attributes) is turned into what it can here, too.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from driver.model import NUMA_NODE, AttrValue, CounterSet, Device, RequestPolicy, attribute_to_api
from driver.resource_api import API_VERSION, MAX_COUNTER_SETS, MAX_DEVICES_ADVANCED, rfc3339

# generateName longer than this is cut by the apiserver (63 - 5 random characters).
_MAX_GENERATE_NAME = 58

LIST_KEYS = ("bools", "ints", "strings", "versions")
# Attributes whose list form has a meaningful scalar form (its first element): the standard
# numaNode publishes the device's own node first (docs/reference/kubelet-plugin.md, 'Standard
# attributes'). Other list attributes have no scalar meaning and are dropped when the
# server cannot store lists.
SCALAR_CAPABLE_LIST_ATTRIBUTES = frozenset({NUMA_NODE})

# (device name, taint key, taint value, taint effect) -> timeAdded as stored by the server.
TaintTimes = Mapping[tuple[str, str, str, str], str]


def spec_devices(spec: object) -> list[dict[str, Any]]:
    """The devices of a slice spec as the server sent it, skipping anything that is not one."""
    if not isinstance(spec, dict):
        return []
    devices = spec.get("devices") or []
    return [d for d in devices if isinstance(d, dict)] if isinstance(devices, list) else []


def metadata(obj: Mapping[str, Any]) -> dict[str, Any]:
    """An object's metadata, or {} when the server sent none."""
    meta = obj.get("metadata")
    return meta if isinstance(meta, dict) else {}


def device_to_api(device: Device, taint_times: TaintTimes, now: str) -> dict[str, Any]:
    out: dict[str, Any] = {"name": device.name}
    if device.attributes:
        out["attributes"] = {k: attribute_to_api(v) for k, v in sorted(device.attributes.items())}
    if device.capacity:
        out["capacity"] = {k: _capacity(v, device.request_policies.get(k)) for k, v in sorted(device.capacity.items())}
    if device.allow_multiple_allocations:
        out["allowMultipleAllocations"] = True
    if device.taints:
        taints = []
        for t in device.taints:
            api_taint: dict[str, Any] = {"key": t.key, "effect": str(t.effect)}
            if t.value:
                api_taint["value"] = t.value
            api_taint["timeAdded"] = taint_times.get((device.name, t.key, t.value, str(t.effect)), now)
            taints.append(api_taint)
        out["taints"] = taints
    if device.binding_conditions:
        out["bindsToNode"] = True
        out["bindingConditions"] = list(device.binding_conditions)
        out["bindingFailureConditions"] = list(device.binding_failure_conditions)
    if device.consumes_counters:
        out["consumesCounters"] = [
            {"counterSet": u.counter_set.name, "counters": _counters(u.counters)} for u in device.consumes_counters
        ]
    return out


def _capacity(value: str, policy: RequestPolicy | None) -> dict[str, Any]:
    out: dict[str, Any] = {"value": value}
    if policy is not None:
        out["requestPolicy"] = {
            "default": policy.default,
            "validRange": {"min": policy.min, "max": policy.max, "step": policy.step},
        }
    return out


def without_sharing(device: Device) -> Device:
    """The device as a server without consumable capacity (DRAConsumableCapacity off) stores it:
    allocatable once, its capacities plain."""
    if not device.allow_multiple_allocations and not device.request_policies:
        return device
    return dataclasses.replace(device, allow_multiple_allocations=False, request_policies={})


def _counters(values: Sequence[tuple[str, str]]) -> dict[str, Any]:
    return {name: {"value": quantity} for name, quantity in values}


def counter_sets(devices: Sequence[Device]) -> list[CounterSet]:
    """The counter sets the devices draw from, once each by name (the first definition wins)."""
    found: dict[str, CounterSet] = {}
    for d in devices:
        for use in d.consumes_counters:
            found.setdefault(use.counter_set.name, use.counter_set)
    return [found[name] for name in sorted(found)]


def uses_advanced_features(api_device: Mapping[str, Any]) -> bool:
    """Whether the device lowers its slice's limit to 64 (taints, counters, list attributes)."""
    if api_device.get("taints") or api_device.get("consumesCounters"):
        return True
    return any(k in LIST_KEYS for attr in (api_device.get("attributes") or {}).values() for k in attr)


def split_devices(api_devices: Sequence[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Cut the (sorted) devices into slices within the per-slice limits.

    Devices are cut into fixed blocks of 64; blocks 2k and 2k+1 share one slice of up to 128
    when neither holds an advanced device. Plain pools therefore pack 128 per slice, and a
    device gaining a taint (the common change: health) only splits its own pair of blocks
    instead of shifting every later slice, as greedy packing would. Always at least one slice:
    an empty pool is published as one empty slice.
    """
    blocks = [list(api_devices[i : i + MAX_DEVICES_ADVANCED]) for i in range(0, len(api_devices), MAX_DEVICES_ADVANCED)]
    chunks: list[list[dict[str, Any]]] = []
    for i in range(0, len(blocks), 2):
        pair = blocks[i : i + 2]
        if len(pair) == 2 and not any(uses_advanced_features(d) for b in pair for d in b):
            chunks.append(pair[0] + pair[1])
        else:
            chunks.extend(pair)
    return chunks or [[]]


def generate_name(node_name: str, driver_name: str, index: int = 0, count: int = 1) -> str:
    """`<index in hex>-<driver>-<node>-` as the Go kubeletplugin library names slices (the
    allocator sorts slices by name), made a valid DNS-subdomain prefix the apiserver will not cut."""
    width = max(5, len(f"{max(count - 1, 0):x}"))
    raw = f"{index:0{width}x}-{driver_name}-{node_name}".lower()
    name = re.sub(r"[^a-z0-9.-]", "-", raw).strip(".-") or "slice"
    return name[: _MAX_GENERATE_NAME - 1].rstrip(".-") + "-"


def owner_reference(node_name: str, node_uid: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Node", "name": node_name, "uid": node_uid, "controller": True}


def build_slices(
    devices: Sequence[Device],
    driver_name: str,
    node_name: str,
    node_uid: str,
    generation: int,
    *,
    taint_times: TaintTimes | None = None,
    now: str | None = None,
) -> list[dict[str, Any]]:
    """The node's pool as complete ResourceSlice bodies (camelCase, ready to POST).

    `taint_times` carries the timeAdded the server holds for taints that are already published,
    so that a taint keeps the time it first appeared; new taints get `now`.
    """
    stamp = now or rfc3339()
    times = taint_times or {}
    api_devices = [device_to_api(d, times, stamp) for d in sorted(devices, key=lambda d: d.name)]
    # A slice holds devices or counter sets, never both: the sets (at most 8 a slice) come after.
    sets = [{"name": c.name, "counters": _counters(c.counters)} for c in counter_sets(devices)]
    chunks: list[tuple[str, list[dict[str, Any]]]] = [("devices", c) for c in split_devices(api_devices)]
    chunks += [("sharedCounters", sets[i : i + MAX_COUNTER_SETS]) for i in range(0, len(sets), MAX_COUNTER_SETS)]
    owners = [owner_reference(node_name, node_uid)]
    return [
        {
            "apiVersion": API_VERSION,
            "kind": "ResourceSlice",
            "metadata": {
                "generateName": generate_name(node_name, driver_name, i, len(chunks)),
                "ownerReferences": list(owners),
            },
            "spec": {
                "driver": driver_name,
                "nodeName": node_name,
                "pool": {"name": node_name, "generation": generation, "resourceSliceCount": len(chunks)},
                field: chunk,
            },
        }
        for i, (field, chunk) in enumerate(chunks)
    ]


def taint_times_of(live_slices: Sequence[Mapping[str, Any]]) -> dict[tuple[str, str, str, str], str]:
    """timeAdded of every published taint, to be kept when the slice is rewritten."""
    times: dict[tuple[str, str, str, str], str] = {}
    for obj in live_slices:
        for dev in spec_devices(obj.get("spec")):
            for t in dev.get("taints") or []:
                if isinstance(t, dict) and isinstance(t.get("timeAdded"), str):
                    key = (dev.get("name"), t.get("key"), t.get("value") or "", t.get("effect"))
                    times[key] = t["timeAdded"]  # type: ignore[index]
    return times


def scalar_attributes(device: Device, scalar_capable: Collection[str]) -> Device:
    """The device as a server without list-typed attributes can store it.

    A scalar-capable list attribute keeps its first element; any other list attribute is dropped.
    """
    attrs: dict[str, AttrValue] = {}
    for name, value in device.attributes.items():
        if not isinstance(value, tuple):
            attrs[name] = value
        elif value and name in scalar_capable:
            attrs[name] = value[0]
    if attrs == device.attributes:
        return device
    return dataclasses.replace(device, attributes=attrs)
