"""SlicePublisher and KubeAPI against the simulated API server, over real HTTP with a kubeconfig."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from driver.discovery.nic.device import shared_capacity
from driver.kube.api import ApiError, Conflict, KubeAPI, NotFound
from driver.model import NUMA_NODE, Device, DeviceKind, Taint, TaintEffect
from driver.slices import publisher
from driver.slices.plan import plan
from driver.slices.publisher import PublisherOptions, SlicePublisher
from sim.apiserver import SimApiServer

DRIVER = "tandem.example.com"
NODE = "node-a"
WRITE_METHODS = {"POST", "PUT", "DELETE", "PATCH"}
FAST = PublisherOptions(
    min_write_interval=0.2,
    debounce=0.02,
    resync_period=1.0,
    backoff_initial=0.05,
    backoff_max=0.5,
    watch_timeout=30,
)
DEADLINE = 20.0


def gpu(i: int, model: str = "H100", **kw: Any) -> Device:
    return Device(
        name=f"gpu-{i:04d}",
        kind=DeviceKind.GPU,
        attributes=kw.pop("attributes", {"index": i, "model": model}),
        capacity={"memory": "81920Mi"},  # the server answers "80Gi": must not cause updates
        **kw,
    )


class Devices:
    """The inventory stand-in: a device list that tests change under a lock."""

    def __init__(self, devices: Sequence[Device]) -> None:
        self._lock = threading.Lock()
        self._devices = list(devices)

    def get(self) -> list[Device]:
        with self._lock:
            return list(self._devices)

    def set(self, devices: Sequence[Device]) -> None:
        with self._lock:
            self._devices = list(devices)


@pytest.fixture
def srv() -> Iterator[Any]:
    server = SimApiServer().start()
    server.add_node(NODE)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def api(srv: Any, tmp_path: Path) -> Iterator[KubeAPI]:
    path = tmp_path / "kubeconfig"
    srv.write_kubeconfig(path)
    client = KubeAPI(str(path))
    yield client
    client.close()


@pytest.fixture
def make_publisher(api: KubeAPI) -> Iterator[Callable[..., SlicePublisher]]:
    started: list[SlicePublisher] = []

    def make(devices: Devices, options: PublisherOptions = FAST) -> SlicePublisher:
        pub = SlicePublisher(api, DRIVER, NODE, devices.get, options)
        pub.start()
        started.append(pub)
        return pub

    yield make
    for pub in started:
        pub.stop()


def slice_writes(srv: Any, since: float = float("-inf")) -> list[Any]:
    """Slice writes that arrived at the server at or after `since` (a time.monotonic() mark)."""
    return [r for r in srv.requests if r.method in WRITE_METHODS and r.resource == "resourceslices" and r.time >= since]


def settled_writes(srv: Any, pub: SlicePublisher, since: float, writes_before: int) -> list[Any]:
    """Slice writes since the mark, once the server has logged every write the publisher saw.

    The server logs a request after answering it, so its log can lag the publisher's view.
    """
    expected = pub.stats.writes - writes_before
    assert _poll(lambda: sum(1 for r in slice_writes(srv, since) if r.status < 300) >= expected)
    return slice_writes(srv, since)


def live_slices(srv: Any) -> list[dict[str, Any]]:
    return [s for s in srv.list("resourceslices") if s["spec"].get("nodeName") == NODE]


def published_names(srv: Any) -> list[str]:
    return sorted(d["name"] for s in live_slices(srv) for d in s["spec"].get("devices") or [])


def wait_syncs(pub: SlicePublisher, more: int) -> None:
    """Wait until the publisher has compared desired and live `more` more times."""
    target = pub.stats.syncs + more
    assert _poll(lambda: pub.stats.syncs >= target), f"publisher did not sync {more} more times"


def _poll(cond: Callable[[], bool], timeout: float = DEADLINE) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


# -- KubeAPI -----------------------------------------------------------------------------------


def test_kubeapi_node_and_error_mapping(srv: Any, api: KubeAPI) -> None:
    node = api.get_node(NODE)
    assert node.name == NODE and node.uid
    with pytest.raises(NotFound):
        api.get_node("no-such-node")
    api.delete_slice("no-such-slice")  # already gone is fine

    srv.faults.inject(method="GET", path=".*/nodes/.*", status=503, count=1)
    with pytest.raises(ApiError) as err:
        api.get_node(NODE)
    assert err.value.status == 503 and err.value.retryable

    body = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"generateName": "x-"},
        "spec": {
            "driver": DRIVER,
            "nodeName": NODE,
            "pool": {"name": NODE, "generation": 1, "resourceSliceCount": 1},
            "devices": [],
        },
    }
    created = api.create_slice(body)
    items, rv = api.list_slices(NODE, DRIVER)
    assert [i["metadata"]["name"] for i in items] == [created["metadata"]["name"]] and rv
    stale = {**created, "metadata": {**created["metadata"], "resourceVersion": "1"}}
    api.update_slice(created)
    with pytest.raises(Conflict):
        api.update_slice(stale)


def test_kubeapi_claim_read_and_status_apply(srv: Any, api: KubeAPI) -> None:
    claim = srv.create(
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": "c1", "namespace": "default"},
            "spec": {"devices": {"requests": [{"name": "r", "exactly": {"deviceClassName": "gpu"}}]}},
        }
    )
    result = {"request": "r", "driver": DRIVER, "pool": NODE, "device": "gpu-0000"}
    claim["status"] = {"allocation": {"devices": {"results": [result]}}}
    srv.update(claim)
    got = api.get_claim("default", "c1")
    assert got["status"]["allocation"]["devices"]["results"] == [result]

    condition = {
        "type": "Ready",
        "status": "True",
        "reason": "Prepared",
        "message": "ok",
        "lastTransitionTime": "2030-01-01T00:00:00Z",
    }
    entry = {"driver": DRIVER, "pool": NODE, "device": "gpu-0000", "conditions": [condition]}
    api.apply_claim_status("default", "c1", [entry], DRIVER, uid=claim["metadata"]["uid"])
    (req,) = [r for r in srv.requests if r.method == "PATCH"]
    assert req.subresource == "status"
    assert req.content_type == "application/apply-patch+yaml"
    assert req.field_manager == DRIVER and req.query.get("force") == "true"
    # The same pooled connection must serve the next request cleanly.
    got = api.get_claim("default", "c1")
    assert got["status"]["devices"] == [entry]
    assert got["status"]["allocation"]["devices"]["results"] == [result]
    with pytest.raises(NotFound):
        api.get_claim("default", "missing")


# -- publisher ---------------------------------------------------------------------------------


def test_initial_publish(srv: Any, make_publisher: Callable[..., SlicePublisher]) -> None:
    devices = Devices([gpu(i) for i in range(10)])
    pub = make_publisher(devices)
    assert pub.wait_synced(DEADLINE)
    (s,) = live_slices(srv)
    node_uid = srv.get("nodes", NODE)["metadata"]["uid"]
    assert s["metadata"]["ownerReferences"][0] == {
        "apiVersion": "v1",
        "kind": "Node",
        "name": NODE,
        "uid": node_uid,
        "controller": True,
    }
    assert s["spec"]["pool"]["resourceSliceCount"] == 1
    assert published_names(srv) == [f"gpu-{i:04d}" for i in range(10)]
    assert len(settled_writes(srv, pub, float("-inf"), 0)) == 1


def test_steady_state_makes_no_writes(srv: Any, make_publisher: Callable[..., SlicePublisher]) -> None:
    devices = Devices([gpu(i) for i in range(300)] + [gpu(999, taints=(Taint("t", TaintEffect.NONE),))])
    pub = make_publisher(devices)
    assert pub.wait_synced(DEADLINE)
    mark, before = time.monotonic(), pub.stats.writes
    for _ in range(5):
        pub.trigger()
    # Triggers and periodic resyncs: several full comparisons, none may write.
    wait_syncs(pub, 4)
    assert pub.stats.writes == before
    assert settled_writes(srv, pub, mark, before) == []


def test_a_sync_that_changed_nothing_does_not_plan_again(
    srv: Any, make_publisher: Callable[..., SlicePublisher], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An idle daemon's syncs (resyncs, triggers of changes that cancelled out) meet the devices
    and live slices of the last sync that planned nothing: answered by comparing those, with no
    build and no plan. A change of either is planned again, also one back to an earlier state."""
    planned: list[int] = []

    def counting_plan(desired: Sequence[dict[str, Any]], live: Sequence[Any]) -> Any:
        if threading.current_thread().name == "slice-publisher":  # not wait_synced's own checks
            planned.append(len(desired))
        return plan(desired, live)

    monkeypatch.setattr(publisher, "plan", counting_plan)
    base = [gpu(i) for i in range(20)]
    devices = Devices(base)
    pub = make_publisher(devices)
    assert pub.wait_synced(DEADLINE)
    wait_syncs(pub, 2)  # the first of them found the pool in agreement and planned nothing
    agreed = len(planned)
    for _ in range(3):
        pub.trigger()
    wait_syncs(pub, 3)  # triggers and resyncs
    assert len(planned) == agreed

    devices.set(base[:10])
    pub.trigger()
    assert _poll(lambda: published_names(srv) == [f"gpu-{i:04d}" for i in range(10)])
    devices.set(base)  # the very devices of the agreement, but the live slices changed since
    pub.trigger()
    assert _poll(lambda: published_names(srv) == [f"gpu-{i:04d}" for i in range(20)])
    assert pub.wait_synced(DEADLINE)
    (s,) = live_slices(srv)
    srv.delete("resourceslices", s["metadata"]["name"], None)  # and a change of the live slices alone
    assert _poll(lambda: published_names(srv) == [f"gpu-{i:04d}" for i in range(20)])


