"""The simulated API server, driven through the official `kubernetes` client as the driver drives it."""

from __future__ import annotations

import json
import re
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client, config, watch
from kubernetes.client.exceptions import ApiException

from sim.apiquantity import canonical
from sim.apiserver import SimApiServer

DRIVER = "gpu.example.com"


@pytest.fixture
def srv() -> Iterator[SimApiServer]:
    with SimApiServer() as server:
        yield server


@pytest.fixture
def api_client(srv: SimApiServer, tmp_path: Path) -> Iterator[client.ApiClient]:
    c = config.new_client_from_config(config_file=str(srv.write_kubeconfig(tmp_path / "kubeconfig")))
    yield c
    c.close()


@pytest.fixture
def api(api_client: client.ApiClient) -> client.ResourceV1Api:
    return client.ResourceV1Api(api_client)


def device(name: str, **extra: Any) -> dict[str, Any]:
    return {"name": name, "attributes": {"model": {"string": "H100"}}, **extra}


def slice_body(
    node: str = "node-a",
    devices: list[dict[str, Any]] | None = None,
    *,
    driver: str = DRIVER,
    pool: str | None = None,
    name: str | None = None,
) -> dict[str, Any]:
    meta = {"name": name} if name else {"generateName": f"00000-{driver}-{node}-"}
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": meta,
        "spec": {
            "driver": driver,
            "nodeName": node,
            "pool": {"name": pool or node, "generation": 1, "resourceSliceCount": 1},
            "devices": devices if devices is not None else [device("gpu-0")],
        },
    }


def claim_body(name: str = "claim", devices: tuple[str, ...] = ("gpu-0", "gpu-1", "gpu-2")) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"devices": {"requests": [{"name": "gpus", "exactly": {"deviceClassName": "gpu.example.com"}}]}},
        "status": {
            "allocation": {
                "devices": {
                    "results": [{"request": "gpus", "driver": DRIVER, "pool": "node-a", "device": d} for d in devices]
                }
            }
        },
    }


def device_status(dev: str, driver: str = DRIVER) -> dict[str, Any]:
    return {
        "driver": driver,
        "pool": "node-a",
        "device": dev,
        "conditions": [
            {
                "type": "Ready",
                "status": "True",
                "reason": "Prepared",
                "message": "",
                "lastTransitionTime": "2026-01-01T00:00:00Z",
            }
        ],
    }


def apply_status(api: client.ResourceV1Api, manager: str, entries: list[dict[str, Any]], **kw: Any) -> Any:
    body = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "claim", "namespace": "default"},
        "status": {"devices": entries},
    }
    kw.setdefault("field_manager", manager)
    kw.setdefault("force", True)
    return api.patch_namespaced_resource_claim_status(
        "claim", "default", body, _content_type="application/apply-patch+yaml", **kw
    )


