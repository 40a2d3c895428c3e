"""Kubernetes Events: what is reported, deduplicated into series, rate-limited, and never a reason
for a caller to fail; sent through the simulated API server, which validates them as a real one."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from waiting import poll, wait_for

from driver import events as events_module
from driver.events import NOTE_LIMIT, EventRecorder
from driver.inventory import Inventory
from driver.kubeapi import ApiError, KubeAPI
from driver.model import Condition, Device, DeviceKind, TaintEffect
from sim.apiserver import SimApiServer

NODE = "node-e"
DRIVER = "tandem.dev"
UID = "0f1e2d3c-4b5a-4678-9abc-def012345678"


@pytest.fixture
def setup(tmp_path: Path) -> Iterator[tuple[SimApiServer, KubeAPI, Inventory, EventRecorder]]:
    with SimApiServer() as srv:
        srv.add_node(NODE)
        srv.write_kubeconfig(tmp_path / "kubeconfig")
        api = KubeAPI(str(tmp_path / "kubeconfig"))
        inventory = Inventory()
        inventory.replace("gpu", [Device("gpu-0", DeviceKind.GPU), Device("gpu-1", DeviceKind.GPU)])
        recorder = EventRecorder(api, DRIVER, NODE, inventory.devices)
        inventory.subscribe(recorder.inventory_changed)
        recorder.start()
        yield srv, api, inventory, recorder
        recorder.stop()
        api.close()


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