def test_one_device_change_is_one_write(srv: Any, make_publisher: Callable[..., SlicePublisher]) -> None:
    base = [gpu(i) for i in range(300)]
    devices = Devices(base)
    pub = make_publisher(devices)
    assert pub.wait_synced(DEADLINE)
    mark, before = time.monotonic(), pub.stats.writes
    base[150] = gpu(150, model="H200")
    devices.set(base)
    pub.trigger()
    assert pub.wait_synced(DEADLINE)
    writes = settled_writes(srv, pub, mark, before)
    assert [w.method for w in writes] == ["PUT"]
    models = {d["name"]: d["attributes"]["model"]["string"] for s in live_slices(srv) for d in s["spec"]["devices"]}
    assert models["gpu-0150"] == "H200"


def test_burst_of_triggers_coalesces(srv: Any, make_publisher: Callable[..., SlicePublisher]) -> None:
    base = [gpu(i) for i in range(20)]
    devices = Devices(base)
    pub = make_publisher(devices)
    assert pub.wait_synced(DEADLINE)
    mark, before = time.monotonic(), pub.stats.writes
    for n in range(200):
        base[n % 20] = gpu(n % 20, model=f"m{n}")
        devices.set(base)
        pub.trigger()
    assert pub.wait_synced(DEADLINE)
    writes = settled_writes(srv, pub, mark, before)
    assert 1 <= len(writes) <= 5, [w.method for w in writes]
    assert {d["attributes"]["model"]["string"] for s in live_slices(srv) for d in s["spec"]["devices"]} == {
        f"m{n}" for n in range(180, 200)
    }


