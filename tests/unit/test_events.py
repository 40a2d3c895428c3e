"""Kubernetes Events: what is reported, deduplicated into series, rate-limited, and never a reason
for a caller to fail; sent through the simulated API server, which validates them as a real one."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from waiting import poll, wait_for

from driver import events as events_module
from driver.claims.checkpoint import ClaimRecord, DeviceRecord
from driver.events import NOTE_LIMIT, EventRecorder
from driver.inventory.store import Inventory
from driver.kube.api import ApiError, KubeAPI
from driver.model import Condition, Device, DeviceKind, TaintEffect
from sim.apiserver import SimApiServer

NODE = "node-e"
DRIVER = "tandem.dev"
UID = "0f1e2d3c-4b5a-4678-9abc-def012345678"


@contextlib.contextmanager
def _running(
    tmp_path: Path, clock: Callable[[], float] = time.time, claims: Callable[[], Mapping[str, ClaimRecord]] = dict
) -> Iterator[tuple[SimApiServer, KubeAPI, Inventory, EventRecorder]]:
    with SimApiServer() as srv:
        srv.add_node(NODE)
        srv.write_kubeconfig(tmp_path / "kubeconfig")
        api = KubeAPI(str(tmp_path / "kubeconfig"))
        inventory = Inventory()
        inventory.replace("gpu", [Device("gpu-0", DeviceKind.GPU), Device("gpu-1", DeviceKind.GPU)])
        recorder = EventRecorder(api, DRIVER, NODE, inventory.devices, clock, claims=claims)
        inventory.subscribe(recorder.inventory_changed)
        recorder.start()
        yield srv, api, inventory, recorder
        recorder.stop()
        api.close()


@pytest.fixture
def setup(tmp_path: Path) -> Iterator[tuple[SimApiServer, KubeAPI, Inventory, EventRecorder]]:
    with _running(tmp_path) as running:
        yield running


def _events(srv: SimApiServer, namespace: str | None = None) -> list[dict[str, Any]]:
    return srv.list("events", namespace)


def _xid(device: str) -> Condition:
    return Condition(f"{DRIVER}/xid", TaintEffect.NO_SCHEDULE, "79", f"{device}: XID 79 (GPU fell off the bus)")


def test_a_failed_prepare_is_a_warning_on_the_claim(setup) -> None:
    srv, _, _, recorder = setup
    recorder.claim_failed("team-a", "train-0", UID, "device 'gpu-7' is not (or no longer) present on this node")
    (event,) = wait_for("the claim's event", lambda: _events(srv, "team-a"))
    assert event["regarding"] == {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "name": "train-0", "namespace": "team-a", "uid": UID,
    }  # fmt: skip
    assert (event["type"], event["reason"], event["action"]) == ("Warning", "PrepareFailed", "PrepareResources")
    assert "gpu-7" in event["note"]
    assert event["reportingController"] == DRIVER


def test_health_and_cordon_changes_are_events_on_the_node_baseline_is_not(setup) -> None:
    srv, _, inventory, _ = setup
    node_uid = srv.get("nodes", NODE)["metadata"]["uid"]
    inventory.set_conditions("gpu-health", "gpu-1", [_xid("gpu-1")])
    unhealthy = wait_for(
        "DeviceUnhealthy", lambda: [e for e in _events(srv, "default") if e["reason"] == "DeviceUnhealthy"]
    )
    assert unhealthy[0]["regarding"] == {"apiVersion": "v1", "kind": "Node", "name": NODE, "uid": node_uid}
    assert unhealthy[0]["type"] == "Warning" and "XID 79" in unhealthy[0]["note"]
    inventory.set_conditions("gpu-health", "gpu-1", [])
    assert poll(lambda: [e for e in _events(srv) if e["reason"] == "DeviceHealthy"])
    cordon = Condition(f"{DRIVER}/cordoned", TaintEffect.NO_SCHEDULE, "manual", "fan", unhealthy=False)
    inventory.set_conditions("cordon", "gpu-0", [cordon])
    assert poll(lambda: [e for e in _events(srv) if e["reason"] == "DeviceCordoned" and "gpu-0" in e["note"]])
    assert {e["reason"] for e in _events(srv)} == {"DeviceUnhealthy", "DeviceHealthy", "DeviceCordoned"}


def test_a_repeat_becomes_a_series_of_the_first_event(setup) -> None:
    srv, _, _, recorder = setup
    for _ in range(3):
        recorder.claim_failed("default", "c", UID, "same error")
    assert poll(lambda: [e for e in _events(srv) if (e.get("series") or {}).get("count") == 3])
    assert len(_events(srv)) == 1
    recorder.claim_failed("default", "c", UID, "another error")
    assert poll(lambda: len(_events(srv)) == 2)


def test_a_series_whose_event_is_gone_starts_a_new_event(setup) -> None:
    """The server keeps events an hour, and an etcd restore can lose them: a repeat of an event
    that is gone is told in a new one, not lost to a 404 on the patch."""
    srv, _, _, recorder = setup
    recorder.claim_failed("default", "c", UID, "same error")
    (first,) = wait_for("the first event", lambda: _events(srv, "default"))
    srv.delete("events", first["metadata"]["name"], "default")
    recorder.claim_failed("default", "c", UID, "same error")
    (again,) = wait_for("the repeat, in a new event", lambda: _events(srv, "default"))
    assert again["metadata"]["name"] != first["metadata"]["name"] and again["note"] == "same error"
    assert recorder.dropped == 0


def test_a_node_registered_again_is_the_one_events_are_about(setup) -> None:
    """A Node deleted and registered again has another UID: its events name the Node as it is."""
    srv, _, inventory, _ = setup
    inventory.set_conditions("gpu-health", "gpu-1", [_xid("gpu-1")])
    wait_for("the first node event", lambda: _events(srv, "default"))
    srv.delete("nodes", NODE)
    new_uid = srv.add_node(NODE)["metadata"]["uid"]
    inventory.set_conditions("gpu-health", "gpu-1", [])
    healthy = wait_for(
        "the node event after it came back",
        lambda: [e for e in _events(srv, "default") if e["reason"] == "DeviceHealthy"],
    )
    assert healthy[0]["regarding"]["uid"] == new_uid


def test_an_object_gets_at_most_a_burst_then_events_are_dropped(setup, monkeypatch) -> None:
    srv, _, _, recorder = setup
    monkeypatch.setattr(events_module, "BURST", 3)
    for i in range(5):
        recorder.claim_failed("default", "spammy", UID, f"error {i}")
    recorder.claim_failed("default", "other", UID, "its own bucket")
    assert poll(lambda: recorder.sent + recorder.dropped == 6)
    assert recorder.dropped == 2
    assert sorted(e["note"] for e in _events(srv)) == ["error 0", "error 1", "error 2", "its own bucket"]


def test_a_long_note_is_cut_to_the_api_limit(setup) -> None:
    srv, _, _, recorder = setup
    recorder.claim_failed("default", "c", UID, "x" * 5000)
    (event,) = wait_for("the event", lambda: _events(srv))
    assert len(event["note"]) == NOTE_LIMIT and event["note"].endswith("...")


def test_a_long_note_is_cut_to_the_api_limit_in_bytes_between_characters(setup) -> None:
    """The server counts the note's UTF-8 bytes; an error can echo a user's non-ASCII input."""
    srv, _, _, recorder = setup
    recorder.claim_failed("default", "c", UID, "字" * 600)  # 3 bytes each
    (event,) = wait_for("the event", lambda: _events(srv))
    assert event["note"] == "字" * 340 + "..."  # 1023 bytes: a 341st would split at byte 1021
    assert len(event["note"].encode()) <= NOTE_LIMIT


def test_events_made_at_one_instant_have_names_of_their_own(tmp_path: Path) -> None:
    """The name is the time in nanoseconds (client-go's), which time.time() often repeats in one
    loop, e.g. when two devices fail at once: the same name twice would be a 409 and a lost event."""
    with _running(tmp_path, clock=lambda: 1_700_000_000.0) as (srv, _, inventory, recorder):
        for device in ("gpu-0", "gpu-1"):
            inventory.set_conditions("gpu-health", device, [_xid(device)])
        recorder.claim_failed("default", NODE, UID, "a claim named as the node: the same name prefix")
        assert poll(lambda: recorder.sent + recorder.dropped == 3)
        assert recorder.dropped == 0
        assert sorted(e["reason"] for e in _events(srv)) == ["DeviceUnhealthy", "DeviceUnhealthy", "PrepareFailed"]


def test_the_buckets_of_the_objects_least_recently_used_are_forgotten(setup, monkeypatch) -> None:
    """A bucket per object ever seen would grow with every claim a long-lived node prepares: as
    client-go's LRU cache, only the last BUCKETS objects' are kept."""
    srv, _, _, recorder = setup
    monkeypatch.setattr(events_module, "BURST", 1)
    monkeypatch.setattr(events_module, "BUCKETS", 2)
    for claim, note in [("a", "a1"), ("a", "a2"), ("b", "b"), ("a", "a3"), ("c", "c"), ("d", "d"), ("a", "a4")]:
        recorder.claim_failed("default", claim, UID, note)
    assert poll(lambda: recorder.sent + recorder.dropped == 7)
    # a2 and a3: a's bucket is empty and kept (one other object since); a4: two others since,
    # so a's bucket was forgotten and a new, full one let it through.
    assert sorted(e["note"] for e in _events(srv)) == ["a1", "a4", "b", "c", "d"]


class _Down(KubeAPI):
    def __init__(self) -> None:  # no client: every call fails as an unreachable server does
        pass

    def create_event(self, namespace: str, body: dict[str, Any]) -> None:
        raise ApiError("connection refused", 0)

    def get_node(self, name: str) -> Any:
        raise ApiError("connection refused", 0)


def test_an_unreachable_api_server_drops_events_and_never_raises() -> None:
    recorder = EventRecorder(_Down(), DRIVER, NODE, list)
    recorder.start()
    try:
        recorder.claim_failed("default", "c", UID, "error")  # returns at once, raises nothing
        assert poll(lambda: recorder.dropped == 1)
    finally:
        recorder.stop()


def _held(device: str) -> dict[str, ClaimRecord]:
    """A claim of team-a prepared with `device`, as the checkpoint reads."""
    return {UID: ClaimRecord("team-a", "train-0", UID, devices=(DeviceRecord(("gpu",), NODE, device),))}


def test_a_health_change_is_also_an_event_on_each_claim_holding_the_device(tmp_path: Path) -> None:
    """The pod's owner reads events in the pod's namespace, not the Node's in `default`."""
    with _running(tmp_path, claims=lambda: _held("gpu-1")) as (srv, _, inventory, _):
        inventory.set_conditions("gpu-health", "gpu-0", [_xid("gpu-0")])  # held by nobody: the Node's only
        inventory.set_conditions("gpu-health", "gpu-1", [_xid("gpu-1")])
        (event,) = wait_for("the claim's event", lambda: _events(srv, "team-a"))
        assert event["regarding"] == {
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "name": "train-0", "namespace": "team-a",
            "uid": UID,
        }  # fmt: skip
        assert (event["type"], event["reason"]) == ("Warning", "DeviceUnhealthy") and "XID 79" in event["note"]
        assert poll(lambda: len([e for e in _events(srv, "default") if e["reason"] == "DeviceUnhealthy"]) == 2)
        inventory.set_conditions("gpu-health", "gpu-1", [])
        healthy = wait_for("healthy", lambda: [e for e in _events(srv, "team-a") if e["reason"] == "DeviceHealthy"])
        assert healthy[0]["note"] == "gpu-1 is healthy again"


def test_the_claims_events_are_rate_limited_as_every_objects(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(events_module, "BURST", 1)
    with _running(tmp_path, claims=lambda: _held("gpu-1")) as (srv, _, inventory, recorder):
        for seen, conditions in ((2, [_xid("gpu-1")]), (4, []), (6, [_xid("gpu-1")])):
            inventory.set_conditions("gpu-health", "gpu-1", conditions)  # one event on the Node, one on the claim
            assert poll(lambda seen=seen: recorder.sent + recorder.dropped == seen)
        assert (recorder.sent, recorder.dropped) == (2, 4)
        assert [e["reason"] for e in _events(srv, "team-a")] == ["DeviceUnhealthy"]


def test_claims_that_cannot_be_read_cost_the_claims_events_only(tmp_path: Path) -> None:
    def broken() -> dict[str, ClaimRecord]:
        raise OSError("checkpoint unreadable")

    with _running(tmp_path, claims=broken) as (srv, _, inventory, _):
        inventory.set_conditions("gpu-health", "gpu-1", [_xid("gpu-1")])
        assert wait_for("the Node's event", lambda: _events(srv, "default"))[0]["reason"] == "DeviceUnhealthy"


def test_a_device_leaving_the_published_set_is_an_event_on_the_node(setup) -> None:
    srv, _, inventory, _ = setup
    inventory.replace("gpu", [Device("gpu-0", DeviceKind.GPU)])
    (event,) = wait_for("DeviceRemoved", lambda: _events(srv, "default"))
    assert (event["type"], event["reason"], event["note"]) == (
        "Warning",
        "DeviceRemoved",
        "gpu-1 is no longer published",
    )
    assert event["regarding"]["kind"] == "Node"


def test_the_last_failure_of_each_claim_is_remembered_bounded(setup, monkeypatch) -> None:
    _, _, _, recorder = setup
    monkeypatch.setattr(events_module, "BUCKETS", 2)
    uids = [f"{i}f1e2d3c-4b5a-4678-9abc-def012345678" for i in range(3)]
    recorder.claim_failed("ns", "a", uids[0], "a1")
    recorder.claim_failed("ns", "b", uids[1], "b1")
    recorder.claim_failed("ns", "a", uids[0], "a2")  # a is now the newest: b goes first
    recorder.claim_failed("ns", "c", uids[2], "c1")
    assert [(f.name, f.error) for f in recorder.failures()] == [("a", "a2"), ("c", "c1")]
    assert recorder.last_failure(uids[1]) is None
    failure = recorder.last_failure(uids[0])
    assert failure is not None and (failure.namespace, failure.name, failure.error) == ("ns", "a", "a2")
