"""GPU and MIG discovery, run in-process against the fake pynvml on a rendered simulated node."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import pytest

from driver.discovery.gpu.attributes import binary_quantity, cuda_version, fit_limits, semver
from driver.discovery.gpu.discover import GpuDiscovery
from driver.discovery.gpu.mig import MigName, mig_device_name, parse_mig_device_name, profile_label
from driver.discovery.gpudirect import GPUDIRECT, GPUDIRECT_MODE, MODE_DMABUF
from driver.discovery.pcie import PCIE_SWITCH
from driver.model import NUMA_NODE, PCI_BUS_ID, PCIE_ROOT, AttrValue, Device, DeviceKind, Version
from driver.node.nvml import NvmlUnavailable
from driver.resource_api import MAX_ATTRIBUTE_VALUES, MAX_ATTRIBUTES_AND_CAPACITIES
from sim import nvml as sim_nvml
from sim.profile import MigProfileSpec, NodeProfile, a100_mig_node, h100_node
from sim.sysfs import mig_ci_cap_minor, mig_gi_cap_minor, render_node

NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_UNKNOWN = 999

Discover = Callable[..., list[Device]]


@pytest.fixture
def fake_nvml(tmp_path: Path) -> Iterator[ModuleType]:
    with sim_nvml.fake_pynvml_in_process(tmp_path / "nvml.json") as module:
        yield module


@pytest.fixture
def node(tmp_path: Path, fake_nvml: ModuleType) -> Callable[[NodeProfile], Discover]:
    """Render a profile (sysfs, /dev, /proc, NVML state); return a function that discovers it."""

    def load(profile: NodeProfile) -> Discover:
        render_node(profile, tmp_path / "sys", tmp_path / "dev", tmp_path / "proc")
        sim_nvml.write_state(profile, tmp_path / "nvml.json")

        def discover(list_attributes: bool = False) -> list[Device]:
            return GpuDiscovery(tmp_path / "sys", list_attributes, proc_root=tmp_path / "proc").discover()

        return discover

    return load


def by_name(devices: list[Device]) -> dict[str, Device]:
    return {d.name: d for d in devices}


def test_full_gpus(node: Callable[[NodeProfile], Discover]) -> None:
    profile = h100_node(nics=0)
    devices = node(profile)()
    assert [d.name for d in devices] == [f"gpu-{i}" for i in range(8)]
    for device, spec in zip(devices, profile.gpus, strict=True):
        assert device.kind is DeviceKind.GPU
        assert device.attributes == {
            "type": "gpu",
            "uuid": spec.uuid,
            "productName": "NVIDIA H100 80GB HBM3",
            "brand": "Nvidia",
            "architecture": "Hopper",
            "cudaComputeCapability": Version("9.0.0"),
            "driverVersion": Version("580.95.5"),
            "cudaDriverVersion": Version("13.0.0"),
            PCI_BUS_ID: spec.pci_bus_id,
            PCIE_ROOT: spec.pcie_root,
            PCIE_SWITCH: spec.pcie_bridges[1],  # the switch's upstream port
            NUMA_NODE: spec.numa_node,
            GPUDIRECT: True,  # the profile's open kernel modules on kernel 6.8
            GPUDIRECT_MODE: MODE_DMABUF,
        }
        assert device.pcie_path == (spec.pcie_root, *spec.pcie_bridges)
        assert device.capacity == {"memory": "80Gi"}
        assert device.gpu is not None
        assert (device.gpu.minor, device.gpu.uuid, device.gpu.pci_bus_id) == (spec.minor, spec.uuid, spec.pci_bus_id)
        assert device.gpu.mig_gi is None and device.gpu.parent_uuid == ""


def test_numa_node_not_published_when_platform_reports_none(node: Callable[[NodeProfile], Discover]) -> None:
    profile = h100_node(gpus=2, nics=0)
    profile.gpus[1].numa_node = -1
    devices = by_name(node(profile)(list_attributes=True))
    assert devices["gpu-0"].attributes[NUMA_NODE] == (0,)
    assert NUMA_NODE not in devices["gpu-1"].attributes
    assert devices["gpu-1"].attributes[PCIE_ROOT] == profile.gpus[1].pcie_root


def test_one_broken_gpu_does_not_hide_the_others(
    node: Callable[[NodeProfile], Discover], caplog: pytest.LogCaptureFixture
) -> None:
    profile = h100_node(nics=0)
    profile.gpus[2].lost = True
    profile.gpus[3].nvml_errors = {"nvmlDeviceGetUUID": NVML_ERROR_NOT_SUPPORTED}
    profile.gpus[4].nvml_errors = {"nvmlDeviceGetMemoryInfo": NVML_ERROR_NOT_SUPPORTED}
    profile.gpus[5].nvml_errors = {"nvmlDeviceGetArchitecture": NVML_ERROR_UNKNOWN, "nvmlDeviceGetPciInfo": 999}
    profile.gpus[6].nvml_errors = {"nvmlDeviceGetMigMode": NVML_ERROR_UNKNOWN}
    with caplog.at_level(logging.WARNING, logger="driver.discovery"):
        devices = by_name(node(profile)())
    assert sorted(devices) == ["gpu-0", "gpu-1", "gpu-4", "gpu-5", "gpu-7"]
    assert devices["gpu-4"].capacity == {}
    assert devices["gpu-4"].attributes["architecture"] == "Hopper"
    assert "architecture" not in devices["gpu-5"].attributes
    assert PCI_BUS_ID not in devices["gpu-5"].attributes and PCIE_ROOT not in devices["gpu-5"].attributes
    assert devices["gpu-5"].attributes["uuid"] == profile.gpus[5].uuid
    assert devices["gpu-5"].gpu is not None and devices["gpu-5"].gpu.pci_bus_id == ""
    assert devices["gpu-7"].capacity == {"memory": "80Gi"}
    messages = [r.getMessage() for r in caplog.records]
    assert any("index 2" in m and "GPU is lost" in m for m in messages), messages
    assert any("index 3" in m and "Not Supported" in m for m in messages), messages
    assert any(m.startswith("gpu-4 (") and "nvmlDeviceGetMemoryInfo" in m for m in messages), messages
    assert any("gpu-6" in m and "MIG mode" in m for m in messages), messages


@pytest.mark.parametrize("how", ["no state file", "driver unloaded", "no environment"])
def test_driver_not_loaded(
    node: Callable[[NodeProfile], Discover], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    discover = node(h100_node(gpus=1, nics=0))
    if how == "no state file":
        (tmp_path / "nvml.json").unlink()
    elif how == "driver unloaded":
        sim_nvml.write_driver_unloaded(tmp_path / "nvml.json")
    else:
        monkeypatch.delenv(sim_nvml.STATE_ENV)
    with pytest.raises(NvmlUnavailable, match="Driver Not Loaded"):
        discover()


def test_pynvml_missing(node: Callable[[NodeProfile], Discover], monkeypatch: pytest.MonkeyPatch) -> None:
    discover = node(h100_node(gpus=1, nics=0))
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` raise ImportError
    with pytest.raises(NvmlUnavailable, match="pynvml"):
        discover()


def test_nvml_left_uninitialised_after_discovery(
    node: Callable[[NodeProfile], Discover], fake_nvml: ModuleType
) -> None:
    node(h100_node(gpus=2, nics=0))()
    with pytest.raises(fake_nvml.NVMLError_Uninitialized):
        fake_nvml.nvmlDeviceGetCount()


def test_names_stay_when_a_gpu_vanishes(node: Callable[[NodeProfile], Discover], tmp_path: Path) -> None:
    profile = h100_node(nics=0)
    discover = node(profile)
    before = by_name(discover())
    del profile.gpus[3]
    for index, gpu in enumerate(profile.gpus):
        gpu.index = index  # NVML indices close up; minors do not
    sim_nvml.write_state(profile, tmp_path / "nvml.json")
    after = by_name(discover())
    assert sorted(after) == sorted(set(before) - {"gpu-3"})
    for name, device in after.items():
        assert device.attributes["uuid"] == before[name].attributes["uuid"]


def test_mig_devices(node: Callable[[NodeProfile], Discover]) -> None:
    profile = a100_mig_node()
    devices = node(profile)()
    assert len(devices) == 8 * 7
    assert all(d.kind is DeviceKind.MIG for d in devices)
    devices_by_name = by_name(devices)
    for gpu in profile.gpus:
        for mig in gpu.mig_devices:
            name = f"gpu-{gpu.minor}-mig-1g-5gb-{mig.gi_id}-{mig.ci_id}"
            device = devices_by_name[name]
            assert parse_mig_device_name(name) == MigName(gpu.minor, "1g-5gb", mig.gi_id, mig.ci_id)
            assert device.attributes["type"] == "mig"
            assert device.attributes["uuid"] == mig.uuid
            assert device.attributes["parentUUID"] == gpu.uuid
            assert device.attributes["profile"] == "1g.5gb"
            assert device.attributes["productName"] == "NVIDIA A100-SXM4-40GB"
            assert device.attributes["architecture"] == "Ampere"
            assert device.attributes["cudaComputeCapability"] == Version("8.0.0")
            assert device.attributes[PCI_BUS_ID] == gpu.pci_bus_id
            assert device.attributes[PCIE_ROOT] == gpu.pcie_root
            assert device.attributes[NUMA_NODE] == gpu.numa_node
            assert device.capacity == {
                "memory": "4864Mi",
                "multiprocessors": "14",
                "copyEngines": "1",
                "decoders": "1",
                "encoders": "0",
                "jpegEngines": "1",
                "ofaEngines": "0",
            }
            info = device.gpu
            assert info is not None
            assert (info.minor, info.uuid, info.parent_uuid, info.pci_bus_id) == (
                gpu.minor,
                mig.uuid,
                gpu.uuid,
                gpu.pci_bus_id,
            )
            assert (info.mig_gi, info.mig_ci) == (mig.gi_id, mig.ci_id)
            assert info.mig_caps == (
                mig_gi_cap_minor(gpu.minor, mig.gi_id),
                mig_ci_cap_minor(gpu.minor, mig.gi_id, mig.ci_id),
            )


def test_mig_profile_rebuilt_from_attributes_when_name_fails(node: Callable[[NodeProfile], Discover]) -> None:
    profile = a100_mig_node(gpus=1, per_gpu=2)
    profile.gpus[0].nvml_errors = {"nvmlDeviceGetName": NVML_ERROR_NOT_SUPPORTED}
    devices = node(profile)()
    assert [d.name for d in devices] == ["gpu-0-mig-1g-5gb-7-0", "gpu-0-mig-1g-5gb-8-0"]
    assert all("productName" not in d.attributes for d in devices)


def test_mig_device_without_proc_capabilities_is_still_published(
    node: Callable[[NodeProfile], Discover], tmp_path: Path
) -> None:
    discover = node(a100_mig_node(gpus=1, per_gpu=1))
    devices = GpuDiscovery(tmp_path / "sys", proc_root=tmp_path / "elsewhere").discover()
    assert [d.name for d in devices] == [d.name for d in discover()]
    assert devices[0].gpu is not None and devices[0].gpu.mig_caps == ()


def test_stranded_mig_gpu_publishes_nothing(
    node: Callable[[NodeProfile], Discover], caplog: pytest.LogCaptureFixture
) -> None:
    profile = a100_mig_node(gpus=2, per_gpu=2)
    profile.gpus[0].mig_devices = []
    with caplog.at_level(logging.WARNING, logger="driver.discovery"):
        devices = node(profile)()
    assert [d.name for d in devices] == ["gpu-1-mig-1g-5gb-7-0", "gpu-1-mig-1g-5gb-8-0"]
    assert any("gpu-0" in r.getMessage() and "stranded" in r.getMessage() for r in caplog.records)


def test_mig_mode_switch_is_seen_by_rediscovery(node: Callable[[NodeProfile], Discover], tmp_path: Path) -> None:
    profile = a100_mig_node(gpus=1, per_gpu=3)
    discover = node(profile)
    assert len(discover()) == 3
    profile.gpus[0].mig_mode = False
    sim_nvml.write_state(profile, tmp_path / "nvml.json")
    assert [d.name for d in discover()] == ["gpu-0"]


def test_list_attributes_on_and_off(node: Callable[[NodeProfile], Discover]) -> None:
    profile = a100_mig_node(gpus=2, per_gpu=1)
    profile.gpus[0].mig_mode = False  # MIG-capable full GPU: has supported profiles to list
    discover = node(profile)
    off = by_name(discover(list_attributes=False))
    on = by_name(discover(list_attributes=True))
    assert sorted(off) == sorted(on) == ["gpu-0", "gpu-1-mig-1g-5gb-7-0"]
    assert "migProfiles" not in off["gpu-0"].attributes
    assert off["gpu-0"].attributes[NUMA_NODE] == 0
    assert on["gpu-0"].attributes[NUMA_NODE] == (0,)
    assert on["gpu-0"].attributes["migProfiles"] == (
        "1g.5gb", "1g.5gb+me", "1g.10gb", "2g.10gb", "3g.20gb", "4g.20gb", "7g.40gb",
    )  # fmt: skip
    assert "migProfiles" not in on["gpu-1-mig-1g-5gb-7-0"].attributes
    for device in off.values():
        assert not any(isinstance(v, tuple) for v in device.attributes.values()), device.name


def _values(attrs: dict[str, AttrValue]) -> int:
    return sum(len(v) if isinstance(v, tuple) else 1 for v in attrs.values())


def test_every_published_device_is_within_api_limits(node: Callable[[NodeProfile], Discover]) -> None:
    profile = a100_mig_node(gpus=2, per_gpu=7)
    profile.gpus[1].mig_mode = False
    names = [f"{g}g.{m}gb" for g in (1, 2, 3, 4, 7) for m in (5, 10, 20, 40)][:18]  # one per profile enum
    profile.gpus[1].mig_profiles = [
        MigProfileSpec(n, enum, enum, 1, 1, [0], 1, 1024 * (enum + 1), 14, 1, 0, 0, 0) for enum, n in enumerate(names)
    ]
    devices = node(profile)(list_attributes=True)
    assert len(next(d for d in devices if d.name == "gpu-1").attributes["migProfiles"]) > 10
    for device in devices:
        assert len(device.attributes) + len(device.capacity) <= MAX_ATTRIBUTES_AND_CAPACITIES
        assert _values(device.attributes) <= MAX_ATTRIBUTE_VALUES
        assert len(device.name) <= 63


def test_fit_limits_shortens_lists() -> None:
    attrs: dict[str, AttrValue] = {f"a{i}": i for i in range(10)}
    attrs["migProfiles"] = tuple(f"{i}g.{i}gb" for i in range(40))
    attrs[NUMA_NODE] = tuple(range(5))
    fitted = fit_limits("gpu-0", attrs, {"memory": "1Gi"})
    assert _values(fitted) == MAX_ATTRIBUTE_VALUES
    assert fitted[NUMA_NODE] == (0, 1, 2, 3, 4)
    assert fitted["migProfiles"] == attrs["migProfiles"][:33]
    attrs["migProfiles"] = tuple(f"p{i}" for i in range(100))
    attrs[NUMA_NODE] = tuple(range(60))
    fitted = fit_limits("gpu-0", attrs, {})
    assert "migProfiles" not in fitted and _values(fitted) == MAX_ATTRIBUTE_VALUES
    assert fitted[NUMA_NODE] == tuple(range(38))


@pytest.mark.parametrize(
    ("profile", "label"),
    [("1g.5gb", "1g-5gb"), ("1g.10gb+me", "1g-10gb-me"), ("1c.2g.20gb", "1c-2g-20gb"), ("7g.80gb", "7g-80gb")],
)
def test_mig_name_round_trip(profile: str, label: str) -> None:
    assert profile_label(profile) == label
    name = mig_device_name(12, profile, 13, 2)
    assert name == f"gpu-12-mig-{label}-13-2"
    assert parse_mig_device_name(name) == MigName(12, label, 13, 2)


@pytest.mark.parametrize("name", ["gpu-0", "gpu-0-mig-7-0", "gpu-x-mig-1g-5gb-7-0", "gpu-0-mig-1g-5gb-7", "nic-0"])
def test_parse_mig_name_rejects_other_names(name: str) -> None:
    assert parse_mig_device_name(name) is None


def test_value_conversions() -> None:
    assert semver("580.95.05") == "580.95.5"
    assert semver("550.54") == "550.54.0"
    assert semver("580.95.05.1") is None and semver("580.95-rc1") is None and semver("") is None
    assert cuda_version(13000) == "13.0.0" and cuda_version(12040) == "12.4.0" and cuda_version(0) is None
    assert binary_quantity(80 * 2**30) == "80Gi"
    assert binary_quantity(4864 * 2**20) == "4864Mi"
    assert binary_quantity(2**40) == "1Ti"
    assert binary_quantity(1000) == "1000"


def test_nvml_is_preloaded_from_the_mounted_driver_root(tmp_path: Path) -> None:
    from driver.node.nvml import preload_nvml

    assert preload_nvml(Path("/")) is None  # the default root uses the normal library search
    assert preload_nvml(tmp_path) is None  # nothing there: pynvml's own lookup reports it
    lib = tmp_path / "usr/lib64/libnvidia-ml.so.1"
    lib.parent.mkdir(parents=True)
    lib.write_bytes(b"not an ELF file")
    assert preload_nvml(tmp_path) is None  # found but unloadable: a warning, not a crash
    real = next(Path("/").glob("usr/lib/*-linux-gnu/libz.so.1"), None) or next(Path("/").glob("lib/*/libz.so.1"))
    lib.write_bytes(real.read_bytes())  # any loadable shared object stands in for libnvidia-ml
    assert preload_nvml(tmp_path) == lib


def test_nvml_is_preloaded_through_links_that_are_absolute_inside_the_driver_root(tmp_path: Path) -> None:
    """Debian's packaged driver: libnvidia-ml.so.1 -> /etc/alternatives/... -> the real file.

    Absolute targets name files of the driver root's own tree; resolved against the pod's root
    they point nowhere, and NVML would never be loaded from a host mounted at /driver-root.
    """
    from driver.node.nvml import preload_nvml

    real = tmp_path / "usr/lib/x86_64-linux-gnu/nvidia/current/libnvidia-ml.so.580.95.05"
    real.parent.mkdir(parents=True)
    libz = next(Path("/").glob("usr/lib/*-linux-gnu/libz.so.1"), None) or next(Path("/").glob("lib/*/libz.so.1"))
    real.write_bytes(libz.read_bytes())  # any loadable shared object stands in for libnvidia-ml
    alternative = tmp_path / "etc/alternatives/nvidia--libnvidia-ml.so.1-x86_64-linux-gnu"
    alternative.parent.mkdir(parents=True)
    alternative.symlink_to("/usr/lib/x86_64-linux-gnu/nvidia/current/libnvidia-ml.so.580.95.05")
    (tmp_path / "usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1").symlink_to(
        "/etc/alternatives/nvidia--libnvidia-ml.so.1-x86_64-linux-gnu"
    )
    assert preload_nvml(tmp_path) == real

    # A link that climbs out of the driver root is not followed: nothing outside it is loaded.
    escape = tmp_path / "escape"
    (escape / "usr/lib64").mkdir(parents=True)
    (escape / "usr/lib64/libnvidia-ml.so.1").symlink_to("../../../usr/lib/x86_64-linux-gnu/nvidia/current/" + real.name)
    assert preload_nvml(escape) is None


def test_a_gpu_that_stops_answering_but_stays_on_the_bus_stays_published(tmp_path: Path) -> None:
    """Its gpu-lost taint must stay on a published device (and evict), not vanish with the device."""
    profile = h100_node(gpus=3, nics=0)
    render_node(profile, tmp_path / "sys", tmp_path / "dev")
    state = tmp_path / "nvml.json"
    sim_nvml.write_state(profile, state)
    with sim_nvml.fake_pynvml_in_process(state):
        discovery = GpuDiscovery(tmp_path / "sys")
        before = {d.name: d for d in discovery.discover()}
        profile.gpus[1].lost = True
        sim_nvml.write_state(profile, state)
        during = {d.name: d for d in discovery.discover()}
        assert during["gpu-1"] == before["gpu-1"]
        # Removed from the PCI bus for real (hot-unplug): then it goes.
        (tmp_path / "sys/bus/pci/devices" / profile.gpus[1].pci_bus_id).unlink()
        assert "gpu-1" not in {d.name for d in discovery.discover()}


def test_a_mig_gpu_whose_mig_devices_cannot_be_listed_keeps_its_last_ones(tmp_path: Path) -> None:
    """NVML still answers for the GPU itself (identity, MIG mode, PCI info) but not for its MIG
    devices: that is no listing, so its last MIG devices stay published, and with them the health
    monitor's gpu-lost taint that evicts their pods."""
    profile = a100_mig_node(gpus=2, per_gpu=2)
    render_node(profile, tmp_path / "sys", tmp_path / "dev", tmp_path / "proc")
    state = tmp_path / "nvml.json"
    sim_nvml.write_state(profile, state)
    with sim_nvml.fake_pynvml_in_process(state):
        discovery = GpuDiscovery(tmp_path / "sys", proc_root=tmp_path / "proc")
        before = discovery.discover()
        profile.gpus[0].nvml_errors = {"nvmlDeviceGetMaxMigDeviceCount": NVML_ERROR_GPU_IS_LOST}
        sim_nvml.write_state(profile, state)
        assert discovery.discover() == before
        # Its MIG devices all destroyed, and listed so: none is kept.
        profile.gpus[0].nvml_errors = {}
        profile.gpus[0].mig_devices = []
        sim_nvml.write_state(profile, state)
        assert {d.name for d in discovery.discover()} == {d.name for d in before if d.name.startswith("gpu-1-")}