def test_slice_deleted_by_someone_else_is_republished(srv: Any, make_publisher: Callable[..., SlicePublisher]) -> None:
    devices = Devices([gpu(i) for i in range(5)])
    pub = make_publisher(devices)
    assert pub.wait_synced(DEADLINE)
    (s,) = live_slices(srv)
    srv.delete("resourceslices", s["metadata"]["name"], None)
    assert _poll(lambda: len(live_slices(srv)) == 1 and published_names(srv) == [f"gpu-{i:04d}" for i in range(5)])
    assert pub.wait_synced(DEADLINE)


def test_server_errors_are_retried(srv: Any, make_publisher: Callable[..., SlicePublisher]) -> None:
    srv.faults.inject(method="POST", path=".*resourceslices.*", status=500, count=3)
    devices = Devices([gpu(i) for i in range(200)])
    pub = make_publisher(devices)
    assert pub.wait_synced(DEADLINE)
    assert len(live_slices(srv)) == 2
    assert pub.stats.errors >= 1
    # 3 failed POSTs, then the pool's 2 creates (a failure may repeat one create per attempt).
    assert len(settled_writes(srv, pub, float("-inf"), 0)) <= 3 + 2 + 3

    mark, before = time.monotonic(), pub.stats.writes
    srv.faults.inject(method="PUT", path=".*resourceslices.*", status=500, count=2)
    srv.faults.inject(method="PUT", path=".*resourceslices.*", status=409, count=1)
    base = devices.get()
    base[0] = gpu(0, model="B200")
    devices.set(base)
    pub.trigger()
    assert pub.wait_synced(DEADLINE)
    assert len(settled_writes(srv, pub, mark, before)) <= 4