def expect_status(code: int, call: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
    """Run `call`, expect ApiException with `code`, return the Status body."""
    with pytest.raises(ApiException) as info:
        call(*args, **kwargs)
    assert info.value.status == code, info.value.body
    body = json.loads(info.value.body)
    assert body["kind"] == "Status" and body["status"] == "Failure" and body["code"] == code
    return body


# --- slices: create, list, selectors --------------------------------------------------------------


def test_create_slice_with_generate_name_sets_server_metadata(api: client.ResourceV1Api) -> None:
    created = api.create_resource_slice(slice_body())
    meta = created.metadata
    assert re.fullmatch(rf"00000-{re.escape(DRIVER)}-node-a-[a-z0-9]{{5}}", meta.name)
    assert meta.uid and meta.creation_timestamp is not None
    assert meta.generation == 1
    assert int(meta.resource_version) > 0
    again = api.create_resource_slice(slice_body())
    assert again.metadata.name != meta.name
    assert int(again.metadata.resource_version) > int(meta.resource_version)


def test_create_existing_name_is_already_exists(api: client.ResourceV1Api) -> None:
    api.create_resource_slice(slice_body(name="fixed"))
    body = expect_status(409, api.create_resource_slice, slice_body(name="fixed"))
    assert body["reason"] == "AlreadyExists"


def test_list_with_field_selectors(api: client.ResourceV1Api) -> None:
    api.create_resource_slice(slice_body("node-a"))
    api.create_resource_slice(slice_body("node-b"))
    api.create_resource_slice(slice_body("node-a", driver="nic.example.com"))
    api.create_resource_slice(slice_body("node-a", pool="other"))

    def names(selector: str) -> list[tuple[str, str, str]]:
        items = api.list_resource_slice(field_selector=selector).items
        return sorted((s.spec.node_name, s.spec.driver, s.spec.pool.name) for s in items)

    assert names(f"spec.nodeName=node-a,spec.driver={DRIVER}") == [
        ("node-a", DRIVER, "node-a"),
        ("node-a", DRIVER, "other"),
    ]
    assert names("spec.pool.name=other") == [("node-a", DRIVER, "other")]
    assert names("spec.nodeName=node-b") == [("node-b", DRIVER, "node-b")]
    assert names("spec.driver!=" + DRIVER) == [("node-a", "nic.example.com", "node-a")]
    assert len(names("")) == 4
    expect_status(400, api.list_resource_slice, field_selector="spec.devices=x")


def test_list_with_label_selector(api: client.ResourceV1Api) -> None:
    labelled = slice_body()
    labelled["metadata"]["labels"] = {"tier": "gold"}
    api.create_resource_slice(labelled)
    api.create_resource_slice(slice_body("node-b"))
    assert [s.spec.node_name for s in api.list_resource_slice(label_selector="tier=gold").items] == ["node-a"]
    assert [s.spec.node_name for s in api.list_resource_slice(label_selector="!tier").items] == ["node-b"]
    assert [s.spec.node_name for s in api.list_resource_slice(label_selector="tier in (gold,x)").items] == ["node-a"]


# --- watches --------------------------------------------------------------------------------------


def test_watch_from_zero_lists_current_objects_as_added(api: client.ResourceV1Api) -> None:
    api.create_resource_slice(slice_body("node-a"))
    api.create_resource_slice(slice_body("node-b"))
    w = watch.Watch()
    seen = []
    for event in w.stream(api.list_resource_slice, field_selector="spec.nodeName=node-a", timeout_seconds=5):
        seen.append((event["type"], event["object"].spec.node_name))
        w.stop()
    assert seen == [("ADDED", "node-a")]


def test_watch_resumes_after_resource_version(api: client.ResourceV1Api) -> None:
    first = api.create_resource_slice(slice_body("node-a"))
    rv = api.list_resource_slice().metadata.resource_version
    api.create_resource_slice(slice_body("node-b"))  # filtered out by the selector
    second = api.create_resource_slice(slice_body("node-a"))
    first.spec.pool.generation = 2
    api.replace_resource_slice(first.metadata.name, first)
    api.delete_resource_slice(second.metadata.name)

    w = watch.Watch()
    seen = []
    for event in w.stream(
        api.list_resource_slice, field_selector="spec.nodeName=node-a", resource_version=rv, timeout_seconds=5
    ):
        seen.append((event["type"], event["object"].metadata.name))
        if len(seen) == 3:
            w.stop()
    assert seen == [
        ("ADDED", second.metadata.name),
        ("MODIFIED", first.metadata.name),
        ("DELETED", second.metadata.name),
    ]


def test_watch_with_expired_resource_version_gets_410(srv: SimApiServer, api: client.ResourceV1Api) -> None:
    srv.store.history = 3
    old_rv = api.create_resource_slice(slice_body()).metadata.resource_version
    for node in ("b", "c", "d", "e"):
        api.create_resource_slice(slice_body(f"node-{node}"))
    with pytest.raises(ApiException) as info:
        for _ in watch.Watch().stream(api.list_resource_slice, resource_version=old_rv):
            pytest.fail("no event may arrive before the 410")
    assert info.value.status == 410
    # the history still covers recent versions
    recent = api.list_resource_slice().metadata.resource_version
    api.create_resource_slice(slice_body("node-f"))
    w = watch.Watch()
    for event in w.stream(api.list_resource_slice, resource_version=recent, timeout_seconds=5):
        assert event["object"].spec.node_name == "node-f"
        w.stop()


def test_watch_claims_with_return_type(srv: SimApiServer, api: client.ResourceV1Api) -> None:
    srv.create(claim_body())
    w = watch.Watch(return_type=client.ResourceV1ResourceClaim)
    for event in w.stream(api.list_namespaced_resource_claim, "default", timeout_seconds=5):
        assert event["type"] == "ADDED"
        assert isinstance(event["object"], client.ResourceV1ResourceClaim)
        assert event["object"].status.allocation.devices.results[0].device == "gpu-0"
        w.stop()
    assert [c.metadata.name for c in api.list_resource_claim_for_all_namespaces().items] == ["claim"]
    assert api.list_namespaced_resource_claim("other").items == []


def test_close_watches_ends_open_streams(srv: SimApiServer, api: client.ResourceV1Api) -> None:
    ended = threading.Event()

    def consume() -> None:
        for _ in watch.Watch().stream(api.list_resource_slice, timeout_seconds=60):
            pass
        ended.set()

    thread = threading.Thread(target=consume, daemon=True)
    thread.start()
    assert srv.wait_for(lambda: srv.store.open_watches == 1, 10)
    assert not ended.is_set()
    srv.faults.close_watches()
    assert ended.wait(10)
    assert srv.wait_for(lambda: srv.store.open_watches == 0, 10)
    assert [r.verb for r in srv.requests] == ["watch"]  # logged once it ended


# --- updates, immutability, deletes ---------------------------------------------------------------


def test_update_with_stale_resource_version_conflicts(api: client.ResourceV1Api) -> None:
    created = api.create_resource_slice(slice_body())
    name = created.metadata.name
    created.spec.pool.generation = 2
    updated = api.replace_resource_slice(name, created)
    assert updated.metadata.generation == 2
    created.spec.pool.generation = 3  # still carries the old resourceVersion
    body = expect_status(409, api.replace_resource_slice, name, created)
    assert body["reason"] == "Conflict"
    created.metadata.resource_version = None  # unconditional
    assert api.replace_resource_slice(name, created).spec.pool.generation == 3


def test_generation_follows_spec_changes_only(api: client.ResourceV1Api) -> None:
    created = api.create_resource_slice(slice_body())
    created.metadata.labels = {"a": "b"}
    relabelled = api.replace_resource_slice(created.metadata.name, created)
    assert relabelled.metadata.generation == 1
    relabelled.spec.devices.append(client.V1Device(name="gpu-1"))
    assert api.replace_resource_slice(created.metadata.name, relabelled).metadata.generation == 2


@pytest.mark.parametrize(
    ("field", "value"),
    [("driver", "other.example.com"), ("pool.name", "other-pool"), ("nodeName", "node-z")],
)
def test_immutable_slice_fields(srv: SimApiServer, api: client.ResourceV1Api, field: str, value: str) -> None:
    created = srv.create(slice_body())
    changed = json.loads(json.dumps(created))
    if field == "pool.name":
        changed["spec"]["pool"]["name"] = value
    else:
        changed["spec"][field] = value
    body = expect_status(422, api.replace_resource_slice, created["metadata"]["name"], changed)
    assert body["reason"] == "Invalid"
    assert f"spec.{field}" in body["message"] and "immutable" in body["message"]


def test_delete_honours_preconditions_and_returns_the_object(api: client.ResourceV1Api) -> None:
    created = api.create_resource_slice(slice_body())
    name, uid, rv = created.metadata.name, created.metadata.uid, created.metadata.resource_version
    expect_status(409, api.delete_resource_slice, name, body=client.V1DeleteOptions(preconditions={"uid": "x"}))
    expect_status(
        409, api.delete_resource_slice, name, body=client.V1DeleteOptions(preconditions={"resourceVersion": "1x"})
    )
    deleted = api.delete_resource_slice(
        name, body=client.V1DeleteOptions(preconditions={"uid": uid, "resourceVersion": rv})
    )
    assert isinstance(deleted, client.V1ResourceSlice) and deleted.metadata.name == name
    body = expect_status(404, api.read_resource_slice, name)
    assert body["reason"] == "NotFound"


def test_delete_collection_with_field_selector(srv: SimApiServer, api: client.ResourceV1Api) -> None:
    api.create_resource_slice(slice_body("node-a"))
    api.create_resource_slice(slice_body("node-a"))
    api.create_resource_slice(slice_body("node-b"))
    api.delete_collection_resource_slice(field_selector=f"spec.nodeName=node-a,spec.driver={DRIVER}")
    assert [s["spec"]["nodeName"] for s in srv.list("resourceslices")] == ["node-b"]


def test_deleting_a_node_collects_the_slices_it_owns(srv: SimApiServer) -> None:
    node = srv.add_node("node-a")
    owned = slice_body()
    owned["metadata"]["ownerReferences"] = [
        {"apiVersion": "v1", "kind": "Node", "name": "node-a", "uid": node["metadata"]["uid"], "controller": True}
    ]
    srv.create(owned)
    srv.create(slice_body("node-b"))
    srv.delete("nodes", "node-a")
    assert [s["spec"]["nodeName"] for s in srv.list("resourceslices")] == ["node-b"]


# --- validation -----------------------------------------------------------------------------------


def raw_request(srv: SimApiServer, method: str, path: str, body: Any = None) -> tuple[int, dict[str, Any]]:
    """A request without the client, whose models would refuse (or drop) unknown fields."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(srv.url + path, data=data, method=method)
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_schema_rejects_unknown_fields(srv: SimApiServer) -> None:
    body = slice_body()
    body["spec"]["devices"][0]["bogusField"] = 1
    code, status = raw_request(srv, "POST", "/apis/resource.k8s.io/v1/resourceslices", body)
    assert code == 422 and status["reason"] == "Invalid"
    assert "bogusField" in status["message"] and "spec.devices[0]" in status["message"]
    assert raw_request(srv, "POST", "/apis/resource.k8s.io/v1/resourceslices", slice_body())[0] == 201


def many(n: int, **extra: Any) -> list[dict[str, Any]]:
    return [device(f"dev-{i}", **extra) for i in range(n)]


TAINT = {"taints": [{"key": "example.com/unhealthy", "effect": "NoSchedule"}]}


@pytest.mark.parametrize(
    ("devices", "ok"),
    [
        (many(128), True),
        (many(129), False),
        (many(64, **TAINT), True),
        (many(65, **TAINT), False),
        (many(64, attributes={"numa": {"ints": [0, 1]}}), True),
        (many(65, attributes={"numa": {"ints": [0, 1]}}), False),
    ],
    ids=["128", "129", "64-tainted", "65-tainted", "64-list", "65-list"],
)
def test_slice_device_count_limits(api: client.ResourceV1Api, devices: list[dict[str, Any]], ok: bool) -> None:
    if ok:
        assert len(api.create_resource_slice(slice_body(devices=devices)).spec.devices) == len(devices)
    else:
        assert (
            "spec.devices: Too many"
            in expect_status(422, api.create_resource_slice, slice_body(devices=devices))["message"]
        )


def test_attribute_and_capacity_limits(api: client.ResourceV1Api) -> None:
    attrs = {f"a{i}": {"int": i} for i in range(20)}
    caps = {f"c{i}": {"value": "1"} for i in range(12)}
    api.create_resource_slice(slice_body(devices=[{"name": "d", "attributes": attrs, "capacity": caps}]))
    caps["c12"] = {"value": "1"}
    status = expect_status(
        422, api.create_resource_slice, slice_body(devices=[{"name": "d", "attributes": attrs, "capacity": caps}])
    )
    assert "total number of attributes and capacities" in status["message"]


def test_attribute_value_limit_counts_list_elements(api: client.ResourceV1Api) -> None:
    fits = {"list": {"ints": list(range(47))}, "one": {"int": 1}}
    api.create_resource_slice(slice_body(devices=[{"name": "d", "attributes": fits}]))
    too_many = {"list": {"ints": list(range(48))}, "one": {"int": 1}}
    status = expect_status(422, api.create_resource_slice, slice_body(devices=[{"name": "d", "attributes": too_many}]))
    assert "attribute values" in status["message"]


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d.update(name="GPU_0"), "RFC 1123 label"),
        (lambda d: d["attributes"].update(x={"int": 1, "string": "a"}), "exactly one value"),
        (lambda d: d["attributes"].update(x={"string": "a" * 65}), "Too long"),
        (lambda d: d["attributes"].update(x={"version": "v1.0"}), "semver"),
        (lambda d: d["attributes"].update({"bad-key": {"int": 1}}), "C identifier"),
        (lambda d: d["attributes"].update({"Bad_Domain/x": {"int": 1}}), "domain"),
        (lambda d: d.update(taints=[{"key": "k", "effect": "PreferNoSchedule"}]), "Unsupported value"),
        (lambda d: d.update(taints=[{"key": f"k{i}", "effect": "None"} for i in range(17)]), "taints: Too many"),
        (lambda d: d.update(capacity={"mem": {"value": "lots"}}), "quantities must match"),
    ],
)
def test_device_rules(api: client.ResourceV1Api, mutate: Any, message: str) -> None:
    dev = device("gpu-0")
    mutate(dev)
    status = expect_status(422, api.create_resource_slice, slice_body(devices=[dev]))
    assert message in status["message"], status["message"]


def test_slice_level_rules(srv: SimApiServer) -> None:
    both = slice_body()
    both["spec"]["allNodes"] = True
    duplicate = slice_body(devices=[device("gpu-0"), device("gpu-0")])
    bad_pool = slice_body()
    bad_pool["spec"]["pool"]["resourceSliceCount"] = 0
    for body, message in (
        (both, "exactly one of"),
        (duplicate, "Duplicate value"),
        (bad_pool, "resourceSliceCount"),
    ):
        with pytest.raises(Exception) as info:
            srv.create(body)
        assert getattr(info.value, "code", None) == 422 and message in str(info.value)


def test_list_attributes_dropped_when_gate_off(srv: SimApiServer, api: client.ResourceV1Api) -> None:
    srv.list_attributes_enabled = False
    body = slice_body(devices=[device("gpu-0", attributes={"numa": {"ints": [0, 1]}, "model": {"string": "H100"}})])
    status = expect_status(422, api.create_resource_slice, body)
    assert "exactly one value must be specified" in status["message"]  # what a real server answers
    scalar = slice_body(devices=[device("gpu-0", attributes={"numa": {"int": 0}})])
    assert api.create_resource_slice(scalar).spec.devices[0].attributes["numa"].int == 0


def test_list_attributes_dropped_silently_without_validation(tmp_path: Path) -> None:
    with SimApiServer(validate=False) as server:
        server.list_attributes_enabled = False
        api = client.ResourceV1Api(
            config.new_client_from_config(config_file=server.write_kubeconfig(str(tmp_path / "kc")))
        )
        body = slice_body(devices=[device("gpu-0", attributes={"numa": {"ints": [0, 1]}})])
        created = api.create_resource_slice(body)
        numa = created.spec.devices[0].attributes["numa"]
        assert numa.ints is None and numa.int is None  # the value is gone, the attribute stays
        server.list_attributes_enabled = True
        assert api.create_resource_slice(body).spec.devices[0].attributes["numa"].ints == [0, 1]


def test_capacity_quantities_are_canonicalised(api: client.ResourceV1Api) -> None:
    given = {"a": "1024Mi", "b": "0.5", "c": "80Gi", "d": "85899345920", "e": "1.5Gi", "f": "1000"}
    dev = {"name": "gpu-0", "capacity": {k: {"value": v} for k, v in given.items()}}
    created = api.create_resource_slice(slice_body(devices=[dev]))
    back = {k: v.value for k, v in created.spec.devices[0].capacity.items()}
    assert back == {"a": "1Gi", "b": "500m", "c": "80Gi", "d": "85899345920", "e": "1536Mi", "f": "1k"}


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("1024Mi", "1Gi"),
        ("0.5", "500m"),
        ("80Gi", "80Gi"),
        ("1.5Gi", "1536Mi"),
        ("0.9Gi", "966367641600m"),  # not a whole number of bytes: decimal-SI
        ("1000Ki", "1000Ki"),
        ("512Ki", "512Ki"),
        ("100m", "100m"),
        ("1500", "1500"),
        ("1000000", "1M"),
        ("85899345920", "85899345920"),  # a bare number is decimal-SI in apimachinery, never binary
        ("1e3", "1e3"),
        ("1.5e3", "1500"),
        ("0", "0"),
        ("0Gi", "0"),
        ("1E", "1E"),
        ("1n", "1n"),
        ("0.0000000001", "1n"),  # rounded up to nano units
        ("-1Gi", "-1Gi"),
        ("1023", "1023"),
    ],
)
def test_quantity_canonical_forms(given: str, expected: str) -> None:
    assert canonical(given) == expected


@pytest.mark.parametrize("bad", ["", "1.2.3", "Gi", "1 Gi", "1ki", "1Ki5", "abc"])
def test_quantity_rejects_garbage(bad: str) -> None:
    with pytest.raises(ValueError):
        canonical(bad)


def test_taints_get_time_added(api: client.ResourceV1Api) -> None:
    created = api.create_resource_slice(slice_body(devices=[device("gpu-0", **TAINT)]))
    assert created.spec.devices[0].taints[0].time_added is not None


# --- claims ---------------------------------------------------------------------------------------


def test_read_claim(srv: SimApiServer, api: client.ResourceV1Api) -> None:
    srv.create(claim_body())
    claim = api.read_namespaced_resource_claim("claim", "default")
    assert isinstance(claim, client.ResourceV1ResourceClaim)
    assert claim.spec.devices.requests[0].exactly.count == 1  # defaulted by the server
    assert claim.spec.devices.requests[0].exactly.allocation_mode == "ExactCount"
    assert claim.metadata.generation == 1
    expect_status(404, api.read_namespaced_resource_claim, "claim", "elsewhere")


def test_http_create_of_claim_drops_status(api: client.ResourceV1Api) -> None:
    created = api.create_namespaced_resource_claim("default", claim_body())
    assert created.status is None


def test_status_apply_by_two_managers(srv: SimApiServer, api: client.ResourceV1Api) -> None:
    srv.create(claim_body())
    apply_status(api, "tandem", [device_status("gpu-0"), device_status("gpu-1")])
    apply_status(api, "other", [device_status("gpu-2")])

    def devices() -> list[str]:
        return sorted(d["device"] for d in srv.get("resourceclaims", "claim", "default")["status"].get("devices", []))

    assert devices() == ["gpu-0", "gpu-1", "gpu-2"]
    apply_status(api, "tandem", [device_status("gpu-1")])  # no longer applies gpu-0
    assert devices() == ["gpu-1", "gpu-2"]
    claim = srv.get("resourceclaims", "claim", "default")
    assert claim["status"]["allocation"]["devices"]["results"][0]["device"] == "gpu-0"  # untouched
    managers = {(m["manager"], m["operation"], m["subresource"]) for m in claim["metadata"]["managedFields"]}
    assert managers == {("tandem", "Apply", "status"), ("other", "Apply", "status")}
    apply_status(api, "tandem", [])
    assert devices() == ["gpu-2"]


def test_status_apply_conflicts_without_force(srv: SimApiServer, api: client.ResourceV1Api) -> None:
    srv.create(claim_body())
    apply_status(api, "tandem", [device_status("gpu-0")])
    changed = device_status("gpu-0")
    changed["conditions"][0]["status"] = "False"
    expect_status(409, apply_status, api, "other", [changed], force=False)
    apply_status(api, "other", [changed], force=True)
    assert srv.get("resourceclaims", "claim", "default")["status"]["devices"][0]["conditions"][0]["status"] == "False"


def test_status_apply_needs_field_manager(srv: SimApiServer, api: client.ResourceV1Api) -> None:
    srv.create(claim_body())
    with pytest.raises(ApiException) as info:
        apply_status(api, "", [device_status("gpu-0")], field_manager=None)
    assert info.value.status == 422


def test_status_entries_must_be_allocated_devices(srv: SimApiServer, api: client.ResourceV1Api) -> None:
    srv.create(claim_body())
    status = expect_status(422, apply_status, api, "tandem", [device_status("gpu-9")])
    assert "allocated" in status["message"]


def test_status_put_and_merge_patch(srv: SimApiServer, api: client.ResourceV1Api) -> None:
    srv.create(claim_body())
    claim = api.read_namespaced_resource_claim_status("claim", "default")
    claim.status.devices = [client.V1AllocatedDeviceStatus(**{"driver": DRIVER, "pool": "node-a", "device": "gpu-0"})]
    claim.metadata.labels = {"ignored": "on-status"}
    replaced = api.replace_namespaced_resource_claim_status("claim", "default", claim)
    assert [d.device for d in replaced.status.devices] == ["gpu-0"]
    assert replaced.metadata.labels is None
    patched = api.patch_namespaced_resource_claim_status(
        "claim",
        "default",
        {"status": {"devices": [{"driver": DRIVER, "pool": "node-a", "device": "gpu-1"}]}},
        _content_type="application/merge-patch+json",
    )
    assert [d.device for d in patched.status.devices] == ["gpu-1"]


def test_deallocation_drops_device_status(srv: SimApiServer, api: client.ResourceV1Api) -> None:
    srv.create(claim_body())
    apply_status(api, "tandem", [device_status("gpu-0")])
    claim = srv.get("resourceclaims", "claim", "default")
    del claim["status"]["allocation"]
    assert "devices" not in srv.update(claim).get("status", {})


def test_claim_spec_is_immutable(srv: SimApiServer) -> None:
    claim = srv.create(claim_body())
    claim["spec"]["devices"]["requests"][0]["exactly"]["count"] = 2
    with pytest.raises(Exception) as info:
        srv.update(claim)
    assert getattr(info.value, "code", None) == 422


def test_device_classes(api: client.ResourceV1Api) -> None:
    api.create_device_class(
        {"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": "gpu.example.com"}, "spec": {}}
    )
    assert api.read_device_class("gpu.example.com").metadata.name == "gpu.example.com"
    assert [c.metadata.name for c in api.list_device_class().items] == ["gpu.example.com"]


def test_nodes(srv: SimApiServer, api_client: client.ApiClient) -> None:
    uid = srv.add_node("node-a")["metadata"]["uid"]
    core = client.CoreV1Api(api_client)
    assert core.read_node("node-a").metadata.uid == uid
    assert [n.metadata.name for n in core.list_node().items] == ["node-a"]


# --- faults, request log, plumbing ----------------------------------------------------------------


def test_injected_errors_hit_only_the_next_matching_requests(srv: SimApiServer, api: client.ResourceV1Api) -> None:
    created = api.create_resource_slice(slice_body())
    srv.faults.inject(method="PUT", path="/resourceslices/", status=500, count=2)
    for _ in range(2):
        body = expect_status(500, api.replace_resource_slice, created.metadata.name, created)
        assert body["reason"] == "InternalError"
    api.read_resource_slice(created.metadata.name)  # GETs were never affected
    assert api.replace_resource_slice(created.metadata.name, created).metadata.name == created.metadata.name


def test_injected_conflict_and_throttling(srv: SimApiServer, api: client.ResourceV1Api) -> None:
    srv.faults.inject(method="POST", status=409)
    assert expect_status(409, api.create_resource_slice, slice_body())["reason"] == "Conflict"
    srv.clear_requests()
    srv.faults.inject(method="GET", status=429)
    assert api.list_resource_slice().items == []  # urllib3 honours Retry-After: 1 and retries
    assert [r.status for r in srv.requests] == [429, 200]
    code, status = _raw_429(srv)
    assert code == 429 and status == "1"
    srv.faults.inject(status=0, delay=0.01)  # delay only: served normally
    assert api.list_resource_slice().items == []
    srv.faults.inject(status=503, count=5)
    srv.faults.clear()
    assert api.list_resource_slice().items == []


def _raw_429(srv: SimApiServer) -> tuple[int, str | None]:
    srv.faults.inject(method="GET", status=429)
    try:
        urllib.request.urlopen(srv.url + "/apis/resource.k8s.io/v1/resourceslices", timeout=5)
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("Retry-After")
    return 200, None


def test_request_log(srv: SimApiServer, api: client.ResourceV1Api) -> None:
    srv.create(claim_body())
    srv.clear_requests()
    created = api.create_resource_slice(slice_body(), field_manager="tandem")
    api.list_resource_slice(field_selector="spec.nodeName=node-a")
    apply_status(api, "tandem", [device_status("gpu-0")])
    api.delete_resource_slice(created.metadata.name)
    log = srv.requests
    summary = [(r.method, r.verb, r.api_group, r.resource, r.subresource, r.namespace, r.name, r.status) for r in log]
    assert summary == [
        ("POST", "create", "resource.k8s.io", "resourceslices", "", "", "", 201),
        ("GET", "list", "resource.k8s.io", "resourceslices", "", "", "", 200),
        ("PATCH", "patch", "resource.k8s.io", "resourceclaims", "status", "default", "claim", 200),
        ("DELETE", "delete", "resource.k8s.io", "resourceslices", "", "", created.metadata.name, 200),
    ]
    assert log[0].field_manager == "tandem"
    assert log[1].query["fieldSelector"] == "spec.nodeName=node-a"
    assert log[2].content_type == "application/apply-patch+yaml" and log[2].field_manager == "tandem"
    assert log[0].time <= log[1].time <= log[2].time
    srv.clear_requests()
    assert srv.requests == []


def test_unknown_paths_answer_404_status(srv: SimApiServer) -> None:
    for path in ("/apis/resource.k8s.io/v1/widgets", "/nothing", "/apis/resource.k8s.io/v1/resourceslices/x/status"):
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(srv.url + path, timeout=5)
        assert info.value.code == 404
        body = json.loads(info.value.read())
        assert body["kind"] == "Status" and body["reason"] == "NotFound"


def test_discovery_documents(srv: SimApiServer, api_client: client.ApiClient) -> None:
    assert client.VersionApi(api_client).get_code().minor == "37"
    groups = client.ApisApi(api_client).get_api_versions().groups
    assert [g.name for g in groups] == ["events.k8s.io", "resource.k8s.io"]
    names = {r.name for r in client.ResourceV1Api(api_client).get_api_resources().resources}
    assert {"resourceslices", "resourceclaims", "resourceclaims/status", "deviceclasses"} <= names
    with urllib.request.urlopen(srv.url + "/api", timeout=5) as resp:
        assert json.loads(resp.read())["versions"] == ["v1"]


def test_in_process_access(srv: SimApiServer) -> None:
    created = srv.create(slice_body())
    name = created["metadata"]["name"]
    with pytest.raises(KeyError):
        srv.get("resourceslices", "missing")
    stale = json.loads(json.dumps(created))
    created["spec"]["pool"]["generation"] = 2
    assert srv.update(created)["spec"]["pool"]["generation"] == 2
    with pytest.raises(Exception) as info:
        srv.update(stale)
    assert getattr(info.value, "code", None) == 409
    assert srv.delete("resourceslices", name)["metadata"]["name"] == name
    assert srv.list("resourceslices") == []
    assert srv.wait_for(lambda: True, 0) and not srv.wait_for(lambda: False, 0.05)


def test_stop_ends_watches_and_listener(tmp_path: Path) -> None:
    server = SimApiServer().start()
    url = server.url
    api = client.ResourceV1Api(config.new_client_from_config(config_file=server.write_kubeconfig(str(tmp_path / "kc"))))
    ended = threading.Event()

    def consume() -> None:
        try:
            for _ in watch.Watch().stream(api.list_resource_slice, timeout_seconds=60):
                pass
        except Exception:  # the connection may be cut instead of ended cleanly
            pass
        ended.set()

    threading.Thread(target=consume, daemon=True).start()
    assert server.wait_for(lambda: server.store.open_watches == 1, 10)
    server.stop()
    assert ended.wait(10)
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(url + "/version", timeout=2)
