"""The PCIe switch a device sits behind, its upstream path and PCIe distances, read from sysfs
trees laid out as the kernel lays them out (rendered by the simulation, or built by hand)."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import pytest

from driver.discovery.pcie import (
    PORT_DOWNSTREAM,
    PORT_ROOT,
    PORT_UPSTREAM,
    device_path,
    distance,
    pcie_path,
    port_type,
    shared_nodes,
)
from sim.pcie import bridge_config, hgx_board
from sim.profile import h100_node
from sim.sysfs import render_node

ROOT, RP, USP, DSP, EP = "pci0000:15", "0000:15:01.0", "0000:16:00.0", "0000:17:00.0", "0000:18:00.0"


def _chain(sysfs: Path, *bridges: tuple[str, bytes | None], endpoint: str = EP) -> None:
    """An endpoint below `bridges` (name, config bytes or None for no config file)."""
    directory = sysfs / "devices" / ROOT
    for name, config in bridges:
        directory = directory / name
        directory.mkdir(parents=True)
        if config is not None:
            (directory / "config").write_bytes(config)
    (directory / endpoint).mkdir(parents=True)
    link = sysfs / "bus" / "pci" / "devices" / endpoint
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(os.path.relpath(directory / endpoint, link.parent))


def test_every_gpu_and_nic_of_the_hgx_board_knows_its_switch(tmp_path: Path) -> None:
    profile = h100_node()
    render_node(profile, tmp_path / "sys", tmp_path / "dev")
    for device in [*(g.pci_bus_id for g in profile.gpus), *(n.pci_address for n in profile.nics)]:
        path = pcie_path(tmp_path / "sys", device)
        assert path is not None
        assert len(path.nodes) == 4  # host bridge, root port, upstream port, downstream port
        assert path.switch == path.nodes[2]


def test_config_space_decides_and_a_pcie_to_pci_bridge_is_no_switch(tmp_path: Path) -> None:
    """Structurally the second bridge would be an upstream port; its config space says it is a
    PCIe-to-PCI bridge (type 7), so the device sits behind no switch."""
    _chain(tmp_path, (RP, bridge_config(0x8086, 1, PORT_ROOT)), (USP, bridge_config(0x10B5, 2, 0x7)))
    path = pcie_path(tmp_path, EP)
    assert path is not None and path.nodes == (ROOT, RP, USP) and path.switch is None


def test_structure_decides_when_config_space_is_cut_short(tmp_path: Path) -> None:
    """An unprivileged reader gets only the first 64 bytes: the capability is out of reach."""
    short = bridge_config(0x10B5, 2, PORT_DOWNSTREAM)[:64]
    _chain(tmp_path, (RP, short), (USP, short), (DSP, None))
    path = pcie_path(tmp_path, EP)
    assert path is not None and path.switch == USP


def test_nearest_of_two_switches_is_the_one_behind(tmp_path: Path) -> None:
    lower_usp, lower_dsp = "0000:18:00.0", "0000:19:00.0"
    types = [PORT_ROOT, PORT_UPSTREAM, PORT_DOWNSTREAM, PORT_UPSTREAM, PORT_DOWNSTREAM]
    names = [RP, USP, DSP, lower_usp, lower_dsp]
    _chain(tmp_path, *((n, bridge_config(0x10B5, 2, t)) for n, t in zip(names, types, strict=True)),
           endpoint="0000:1a:00.0")  # fmt: skip
    path = pcie_path(tmp_path, "0000:1a:00.0")
    assert path is not None and path.switch == lower_usp


@pytest.mark.parametrize(
    ("config", "want"),
    [
        (bridge_config(1, 2, PORT_UPSTREAM), PORT_UPSTREAM),
        (b"", None),
        (bridge_config(1, 2, PORT_UPSTREAM)[:0x40], None),  # the capability is beyond what was read
        (bytes(256), None),  # no capability list
    ],
)
def test_port_type(config: bytes, want: int | None) -> None:
    assert port_type(config) == want


def test_a_capability_list_that_loops_ends() -> None:
    config = bytearray(256)
    struct.pack_into("<H", config, 0x06, 0x10)
    config[0x34] = 0x40
    config[0x40], config[0x41] = 0x01, 0x40  # power management, pointing at itself
    assert port_type(bytes(config)) is None


def test_device_path_names_host_bridge_bridges_and_device(tmp_path: Path) -> None:
    _chain(tmp_path, (RP, None), (USP, None), (DSP, None))
    assert device_path(tmp_path, EP) == (ROOT, RP, USP, DSP, EP)
    assert device_path(tmp_path, "0000:99:00.0") is None


def test_distances() -> None:
    a = (ROOT, RP, USP, "0000:17:00.0")
    b = (ROOT, RP, USP, "0000:17:01.0")
    c = (ROOT, "0000:15:02.0", "0000:1e:00.0", "0000:1f:00.0")
    assert distance(a, b) == 4 and shared_nodes(a, b) == 3  # up to the switch and down
    assert distance(a, c) == 8 and shared_nodes(a, c) == 1  # through the root complex
    assert distance(a, ("pci0000:95",)) is None and distance(a, ()) is None


def test_board_has_two_gpus_and_a_nic_per_switch_two_switches_per_root() -> None:
    gpus, nics = hgx_board(8, 4)
    by_switch: dict[str, list[str]] = {}
    for name, slot in [*((f"gpu{i}", s) for i, s in enumerate(gpus)), *((f"nic{j}", s) for j, s in enumerate(nics))]:
        by_switch.setdefault(slot.bridges[1], []).append(name)
    assert sorted(by_switch.values()) == [["gpu0", "gpu1", "nic0"], ["gpu2", "gpu3", "nic1"],
                                          ["gpu4", "gpu5", "nic2"], ["gpu6", "gpu7", "nic3"]]  # fmt: skip
    assert [s.pcie_root for s in nics] == ["pci0000:15", "pci0000:15", "pci0000:95", "pci0000:95"]
    assert [s.numa_node for s in nics] == [0, 0, 1, 1]