def test_a_throttled_write_is_retried_no_sooner_than_the_server_asked(
    srv: Any, make_publisher: Callable[..., SlicePublisher]
) -> None:
    """The server's 429 says `Retry-After: 1`; the publisher's own backoff (FAST: from 0.05 s)
    would write again at once."""
    srv.faults.inject(method="POST", path=".*resourceslices.*", status=429, count=1)
    pub = make_publisher(Devices([gpu(i) for i in range(5)]))
    assert pub.wait_synced(DEADLINE)
    throttled, retried = [r for r in slice_writes(srv) if r.method == "POST"][:2]
    assert (throttled.status, retried.status) == (429, 201)
    assert retried.time - throttled.time >= 1.0


def test_a_throttled_watch_is_opened_again_no_sooner_than_the_server_asked(
    srv: Any, make_publisher: Callable[..., SlicePublisher]
) -> None:
    """The watch, then the list after it, throttled: each next request waits out the server's
    `Retry-After: 1`, where the cache's own backoff (FAST: from 0.05 s) would not."""
    pub = make_publisher(Devices([gpu(i) for i in range(5)]))
    assert pub.wait_synced(DEADLINE)
    srv.faults.inject(method="GET", path=".*resourceslices.*", status=429, count=2)
    srv.faults.close_watches()

    def gets() -> list[Any]:
        slices = [r for r in srv.requests if r.resource == "resourceslices" and r.method == "GET"]
        return slices[next((i for i, r in enumerate(slices) if r.status == 429), len(slices)) :]

    assert _poll(lambda: len(gets()) >= 3)
    watch, relist, again = gets()[:3]
    assert (watch.verb, watch.status, relist.verb, relist.status) == ("watch", 429, "list", 429)
    assert relist.time - watch.time >= 1.0
    assert again.time - relist.time >= 1.0


def test_conflict_from_concurrent_writer_is_resolved(srv: Any, make_publisher: Callable[..., SlicePublisher]) -> None:
    devices = Devices([gpu(i) for i in range(5)])
    pub = make_publisher(devices)
    assert pub.wait_synced(DEADLINE)
    # Someone else rewrites our slice: the publisher must notice and restore its content.
    (s,) = live_slices(srv)
    s["spec"]["devices"] = s["spec"]["devices"][:2]
    srv.update(s)
    assert _poll(lambda: published_names(srv) == [f"gpu-{i:04d}" for i in range(5)])
    assert pub.wait_synced(DEADLINE)


def test_lost_watch_is_reestablished(srv: Any, make_publisher: Callable[..., SlicePublisher]) -> None:
    devices = Devices([gpu(i) for i in range(5)])
    pub = make_publisher(devices, dataclasses.replace(FAST, resync_period=3600.0))
    assert pub.wait_synced(DEADLINE)
    srv.faults.close_watches()
    assert _poll(lambda: pub.stats.watch_restarts >= 1)
    # With resync effectively off, only a working watch can bring the deletion to the publisher.
    (s,) = live_slices(srv)
    srv.delete("resourceslices", s["metadata"]["name"], None)
    assert _poll(lambda: len(live_slices(srv)) == 1)
    assert pub.wait_synced(DEADLINE)


