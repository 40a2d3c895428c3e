"""Per-claim GPU usage (driver/claims/usage.py) read from the fake NVML, and its series in /metrics:
labelled by the pod holding the claim, present while the claim is prepared, bounded in time."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from driver.claims import usage as usage_module
from driver.claims.checkpoint import ClaimRecord, DeviceRecord
from driver.claims.usage import ClaimGpuUsage, GpuUsage, Holder, holders
from driver.claims.vocabulary import PrepareState
from driver.inventory.store import Inventory
from driver.metrics import Metrics, ScrapeSources
from driver.model import Device, DeviceKind, GpuInfo
from driver.node.nvml import NVML_ACCESS, NvmlUnavailable
from sim import nvml as sim_nvml
from sim.profile import a100_mig_node, h100_node

GIB = 1024**3
GPU_UUID = "GPU-00000001-0000-4000-8000-000000000001"  # h100_node's first GPU


@pytest.fixture
def node(tmp_path: Path) -> Iterator[tuple[Path, Inventory, str]]:
    """An H100 (gpu-0) and an A100 in MIG mode whose first MIG device is `gpu-1-mig-0`, in the fake
    NVML; the inventory knows both by UUID, and a NIC. Yields the state file, the inventory and
    the MIG device's UUID."""
    profile = h100_node(gpus=1, nics=0)
    a100 = a100_mig_node(gpus=1, per_gpu=2).gpus[0]
    a100.index, a100.minor = 1, 1
    profile.gpus.append(a100)
    mig_uuid = a100.mig_devices[0].uuid
    state = tmp_path / "nvml.json"
    sim_nvml.write_state(profile, state)
    inventory = Inventory()
    inventory.replace("gpu", [
        Device("gpu-0", DeviceKind.GPU, gpu=GpuInfo(0, GPU_UUID, profile.gpus[0].pci_bus_id)),
        Device("gpu-1-mig-0", DeviceKind.MIG, gpu=GpuInfo(1, mig_uuid, a100.pci_bus_id, parent_uuid=a100.uuid)),
        Device("gpu-1-mig-1g-5gb-p1", DeviceKind.MIG, gpu=GpuInfo(1, "", a100.pci_bus_id)),  # not made yet
    ])  # fmt: skip
    inventory.replace("nic", [Device("nic-0", DeviceKind.NIC)])
    with sim_nvml.fake_pynvml_in_process(state):
        yield state, inventory, mig_uuid


def record(name: str, *devices: str, pods: tuple[str, ...] = (), state: PrepareState = PrepareState.COMPLETED):
    return ClaimRecord(
        "team-a", name, f"uid-{name}", state, tuple(DeviceRecord(("r",), "node-1", d) for d in devices), pods=pods
    )


def by_uid(*records: ClaimRecord) -> dict[str, ClaimRecord]:
    return {r.uid: r for r in records}


def test_a_full_gpu_gives_utilisation_and_memory_a_mig_device_memory_only(node) -> None:
    state, inventory, mig_uuid = node
    sim_nvml.set_usage(state, GPU_UUID, utilization=37, memory_used=5 * GIB)
    sim_nvml.set_usage(state, mig_uuid, memory_used=GIB)
    prepared = by_uid(record("train", "gpu-0", pods=("trainer",)), record("infer", "gpu-1-mig-0", pods=("server",)))

    got = ClaimGpuUsage(lambda: prepared, inventory.get, Path("/")).read()

    mig_total = 5 * GIB - 256 * 1024**2
    assert sorted(got, key=lambda u: u.claim) == [
        GpuUsage("team-a", "server", "infer", "gpu-1-mig-0", mig_uuid, None, GIB, mig_total),
        GpuUsage("team-a", "trainer", "train", "gpu-0", GPU_UUID, 0.37, 5 * GIB, 80 * GIB),
    ]


def test_holders_are_the_completed_records_pods() -> None:
    inventory = Inventory()
    inventory.replace("gpu", [Device("gpu-0", DeviceKind.GPU, gpu=GpuInfo(0, GPU_UUID, "0000:1b:00.0"))])
    prepared = by_uid(
        record("two-pods", "gpu-0", pods=("a", "b")),
        record("older-release", "gpu-0"),  # a record that names no pods
        record("two-shares", "gpu-0", "gpu-0", pods=("c",)),  # two shares of one GPU: one series
        record("half-done", "gpu-0", pods=("d",), state=PrepareState.STARTED),
        record("nic-and-gone", "nic-0", "gpu-9", pods=("e",)),
    )
    assert holders(prepared, inventory.get) == {
        GPU_UUID: [
            Holder("team-a", "", "older-release", "gpu-0", GPU_UUID),
            Holder("team-a", "a", "two-pods", "gpu-0", GPU_UUID),
            Holder("team-a", "b", "two-pods", "gpu-0", GPU_UUID),
            Holder("team-a", "c", "two-shares", "gpu-0", GPU_UUID),
        ]
    }


