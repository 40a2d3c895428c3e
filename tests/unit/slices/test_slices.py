"""Pure slice building, splitting, comparison and planning (no API server)."""

from __future__ import annotations

import copy
import itertools
from typing import Any

import pytest

from driver.model import NUMA_NODE, Device, DeviceKind, Taint, TaintEffect, Version, attribute_to_api
from driver.resource_api import MAX_DEVICES_ADVANCED, MAX_DEVICES_PER_SLICE
from driver.slices.build import build_slices, generate_name, scalar_attributes, taint_times_of
from driver.slices.plan import list_attributes_dropped, plan, slice_spec_equal

DRIVER = "tandem.example.com"
NODE = "node-a"
UID = "uid-1"
NOW = "2030-01-01T00:00:00Z"

_rv = itertools.count(100)


def gpu(i: int, **kw: Any) -> Device:
    return Device(
        name=f"gpu-{i:04d}",
        kind=DeviceKind.GPU,
        attributes=kw.pop("attributes", {"index": i, "model": "H100", "driverVersion": Version("550.1.0")}),
        capacity=kw.pop("capacity", {"memory": "80Gi"}),
        **kw,
    )


def tainted(i: int) -> Device:
    return gpu(i, taints=(Taint(key="tandem.example.com/unhealthy", effect=TaintEffect.NO_SCHEDULE),))


def build(devices: list[Device], **kw: Any) -> list[dict[str, Any]]:
    kw.setdefault("now", NOW)
    return build_slices(devices, DRIVER, NODE, UID, 0, **kw)


def as_stored(bodies: list[dict[str, Any]], p_gen: int | None = None) -> list[dict[str, Any]]:
    """What the server would hold after creating these bodies (names, RVs, canonical quantities)."""
    out = []
    for i, body in enumerate(bodies):
        obj = copy.deepcopy(body)
        obj["metadata"] = {
            **obj["metadata"],
            "name": obj["metadata"].get("name") or f"{obj['metadata']['generateName']}{i:05d}",
            "resourceVersion": str(next(_rv)),
            "uid": f"slice-uid-{i}",
        }
        for dev in obj["spec"]["devices"]:
            for cap in (dev.get("capacity") or {}).values():
                if cap["value"] == "80Gi":
                    cap["value"] = "81920Mi"  # same quantity, other spelling
        if p_gen is not None:
            obj["spec"]["pool"]["generation"] = p_gen
        out.append(obj)
    return out


def publish(devices: list[Device]) -> list[dict[str, Any]]:
    """Plan from nothing and return the stored result."""
    p = plan(build(devices), [])
    return as_stored(p.creates)


def apply(live: list[dict[str, Any]], p: Any) -> list[dict[str, Any]]:
    deleted = {name for name, _ in p.deletes}
    by_name = {o["metadata"]["name"]: o for o in live if o["metadata"]["name"] not in deleted}
    for body in p.updates:
        (stored,) = as_stored([body])
        by_name[stored["metadata"]["name"]] = stored
    for j, stored in enumerate(as_stored(p.creates)):
        stored["metadata"]["name"] = f"new-{next(_rv)}-{j}"
        by_name[stored["metadata"]["name"]] = stored
    return list(by_name.values())


# -- attribute and device form -----------------------------------------------------------------


def test_attribute_types_map_to_api_fields() -> None:
    assert attribute_to_api(True) == {"bool": True}
    assert attribute_to_api(3) == {"int": 3}
    assert attribute_to_api("x") == {"string": "x"}
    assert attribute_to_api(Version("1.2.3")) == {"version": "1.2.3"}
    assert attribute_to_api((0, 1)) == {"ints": [0, 1]}
    assert attribute_to_api((True,)) == {"bools": [True]}
    assert attribute_to_api(("a", "b")) == {"strings": ["a", "b"]}
    assert attribute_to_api((Version("1.0.0"),)) == {"versions": ["1.0.0"]}


@pytest.mark.parametrize("bad", [(), (1, "a"), (True, 1), 1.5, None])
def test_unrepresentable_attributes_are_rejected(bad: Any) -> None:
    with pytest.raises(ValueError):
        attribute_to_api(bad)


def test_slice_object_shape() -> None:
    (body,) = build([gpu(0)])
    assert body["apiVersion"] == "resource.k8s.io/v1"
    assert body["kind"] == "ResourceSlice"
    assert body["metadata"]["generateName"] == "00000-tandem.example.com-node-a-"
    assert body["metadata"]["ownerReferences"] == [
        {"apiVersion": "v1", "kind": "Node", "name": NODE, "uid": UID, "controller": True}
    ]
    spec = body["spec"]
    assert spec["driver"] == DRIVER
    assert spec["nodeName"] == NODE
    assert spec["pool"] == {"name": NODE, "generation": 0, "resourceSliceCount": 1}
    assert spec["devices"] == [
        {
            "name": "gpu-0000",
            "attributes": {
                "driverVersion": {"version": "550.1.0"},
                "index": {"int": 0},
                "model": {"string": "H100"},
            },
            "capacity": {"memory": {"value": "80Gi"}},
        }
    ]


