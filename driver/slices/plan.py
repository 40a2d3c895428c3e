"""The fewest writes that turn the live pool into the desired one: semantic comparison and planning.

Pure: `plan` takes the slices `build_slices` made and the slices the server holds, and returns
the deletes, updates and creates in the order they must be done. It follows the Go
`resourceslice` controller where that matters to consumers (docs/reference/kubelet-plugin.md,
'Publishing ResourceSlices'): delete-then-update-then-create, generation bumps, comparison as the
server would see it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from driver.model import Device
from driver.resource_api import parse_quantity
from driver.slices.build import LIST_KEYS, metadata, spec_devices, without_sharing


def _prune(value: Any) -> Any:
    """Drop None, {} and [] recursively: the server omits them (omitempty), we may not.

    One pass that recurses only into containers: every comparison of a pool prunes each of its
    devices' attributes and capacities twice, the bulk of a sync's CPU."""
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if isinstance(v, (dict, list)):
                v = _prune(v)
                if not v:
                    continue
            elif v is None:
                continue
            out[k] = v
        return out
    if isinstance(value, list):
        return [_prune(v) if isinstance(v, (dict, list)) else v for v in value]
    return value


def _quantity(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return parse_quantity(value)
        except ValueError:
            return value
    return value


def _canon_device(dev: Mapping[str, Any]) -> Any:
    out = dict(_prune(dict(dev)))
    if isinstance(out.get("capacity"), dict):
        out["capacity"] = {k: _canon_capacity(c) for k, c in out["capacity"].items()}
    if isinstance(out.get("taints"), list):
        out["taints"] = [
            (t.get("key"), t.get("value") or "", t.get("effect")) if isinstance(t, dict) else t for t in out["taints"]
        ]
    if isinstance(out.get("consumesCounters"), list):
        out["consumesCounters"] = [_canon_counters(c) for c in out["consumesCounters"]]
    return out


def _canon_capacity(cap: Any) -> Any:
    """A capacity with its value and request policy's quantities compared by value."""
    if not isinstance(cap, dict):
        return cap
    out = {**cap, "value": _quantity(cap.get("value"))}
    policy = cap.get("requestPolicy")
    if isinstance(policy, dict):
        policy = {**policy, "default": _quantity(policy.get("default"))}
        if isinstance(policy.get("validRange"), dict):
            policy["validRange"] = {k: _quantity(v) for k, v in policy["validRange"].items()}
        if isinstance(policy.get("validValues"), list):
            policy["validValues"] = [_quantity(v) for v in policy["validValues"]]
        out["requestPolicy"] = policy
    return out


def _canon_counters(entry: Any) -> Any:
    """A counter set or consumption with its quantities compared by value."""
    if not isinstance(entry, dict) or not isinstance(entry.get("counters"), dict):
        return entry
    counters = {
        k: {**c, "value": _quantity(c.get("value"))} if isinstance(c, dict) else c for k, c in entry["counters"].items()
    }
    return {**entry, "counters": counters}


def _canon_devices(spec: object) -> list[Any]:
    return [_canon_device(d) for d in spec_devices(spec)]


def _canon_shared(spec: object) -> list[Any]:
    shared = spec.get("sharedCounters") if isinstance(spec, dict) else None
    return [_canon_counters(_prune(c)) for c in shared] if isinstance(shared, list) else []


def _canon_content(spec: object) -> tuple[list[Any], list[Any]]:
    """What a slice holds, for matching desired slices to live ones: its devices or counter sets."""
    return _canon_devices(spec), _canon_shared(spec)


def _canon_spec(spec: object) -> dict[str, Any] | None:
    if not isinstance(spec, dict):
        return None
    out: dict[str, Any] = dict(_prune(dict(spec)))
    out["devices"] = _canon_devices(spec)
    out["sharedCounters"] = _canon_shared(spec)
    if out.get("allNodes") is False:
        del out["allNodes"]
    return out


def slice_spec_equal(desired: Mapping[str, Any], live: Mapping[str, Any]) -> bool:
    """Semantic equality of two slice specs, as the server would see them.

    Quantities compare by value ("1024Mi" == "1Gi": the server canonicalises them), taint
    timeAdded is ignored (the server sets it, we keep it), and absent, null and empty fields are
    equal. Device order counts: it is the order consumers see.
    """
    return _canon_spec(dict(desired)) == _canon_spec(dict(live))