def test_adopts_slices_of_previous_instance(
    srv: Any, api: KubeAPI, make_publisher: Callable[..., SlicePublisher]
) -> None:
    devices = Devices([gpu(i) for i in range(300)])
    first = make_publisher(devices)
    assert first.wait_synced(DEADLINE)
    first.stop()
    names = sorted(s["metadata"]["name"] for s in live_slices(srv))
    mark = time.monotonic()
    second = make_publisher(devices)
    assert second.wait_synced(DEADLINE)
    wait_syncs(second, 2)
    assert second.stats.writes == 0
    assert settled_writes(srv, second, mark, 0) == []
    assert sorted(s["metadata"]["name"] for s in live_slices(srv)) == names


def test_obsolete_slices_deleted_when_devices_shrink(srv: Any, make_publisher: Callable[..., SlicePublisher]) -> None:
    devices = Devices([gpu(i) for i in range(300)])
    pub = make_publisher(devices)
    assert pub.wait_synced(DEADLINE)
    assert len(live_slices(srv)) == 3
    mark, before = time.monotonic(), pub.stats.writes
    devices.set([gpu(i) for i in range(50)])
    pub.trigger()
    assert pub.wait_synced(DEADLINE)
    assert len(live_slices(srv)) == 1
    assert published_names(srv) == [f"gpu-{i:04d}" for i in range(50)]
    assert sorted(w.method for w in settled_writes(srv, pub, mark, before)) == ["DELETE", "DELETE", "PUT"]


def test_list_attribute_fallback(srv: Any, make_publisher: Callable[..., SlicePublisher]) -> None:
    srv.list_attributes_enabled = False
    devices = Devices([gpu(i, attributes={NUMA_NODE: (i % 2, 1 - i % 2), "peers": ("a",)}) for i in range(4)])
    pub = make_publisher(devices)
    assert _poll(lambda: not pub.list_attributes_active)
    assert pub.wait_synced(DEADLINE)
    attrs = {d["name"]: d["attributes"] for s in live_slices(srv) for d in s["spec"]["devices"]}
    assert attrs["gpu-0001"] == {NUMA_NODE: {"int": 1}}
    assert attrs["gpu-0002"] == {NUMA_NODE: {"int": 0}}


def test_list_attributes_kept_when_server_supports_them(
    srv: Any, make_publisher: Callable[..., SlicePublisher]
) -> None:
    devices = Devices([gpu(0, attributes={NUMA_NODE: (1, 0)})])
    pub = make_publisher(devices)
    assert pub.wait_synced(DEADLINE)
    assert pub.list_attributes_active
    (s,) = live_slices(srv)
    assert s["spec"]["devices"][0]["attributes"] == {NUMA_NODE: {"ints": [1, 0]}}


def test_taints_dropped_by_the_server_do_not_cause_endless_rewrites(
    srv: Any, make_publisher: Callable[..., SlicePublisher]
) -> None:
    srv.device_taints_enabled = False
    taint = Taint("tandem.dev/xid", TaintEffect.NO_SCHEDULE, "79")
    devices = Devices([gpu(0, taints=(taint,)), gpu(1)])
    pub = make_publisher(devices)
    assert _poll(lambda: not pub.taints_active)
    assert pub.wait_synced(DEADLINE)
    writes = pub.stats.writes
    pub.trigger()
    assert pub.wait_synced(DEADLINE)
    assert pub.stats.writes == writes, "a synced pool must not be rewritten"


def _shared_nic(i: int) -> Device:
    sharing = shared_capacity(8)
    return Device(
        name=f"pci-0000-{i:02x}-00-0",
        kind=DeviceKind.NIC,
        attributes={"type": "nic"},
        capacity=sharing.capacity,
        allow_multiple_allocations=sharing.allow_multiple_allocations,
        request_policies=sharing.request_policies,
    )


