"""The grey monitor against the simulated node in process (fake NVML, rendered sysfs): a GPU's
verdict reaches each device published of it (its MIG devices), NICs are judged against their
identical peers, a released NVML is not opened and leaves the verdicts as they were, and a device
gone from the inventory takes its conditions with it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from driver.discovery.gpu.discover import GpuDiscovery
from driver.discovery.nic.discover import NicDiscovery
from driver.health.grey_monitor import GreyMonitor
from driver.health.thresholds import GreyThresholds
from driver.inventory.store import Inventory
from driver.node.nvml import NVML_ACCESS
from sim import nvml as sim_nvml
from sim.grey import set_gpu_signals, set_netdev_speed
from sim.profile import NodeProfile, a100_mig_node, h100_node
from sim.sysfs import render_node

T = GreyThresholds(period=1, window=4, hold=2, recovery=2, rising_reads=2)


class Node:
    def __init__(self, root: Path, profile: NodeProfile) -> None:
        self.root, self.profile = root, profile
        self.sysfs, self.state = root / "sys", root / "nvml.json"
        render_node(profile, self.sysfs, root / "dev", root / "proc")
        sim_nvml.write_state(profile, self.state, proc_root=root / "proc")
        self.inventory = Inventory()
        self.now = 0.0

    def discover(self) -> None:
        self.inventory.replace("gpu", GpuDiscovery(self.sysfs, proc_root=self.root / "proc").discover())
        self.inventory.replace("nic", NicDiscovery(self.sysfs, netlink=False).discover())

    def monitor(self) -> GreyMonitor:
        return GreyMonitor(
            self.inventory, T, sysfs_root=self.sysfs, driver_root=self.root, clock=self.clock, wall_clock=self.clock
        )

    def clock(self) -> float:
        return self.now

    def rounds(self, monitor: GreyMonitor, n: int) -> None:
        for _ in range(n):
            monitor.poll()
            self.now += T.period

    def keys(self, device: str) -> set[str]:
        d = self.inventory.get(device)
        return {t.key for t in d.taints} if d else set()


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    yield Node(tmp_path, h100_node("grey", gpus=2, nics=2))


@contextlib.contextmanager
def _in_process(node: Node) -> Iterator[None]:
    with sim_nvml.fake_pynvml_in_process(node.state) as pynvml:
        pynvml.nvmlInit()
        try:
            node.discover()
            yield
        finally:
            pynvml.nvmlShutdown()


def test_a_gpu_verdict_reaches_every_mig_device_of_it(tmp_path: Path) -> None:
    node = Node(tmp_path, a100_mig_node("mig", gpus=2, per_gpu=3))
    with _in_process(node):
        monitor = node.monitor()
        node.rounds(monitor, 1)
        set_gpu_signals(node.state, node.profile.gpus[1].uuid, pcie_link_width=8)
        node.rounds(monitor, 4)
        tainted = {d.name for d in node.inventory.devices() if "tandem.dev/pcie-degraded" in node.keys(d.name)}
        assert tainted and all(name.startswith("gpu-1-mig-") for name in tainted) and len(tainted) == 3
        assert len(monitor.readings()) == 2, "counters by GPU, never by each of its MIG devices"


def test_a_nic_slower_than_its_identical_peer_is_tainted(node: Node) -> None:
    with _in_process(node):
        monitor = node.monitor()
        set_netdev_speed(node.sysfs, node.profile.nics[1].ifname, 200000)
        node.rounds(monitor, 4)
        slow = next(d.name for d in node.inventory.devices() if d.nic and d.nic.ifname == node.profile.nics[1].ifname)
        fast = next(d.name for d in node.inventory.devices() if d.nic and d.nic.ifname == node.profile.nics[0].ifname)
        assert node.keys(slow) == {"tandem.dev/link-slow"} and node.keys(fast) == set()


def test_a_released_nvml_is_not_opened_and_the_verdicts_stand(node: Node) -> None:
    with _in_process(node):
        monitor = node.monitor()
        set_gpu_signals(node.state, node.profile.gpus[0].uuid, pcie_link_width=8)
        node.rounds(monitor, 4)
        assert node.keys("gpu-0") == {"tandem.dev/pcie-degraded"}
        assert NVML_ACCESS.set_released("gpu-0 is released", timeout=5)
        try:
            opened = NVML_ACCESS.open_sessions()
            set_gpu_signals(node.state, node.profile.gpus[0].uuid, pcie_link_width=16)
            node.rounds(monitor, 5)  # well for longer than recovery, but not read
            assert node.keys("gpu-0") == {"tandem.dev/pcie-degraded"}
            assert NVML_ACCESS.open_sessions() == opened
        finally:
            assert NVML_ACCESS.set_released("", timeout=5)
        node.rounds(monitor, 4)
        assert node.keys("gpu-0") == set()


def test_a_device_gone_from_the_inventory_takes_its_conditions(node: Node) -> None:
    with _in_process(node):
        monitor = node.monitor()
        set_gpu_signals(node.state, node.profile.gpus[0].uuid, pcie_link_width=8)
        node.rounds(monitor, 4)
        assert node.keys("gpu-0")
        node.inventory.replace("gpu", [d for d in node.inventory.devices() if d.name == "gpu-1"])
        node.rounds(monitor, 1)
        assert "gpu-0" not in monitor.readings() and node.inventory.get("gpu-0") is None
        node.discover()  # back: it starts clean, without the old verdict
        assert node.keys("gpu-0") == set()
