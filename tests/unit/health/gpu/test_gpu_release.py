"""`tandemctl release`/`reacquire` below the status socket: what is durable and how it comes back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from driver.health.cordon import CordonError
from driver.health.gpu.release import GpuReleases, ReleaseError
from driver.inventory.store import Inventory
from driver.model import Device, DeviceKind, GpuInfo, TaintEffect
from driver.node.nvml import NvmlAccess


def _gpu(minor: int) -> Device:
    return Device(f"gpu-{minor}", DeviceKind.GPU, gpu=GpuInfo(minor=minor, uuid=f"GPU-{minor}", pci_bus_id=""))


def _mig(name: str, parent: int) -> Device:
    info = GpuInfo(minor=parent, uuid=f"MIG-{name}", pci_bus_id="", parent_uuid=f"GPU-{parent}", mig_gi=1, mig_ci=0)
    return Device(name, DeviceKind.MIG, gpu=info)


def _taints(inv: Inventory, device: str) -> set[tuple[str, str, TaintEffect]]:
    d = inv.get(device)
    assert d is not None
    return {(t.key, t.value, t.effect) for t in d.taints}


def test_a_release_survives_a_restart_and_is_taken_back_by_name(tmp_path: Path) -> None:
    inv = Inventory()
    inv.replace("gpu", [_gpu(0), _mig("gpu-1-mig-a", 1), _mig("gpu-1-mig-b", 1)])
    access = NvmlAccess()
    releases = GpuReleases(tmp_path, inv, access=access)
    releases.load()
    assert releases.release("gpu-1-mig-a", "reset", "bob") == ["gpu-1-mig-a", "gpu-1-mig-b"]  # the whole GPU
    assert access.released() == "NVML is released while gpu-1-mig-a is released (tandemctl release)"
    assert _taints(inv, "gpu-1-mig-b") == {("tandem.dev/released", "gpu", TaintEffect.NO_SCHEDULE)}
    # NVML opens every GPU: the others are let go too, stay schedulable and say why.
    assert _taints(inv, "gpu-0") == {("tandem.dev/unmonitored", "", TaintEffect.NONE)}
    assert "gpu-1-mig-a is released" in inv.get("gpu-0").health_message  # type: ignore[union-attr]
    assert inv.get("gpu-1-mig-b").health_message.startswith("released by bob at ")  # type: ignore[union-attr]

    # The daemon restarts: it discovers no GPUs while anything is released, but remembers.
    restarted_inv, restarted_access = Inventory(), NvmlAccess()
    again = GpuReleases(tmp_path, restarted_inv, access=restarted_access)
    assert [(r.gpu, r.device, r.reason) for r in again.load()] == [("GPU-1", "gpu-1-mig-a", "reset")]
    assert restarted_access.released()
    assert any("gpu-1-mig-a" in p and "reset" in p for p in again.problems())
    assert [r.gpu for r in again.reacquire("gpu-1-mig-a")] == ["GPU-1"]  # by the name it was released by
    assert restarted_access.released() == "" and again.current() == []
    assert json.loads((tmp_path / "released.json").read_text())["releases"] == []


def test_reacquire_tells_what_it_took_back_and_calls_back_once(tmp_path: Path) -> None:
    inv = Inventory()
    inv.replace("gpu", [_gpu(0), _gpu(1)])
    calls: list[str] = []
    releases = GpuReleases(tmp_path, inv, access=NvmlAccess(), on_reacquire=lambda: calls.append("x"))
    releases.release("gpu-0", "a")
    releases.release("", "b")
    assert _taints(inv, "gpu-0") == {("tandem.dev/released", "gpu", TaintEffect.NO_SCHEDULE)}
    assert _taints(inv, "gpu-1") == {("tandem.dev/released", "nvml", TaintEffect.NO_SCHEDULE)}
    assert releases.reacquire("gpu-1") == []  # gpu-1 was never released on its own
    assert calls == []
    assert sorted(r.reason for r in releases.reacquire("")) == ["a", "b"]
    assert calls == ["x"] and not inv.get("gpu-0").taints  # type: ignore[union-attr]


def test_refusals_and_a_corrupt_file(tmp_path: Path) -> None:
    inv = Inventory()
    inv.replace("gpu", [_gpu(0)])
    inv.replace("nic", [Device("nic-x", DeviceKind.NIC)])
    releases = GpuReleases(tmp_path, inv, access=NvmlAccess())
    with pytest.raises(ReleaseError, match="nic-x is not a GPU"):
        releases.release("nic-x", "x")
    with pytest.raises(CordonError, match="reason must not be empty"):  # the check cordons use too
        releases.release("gpu-0", "  ")
    (tmp_path / "released.json").write_text("{nope")
    assert releases.load() == []
    assert list(tmp_path.glob("released.json.corrupt-*"))


def test_a_file_without_a_version_is_read_and_one_of_a_newer_format_set_aside(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An upgrade from a release that wrote no version keeps its releases; a downgrade sets aside
    the newer file whole rather than misread it, and goes on as for an unreadable file."""
    inv = Inventory()
    inv.replace("gpu", [_gpu(0)])
    path = tmp_path / "released.json"
    path.write_text(json.dumps({"releases": [{"gpu": "GPU-0", "device": "gpu-0", "reason": "reset"}]}))
    releases = GpuReleases(tmp_path, inv, access=NvmlAccess())
    assert [(r.gpu, r.reason) for r in releases.load()] == [("GPU-0", "reset")]
    releases.release("", "upgrade")
    assert json.loads(path.read_text())["version"] == 1

    content = json.dumps({"version": 2, "releases": {"GPU-0": {"why": "reset"}}})
    path.write_text(content)
    assert GpuReleases(tmp_path, Inventory(), access=NvmlAccess()).load() == []
    [aside] = tmp_path.glob("released.json.newer-*")
    assert aside.read_text() == content
    assert "format version 2 is newer" in caplog.text
