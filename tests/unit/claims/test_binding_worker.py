"""The binding worker (`driver.claims.binding.PreBinder`) against a small fake of the two API calls
it makes (`BindingAPI`): a NIC checked before its pod binds sets the claim's binding condition,
one that is not ready sets the failure condition, taints the NIC and tells why."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from driver.claims.allocation import ClaimLocks, ClaimRef, PrepareSettings
from driver.claims.binding import PreBinder
from driver.claims.checkpoint import Checkpoint
from driver.kube.types import AllocatedDeviceStatus, ResourceClaim
from driver.model import Condition, Device, DeviceKind, NicInfo

SETTINGS = PrepareSettings("x.dev", "node-a", Path("/cdi"), Path("/dev"))
UID = "0f6f1c8e-3c1a-4b8e-9a51-2c4e6f7a8b9c"


def claim() -> ResourceClaim:
    result = {
        "request": "nic",
        "driver": "x.dev",
        "pool": "node-a",
        "device": "nic-0",
        "bindingConditions": ["x.dev/nic-ready"],
        "bindingFailureConditions": ["x.dev/nic-failed"],
    }
    doc: dict[str, Any] = {
        "metadata": {"namespace": "ns", "name": "c", "uid": UID},
        "status": {"allocation": {"devices": {"results": [result]}}},
    }
    return doc  # type: ignore[return-value]


class FakeAPI:
    """`BindingAPI`: one claim, and the status applies it was sent."""

    def __init__(self) -> None:
        self.applied: list[tuple[str, str, list[AllocatedDeviceStatus], str, str]] = []
        self.done = threading.Event()

    def get_claim(self, namespace: str, name: str) -> ResourceClaim:
        assert (namespace, name) == ("ns", "c")
        return claim()

    def apply_claim_status(
        self, namespace: str, name: str, devices: list[AllocatedDeviceStatus], field_manager: str, *, uid: str
    ) -> None:
        self.applied.append((namespace, name, devices, field_manager, uid))
        self.done.set()


class NoPartitions:
    """A node without dynamic MIG: there is nothing to make or destroy."""

    def ensure(self, *_: object, **__: object) -> None:
        raise AssertionError("a NIC makes no partition")

    def destroy(self, uid: str, placements: object = (), keep: object = ()) -> None:
        pass


def run_binder(tmp_path: Path, nic: NicInfo) -> tuple[FakeAPI, dict[str, list[Condition]], list[str]]:
    api = FakeAPI()
    device = Device("nic-0", DeviceKind.NIC, nic=nic)
    taints: dict[str, list[Condition]] = {}
    reports: list[str] = []

    def report(ref: ClaimRef, error: str) -> None:
        reports.append(f"{ref.namespace}/{ref.name}: {error}")

    binder = PreBinder(
        api,
        SETTINGS,
        Checkpoint(tmp_path, "boot-1"),
        NoPartitions(),  # type: ignore[arg-type]
        ClaimLocks(),
        lookup=lambda name: device if name == "nic-0" else None,
        devices=lambda: [device],
        taint=lambda name, conds: taints.__setitem__(name, list(conds)),
        report=report,
    )
    binder.start()
    try:
        binder.want("ns", ["c"])
        assert api.done.wait(timeout=10), "no status applied"  # after the taint and the report, if any
    finally:
        binder.stop()
    return api, taints, reports


def test_a_ready_nic_sets_the_binding_condition_under_the_binders_field_manager(tmp_path: Path) -> None:
    api, taints, reports = run_binder(tmp_path, NicInfo("0000:04:00.0", "eth0", "mlx5_0"))
    [(namespace, name, devices, manager, uid)] = api.applied
    assert (namespace, name, manager, uid) == ("ns", "c", "x.dev/binding", UID)
    [entry] = devices
    assert (entry["device"], [(c["type"], c["status"]) for c in entry["conditions"]]) == (
        "nic-0",
        [("x.dev/nic-ready", "True")],
    )
    assert taints == {} and reports == []


def test_a_nic_not_on_the_host_sets_the_failure_condition_and_is_tainted(tmp_path: Path) -> None:
    api, taints, reports = run_binder(tmp_path, NicInfo("0000:04:00.0", "eth0", "mlx5_0", present=False))
    [(_, _, devices, _, _)] = api.applied
    assert [(c["type"], c["reason"]) for c in devices[0]["conditions"]] == [("x.dev/nic-failed", "NicNotReady")]
    assert [c.key for c in taints["nic-0"]] == ["x.dev/nic-failed"]
    assert reports == ["ns/c: NIC nic-0 (0000:04:00.0) is not ready: not on the host"]
