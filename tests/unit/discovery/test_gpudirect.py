"""GPUDirect RDMA readiness from what the simulated node's kernel and NVIDIA driver show, and the
attributes GPUs and NICs publish from it."""

from __future__ import annotations

from pathlib import Path

import pytest

from driver.discovery.gpudirect import (
    GPUDIRECT,
    GPUDIRECT_MODE,
    MODE_DMABUF,
    MODE_PEERMEM,
    GpuDirect,
    gpu_attributes,
    nic_attributes,
    read_gpudirect,
)
from driver.discovery.nic.discover import NicDiscovery
from sim.gpudirect import nvrm_version_line
from sim.profile import NodeProfile, h100_node
from sim.sysfs import render_node


def _node(tmp_path: Path, **settings: object) -> NodeProfile:
    profile = h100_node(gpus=2, nics=1)
    for key, value in settings.items():
        setattr(profile, key, value)
    render_node(profile, tmp_path / "sys", tmp_path / "dev", tmp_path / "proc")
    return profile


@pytest.mark.parametrize(
    ("settings", "peermem", "dmabuf"),
    [
        ({}, False, True),  # open modules on 6.8
        ({"nvidia_peermem": True}, True, True),
        ({"nvidia_open_modules": False}, False, False),
        ({"nvidia_open_modules": False, "nvidia_peermem": True}, True, False),
        ({"kernel_release": "5.10.0-32-amd64"}, False, False),  # before RDMA dma-buf regions
        ({"kernel_release": "5.12.0"}, False, True),
        ({"driver_version": "510.108.03"}, False, False),  # open modules before dma-buf export
    ],
)
def test_modes(tmp_path: Path, settings: dict[str, object], peermem: bool, dmabuf: bool) -> None:
    _node(tmp_path, **settings)
    gd = read_gpudirect(tmp_path / "sys", tmp_path / "proc")
    assert (gd.peermem, gd.dmabuf) == (peermem, dmabuf)
    assert bool(gd.why) == (not peermem and not dmabuf)


def test_a_node_without_the_nvidia_driver_has_none(tmp_path: Path) -> None:
    gd = read_gpudirect(tmp_path / "sys", tmp_path / "proc")
    assert not gd.peermem and not gd.dmabuf
    assert "NVIDIA kernel module is not loaded" in gd.why


def test_the_version_line_of_the_open_modules_is_recognised(tmp_path: Path) -> None:
    (tmp_path / "proc/driver/nvidia").mkdir(parents=True)
    (tmp_path / "proc/sys/kernel").mkdir(parents=True)
    (tmp_path / "proc/sys/kernel/osrelease").write_text("6.8.0\n")
    (tmp_path / "proc/driver/nvidia/version").write_text(nvrm_version_line("535.54", open_modules=True))
    assert read_gpudirect(tmp_path / "sys", tmp_path / "proc").dmabuf


def test_attributes_prefer_dma_buf_and_need_an_able_nic_driver() -> None:
    both, peermem, none = GpuDirect(True, True), GpuDirect(True, False), GpuDirect(False, False)
    assert gpu_attributes(both) == {GPUDIRECT: True, GPUDIRECT_MODE: MODE_DMABUF}
    assert gpu_attributes(peermem) == {GPUDIRECT: True, GPUDIRECT_MODE: MODE_PEERMEM}
    assert gpu_attributes(none) == {GPUDIRECT: False}
    assert nic_attributes(GpuDirect(False, True), "mlx5_core")[GPUDIRECT] is True
    assert nic_attributes(GpuDirect(False, True), "ice") == {GPUDIRECT: False}  # E810 (irdma): not claimed
    assert nic_attributes(both, "ice") == {GPUDIRECT: True, GPUDIRECT_MODE: MODE_PEERMEM}


def test_nics_publish_it(tmp_path: Path) -> None:
    _node(tmp_path, nvidia_open_modules=False, nvidia_peermem=True)
    (nic,) = NicDiscovery(tmp_path / "sys", netlink=False, proc_root=tmp_path / "proc").discover()
    assert (nic.attributes[GPUDIRECT], nic.attributes[GPUDIRECT_MODE]) == (True, MODE_PEERMEM)