def test_shared_nics_are_stored_as_sent_and_a_synced_pool_is_not_rewritten(
    srv: Any, make_publisher: Callable[..., SlicePublisher]
) -> None:
    pub = make_publisher(Devices([_shared_nic(1), gpu(0)]))
    assert pub.wait_synced(DEADLINE)
    (stored,) = [d for s in srv.list("resourceslices") for d in s["spec"]["devices"] if d["name"].startswith("pci-")]
    assert stored["allowMultipleAllocations"] is True
    assert stored["capacity"]["shares"] == {
        "value": "8",
        "requestPolicy": {"default": "8", "validRange": {"min": "1", "max": "8", "step": "1"}},
    }
    writes = pub.stats.writes
    pub.trigger()
    assert pub.wait_synced(DEADLINE)
    assert pub.stats.writes == writes, "a synced pool must not be rewritten"


def test_sharing_dropped_by_the_server_falls_back_to_whole_nics(
    srv: Any, make_publisher: Callable[..., SlicePublisher], caplog: pytest.LogCaptureFixture
) -> None:
    srv.consumable_capacity_enabled = False
    pub = make_publisher(Devices([_shared_nic(1), _shared_nic(2)]))
    assert _poll(lambda: "does not store allowMultipleAllocations" in caplog.text)
    assert pub.wait_synced(DEADLINE)
    devices = [d for s in srv.list("resourceslices") for d in s["spec"]["devices"]]
    assert not any(d.get("allowMultipleAllocations") or d["capacity"]["shares"].get("requestPolicy") for d in devices)
    writes = pub.stats.writes
    pub.trigger()
    assert pub.wait_synced(DEADLINE)
    assert pub.stats.writes == writes, "a synced pool must not be rewritten"


# -- an API server whose history went back -----------------------------------------------------

CORDON = Taint("tandem.dev/cordoned", TaintEffect.NO_SCHEDULE, "sre")


def _taints(srv: Any) -> dict[str, list[str]]:
    return {
        d["name"]: [t["key"] for t in d.get("taints") or []] for s in live_slices(srv) for d in s["spec"]["devices"]
    }


def test_a_restored_backup_is_an_api_server_like_etcd_restored(srv: Any, api: KubeAPI) -> None:
    """The simulation of a restore that the tests below rely on: the backup's objects with their
    old resourceVersions, numbering on from its revision, a watch from before it 410 Gone and one
    from beyond it refused as kube-apiserver's watch cache refuses it."""
    before = srv.create({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "n2"}, "spec": {}})
    backup = srv.snapshot()
    later = srv.update({**before, "metadata": {**before["metadata"], "labels": {"x": "y"}}})
    srv.restore(backup)
    assert srv.get("nodes", "n2") == before
    again = srv.update({**before, "metadata": {**before["metadata"], "labels": {"x": "z"}}})
    assert again["metadata"]["resourceVersion"] == later["metadata"]["resourceVersion"]
    with pytest.raises(ApiError) as err:
        next(api.watch_slices(NODE, DRIVER, str(int(again["metadata"]["resourceVersion"]) + 5), 5))
    assert err.value.status == 504 and "Too large resource version" in str(err.value)
    with pytest.raises(ApiError) as err:
        next(api.watch_slices(NODE, DRIVER, "1", 5))
    assert err.value.status == 410
    srv.restore()
    assert srv.list("nodes") == []