def test_generate_name_is_a_valid_prefix_led_by_the_slice_index() -> None:
    assert generate_name("n", "d.example.com", 10, 11) == "0000a-d.example.com-n-"
    assert generate_name("n", "d.example.com", 0x12345, 0x100001).startswith("012345-")
    name = generate_name("Node_With.Caps" + "x" * 80, "Tandem.Example.com")
    assert name.endswith("-")
    assert len(name) <= 58
    assert name == name.lower()
    assert all(c.isalnum() or c in "-." for c in name)


def test_empty_pool_is_one_empty_slice() -> None:
    (body,) = build([])
    assert body["spec"]["devices"] == []
    assert body["spec"]["pool"]["resourceSliceCount"] == 1


def test_taint_form_and_time_kept_from_live() -> None:
    devices = [tainted(0)]
    (body,) = build(devices)
    assert body["spec"]["devices"][0]["taints"] == [
        {"key": "tandem.example.com/unhealthy", "effect": "NoSchedule", "timeAdded": NOW}
    ]
    live = as_stored([body])
    live[0]["spec"]["devices"][0]["taints"][0]["timeAdded"] = "2020-05-05T05:05:05Z"
    (again,) = build(devices, taint_times=taint_times_of(live), now="2031-01-01T00:00:00Z")
    assert again["spec"]["devices"][0]["taints"][0]["timeAdded"] == "2020-05-05T05:05:05Z"
    # A different effect is a different taint: it gets the current time.
    other = Device(
        name="gpu-0000",
        kind=DeviceKind.GPU,
        taints=(Taint(key="tandem.example.com/unhealthy", effect=TaintEffect.NO_EXECUTE),),
    )
    (changed,) = build([other], taint_times=taint_times_of(live), now="2031-01-01T00:00:00Z")
    assert changed["spec"]["devices"][0]["taints"][0]["timeAdded"] == "2031-01-01T00:00:00Z"


# -- splitting ---------------------------------------------------------------------------------


def _sizes(bodies: list[dict[str, Any]]) -> list[int]:
    return [len(b["spec"]["devices"]) for b in bodies]


def test_plain_devices_pack_128_per_slice() -> None:
    bodies = build([gpu(i) for i in range(1000)])
    assert _sizes(bodies) == [128] * 7 + [104]
    for b in bodies:
        assert b["spec"]["pool"]["resourceSliceCount"] == 8
        assert b["spec"]["pool"]["generation"] == 0


def test_order_is_sorted_by_name_and_stable() -> None:
    devices = [gpu(i) for i in range(300)]
    shuffled = devices[::-1]
    names = [d["name"] for b in build(shuffled) for d in b["spec"]["devices"]]
    assert names == sorted(d.name for d in devices)
    assert build(shuffled) == build(devices)


def test_advanced_devices_limit_their_slice_to_64() -> None:
    devices = [gpu(i) for i in range(1000)]
    devices[5] = tainted(5)
    list_attr = gpu(700, attributes={NUMA_NODE: (1, 0)})
    devices[700] = list_attr
    bodies = build(devices)
    for b in bodies:
        devs = b["spec"]["devices"]
        advanced = any(d.get("taints") or "ints" in str(d.get("attributes")) for d in devs)
        assert len(devs) <= (MAX_DEVICES_ADVANCED if advanced else MAX_DEVICES_PER_SLICE)
    # Only the two pairs of blocks holding advanced devices are split; the rest still pack 128.
    assert _sizes(bodies) == [64, 64, 128, 128, 128, 128, 64, 64, 128, 104]
    assert sum(_sizes(bodies)) == 1000


def test_small_pool_with_taints_is_one_slice() -> None:
    bodies = build([tainted(i) for i in range(64)])
    assert _sizes(bodies) == [64]


# -- comparison --------------------------------------------------------------------------------


def test_quantity_spellings_compare_equal() -> None:
    (a,) = build([gpu(0, capacity={"memory": "1024Mi", "cores": "0.5"})])
    b = copy.deepcopy(a)
    b["spec"]["devices"][0]["capacity"] = {"memory": {"value": "1Gi"}, "cores": {"value": "500m"}}
    assert slice_spec_equal(a["spec"], b["spec"])
    b["spec"]["devices"][0]["capacity"]["memory"]["value"] = "2Gi"
    assert not slice_spec_equal(a["spec"], b["spec"])


def test_taint_time_and_empty_fields_ignored_but_content_is_not() -> None:
    (a,) = build([tainted(0), gpu(1, capacity={})])
    b = copy.deepcopy(a)
    b["spec"]["devices"][0]["taints"][0]["timeAdded"] = "1999-01-01T00:00:00Z"
    b["spec"]["devices"][0]["taints"][0]["value"] = ""
    b["spec"]["devices"][1]["capacity"] = {}
    b["spec"]["devices"][1]["taints"] = None
    b["spec"]["devices"][1]["bindingConditions"] = []
    b["spec"]["devices"][1]["nodeSelector"] = {"nodeSelectorTerms": None}  # empty once pruned: omitted
    b["spec"]["allNodes"] = None
    assert slice_spec_equal(a["spec"], b["spec"])
    b["spec"]["devices"][0]["taints"][0]["effect"] = "NoExecute"
    assert not slice_spec_equal(a["spec"], b["spec"])
    c = copy.deepcopy(a)
    c["spec"]["devices"][1]["attributes"]["index"] = {"int": 2}
    assert not slice_spec_equal(a["spec"], c["spec"])
    d = copy.deepcopy(a)
    d["spec"]["devices"].reverse()
    assert not slice_spec_equal(a["spec"], d["spec"])


