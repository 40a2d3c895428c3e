"""Standard PCI topology attributes read from hand-built sysfs trees laid out like the kernel's."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from driver.discovery.pcie import PCIE_PATH, device_path
from driver.discovery.topology import (
    is_pci_bus_id,
    numa_node,
    numa_node_list,
    pci_bus_id,
    topology,
)
from driver.model import NUMA_NODE, PCI_BUS_ID, PCIE_ROOT

BDF = "0000:16:00.0"


def add_function(sysfs: Path, bdf: str = BDF, chain: str = "pci0000:15/0000:15:01.0", numa: str | None = "1") -> Path:
    """A PCI function under devices/<chain>/<bdf> with the kernel's relative bus/pci/devices link."""
    real = sysfs / "devices" / chain / bdf
    real.mkdir(parents=True)
    if numa is not None:
        (real / "numa_node").write_text(numa + "\n")
    link = sysfs / "bus" / "pci" / "devices" / bdf
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(os.path.relpath(real, link.parent))
    return real


def add_numa(sysfs: Path, distances: list[list[int]], sockets: list[int | None]) -> None:
    """NUMA nodes with SLIT rows; socket None makes a memory-only node (no CPUs)."""
    for n, row in enumerate(distances):
        node = sysfs / "devices" / "system" / "node" / f"node{n}"
        node.mkdir(parents=True)
        (node / "distance").write_text(" ".join(map(str, row)) + "\n")
        if sockets[n] is None:
            (node / "cpulist").write_text("\n")
            continue
        (node / "cpulist").write_text(f"{2 * n}-{2 * n + 1}\n")
        for cpu in (2 * n, 2 * n + 1):
            topo = sysfs / "devices" / "system" / "cpu" / f"cpu{cpu}" / "topology"
            topo.mkdir(parents=True)
            (topo / "physical_package_id").write_text(f"{sockets[n]}\n")


@pytest.mark.parametrize(
    ("raw", "want"),
    [
        (b"00000000:1B:00.0\x00\x00", "0000:1b:00.0"),
        ("00000000:1B:00.0", "0000:1b:00.0"),
        ("0000:1B:00.0", "0000:1b:00.0"),
        ("0000:3b:00.1", "0000:3b:00.1"),
        ("0000FFFF:3B:00.0", "ffff:3b:00.0"),
    ],
)
def test_pci_bus_id_normalises_nvml_and_sysfs_forms(raw: str | bytes, want: str) -> None:
    assert pci_bus_id(raw) == want
    assert is_pci_bus_id(want)


@pytest.mark.parametrize("raw", ["", "0000:1b:00", "1b:00.0", "0000:1b:00.0.0", "0000:zz:00.0", "00010000:3B:00.0"])
def test_pci_bus_id_rejects_malformed(raw: str) -> None:
    with pytest.raises(ValueError):
        pci_bus_id(raw)


def test_device_path_from_relative_link(tmp_path: Path) -> None:
    add_function(tmp_path)
    assert device_path(tmp_path, BDF) == ("pci0000:15", "0000:15:01.0", BDF)
    assert topology(tmp_path, BDF, list_form=False).attributes[PCIE_ROOT] == "pci0000:15"


def test_device_path_of_function_on_root_bus(tmp_path: Path) -> None:
    add_function(tmp_path, bdf="0000:00:02.0", chain="pci0000:00")
    assert device_path(tmp_path, "0000:00:02.0") == ("pci0000:00", "0000:00:02.0")


def test_device_path_rejects_absolute_link(tmp_path: Path) -> None:
    real = add_function(tmp_path)
    link = tmp_path / "bus" / "pci" / "devices" / BDF
    link.unlink()
    link.symlink_to(real)  # absolute: the kernel never makes these
    assert device_path(tmp_path, BDF) is None


def test_device_path_rejects_target_outside_devices_pci(tmp_path: Path) -> None:
    add_function(tmp_path, chain="platform/soc")
    assert device_path(tmp_path, BDF) is None


def test_device_path_rejects_target_naming_another_function(tmp_path: Path) -> None:
    real = add_function(tmp_path)
    link = tmp_path / "bus" / "pci" / "devices" / "0000:16:00.1"
    link.symlink_to(os.path.relpath(real, link.parent))
    assert device_path(tmp_path, "0000:16:00.1") is None


def test_topology_of_missing_link_or_bad_bdf(tmp_path: Path) -> None:
    assert device_path(tmp_path, BDF) is None
    add_function(tmp_path)
    assert topology(tmp_path, "0000:16:00.0 ", list_form=False).attributes == {}
    assert topology(tmp_path, "0000:16:00.0/../x", list_form=False).attributes == {}


@pytest.mark.parametrize(
    ("content", "want"),
    [("1", 1), ("0", 0), ("1023", 1023), ("-1", None), ("1024", None), ("abc", None), ("", None), ("-7", None)],
)
def test_numa_node_values(tmp_path: Path, content: str, want: int | None) -> None:
    add_function(tmp_path, numa=content)
    assert numa_node(tmp_path, BDF) == want


