"""The simulated API server for binding conditions (issue 23), as the real 1.37 server behaves:
pods and their field selectors, a device's bindingConditions/bindingFailureConditions/bindsToNode
and their copies in an allocation result (validateDeviceBindingParameters), metav1.Condition rules
on a device's status conditions, server-side apply merging those conditions by `type` per manager,
and the simulated scheduler copying a device's binding conditions into its allocation result."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from sim import scheduler
from sim.apierrors import ApiError
from sim.apiserver import SimApiServer

DRIVER = "gpu.example.com"
READY, FAILED = "tandem.dev/partition-ready", "tandem.dev/partition-failed"
BINDING = {"bindsToNode": True, "bindingConditions": [READY], "bindingFailureConditions": [FAILED]}


@pytest.fixture
def srv() -> Iterator[SimApiServer]:
    with SimApiServer() as server:
        yield server


def http(
    srv: SimApiServer, method: str, path: str, body: Any = None, ctype: str = "application/json"
) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(srv.url + path, data=data, method=method, headers={"Content-Type": ctype})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def pod_body(name: str, namespace: str = "default") -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"containers": [{"name": "c", "image": "busybox"}]},
    }


def slice_body(**device: Any) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"generateName": "s-"},
        "spec": {
            "driver": DRIVER,
            "nodeName": "node-a",
            "pool": {"name": "node-a", "generation": 1, "resourceSliceCount": 1},
            "devices": [{"name": "gpu-0", **device}],
        },
    }


def claim_body(**result: Any) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "claim", "namespace": "default"},
        "spec": {"devices": {"requests": [{"name": "gpus", "exactly": {"deviceClassName": "gpu.example.com"}}]}},
        "status": {
            "allocation": {
                "devices": {
                    "results": [{"request": "gpus", "driver": DRIVER, "pool": "node-a", "device": "gpu-0", **result}]
                },
                "allocationTimestamp": "2026-01-01T00:00:00Z",
            }
        },
    }


def condition(kind: str, status: str = "True", reason: str = "Carved") -> dict[str, Any]:
    return {
        "type": kind,
        "status": status,
        "reason": reason,
        "message": "",
        "lastTransitionTime": "2026-01-01T00:00:00Z",
    }


def apply(srv: SimApiServer, manager: str, conditions: list[dict[str, Any]], force: bool = True) -> tuple[int, dict]:
    body = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "claim", "namespace": "default"},
        "status": {"devices": [{"driver": DRIVER, "pool": "node-a", "device": "gpu-0", "conditions": conditions}]},
    }
    path = f"/apis/resource.k8s.io/v1/namespaces/default/resourceclaims/claim/status?fieldManager={manager}"
    return http(srv, "PATCH", path + ("&force=true" if force else ""), body, "application/apply-patch+yaml")


def condition_types(srv: SimApiServer) -> list[str]:
    (entry,) = srv.get("resourceclaims", "claim", "default")["status"]["devices"]
    return sorted(c["type"] for c in entry.get("conditions") or [])


# --- pods -----------------------------------------------------------------------------------------


def test_pods_are_served_with_the_node_field_selectors(srv: SimApiServer) -> None:
    for name in ("nominated", "bound", "pending"):
        assert http(srv, "POST", "/api/v1/namespaces/default/pods", pod_body(name))[0] == 201
    status = srv.get("pods", "nominated", "default")
    status["status"] = {"nominatedNodeName": "node-a"}
    code, stored = http(srv, "PUT", "/api/v1/namespaces/default/pods/nominated/status", status)
    assert code == 200 and stored["status"]["nominatedNodeName"] == "node-a"
    bound = srv.get("pods", "bound", "default")
    bound["spec"]["nodeName"] = "node-a"
    srv.update(bound)

    def names(selector: str) -> list[str]:
        code, listed = http(srv, "GET", f"/api/v1/pods?fieldSelector={selector}")
        assert code == 200 and listed["kind"] == "PodList"
        return [p["metadata"]["name"] for p in listed["items"]]

    assert names("status.nominatedNodeName=node-a") == ["nominated"]
    assert names("spec.nodeName=node-a") == ["bound"]
    code, error = http(srv, "GET", "/api/v1/pods?fieldSelector=status.podIP=1.2.3.4")
    assert code == 400 and "not a known field selector" in error["message"]


def test_the_scheduler_nominates_a_pod_through_its_status(srv: SimApiServer) -> None:
    srv.create(pod_body("p"))
    scheduler.nominate(srv, "default", "p", "node-a")
    assert srv.get("pods", "p", "default")["status"]["nominatedNodeName"] == "node-a"


# --- binding parameters -----------------------------------------------------------------------------

BAD_BINDINGS = [
    ({"bindingConditions": [READY]}, "bindingFailureConditions are required to use bindingConditions"),
    ({"bindingFailureConditions": [FAILED]}, "bindingConditions are required to use bindingFailureConditions"),
    ({"bindingConditions": [READY, READY], "bindingFailureConditions": [FAILED]}, "Duplicate value"),
    ({"bindingConditions": [READY], "bindingFailureConditions": [FAILED, FAILED]}, "Duplicate value"),
    ({"bindingConditions": [READY], "bindingFailureConditions": [READY]}, "must not overlap"),
    ({"bindingConditions": [f"c{i}" for i in range(5)], "bindingFailureConditions": [FAILED]}, "Too many: 5"),
    ({"bindingConditions": [READY], "bindingFailureConditions": [f"f{i}" for i in range(5)]}, "Too many: 5"),
    ({"bindingConditions": ["Not/A/Name"], "bindingFailureConditions": [FAILED]}, "qualified name"),
    ({"bindingConditions": [READY], "bindingFailureConditions": ["-bad"]}, "qualified name"),
]


def test_a_device_may_carry_binding_conditions(srv: SimApiServer) -> None:
    four = {"bindingConditions": ["a", "b", "x.io/c", "d"], "bindingFailureConditions": ["e", "f", "g", "h"]}
    for device in (BINDING, four, {"bindsToNode": False}):
        code, stored = http(srv, "POST", "/apis/resource.k8s.io/v1/resourceslices", slice_body(**device))
        assert code == 201, stored
        assert {k: stored["spec"]["devices"][0][k] for k in device} == device


@pytest.mark.parametrize(("binding", "says"), BAD_BINDINGS)
def test_a_device_with_bad_binding_conditions_is_refused(srv: SimApiServer, binding: dict, says: str) -> None:
    code, error = http(srv, "POST", "/apis/resource.k8s.io/v1/resourceslices", slice_body(**binding))
    assert code == 422 and says in error["message"], error["message"]


def test_an_allocation_result_may_copy_binding_conditions(srv: SimApiServer) -> None:
    binding = {k: BINDING[k] for k in ("bindingConditions", "bindingFailureConditions")}
    stored = srv.create(claim_body(**binding))
    assert stored["status"]["allocation"]["devices"]["results"][0]["bindingConditions"] == [READY]
    assert stored["status"]["allocation"]["allocationTimestamp"] == "2026-01-01T00:00:00Z"


@pytest.mark.parametrize(("binding", "says"), BAD_BINDINGS)
def test_an_allocation_result_with_bad_binding_conditions_is_refused(
    srv: SimApiServer, binding: dict, says: str
) -> None:
    with pytest.raises(ApiError) as e:
        srv.create(claim_body(**binding))
    assert e.value.code == 422 and "status.allocation.devices.results[0]" in str(e.value.status())
    assert says in e.value.status()["message"]


def test_with_the_gate_off_binding_fields_are_dropped(srv: SimApiServer) -> None:
    srv.binding_conditions_enabled = False
    code, stored = http(srv, "POST", "/apis/resource.k8s.io/v1/resourceslices", slice_body(**BINDING))
    assert code == 201 and stored["spec"]["devices"][0] == {"name": "gpu-0"}


# --- device status conditions -----------------------------------------------------------------------


def test_a_device_status_condition_may_have_a_prefixed_type(srv: SimApiServer) -> None:
    srv.create(claim_body())
    code, body = apply(srv, "tandem", [condition(READY), condition("Ready")])
    assert code == 200, body
    assert condition_types(srv) == ["Ready", READY]


@pytest.mark.parametrize(
    ("conditions", "says"),
    [
        ([condition("Not/A/Type")], "conditions[0].type"),
        (
            [condition(READY), condition(READY, "False")],
            'duplicate entries for key [type="tandem.dev/partition-ready"]',
        ),
        ([condition(READY, reason="1bad")], "a condition reason must start with alphabetic character"),
        ([condition(READY, reason="x" * 1025)], "may not be more than 1024"),
        ([{**condition(READY), "message": "m" * (32 * 1024 + 1)}], "may not be more than 32768"),
        ([{**condition(READY), "observedGeneration": -1}], "greater than or equal to zero"),
        ([condition(READY, status="Yes")], "Unsupported value"),
    ],
)
def test_a_bad_device_status_condition_is_refused(srv: SimApiServer, conditions: list, says: str) -> None:
    srv.create(claim_body())
    code, error = apply(srv, "tandem", conditions)
    assert code == 422 and says in error["message"], error["message"]


def test_apply_merges_conditions_by_type_per_manager(srv: SimApiServer) -> None:
    srv.create(claim_body())
    assert apply(srv, "binding", [condition(READY), condition(FAILED, "False")])[0] == 200
    assert apply(srv, "prepare", [condition("Ready")])[0] == 200
    assert condition_types(srv) == ["Ready", FAILED, READY], "another manager's condition is added, not a replacement"
    assert apply(srv, "binding", [condition(READY)])[0] == 200
    assert condition_types(srv) == ["Ready", READY], "a condition the manager no longer applies is removed"
    assert apply(srv, "prepare", [condition("Ready", "False", "Unprepared")])[0] == 200
    (entry,) = srv.get("resourceclaims", "claim", "default")["status"]["devices"]
    assert {c["type"]: c["status"] for c in entry["conditions"]} == {"Ready": "False", READY: "True"}


def test_a_manager_that_applies_nothing_more_leaves_the_others_entry(srv: SimApiServer) -> None:
    srv.create(claim_body())
    apply(srv, "binding", [condition(READY)])
    apply(srv, "prepare", [condition("Ready")])
    body = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": "claim"}, "status": {}}
    path = "/apis/resource.k8s.io/v1/namespaces/default/resourceclaims/claim/status?fieldManager=binding&force=true"
    assert http(srv, "PATCH", path, body, "application/apply-patch+yaml")[0] == 200
    assert condition_types(srv) == ["Ready"]
    managers = {m["manager"] for m in srv.get("resourceclaims", "claim", "default")["metadata"]["managedFields"]}
    assert managers == {"prepare"}


def test_changing_another_managers_condition_conflicts_unless_forced(srv: SimApiServer) -> None:
    srv.create(claim_body())
    apply(srv, "binding", [condition(READY)])
    code, error = apply(srv, "other", [condition(READY, "False")], force=False)
    assert code == 409 and 'conflict with "binding"' in error["message"]
    assert apply(srv, "other", [condition(READY)], force=False)[0] == 200, "the same value is shared, no conflict"
    assert apply(srv, "other", [condition(READY, "False")])[0] == 200
    assert apply(srv, "binding", [])[0] == 200  # the forced field left binding: dropping it removes nothing
    (entry,) = srv.get("resourceclaims", "claim", "default")["status"]["devices"]
    assert entry["conditions"][0]["status"] == "False"


# --- the simulated scheduler --------------------------------------------------------------------------


def test_the_scheduler_copies_binding_conditions_into_the_result(srv: SimApiServer) -> None:
    body = slice_body(**BINDING)
    body["spec"]["devices"].append({"name": "gpu-1"})
    srv.create(body)
    requests = [scheduler.Request("gpus", "gpu.example.com", lambda _d: True, count=2)]
    claim = srv.create(scheduler.claim_object("default", "c", requests))
    allocated = scheduler.allocate(srv, claim, DRIVER, "node-a", requests)
    results = {r["device"]: r for r in allocated["status"]["allocation"]["devices"]["results"]}
    assert results["gpu-0"]["bindingConditions"] == [READY]
    assert results["gpu-0"]["bindingFailureConditions"] == [FAILED]
    assert "bindingConditions" not in results["gpu-1"] and "bindsToNode" not in results["gpu-0"]
    assert allocated["status"]["allocation"]["allocationTimestamp"]