@dataclass(frozen=True)
class Plan:
    """Writes that bring the live pool to the desired one, in the order they must be done."""

    generation: int
    deletes: list[tuple[str, str]] = field(default_factory=list)  # (name, resourceVersion)
    updates: list[dict[str, Any]] = field(default_factory=list)  # full bodies with name + RV
    creates: list[dict[str, Any]] = field(default_factory=list)  # full bodies with generateName

    @property
    def empty(self) -> bool:
        return not (self.deletes or self.updates or self.creates)

    @property
    def writes(self) -> int:
        return len(self.deletes) + len(self.updates) + len(self.creates)


def _generation(obj: Mapping[str, Any]) -> int:
    pool = (obj.get("spec") or {}).get("pool") or {}
    gen = pool.get("generation")
    return gen if isinstance(gen, int) and not isinstance(gen, bool) else -1


def _with_pool(body: dict[str, Any], generation: int, count: int) -> dict[str, Any]:
    spec = dict(body["spec"])
    spec["pool"] = {**spec["pool"], "generation": generation, "resourceSliceCount": count}
    return {**body, "spec": spec}


def _device_names(obj: Mapping[str, Any]) -> set[str]:
    return {name for d in spec_devices(obj.get("spec")) if isinstance(name := d.get("name"), str)}


def plan(desired: Sequence[dict[str, Any]], live: Sequence[Mapping[str, Any]]) -> Plan:
    """The minimal writes that turn `live` (this node's slices of this driver) into `desired`.

    `desired` comes from `build_slices`; its pool generation and count are decided here.
    Matching reuses live slices: first those whose devices are already exactly right, then by
    the largest overlap of device names, so that a steady state plans nothing and one changed
    device plans one update. Unmatched live slices, slices of an older generation or another
    pool are deleted; missing ones are created.

    Generation (docs/reference/kubelet-plugin.md, 'Publishing ResourceSlices'): consumers use only the slices with the highest
    generation and count them against resourceSliceCount. One rewritten slice is atomic, so the
    generation can stay. When new slices appear or several change, a consumer could see some
    old and some new slices at the same generation (a device moved between slices would show
    twice or not at all); a higher generation in all of them makes it ignore the old ones until
    the set is complete. The bump rewrites every kept slice, so it is done only then.
    """
    if not desired:
        raise ValueError("desired pool has no slices (build_slices always returns at least one)")
    pool_name = desired[0]["spec"]["pool"]["name"]
    asked = max(_generation(d) for d in desired)
    owners = desired[0]["metadata"].get("ownerReferences")

    current = max((_generation(obj) for obj in live), default=0)
    candidates: list[Mapping[str, Any]] = []
    deletes: list[tuple[str, str]] = []
    for obj in sorted(live, key=lambda o: str(metadata(o).get("name", ""))):
        meta = metadata(obj)
        name = meta.get("name")
        if not isinstance(name, str) or not name:
            continue
        pool = (obj.get("spec") or {}).get("pool") or {}
        if pool.get("name") == pool_name and _generation(obj) == current:
            candidates.append(obj)
        else:
            deletes.append((name, str(meta.get("resourceVersion") or "")))

    matched: dict[int, Mapping[str, Any]] = {}
    for i, body in enumerate(desired):
        want = _canon_content(body["spec"])
        for obj in candidates:
            if _canon_content(obj.get("spec")) == want:
                matched[i] = obj
                candidates.remove(obj)
                break
    for i, body in enumerate(desired):
        if i in matched or not candidates:
            continue
        names = _device_names(body)
        best = max(candidates, key=lambda o: len(names & _device_names(o)))
        matched[i] = best
        candidates.remove(best)
    deletes += [(str(metadata(o)["name"]), str(metadata(o).get("resourceVersion") or "")) for o in candidates]

    count = len(desired)
    missing = [i for i in range(count) if i not in matched]

    def changed(i: int, generation: int) -> bool:
        obj = matched[i]
        want = _with_pool(desired[i], generation, count)
        same_owner = _prune(metadata(obj).get("ownerReferences")) == _prune(owners)
        return not (same_owner and slice_spec_equal(want["spec"], obj.get("spec") or {}))

    changed_now = [i for i in matched if changed(i, current)]
    if asked > current:
        generation = asked
    elif not missing and len(changed_now) <= 1:
        generation = current
    else:
        generation = current + 1
    to_update = sorted(matched) if generation != current else changed_now

    updates = []
    for i in to_update:
        body = _with_pool(desired[i], generation, count)
        meta = {**metadata(matched[i]), "ownerReferences": owners}
        meta.pop("managedFields", None)
        updates.append({**body, "metadata": meta})
    creates = [_with_pool(desired[i], generation, count) for i in missing]
    return Plan(generation=generation, deletes=deletes, updates=updates, creates=creates)