def test_numa_node_missing_file(tmp_path: Path) -> None:
    add_function(tmp_path, numa=None)
    assert numa_node(tmp_path, BDF) is None


def test_numa_node_list_same_socket_at_minimum_distance(tmp_path: Path) -> None:
    # Two sockets of two nodes each (sub-NUMA clustering); node 0's socket peer is node 1.
    add_numa(
        tmp_path,
        [[10, 12, 20, 20], [12, 10, 20, 20], [20, 20, 10, 12], [20, 20, 12, 10]],
        [0, 0, 1, 1],
    )
    assert numa_node_list(tmp_path, 0) == [0, 1]
    assert numa_node_list(tmp_path, 3) == [3, 2]


def test_numa_node_list_only_nearest_and_ties(tmp_path: Path) -> None:
    # One socket of four nodes: node 0 is at 11 from nodes 1 and 2, at 12 from node 3.
    add_numa(
        tmp_path,
        [[10, 11, 11, 12], [11, 10, 12, 11], [11, 12, 10, 11], [12, 11, 11, 10]],
        [0, 0, 0, 0],
    )
    assert numa_node_list(tmp_path, 0) == [0, 1, 2]


def test_numa_node_list_ignores_other_socket_even_when_nearer(tmp_path: Path) -> None:
    add_numa(tmp_path, [[10, 11, 21], [11, 10, 21], [21, 21, 10]], [0, 1, 0])
    assert numa_node_list(tmp_path, 0) == [0, 2]


def test_numa_node_list_skips_nodes_without_cpus(tmp_path: Path) -> None:
    add_numa(tmp_path, [[10, 11, 12], [11, 10, 12], [12, 12, 10]], [0, None, 0])
    assert numa_node_list(tmp_path, 0) == [0, 2]


def test_numa_node_list_reads_a_socket_from_the_first_cpu_of_a_huge_range(tmp_path: Path) -> None:
    """Only the first CPU of a node's cpulist is read: a corrupt range of four billion CPUs costs
    no more than one of two."""
    add_numa(tmp_path, [[10, 11], [11, 10]], [0, 0])
    (tmp_path / "devices/system/node/node0/cpulist").write_text("0-4294967295\n")
    assert numa_node_list(tmp_path, 1) == [1, 0]


@pytest.mark.parametrize("cpulist", ["3-1", "-1", "0-", "1-2-3", "a", "0x1", "1_0", "0-3:2/4"])
def test_a_cpulist_that_is_not_one_is_refused_saying_so(tmp_path: Path, caplog, cpulist: str) -> None:
    add_numa(tmp_path, [[10, 11], [11, 10]], [0, 0])
    path = tmp_path / "devices/system/node/node0/cpulist"
    path.write_text(cpulist + "\n")
    with caplog.at_level(logging.WARNING, logger="driver.discovery.topology"):
        assert numa_node_list(tmp_path, 1) == [1]  # node 0's socket is unknown: no peer of node 1
    assert f"socket of NUMA node 0: {path} is not a CPU list: {cpulist!r} is neither" in caplog.text


def test_numa_node_list_falls_back_to_own_node(tmp_path: Path) -> None:
    add_numa(tmp_path, [[10, 11], [11, 10]], [0, 0])
    (tmp_path / "devices/system/node/node0/distance").write_text("10 eleven\n")
    assert numa_node_list(tmp_path, 0) == [0]
    (tmp_path / "devices/system/node/node0/distance").write_text("10 11 12\n")  # more entries than nodes
    assert numa_node_list(tmp_path, 0) == [0]
    assert numa_node_list(tmp_path, 1) == [1, 0]


def test_topology_attributes_scalar_and_list(tmp_path: Path) -> None:
    add_function(tmp_path, numa="0")
    add_numa(tmp_path, [[10, 11], [11, 10]], [0, 0])
    scalar = topology(tmp_path, BDF, list_form=False)
    assert scalar.attributes == {PCI_BUS_ID: BDF, PCIE_ROOT: "pci0000:15", NUMA_NODE: 0}
    assert scalar.pcie_path == ("pci0000:15", "0000:15:01.0")  # for pairing, whatever the form
    listed = topology(tmp_path, BDF, list_form=True).attributes
    assert listed[NUMA_NODE] == (0, 1)
    assert listed[PCIE_PATH] == ("pci0000:15", "0000:15:01.0")


def test_topology_attributes_leave_out_what_cannot_be_read(tmp_path: Path) -> None:
    add_function(tmp_path, numa="-1")
    assert topology(tmp_path, BDF, list_form=False).attributes == {PCI_BUS_ID: BDF, PCIE_ROOT: "pci0000:15"}
    missing = topology(tmp_path, "0000:99:00.0", list_form=False)
    assert missing.attributes == {PCI_BUS_ID: "0000:99:00.0"}
    assert missing.pcie_path == ()
    assert topology(tmp_path, "not-a-bdf", list_form=False).attributes == {}