def test_a_lost_gpu_and_an_unmade_partition_have_no_series(node) -> None:
    state, inventory, _ = node
    profile = sim_nvml.read_state(state)
    profile.gpus[0].lost = True
    sim_nvml.write_state(profile, state)
    prepared = by_uid(record("a", "gpu-0", pods=("p",)), record("b", "gpu-1-mig-0", "gpu-1-mig-1g-5gb-p1", pods=("q",)))

    got = ClaimGpuUsage(lambda: prepared, inventory.get, Path("/")).read()

    assert [(u.claim, u.device) for u in got] == [("b", "gpu-1-mig-0")]


def test_no_series_while_nvml_is_released(node) -> None:
    _, inventory, _ = node
    prepared = by_uid(record("a", "gpu-0", pods=("p",)))
    usage = ClaimGpuUsage(lambda: prepared, inventory.get, Path("/"))
    assert NVML_ACCESS.set_released("a GPU reset", timeout=5)
    try:
        assert usage.read() == []
    finally:
        NVML_ACCESS.set_released("", timeout=5)
    assert [u.pod for u in usage.read()] == ["p"]


def test_a_stuck_nvml_costs_scrapes_their_series_never_a_second_thread(node, monkeypatch) -> None:
    _, inventory, _ = node
    prepared = by_uid(record("a", "gpu-0", pods=("p",)))
    usage = ClaimGpuUsage(lambda: prepared, inventory.get, Path("/"), timeout=0.2)
    entered, unblock, calls = threading.Event(), threading.Event(), []

    def stuck(driver_root: Path) -> object:
        calls.append(driver_root)
        entered.set()
        unblock.wait(30)
        raise NvmlUnavailable("unblocked")

    monkeypatch.setattr(usage_module, "init_nvml", stuck)
    assert usage.read() == []  # the scrape's wait ends at the timeout
    assert entered.is_set()
    assert usage.read() == []  # at once: the stuck read is still running
    assert len(calls) == 1

    unblock.set()
    for t in threading.enumerate():
        if t.name == "gpu-usage":
            t.join(10)
    monkeypatch.undo()
    assert [u.pod for u in usage.read()] == ["p"]


def samples(metrics: Metrics) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(metrics.render().decode())
        for s in family.samples
        if s.name.startswith("tandem_claim_gpu_")
    }


def test_series_appear_for_the_pod_and_go_with_its_claim(node) -> None:
    state, inventory, mig_uuid = node
    sim_nvml.set_usage(state, GPU_UUID, utilization=50, memory_used=GIB)
    prepared = by_uid(record("train", "gpu-0", pods=("trainer",)), record("infer", "gpu-1-mig-0", pods=("server",)))
    usage = ClaimGpuUsage(lambda: prepared, inventory.get, Path("/"))
    metrics = Metrics(inventory, ScrapeSources(claim_gpus=usage.read))

    gpu = {"namespace": "team-a", "pod": "trainer", "claim": "train", "device": "gpu-0", "uuid": GPU_UUID}
    mig = {"namespace": "team-a", "pod": "server", "claim": "infer", "device": "gpu-1-mig-0", "uuid": mig_uuid}
    key = lambda name, labels: (name, frozenset(labels.items()))  # noqa: E731
    assert samples(metrics) == {
        key("tandem_claim_gpu_utilization_ratio", gpu): 0.5,
        key("tandem_claim_gpu_memory_used_bytes", gpu): GIB,
        key("tandem_claim_gpu_memory_total_bytes", gpu): 80 * GIB,
        key("tandem_claim_gpu_memory_used_bytes", mig): 0,
        key("tandem_claim_gpu_memory_total_bytes", mig): 5 * GIB - 256 * 1024**2,
    }

    del prepared["uid-train"], prepared["uid-infer"]  # unprepared: the pods went
    assert samples(metrics) == {}


def test_set_usage_refuses_a_mig_devices_utilisation(node) -> None:
    state, _, mig_uuid = node
    with pytest.raises(ValueError, match="MIG device"):
        sim_nvml.set_usage(state, mig_uuid, utilization=10)