def list_attributes_dropped(sent: Mapping[str, Any], stored: Mapping[str, Any]) -> bool:
    """Whether the server silently dropped list-typed attribute values we sent.

    An apiserver with DRAListTypeAttributes off keeps the attribute key but drops the list, so
    the stored attribute has no value at all.
    """
    stored_devices = {d.get("name"): d for d in spec_devices(stored.get("spec"))}
    for dev in spec_devices(sent.get("spec")):
        back = stored_devices.get(dev.get("name"))
        back_attrs = (back or {}).get("attributes") or {}
        for name, attr in (dev.get("attributes") or {}).items():
            for key in LIST_KEYS:
                if attr.get(key) and not (back_attrs.get(name) or {}).get(key):
                    return True
    return False


def counters_dropped(sent: Mapping[str, Any], stored: Mapping[str, Any]) -> bool:
    """Whether the server silently dropped shared counters or counter consumptions we sent
    (DRAPartitionableDevices off): partitions would then look independent to the scheduler."""
    if (sent.get("spec") or {}).get("sharedCounters") and not (stored.get("spec") or {}).get("sharedCounters"):
        return True
    stored_devices = {d.get("name"): d for d in spec_devices(stored.get("spec"))}
    return any(
        dev.get("consumesCounters") and not (stored_devices.get(dev.get("name")) or {}).get("consumesCounters")
        for dev in spec_devices(sent.get("spec"))
    )


def _device_field_dropped(key: str) -> Callable[[Mapping[str, Any], Mapping[str, Any]], bool]:
    """Whether the server silently dropped device field `key` from some device we sent."""

    def dropped(sent: Mapping[str, Any], stored: Mapping[str, Any]) -> bool:
        stored_devices = {d.get("name"): d for d in spec_devices(stored.get("spec"))}
        return any(
            dev.get(key) and not (stored_devices.get(dev.get("name")) or {}).get(key)
            for dev in spec_devices(sent.get("spec"))
        )

    return dropped


@dataclass(frozen=True)
class Droppable:
    """A feature a server with its gate off drops without an error: how to see that it did, what
    the devices look like without it, and what that costs (logged once)."""

    dropped: Callable[[Mapping[str, Any], Mapping[str, Any]], bool]
    leave_out: Callable[[Sequence[Device]], list[Device]]
    why: str


DROPPABLE: dict[str, Droppable] = {
    "taints": Droppable(
        _device_field_dropped("taints"),
        lambda devices: [dataclasses.replace(d, taints=()) if d.taints else d for d in devices],
        "the API server does not store device taints (feature gate DRADeviceTaints off?): unhealthy devices "
        "stay schedulable",
    ),
    # Without counters the scheduler would give out overlapping MIG partitions: every device that
    # draws from counters (dynamic MIG) is left out rather than published unguarded.
    "counters": Droppable(
        counters_dropped,
        lambda devices: [d for d in devices if not d.consumes_counters],
        "the API server does not store shared counters (feature gate DRAPartitionableDevices off?): the "
        "partitions and whole GPUs of dynamic-MIG GPUs are not published",
    ),
    "sharing": Droppable(
        _device_field_dropped("allowMultipleAllocations"),
        lambda devices: [without_sharing(d) for d in devices],
        "the API server does not store allowMultipleAllocations (feature gate DRAConsumableCapacity off?): "
        "shared NICs and GPUs are published as devices one claim at a time can have",
    ),
    "binding": Droppable(
        _device_field_dropped("bindingConditions"),
        lambda devices: [
            dataclasses.replace(d, binding_conditions=(), binding_failure_conditions=()) if d.binding_conditions else d
            for d in devices
        ],
        "the API server does not store binding conditions (feature gates DRADeviceBindingConditions, "
        "DRAResourceClaimDeviceStatus off?): partitions are made, and NICs checked, at prepare",
    ),
}