def test_a_cordon_lost_to_an_etcd_restore_is_published_again(
    srv: Any, make_publisher: Callable[..., SlicePublisher], caplog: pytest.LogCaptureFixture
) -> None:
    """etcd put back to a backup taken before a cordon: the server's slice lacks the cordon's
    taint and has versions older than those the publisher wrote since. Without the reset the
    cache kept its copy (newer by number) and the publisher saw nothing to write."""
    devices = Devices([gpu(i) for i in range(3)])
    pub = make_publisher(devices)
    assert pub.wait_synced(DEADLINE)
    backup = srv.snapshot()
    devices.set([gpu(0, taints=(CORDON,)), gpu(1), gpu(2)])
    pub.trigger()
    assert _poll(lambda: _taints(srv)["gpu-0000"] == [CORDON.key])
    assert pub.wait_synced(DEADLINE)
    caplog.set_level(logging.WARNING, logger="driver.slices.cache")
    srv.restore(backup)
    assert _taints(srv)["gpu-0000"] == []
    assert _poll(lambda: _taints(srv)["gpu-0000"] == [CORDON.key]), "the cordon never came back"
    assert pub.wait_synced(DEADLINE)
    assert _poll(lambda: pub.progress.problems() == [] and pub.progress.unready() == [])
    assert any("resourceVersion went back" in r.getMessage() for r in caplog.records), caplog.text


def test_an_api_server_started_empty_gets_the_slices_again_owned_by_the_new_node(
    srv: Any, make_publisher: Callable[..., SlicePublisher]
) -> None:
    """Everything gone, the Node registered anew (a new UID): the slices are created again, owned
    by that Node (the old owner would have them garbage-collected), with no update sent for a
    slice that is not there (they were answered 404 for minutes)."""
    devices = Devices([gpu(i) for i in range(200)])
    pub = make_publisher(devices)
    assert pub.wait_synced(DEADLINE)
    old_uid = srv.get("nodes", NODE)["metadata"]["uid"]
    mark = time.monotonic()
    srv.restore()
    new_uid = srv.add_node(NODE)["metadata"]["uid"]
    assert new_uid != old_uid

    def republished() -> bool:
        owners = {r["uid"] for s in live_slices(srv) for r in s["metadata"]["ownerReferences"]}
        return len(published_names(srv)) == 200 and owners == {new_uid}

    assert _poll(republished), [s["metadata"]["ownerReferences"] for s in live_slices(srv)]
    assert pub.wait_synced(DEADLINE)
    assert [(w.method, w.status) for w in slice_writes(srv, mark) if w.status == 404] == []


class _BlindWatch(KubeAPI):
    """A door whose slice watch opens only when `opened` is set: until then the publisher hears
    of no change that it did not make itself."""

    opened = threading.Event()

    def watch_slices(self, node_name: str, driver: str, resource_version: str, timeout_seconds: int) -> Any:
        self.opened.wait()
        return super().watch_slices(node_name, driver, resource_version, timeout_seconds)


def test_an_update_answered_404_creates_the_slice_again_under_its_name(srv: Any, tmp_path: Path) -> None:
    """A slice deleted before its watch event came: the update is answered 404, and the
    publisher creates it at once under the same name rather than listing and planning again."""
    api = _BlindWatch(str(srv.write_kubeconfig(tmp_path / "kubeconfig")))
    api.opened = threading.Event()
    devices = Devices([gpu(i) for i in range(3)])
    pub = SlicePublisher(api, DRIVER, NODE, devices.get, FAST)
    pub.start()
    try:
        assert pub.wait_synced(DEADLINE)
        (s,) = live_slices(srv)
        srv.delete("resourceslices", s["metadata"]["name"], None)
        mark = time.monotonic()
        devices.set([gpu(0, model="B200"), gpu(1), gpu(2)])
        pub.trigger()
        assert _poll(lambda: len(live_slices(srv)) == 1)
        (again,) = live_slices(srv)
        assert again["metadata"]["name"] == s["metadata"]["name"]
        assert again["spec"]["devices"][0]["attributes"]["model"]["string"] == "B200"
        writes = [(w.method, w.status) for w in slice_writes(srv, mark)]
        assert writes == [("PUT", 404), ("POST", 201)], writes
        assert [r.verb for r in srv.requests if r.time >= mark and r.resource == "resourceslices"][:2] == [
            "update",
            "create",
        ]
    finally:
        api.opened.set()
        pub.stop()
        api.close()