# -- planning ----------------------------------------------------------------------------------


def test_first_publish_creates_all_at_generation_1() -> None:
    p = plan(build([gpu(i) for i in range(1000)]), [])
    assert len(p.creates) == 8 and not p.updates and not p.deletes
    assert {b["spec"]["pool"]["generation"] for b in p.creates} == {1}


def test_steady_state_plans_nothing() -> None:
    devices = [gpu(i) for i in range(1000)]
    devices[3] = tainted(3)
    live = publish(devices)
    # Rebuilt later, with a new "now": timeAdded differs textually but is kept from live.
    desired = build_slices(devices, DRIVER, NODE, UID, 0, taint_times=taint_times_of(live))
    assert plan(desired, live).empty


def test_one_changed_device_is_one_update_without_generation_bump() -> None:
    devices = [gpu(i) for i in range(1000)]
    live = publish(devices)
    devices[500] = gpu(500, attributes={"index": 500, "model": "H200"})
    p = plan(build(devices), live)
    assert p.writes == 1 and len(p.updates) == 1
    assert p.generation == 1
    (upd,) = p.updates
    assert upd["metadata"]["resourceVersion"]
    assert any(d["name"] == "gpu-0500" for d in upd["spec"]["devices"])
    assert plan(build(devices), apply(live, p)).empty


def test_new_slice_bumps_generation_in_all_slices() -> None:
    devices = [gpu(i) for i in range(128)]
    live = publish(devices)
    devices.append(gpu(128))
    p = plan(build(devices), live)
    assert len(p.creates) == 1 and len(p.updates) == 1 and not p.deletes
    assert p.generation == 2
    for body in p.creates + p.updates:
        assert body["spec"]["pool"] == {"name": NODE, "generation": 2, "resourceSliceCount": 2}
    assert plan(build(devices), apply(live, p)).empty


def test_shrinking_deletes_obsolete_slices() -> None:
    devices = [gpu(i) for i in range(300)]
    live = publish(devices)
    p = plan(build(devices[:100]), live)
    assert len(p.deletes) == 2 and len(p.updates) == 1 and not p.creates
    assert all(rv for _, rv in p.deletes)
    assert plan(build(devices[:100]), apply(live, p)).empty


def test_old_generation_and_foreign_pool_slices_are_deleted() -> None:
    devices = [gpu(i) for i in range(10)]
    live = publish(devices)
    stale = copy.deepcopy(live[0])
    stale["metadata"]["name"] = "stale"
    stale["spec"]["pool"]["generation"] = 0
    foreign = copy.deepcopy(live[0])
    foreign["metadata"]["name"] = "foreign"
    foreign["spec"]["pool"]["name"] = "other-pool"
    p = plan(build(devices), [*live, stale, foreign])
    assert sorted(name for name, _ in p.deletes) == ["foreign", "stale"]
    assert not p.updates and not p.creates


def test_node_uid_change_rewrites_owner_reference() -> None:
    devices = [gpu(0)]
    live = publish(devices)
    p = plan(build_slices(devices, DRIVER, NODE, "uid-2", 0, now=NOW), live)
    assert len(p.updates) == 1
    assert p.updates[0]["metadata"]["ownerReferences"][0]["uid"] == "uid-2"


def test_taint_on_one_device_only_touches_its_blocks() -> None:
    devices = [gpu(i) for i in range(1000)]
    live = publish(devices)
    devices[900] = tainted(900)
    p = plan(build(devices), live)
    # 8 -> 9 slices: one new slice, so a new generation for all of them.
    assert len(p.creates) == 1 and len(p.updates) == 8
    assert plan(build(devices), apply(live, p)).empty


# -- list attributes fallback ------------------------------------------------------------------


def test_list_attribute_drop_is_detected() -> None:
    (sent,) = build([gpu(0, attributes={NUMA_NODE: (1, 0), "index": 0})])
    stored = copy.deepcopy(sent)
    assert not list_attributes_dropped(sent, stored)
    stored["spec"]["devices"][0]["attributes"][NUMA_NODE] = {}
    assert list_attributes_dropped(sent, stored)


def test_scalar_fallback_keeps_scalar_capable_first_element() -> None:
    dev = gpu(0, attributes={NUMA_NODE: (1, 0), "peers": ("a", "b"), "index": 0})
    out = scalar_attributes(dev, {NUMA_NODE})
    assert out.attributes == {NUMA_NODE: 1, "index": 0}
    plain = gpu(1)
    assert scalar_attributes(plain, {NUMA_NODE}) is plain
