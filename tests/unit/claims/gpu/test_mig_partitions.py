"""Prepare and unprepare of dynamic-MIG devices, in process against the fake NVML: the allocated
placement is made, inside the two-phase checkpoint; failures roll back or are finished by the next
call or at start; only what Tandem recorded is ever destroyed."""

from __future__ import annotations

import json
from ctypes import byref
from pathlib import Path

from mig_fakes import ONE_G, THREE_G, mig_node_fixture  # noqa: F401  (fixture: node)
from mig_fakes import MigNode as Node
from prepare_fakes import NODE

from driver.claims.checkpoint import Checkpoint, ClaimRecord, DeviceRecord
from driver.claims.unprepare import Unprepared
from driver.claims.vocabulary import PrepareState
from driver.daemon import Daemon
from driver.kubelet.server import KubeletServer
from driver.model import MigPlacement
from sim.sysfs import mig_ci_cap_minor, mig_gi_cap_minor


def _spec(node: Node, uid: str) -> dict:
    (path,) = [p for p in (node.root / "cdi").iterdir() if uid in p.name and "claim" in p.name]
    return json.loads(path.read_text())


def _nodes(spec: dict) -> set[str]:
    out = {n["path"] for n in spec["containerEdits"].get("deviceNodes", [])}
    for d in spec["devices"]:
        out |= {n["path"] for n in d["containerEdits"].get("deviceNodes", [])}
    return out


def test_prepare_makes_the_allocated_placement_and_unprepare_destroys_it(node: Node) -> None:
    p = node.preparer()
    one = node.api.add("default", "one", "uid-1", ("mig", ONE_G))
    three = node.api.add("default", "three", "uid-3", ("mig", THREE_G))
    results = p.prepare([one, three])
    assert results[one.uid].error == "" and results[three.uid].error == ""
    assert node.instances() == [("1g.10gb", 10, 0), ("3g.40gb", 2, 0)]
    spec = _spec(node, one.uid)
    caps = {f"/dev/nvidia-caps/nvidia-cap{m}" for m in (mig_gi_cap_minor(0, 10), mig_ci_cap_minor(0, 10, 0))}
    assert caps <= _nodes(spec) and "/dev/nvidia0" in _nodes(spec)
    assert all((node.root / "dev" / c.removeprefix("/dev/")).exists() for c in caps)  # made as nvidia-modprobe does
    env = [e for d in spec["devices"] for e in d["containerEdits"]["env"]]
    assert any(e.startswith("TANDEM_DEVICE_GPU_0_MIG_1G_10GB_P3=MIG-") for e in env)
    record = node.records()[one.uid]
    assert record.state == PrepareState.COMPLETED
    assert record.devices[0].mig == MigPlacement(node.devices[ONE_G].gpu.parent_uuid, 19, 3, 1)  # type: ignore[union-attr]
    assert p.prepare([one])[one.uid] == results[one.uid]  # the same answer, nothing made twice
    assert node.instances() == [("1g.10gb", 10, 0), ("3g.40gb", 2, 0)]
    assert p.unprepare([one]) == {one.uid: Unprepared()}
    assert node.instances() == [("3g.40gb", 2, 0)]
    assert one.uid not in node.records()
    p.close()


def test_the_whole_gpu_is_the_instance_spanning_it(node: Node) -> None:
    p = node.preparer()
    whole = node.api.add("default", "whole", "uid-w", ("gpu", "gpu-0"))
    assert p.prepare([whole])[whole.uid].error == ""
    assert node.instances() == [("7g.80gb", 0, 0)]
    assert {"/dev/nvidia0", f"/dev/nvidia-caps/nvidia-cap{mig_gi_cap_minor(0, 0)}"} <= _nodes(_spec(node, whole.uid))
    assert p.unprepare([whole]) == {whole.uid: Unprepared()} and node.instances() == []
    p.close()


def test_nvml_refusing_the_placement_fails_the_claim_and_leaves_nothing(node: Node) -> None:
    p = node.preparer()
    node.pynvml.nvmlInit()
    gpu = node.pynvml.nvmlDeviceGetHandleByIndex(0)
    node.pynvml.nvmlDeviceCreateGpuInstanceWithPlacement(gpu, 9, byref(node.pynvml.c_nvmlGpuInstancePlacement_t(4, 4)))
    node.pynvml.nvmlShutdown()  # someone else's 3g.40gb, made after the scheduler allocated
    claim = node.api.add("default", "c", "uid-c", ("mig", THREE_G))
    error = p.prepare([claim])[claim.uid].error
    assert "memory slices 4-7" in error and "taken by a MIG device Tandem did not make" in error, error
    assert node.instances() == [("3g.40gb", 2, None)]  # theirs, untouched
    assert p.unprepare([claim]) == {claim.uid: Unprepared()}
    assert node.instances() == [("3g.40gb", 2, None)]  # never destroyed: it was not Tandem's
    p.close()


