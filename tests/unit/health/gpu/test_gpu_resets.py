"""Reset-class XIDs where the driver reports no recovery action: held until evidence of a reset
(`driver.health.gpu.resets`), never cleared by a quiet period alone; the evidence each door gives."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from driver.health.cordon import CordonError, UnknownDevice
from driver.health.gpu.conditions import GpuConditions
from driver.health.gpu.held import held_gpus
from driver.health.gpu.policy import RESET_XIDS, GpuHealthPolicy, HealthState, RecoveryAction, index_gpus
from driver.health.gpu.release import MAX_CLEARS, GpuReleases, ReleaseError
from driver.health.gpu.resets import EVERY_GPU, ResetEvidence
from driver.inventory.store import Inventory
from driver.model import Device, DeviceKind, GpuInfo, TaintEffect
from driver.node.nvml import NvmlAccess
from driver.status.server import RequestError, StatusServer

SOURCE = "gpu-health"
NOT_REPORTED = None  # a driver or GPU without NVML's recovery-action field


def _gpu(minor: int) -> Device:
    return Device(f"gpu-{minor}", DeviceKind.GPU, gpu=GpuInfo(minor=minor, uuid=f"GPU-{minor}", pci_bus_id=""))


def _mig(name: str, parent: int, gi: int) -> Device:
    info = GpuInfo(minor=parent, uuid=f"MIG-{name}", pci_bus_id="", parent_uuid=f"GPU-{parent}", mig_gi=gi, mig_ci=0)
    return Device(name, DeviceKind.MIG, gpu=info)


# --- the policy: which XIDs wait for a reset, and what their message says -------------------------


@pytest.mark.parametrize("xid", sorted(RESET_XIDS))
def test_a_reset_xid_without_a_recovery_action_waits_for_a_reset_and_says_what_clears_it(xid: int) -> None:
    p = GpuHealthPolicy()
    assert p.needs_reset(xid, NOT_REPORTED)
    cond = p.xid(xid, NOT_REPORTED)
    assert cond.effect is TaintEffect.NO_EXECUTE and cond.unhealthy
    assert "the driver reports no recovery action" in cond.message
    assert "clears when the GPU is reset (tandemctl release, nvidia-smi -r, tandemctl reacquire)" in cond.message
    assert "tandemctl clear" in cond.message


@pytest.mark.parametrize(
    ("xid", "action"),
    [
        (79, RecoveryAction.NONE),  # the driver reports the field: its "none" later is the truth
        (79, RecoveryAction.GPU_RESET),  # the recovery-action condition holds until the driver says none
        (79, 99),  # unknown action: its own condition holds until the driver says none
        (94, NOT_REPORTED),  # not reset-class: the quiet period is right
        (13, NOT_REPORTED),  # an application's XID
    ],
)
def test_other_xids_keep_the_quiet_period(xid: int, action: int | None) -> None:
    p = GpuHealthPolicy()
    assert not p.needs_reset(xid, action)
    assert "tandemctl clear" not in p.xid(xid, action).message


def test_a_reset_xid_the_driver_asks_nothing_for_does_not_say_the_gpu_needs_a_reset() -> None:
    """It clears after the quiet period: a message saying the GPU needs a reset would send an SRE
    to reset a GPU for a taint that lifts by itself ten minutes later."""
    message = GpuHealthPolicy().xid(79, RecoveryAction.NONE).message
    assert "needs a reset" not in message
    assert "advises a reset, but NVML reports recovery action none; clears after 600 s without another" in message


def test_an_ignored_reset_xid_stays_informational() -> None:
    p = GpuHealthPolicy(ignored_xids=frozenset({48}))
    assert not p.needs_reset(48, NOT_REPORTED)
    assert p.xid(48, NOT_REPORTED).effect is TaintEffect.NONE


# --- the state: no quiet period ends it, evidence does ---------------------------------------------


def test_a_condition_held_until_reset_outlives_every_quiet_period_and_clears_on_evidence() -> None:
    p = GpuHealthPolicy(xid_quiet_period=10)
    state = HealthState(p)
    held, timed = p.xid(79, NOT_REPORTED), p.xid(94, NOT_REPORTED)
    assert state.observe("GPU-0", held, now=0.0, until_reset=True)
    assert state.observe("GPU-0", timed, now=0.0)
    assert state.expire(1e9) == {"GPU-0"}  # the quiet period ends the other XID only
    assert state.conditions("GPU-0") == {held}
    assert state.clear_reset("GPU-0")
    assert state.conditions("GPU-0") == frozenset() and state.subjects() == set()
    assert not state.clear_reset("GPU-0")


def test_the_same_xid_is_one_condition_whichever_way_it_clears() -> None:
    p = GpuHealthPolicy(xid_quiet_period=10)
    state = HealthState(p)
    state.observe("GPU-0", p.xid(79, RecoveryAction.NONE), now=0.0)
    state.observe("GPU-0", p.xid(79, NOT_REPORTED), now=1.0, until_reset=True)
    assert state.conditions("GPU-0") == {p.xid(79, NOT_REPORTED)}
    assert state.expire(1e9) == set()
    assert state.forget("GPU-0") and state.subjects() == set()


# --- the monitor's conditions: evidence per GPU, its MIG devices included ------------------------


def test_evidence_clears_the_gpu_and_its_instances_and_nothing_else() -> None:
    inv = Inventory()
    inv.replace("gpu", [_mig("mig-a", 0, 1), _mig("mig-b", 0, 2), _gpu(1)])
    p = GpuHealthPolicy()
    c = GpuConditions(inv, p, SOURCE)
    xid = p.xid(48, NOT_REPORTED)
    for subject in ("GPU-0", "MIG-mig-a", "GPU-1"):
        c.observe([subject], xid, now=0.0, until_reset=True)
    c.publish()
    assert not c.reset({"GPU-9": "not here"})
    assert c.reset({"GPU-0": "reacquired"})
    c.publish()
    assert set(inv.conditions(SOURCE)) == {"gpu-1"}
    assert c.reset({EVERY_GPU: "all of NVML reacquired"})
    c.publish()
    assert inv.conditions(SOURCE) == {}


def test_a_gpu_that_was_lost_and_answers_again_was_reset() -> None:
    inv = Inventory()
    inv.replace("gpu", [_gpu(0)])
    p = GpuHealthPolicy()
    c = GpuConditions(inv, p, SOURCE)
    gpu = index_gpus(inv.devices())["GPU-0"]
    c.observe(["GPU-0"], p.xid(79, NOT_REPORTED), now=0.0, until_reset=True)
    c.probed(gpu, [], answers=True)  # answering all along proves nothing
    assert c.state.conditions("GPU-0")
    c.probed(gpu, [p.gpu_lost("off the bus")], answers=False)
    assert c.state.conditions("GPU-0")
    c.probed(gpu, [], answers=True)
    assert c.state.conditions("GPU-0") == frozenset()


# --- the doors: reacquire and the operator's clear -----------------------------------------------


@pytest.fixture
def releases(tmp_path: Path) -> tuple[GpuReleases, ResetEvidence]:
    inv = Inventory()
    inv.replace("gpu", [_gpu(0), _mig("mig-a", 1, 1)])
    inv.replace("nic", [Device("nic-0", DeviceKind.NIC)])
    evidence = ResetEvidence()
    r = GpuReleases(tmp_path, inv, access=NvmlAccess(), evidence=evidence, held=lambda: {"GPU-0", "GPU-1"})
    r.load()
    return r, evidence


def test_a_reacquire_is_evidence_for_what_was_released(releases: tuple[GpuReleases, ResetEvidence]) -> None:
    r, evidence = releases
    r.release("mig-a", "nvidia-smi -r after XID 79", "bob")
    assert evidence.take() == {}  # a release alone is not a reset
    r.reacquire("mig-a")
    (why,) = evidence.take().values()
    assert list(evidence.take()) == [] and "bob" in why and "nvidia-smi -r after XID 79" in why
    r.release("", "driver upgrade", "ann")
    r.reacquire("")
    assert list(evidence.take()) == [EVERY_GPU]
    r.reacquire("gpu-0")  # not released: no evidence
    assert evidence.take() == {}


def test_clear_is_recorded_durably_with_who_why_and_when(releases: tuple[GpuReleases, ResetEvidence]) -> None:
    r, evidence = releases
    woke: list[bool] = []
    evidence.subscribe(lambda: woke.append(True))
    assert r.clear("mig-a", "reset by hand with nvidia-smi -r", "bob") == ["mig-a"]
    assert woke == [True]
    assert "bob" in evidence.take()["GPU-1"]
    doc = json.loads(r.clears_path.read_text())
    (entry,) = doc["clears"]
    assert (entry["gpu"], entry["device"], entry["by"]) == ("GPU-1", "mig-a", "bob")
    assert entry["reason"] == "reset by hand with nvidia-smi -r" and entry["since"].endswith("Z")
    assert r.clears_path.stat().st_mode & 0o777 == 0o600
    for i in range(MAX_CLEARS + 5):
        r.clear("gpu-0", f"clear {i}")
    clears = json.loads(r.clears_path.read_text())["clears"]
    assert len(clears) == MAX_CLEARS and clears[-1]["reason"] == f"clear {MAX_CLEARS + 4}"


@pytest.mark.parametrize(
    ("device", "reason", "error"),
    [
        ("gpu-0", "", CordonError),
        ("gpu-0", "x" * 1000, CordonError),
        ("gpu-9", "reset", UnknownDevice),
        ("nic-0", "reset", Exception),
    ],
)
def test_a_bad_clear_changes_nothing(
    releases: tuple[GpuReleases, ResetEvidence], device: str, reason: str, error: type[Exception]
) -> None:
    r, evidence = releases
    with pytest.raises(error):
        r.clear(device, reason, "bob")
    assert evidence.take() == {} and not r.clears_path.exists()


def test_a_clear_with_nothing_held_is_refused_and_recorded_nowhere(tmp_path: Path) -> None:
    """Saying "cleared" when nothing waited for a reset would record false evidence and leave the
    SRE thinking a taint was lifted: the answer says there is nothing to clear, and the exit is 1."""
    inv = Inventory()
    inv.replace("gpu", [_gpu(0), _mig("mig-a", 1, 1)])
    evidence = ResetEvidence()
    r = GpuReleases(tmp_path, inv, access=NvmlAccess(), evidence=evidence, held=lambda: {"GPU-1"})
    with pytest.raises(ReleaseError, match="nothing to clear: no reset XID of gpu-0's GPU waits for a reset"):
        r.clear("gpu-0", "reset", "bob")
    assert evidence.take() == {} and not r.clears_path.exists()
    assert r.clear("mig-a", "reset", "bob") == ["mig-a"]  # GPU-1's held XID: cleared


def test_what_is_held_is_what_the_gpu_monitor_wrote_this_boot(tmp_path: Path) -> None:
    doc = {
        "version": 1,
        "held": {"boot": "b1", "entries": [{"gpu": "GPU-1", "pci": "", "subject": "GPU-1", "xid": 79}]},
    }
    (tmp_path / "held-resets.json").write_text(json.dumps(doc))
    assert held_gpus(tmp_path, "b1") == {"GPU-1"}
    assert held_gpus(tmp_path, "b2") == set()  # a reboot was the reset
    assert held_gpus(tmp_path / "none", "b1") == set()


def test_the_status_socket_routes_clear(releases: tuple[GpuReleases, ResetEvidence], tmp_path: Path) -> None:
    r, evidence = releases
    # Only the releases take part in a clear; the other doors stay unused (None).
    server = StatusServer(tmp_path / "s.sock", Inventory(), None, None, r, dict)  # type: ignore[arg-type]
    doc = server.handle("POST", "/clear", {"device": "gpu-0", "reason": "reset"}, "uid 0")
    assert doc == {"cleared": "gpu-0", "devices": ["gpu-0"]}
    assert "uid 0" in evidence.take()["GPU-0"]  # no --by: the peer is who
    with pytest.raises(RequestError) as e:
        server.handle("POST", "/clear", {"device": "gpu-0"}, "uid 0")
    assert e.value.status == 400
