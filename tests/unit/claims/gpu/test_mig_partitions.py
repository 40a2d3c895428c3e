"""Prepare and unprepare of dynamic-MIG devices, in process against the fake NVML: the allocated
placement is made, inside the two-phase checkpoint; failures roll back or are finished by the next
call or at start; only what Tandem recorded is ever destroyed."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from ctypes import byref
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest
from prepare_fakes import DRIVER, NODE, FakeAPI

from driver.claims.allocation import PrepareSettings
from driver.claims.checkpoint import STATE_COMPLETED, STATE_STARTED, Checkpoint, ClaimRecord, DeviceRecord, InstanceLock
from driver.claims.files import ClaimFiles
from driver.claims.gpu.mig import MigPartitions
from driver.claims.metadata import MetadataWriter
from driver.claims.prepare import Preparer
from driver.claims.reconcile import Reconciler
from driver.daemon import Daemon
from driver.discovery.gpu import GpuDiscovery
from driver.kubelet.server import KubeletServer
from driver.model import Device, MigPlacement
from driver.node.driver_root import find_driver_files
from sim import nvml as sim_nvml
from sim.driver_files import render_driver_files
from sim.profile import h100_node
from sim.sysfs import mig_ci_cap_minor, mig_gi_cap_minor, render_node

ONE_G = "gpu-0-mig-1g-10gb-p3"  # 1g.10gb on memory slice 3: GPU instance 10
THREE_G = "gpu-0-mig-3g-40gb-p4"  # 3g.40gb on memory slices 4-7: GPU instance 2


@dataclass
class Node:
    root: Path
    state: Path
    pynvml: ModuleType
    devices: dict[str, Device]
    api: FakeAPI
    partitions: MigPartitions

    @property
    def settings(self) -> PrepareSettings:
        return PrepareSettings(DRIVER, NODE, self.root / "cdi", self.root / "dev", self.root / "proc")

    def files(self) -> ClaimFiles:
        return ClaimFiles(self.settings, MetadataWriter(self.root / "data", self.root / "cdi", DRIVER))

    def preparer(self, instance: str = "a") -> Preparer:
        return Preparer(
            api=self.api,
            checkpoint=Checkpoint(self.root / "data", "boot"),
            instance=InstanceLock(self.root / "data", instance),
            settings=self.settings,
            lookup_device=self.devices.get,
            driver_files=lambda: find_driver_files(self.root / "driver"),
            files=self.files(),
            partitions=self.partitions,
        )

    def reconciler(self, preparer: Preparer) -> Reconciler:
        instance = InstanceLock(self.root / "data", f"start-{uuid.uuid4().hex[:8]}")
        checkpoint = Checkpoint(self.root / "data", "boot")
        return Reconciler(self.api, checkpoint, instance, self.settings, self.files(), preparer.prepare,
                          partitions=self.partitions)  # fmt: skip

    def instances(self) -> list[tuple[str, int, int | None]]:
        """What NVML holds on GPU 0: (profile, GPU instance, compute instance)."""
        migs = sim_nvml.read_state(self.state).gpus[0].mig_devices
        return sorted((m.profile, m.gi_id, m.ci_id) for m in migs)

    def inject(self, function: str, code: int) -> None:
        profile = sim_nvml.read_state(self.state)
        profile.gpus[0].nvml_errors = {function: code} if function else {}
        sim_nvml.write_state(profile, self.state)

    def records(self) -> dict[str, ClaimRecord]:
        return Checkpoint(self.root / "data", "boot").read()


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    profile = h100_node(NODE, gpus=2, nics=0, mig_capable=True)
    profile.gpus[0].mig_mode = True
    render_node(profile, tmp_path / "sys", tmp_path / "dev", tmp_path / "proc", lazy_nodes=True)
    render_driver_files(tmp_path / "driver")
    state = tmp_path / "nvml.json"
    sim_nvml.write_state(profile, state, proc_root=tmp_path / "proc")
    with sim_nvml.fake_pynvml_in_process(state) as pynvml:
        devices = GpuDiscovery(
            tmp_path / "sys", proc_root=tmp_path / "proc", dynamic_mig=lambda minor, uuid: minor == 0
        ).discover()
        yield Node(tmp_path, state, pynvml, {d.name: d for d in devices}, FakeAPI(),
                   MigPartitions(Path("/"), tmp_path / "proc"))  # fmt: skip


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
    assert record.state == STATE_COMPLETED
    assert record.devices[0].mig == MigPlacement(node.devices[ONE_G].gpu.parent_uuid, 19, 3, 1)  # type: ignore[union-attr]
    assert p.prepare([one])[one.uid] == results[one.uid]  # the same answer, nothing made twice
    assert node.instances() == [("1g.10gb", 10, 0), ("3g.40gb", 2, 0)]
    assert p.unprepare([one]) == {one.uid: ""}
    assert node.instances() == [("3g.40gb", 2, 0)]
    assert one.uid not in node.records()
    p.close()


def test_the_whole_gpu_is_the_instance_spanning_it(node: Node) -> None:
    p = node.preparer()
    whole = node.api.add("default", "whole", "uid-w", ("gpu", "gpu-0"))
    assert p.prepare([whole])[whole.uid].error == ""
    assert node.instances() == [("7g.80gb", 0, 0)]
    assert {"/dev/nvidia0", f"/dev/nvidia-caps/nvidia-cap{mig_gi_cap_minor(0, 0)}"} <= _nodes(_spec(node, whole.uid))
    assert p.unprepare([whole]) == {whole.uid: ""} and node.instances() == []
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
    assert p.unprepare([claim]) == {claim.uid: ""}
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
    assert node.instances() == [("1g.10gb", 10, 0)] and node.records()[claim.uid].state == STATE_COMPLETED
    p.close()


def test_a_refused_destroy_keeps_the_record_until_the_kubelet_retries(node: Node) -> None:
    p = node.preparer()
    claim = node.api.add("default", "c", "uid-c", ("mig", ONE_G))
    assert p.prepare([claim])[claim.uid].error == ""
    node.inject("nvmlComputeInstanceDestroy", node.pynvml.NVML_ERROR_IN_USE)
    assert "a process still uses it" in p.unprepare([claim])[claim.uid]
    assert claim.uid in node.records() and node.instances() == [("1g.10gb", 10, 0)]
    node.inject("", 0)
    assert p.unprepare([claim]) == {claim.uid: ""}
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
        claims["uid-dead"] = ClaimRecord("default", "c", "uid-dead", STATE_STARTED, (device,), owner="gone-1234")
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
    assert p.unprepare([claim]) == {claim.uid: ""}  # the kubelet's retry finds nothing left to do
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