def test_a_failed_compute_instance_rolls_back_its_gpu_instance(node: Node) -> None:
    p = node.preparer()
    claim = node.api.add("default", "c", "uid-c", ("mig", ONE_G))
    node.inject("nvmlGpuInstanceCreateComputeInstance", node.pynvml.NVML_ERROR_UNKNOWN)
    assert "cannot make the MIG device" in p.prepare([claim])[claim.uid].error
    assert node.instances() == [] and node.records() == {}  # rolled back: no half-made partition
    node.inject("", 0)
    assert p.prepare([claim])[claim.uid].error == ""
    assert node.instances() == [("1g.10gb", 10, 0)] and node.records()[claim.uid].state == PrepareState.COMPLETED
    p.close()


def test_a_refused_destroy_keeps_the_record_until_the_kubelet_retries(node: Node) -> None:
    p = node.preparer()
    claim = node.api.add("default", "c", "uid-c", ("mig", ONE_G))
    assert p.prepare([claim])[claim.uid].error == ""
    node.inject("nvmlComputeInstanceDestroy", node.pynvml.NVML_ERROR_IN_USE)
    refused = p.unprepare([claim])[claim.uid]
    assert "a process still uses it" in refused.error and refused.error_kind == "device"
    assert claim.uid in node.records() and node.instances() == [("1g.10gb", 10, 0)]
    node.inject("", 0)
    assert p.unprepare([claim]) == {claim.uid: Unprepared()}
    assert node.instances() == [] and node.records() == {}
    p.close()


def test_start_up_rolls_back_a_dead_instances_half_made_partition(node: Node) -> None:
    # A prepare killed after its GPU instance was made: the record says PrepareStarted, owner dead.
    placement = node.devices[ONE_G].gpu.placement  # type: ignore[union-attr]
    assert placement is not None
    p = node.preparer()
    node.pynvml.nvmlInit()
    gpu = node.pynvml.nvmlDeviceGetHandleByIndex(0)
    where = node.pynvml.c_nvmlGpuInstancePlacement_t(placement.start, placement.size)
    node.pynvml.nvmlDeviceCreateGpuInstanceWithPlacement(gpu, placement.profile_id, byref(where))
    node.pynvml.nvmlShutdown()
    with Checkpoint(node.root / "data", "boot").transaction() as claims:
        device = DeviceRecord(("mig",), NODE, ONE_G, mig=placement)
        claims["uid-dead"] = ClaimRecord("default", "c", "uid-dead", PrepareState.STARTED, (device,), owner="gone-1234")
    node.reconciler(p).run()
    assert node.instances() == [] and node.records() == {}
    p.close()


def test_start_up_finishes_an_unprepare_cut_short_after_the_files_went(node: Node) -> None:
    p = node.preparer()
    claim = node.api.add("default", "c", "uid-c", ("mig", THREE_G))
    assert p.prepare([claim])[claim.uid].error == ""
    node.files().remove(claim.uid)  # unprepare's first step, then kill -9
    node.reconciler(p).run()
    assert node.instances() == [] and node.records() == {}
    assert p.unprepare([claim]) == {claim.uid: Unprepared()}  # the kubelet's retry finds nothing left to do
    p.close()


def test_a_mig_change_before_the_kubelet_can_call_does_not_wait_for_the_rediscovery() -> None:
    """Start-up reconciliation destroys what a crash left while it holds the checkpoint lock, which
    a GPU discovery needs: waiting for one there would only stall start-up (5 s a partition). Once
    the kubelet can call, a prepare answers after the rediscovery, as health attribution needs."""
    calls: list[str] = []

    class Source:
        name = "gpu"

        def trigger(self) -> None:
            calls.append("trigger")

        def refresh(self, timeout: float) -> bool:
            calls.append("refresh")
            return True

    daemon = Daemon.__new__(Daemon)  # only what _rediscover_gpus reads
    daemon.sources = [Source()]  # type: ignore[list-item]
    daemon.kubelet_server = KubeletServer("tandem.dev", Path("dra.sock"), Path("reg.sock"))
    daemon._rediscover_gpus()
    assert calls == ["trigger"]
    daemon.kubelet_server._server = object()  # type: ignore[assignment]  # serving now
    daemon._rediscover_gpus()
    assert calls == ["trigger", "refresh"]
