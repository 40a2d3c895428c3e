"""The simulated node looks like the kernel's and the NVIDIA driver's, and the fake NVML like nvidia-ml-py."""

from __future__ import annotations

import importlib.util
import inspect
import os
import stat
import struct
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from ctypes import c_uint
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from demo.cluster_node import RENDERED_MARK, ClusterNode
from driver.discovery.pcie import pcie_path
from sim import nvml as sim_nvml
from sim import sysfs as sim_sysfs
from sim.fstree import pci_device_dir
from sim.profile import NodeProfile, a100_mig_node, h100_node
from sim.sysfs import (
    NVIDIA_CAPS_MAJOR,
    NVIDIA_MAJOR,
    NVIDIA_UVM_MAJOR,
    mig_ci_cap_minor,
    mig_gi_cap_minor,
    render_node,
)

FAKE_FILE = sim_nvml.FAKE_PYNVML_DIR / "pynvml.py"


def render(tmp_path: Path, profile: NodeProfile) -> tuple[Path, Path, Path]:
    sysfs, dev, proc = tmp_path / "sys", tmp_path / "dev", tmp_path / "proc"
    render_node(profile, sysfs, dev, proc)
    return sysfs, dev, proc


# --- sysfs -----------------------------------------------------------------------------------------


def test_bus_pci_devices_links_are_relative_like_the_kernels(tmp_path: Path) -> None:
    profile = h100_node(nics=0)
    sysfs, _, _ = render(tmp_path, profile)
    for gpu in profile.gpus:
        link = sysfs / "bus" / "pci" / "devices" / gpu.pci_bus_id
        target = os.readlink(link)
        assert target.startswith(f"../../../devices/{gpu.pcie_root}/"), target
        assert target.endswith("/" + gpu.pci_bus_id)
        real = link.resolve()
        assert real.is_relative_to((sysfs / "devices" / gpu.pcie_root).resolve())
        assert (real / "vendor").read_text() == "0x10de\n"
        assert (real / "device").read_text() == f"0x{gpu.pci_device_id:04x}\n"
        assert (real / "class").read_text() == "0x030200\n"
        assert (real / "numa_node").read_text() == f"{gpu.numa_node}\n"
        driver = os.readlink(real / "driver")
        assert not os.path.isabs(driver)
        assert (real / "driver").resolve() == (sysfs / "bus" / "pci" / "drivers" / "nvidia").resolve()


def test_pci_device_dir_without_driver_and_on_root_bus(tmp_path: Path) -> None:
    real = pci_device_dir(tmp_path, "0000:00:02.0", "pci0000:00", -1, 0x15B3, 0x1021, None)
    assert real == tmp_path / "devices" / "pci0000:00" / "0000:00:02.0"
    assert not (real / "driver").exists()
    assert (real / "class").read_text() == "0x020000\n"
    assert os.readlink(tmp_path / "bus/pci/devices/0000:00:02.0") == "../../../devices/pci0000:00/0000:00:02.0"


def test_render_is_idempotent(tmp_path: Path) -> None:
    profile = a100_mig_node(gpus=2, per_gpu=2)
    render(tmp_path, profile)
    profile.gpus[0].numa_node = 1
    sysfs, _, _ = render(tmp_path, profile)
    assert (sysfs / "bus/pci/devices" / profile.gpus[0].pci_bus_id / "numa_node").read_text() == "1\n"


def test_numa_nodes_with_distances_and_sockets(tmp_path: Path) -> None:
    profile = NodeProfile(
        name="n",
        numa_nodes=4,
        numa_distances=[[10, 12, 20, 20], [12, 10, 20, 20], [20, 20, 10, 12], [20, 20, 12, 10]],
        numa_sockets=[0, 0, 1, 1],
    )
    sysfs, _, _ = render(tmp_path, profile)
    nodes = sysfs / "devices" / "system" / "node"
    assert (nodes / "online").read_text() == "0-3\n"
    assert (nodes / "node2" / "distance").read_text() == "20 20 10 12\n"
    for n, socket in enumerate(profile.numa_sockets):
        first = int((nodes / f"node{n}" / "cpulist").read_text().split("-")[0])
        pkg = sysfs / "devices" / "system" / "cpu" / f"cpu{first}" / "topology" / "physical_package_id"
        assert pkg.read_text() == f"{socket}\n"
        assert (nodes / f"node{n}" / f"cpu{first}").resolve() == pkg.parent.parent.resolve()


def test_gpu_device_nodes(tmp_path: Path) -> None:
    profile = h100_node(gpus=3, nics=0)
    _, dev, _ = render(tmp_path, profile)
    for name in ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset"):
        assert (dev / name).exists(), name
    for gpu in profile.gpus:
        st = os.stat(dev / f"nvidia{gpu.minor}")
        if stat.S_ISCHR(st.st_mode):
            assert (os.major(st.st_rdev), os.minor(st.st_rdev)) == (NVIDIA_MAJOR, gpu.minor)
        else:
            assert stat.S_ISREG(st.st_mode) and st.st_size == 0
    assert not (dev / "nvidia-caps").exists()  # no MIG-capable GPU


@pytest.mark.parametrize("can_mknod", [True, False])
def test_lazily_made_nodes_are_absent_until_made_where_they_can_be(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, can_mknod: bool
) -> None:
    """nvidia-modprobe makes nvidia-uvm and the MIG capability nodes on first use; a tree whose
    nodes are plain files (no mknod) has them up front, as no daemon there could make them."""
    if can_mknod and os.geteuid() != 0:
        pytest.skip("making character devices needs root")
    if not can_mknod:
        monkeypatch.setattr(sim_sysfs.os, "geteuid", lambda: 1000)
    profile = a100_mig_node(gpus=1, per_gpu=1)
    dev = tmp_path / "dev"
    render_node(profile, tmp_path / "sys", dev, tmp_path / "proc", lazy_nodes=True)
    for name in ("nvidiactl", "nvidia-modeset", "nvidia0"):
        assert (dev / name).exists(), name
    lazy = ["nvidia-uvm", "nvidia-uvm-tools", "nvidia-caps"]
    assert [n for n in lazy if (dev / n).exists()] == ([] if can_mknod else lazy)


def test_proc_lists_the_majors_and_the_device_file_parameters(tmp_path: Path) -> None:
    """What nvidia-modprobe reads: `/proc/devices` in the kernel's layout, the driver's params."""
    _, _, proc = render(tmp_path, h100_node(gpus=1, nics=0))
    text = (proc / "devices").read_text()
    chars, _, blocks = text.partition("\n\n")
    lines = chars.splitlines()
    assert lines[0] == "Character devices:" and blocks.startswith("Block devices:\n")
    assert all(line[:3].strip().isdigit() and line[3] == " " for line in lines[1:])  # right-aligned majors
    names = {line[4:]: int(line[:3]) for line in lines[1:]}
    assert names["nvidia-frontend"] == NVIDIA_MAJOR
    assert names["nvidia-uvm"] == NVIDIA_UVM_MAJOR and names["nvidia-caps"] == NVIDIA_CAPS_MAJOR
    params = dict(line.split(": ") for line in (proc / "driver/nvidia/params").read_text().splitlines())
    assert (params["ModifyDeviceFiles"], params["DeviceFileMode"], params["DeviceFileUID"]) == ("1", "438", "0")


def test_mig_capabilities_in_proc_and_dev(tmp_path: Path) -> None:
    profile = a100_mig_node(gpus=2, per_gpu=3)
    _, dev, proc = render(tmp_path, profile)
    minors = (proc / "driver/nvidia-caps/mig-minors").read_text().splitlines()
    assert minors[:2] == ["config 1", "monitor 2"]
    table = dict(line.split(" ") for line in minors[2:])
    for gpu in profile.gpus:
        for mig in gpu.mig_devices:
            gi_dir = proc / f"driver/nvidia/capabilities/gpu{gpu.minor}/mig/gi{mig.gi_id}"
            gi_minor = mig_gi_cap_minor(gpu.minor, mig.gi_id)
            ci_minor = mig_ci_cap_minor(gpu.minor, mig.gi_id, mig.ci_id)
            assert (gi_dir / "access").read_text().splitlines()[0] == f"DeviceFileMinor: {gi_minor}"
            assert (gi_dir / f"ci{mig.ci_id}" / "access").read_text().startswith(f"DeviceFileMinor: {ci_minor}\n")
            assert table[f"gpu{gpu.minor}/gi{mig.gi_id}/access"] == str(gi_minor)
            assert table[f"gpu{gpu.minor}/gi{mig.gi_id}/ci{mig.ci_id}/access"] == str(ci_minor)
            assert (dev / "nvidia-caps" / f"nvidia-cap{gi_minor}").exists()
            assert (dev / "nvidia-caps" / f"nvidia-cap{ci_minor}").exists()
    assert len(set(table.values())) == len(table)  # every capability has its own minor


# --- fake pynvml ---------------------------------------------------------------------------------


@pytest.fixture
def fake(tmp_path: Path) -> Iterator[tuple[ModuleType, Path]]:
    state = tmp_path / "nvml.json"
    with sim_nvml.fake_pynvml_in_process(state) as module:
        yield module, state


def _load_isolated(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[name]
    return module


def test_fake_matches_real_binding_names_and_codes() -> None:
    real_spec = importlib.util.find_spec("pynvml")
    assert real_spec is not None and real_spec.origin is not None
    assert Path(real_spec.origin).parent != sim_nvml.FAKE_PYNVML_DIR, "the real nvidia-ml-py must be installed"
    real = _load_isolated(Path(real_spec.origin), "real_pynvml_under_test")
    fake = _load_isolated(FAKE_FILE, "fake_pynvml_under_test")
    for name, value in vars(fake).items():
        if name.startswith(("NVML_", "nvmlEvent", "nvmlGpuInstanceProfileInfo_v2")) and isinstance(value, int):
            assert getattr(real, name) == value, name
        if name.startswith("nvml") and inspect.isfunction(value):
            assert inspect.isfunction(getattr(real, name, None)), f"{name} is not in nvidia-ml-py"
        if name.startswith("NVMLError_"):
            assert getattr(real, name)().value == value().value, name
    real_struct = dict(real.c_nvmlDeviceAttributes._fields_)
    assert [f for f, _ in fake.c_nvmlDeviceAttributes._fields_] == list(real_struct)
    assert [f for f, _ in fake.nvmlPciInfo_t._fields_] == [f for f, _ in real.nvmlPciInfo_t._fields_]


def test_fake_error_classes_behave_like_the_real_ones(fake: tuple[ModuleType, Path]) -> None:
    pynvml, _ = fake
    err = pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
    assert type(err) is pynvml.NVMLError_GpuIsLost
    assert err.value == 15 and str(err) == "GPU is lost"
    assert pynvml.NVMLError_NotSupported().value == pynvml.NVML_ERROR_NOT_SUPPORTED
    assert isinstance(pynvml.NVMLError_DriverNotLoaded(), pynvml.NVMLError)
    assert pynvml.nvmlExceptionClass(999) is pynvml.NVMLError_Unknown


def test_fake_driver_not_loaded(fake: tuple[ModuleType, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    pynvml, state = fake
    with pytest.raises(pynvml.NVMLError_DriverNotLoaded):
        pynvml.nvmlInit()  # no state file
    sim_nvml.write_driver_unloaded(state)
    with pytest.raises(pynvml.NVMLError_DriverNotLoaded):
        pynvml.nvmlInit()
    sim_nvml.write_state(h100_node(gpus=1, nics=0), state)
    monkeypatch.delenv(sim_nvml.STATE_ENV)
    with pytest.raises(pynvml.NVMLError_DriverNotLoaded):
        pynvml.nvmlInit()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        pynvml.nvmlDeviceGetCount()


def test_fake_reference_counts_init(fake: tuple[ModuleType, Path]) -> None:
    pynvml, state = fake
    sim_nvml.write_state(h100_node(gpus=2, nics=0), state)
    pynvml.nvmlInit()
    pynvml.nvmlInitWithFlags(pynvml.NVML_INIT_FLAG_NO_GPUS)
    pynvml.nvmlShutdown()
    assert pynvml.nvmlDeviceGetCount() == 2
    pynvml.nvmlShutdown()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        pynvml.nvmlDeviceGetCount()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        pynvml.nvmlShutdown()


def test_fake_results_are_shaped_like_the_bindings(fake: tuple[ModuleType, Path]) -> None:
    pynvml, state = fake
    profile = a100_mig_node(gpus=1, per_gpu=2)
    sim_nvml.write_state(profile, state)
    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    pci = pynvml.nvmlDeviceGetPciInfo(handle)
    assert pci.busId == b"00000000:07:00.0"
    assert pci.busIdLegacy == b"0000:07:00.0"
    assert pynvml.nvmlDeviceGetUUID(handle) == profile.gpus[0].uuid
    assert pynvml.nvmlSystemGetDriverVersion() == "580.95.05"
    assert pynvml.nvmlDeviceGetMemoryInfo(handle).total == profile.gpus[0].memory_bytes
    assert pynvml.nvmlDeviceGetMigMode(handle) == [1, 1]
    mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, 1)
    flag = pynvml.nvmlDeviceIsMigDeviceHandle(mig)
    assert isinstance(flag, c_uint) and flag.value == 1
    assert pynvml.nvmlDeviceGetName(mig) == "NVIDIA A100-SXM4-40GB MIG 1g.5gb"
    assert pynvml.nvmlDeviceGetGpuInstanceId(mig) == profile.gpus[0].mig_devices[1].gi_id
    assert pynvml.nvmlDeviceGetAttributes(mig).memorySizeMB == 4864
    assert pynvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(mig) == handle
    with pytest.raises(pynvml.NVMLError_NotFound):
        pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, 2)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceGetMinorNumber(mig)
    info = pynvml.nvmlDeviceGetGpuInstanceProfileInfo(handle, pynvml.NVML_GPU_INSTANCE_PROFILE_7_SLICE)
    assert info.name == b"MIG 7g.40gb" and info.sliceCount == 7
    pynvml.nvmlShutdown()


def test_fake_sees_state_rewrites_and_injected_failures(fake: tuple[ModuleType, Path]) -> None:
    pynvml, state = fake
    profile = h100_node(gpus=3, nics=0)
    sim_nvml.write_state(profile, state)
    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(1)
    assert pynvml.nvmlDeviceGetMinorNumber(handle) == 1
    profile.gpus[1].nvml_errors = {"nvmlDeviceGetMemoryInfo": pynvml.NVML_ERROR_UNKNOWN}
    sim_nvml.write_state(profile, state)
    with pytest.raises(pynvml.NVMLError_Unknown):
        pynvml.nvmlDeviceGetMemoryInfo(handle)
    assert pynvml.nvmlDeviceGetMinorNumber(handle) == 1
    profile.gpus[1].lost = True
    sim_nvml.write_state(profile, state)
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        pynvml.nvmlDeviceGetUUID(handle)
    del profile.gpus[1]
    sim_nvml.write_state(profile, state)
    assert pynvml.nvmlDeviceGetCount() == 2
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        pynvml.nvmlDeviceGetUUID(handle)  # a handle to a GPU that vanished
    pynvml.nvmlShutdown()


def test_fake_events(fake: tuple[ModuleType, Path]) -> None:
    pynvml, state = fake
    profile = h100_node(gpus=2, nics=0)
    sim_nvml.write_state(profile, state)
    pynvml.nvmlInit()
    sim_nvml.append_event(state, profile.gpus[0].uuid, pynvml.nvmlEventTypeXidCriticalError, 13)  # before the set
    events = pynvml.nvmlEventSetCreate()
    pynvml.nvmlDeviceRegisterEvents(pynvml.nvmlDeviceGetHandleByIndex(1), pynvml.nvmlEventTypeXidCriticalError, events)
    with pytest.raises(pynvml.NVMLError_Timeout):
        pynvml.nvmlEventSetWait_v2(events, 0)
    sim_nvml.append_event(state, profile.gpus[0].uuid, pynvml.nvmlEventTypeXidCriticalError, 31)  # not registered
    sim_nvml.append_event(state, profile.gpus[1].uuid, pynvml.nvmlEventTypeXidCriticalError, 79)
    data = pynvml.nvmlEventSetWait_v2(events, 5000)
    assert (data.eventType, data.eventData) == (pynvml.nvmlEventTypeXidCriticalError, 79)
    assert pynvml.nvmlDeviceGetUUID(data.device) == profile.gpus[1].uuid
    pynvml.nvmlEventSetFree(events)
    pynvml.nvmlShutdown()


@pytest.fixture
def quiet_set(fake: tuple[ModuleType, Path]) -> tuple[ModuleType, Path, NodeProfile, Any]:
    """The fake on two GPUs and an event set for GPU 1's XIDs whose first wait found nothing."""
    pynvml, state = fake
    profile = h100_node(gpus=2, nics=0)
    sim_nvml.write_state(profile, state)
    pynvml.nvmlInit()
    events = pynvml.nvmlEventSetCreate()
    pynvml.nvmlDeviceRegisterEvents(pynvml.nvmlDeviceGetHandleByIndex(1), pynvml.nvmlEventTypeXidCriticalError, events)
    with pytest.raises(pynvml.NVMLError_Timeout):
        pynvml.nvmlEventSetWait_v2(events, 0)
    return pynvml, state, profile, events


def test_fake_event_wait_blocks_until_an_event_or_a_lost_gpu_wakes_it(
    quiet_set: tuple[ModuleType, Path, NodeProfile, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """As the real wait blocks in the driver, the fake's sleeps until a file changes: no polling
    (which cost the daemon 1 % of a core at idle), no look at the files while they stay as they
    were, and a new event or a lost GPU wakes it at once."""
    pynvml, state, profile, events = quiet_set
    looks = 0
    current = pynvml._current

    def counted() -> list:
        nonlocal looks
        looks += 1
        return current()

    monkeypatch.setattr(pynvml, "_current", counted)
    done = threading.Event()

    def write_beside() -> None:  # other files in the state's directory (a daemon log) change often
        while not done.wait(0.01):
            with open(state.parent / "daemon.log", "a") as f:
                f.write("line\n")

    with ThreadPoolExecutor(1) as pool:
        writer = pool.submit(write_beside)
        for timeout_ms in (300, 100):
            with pytest.raises(pynvml.NVMLError_Timeout):
                pynvml.nvmlEventSetWait_v2(events, timeout_ms)
        done.set()
        writer.result()
    assert looks == 0  # nothing changed since the last look: a waiter in a loop pays only the wake

    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(pynvml.nvmlEventSetWait_v2, events, 60_000)
        sim_nvml.append_event(state, profile.gpus[1].uuid, pynvml.nvmlEventTypeXidCriticalError, 79)
        assert waiting.result(timeout=30).eventData == 79
        waiting = pool.submit(pynvml.nvmlEventSetWait_v2, events, 60_000)
        profile.gpus[1].lost = True
        sim_nvml.write_state(profile, state)
        with pytest.raises(pynvml.NVMLError_GpuIsLost):
            waiting.result(timeout=30)


def test_fake_event_wait_misses_nothing_that_changed_between_two_waits(
    quiet_set: tuple[ModuleType, Path, NodeProfile, Any],
) -> None:
    """A set that found nothing skips its look only while the files stay as they were: events
    raised, a GPU lost or NVML shut down between two waits are seen by the next one."""
    pynvml, state, profile, events = quiet_set
    xid = pynvml.nvmlEventTypeXidCriticalError
    sim_nvml.append_event(state, profile.gpus[1].uuid, xid, 79)  # while nobody waits
    sim_nvml.append_event(state, profile.gpus[1].uuid, xid, 48)
    assert pynvml.nvmlEventSetWait_v2(events, 0).eventData == 79
    assert pynvml.nvmlEventSetWait_v2(events, 0).eventData == 48  # the rest of a burst
    with pytest.raises(pynvml.NVMLError_Timeout):
        pynvml.nvmlEventSetWait_v2(events, 0)
    profile.gpus[1].lost = True
    sim_nvml.write_state(profile, state)
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        pynvml.nvmlEventSetWait_v2(events, 0)
    with pytest.raises(pynvml.NVMLError_GpuIsLost):  # for as long as it is lost
        pynvml.nvmlEventSetWait_v2(events, 0)
    profile.gpus[1].lost = False
    sim_nvml.write_state(profile, state)
    with pytest.raises(pynvml.NVMLError_Timeout):
        pynvml.nvmlEventSetWait_v2(events, 0)
    pynvml.nvmlShutdown()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        pynvml.nvmlEventSetWait_v2(events, 0)


def test_fake_event_wait_looks_again_after_the_kernel_dropped_notifications(
    quiet_set: tuple[ModuleType, Path, NodeProfile, Any],
) -> None:
    """An inotify queue that overflowed may have dropped the events file's notification: a quiet
    set looks again rather than sleep through an event."""
    pynvml, state, profile, events = quiet_set
    watch, (dropped, kernel) = events.changes._fd, os.pipe()
    os.set_blocking(dropped, False)
    events.changes._fd = dropped  # the kernel's queue: nothing but its overflow notice
    try:
        sim_nvml.append_event(state, profile.gpus[1].uuid, pynvml.nvmlEventTypeXidCriticalError, 79)
        os.write(kernel, struct.pack("=iIII", -1, 0x4000, 0, 0))  # wd, IN_Q_OVERFLOW, cookie, len
        assert pynvml.nvmlEventSetWait_v2(events, 0).eventData == 79
    finally:
        events.changes._fd = watch
        os.close(dropped)
        os.close(kernel)


def test_env_for_makes_a_child_process_load_the_fake(tmp_path: Path) -> None:
    state = tmp_path / "nvml.json"
    sim_nvml.write_state(h100_node(gpus=2, nics=0), state)
    env = {**os.environ, **sim_nvml.env_for(state)}
    code = "import pynvml; pynvml.nvmlInit(); print(pynvml.__file__, pynvml.nvmlDeviceGetCount())"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    path, count = out.stdout.split()
    assert Path(path) == FAKE_FILE and count == "2"


def test_hgx_board_two_gpus_and_a_nic_behind_each_switch_two_switches_per_root(tmp_path: Path) -> None:
    profile = h100_node()
    sysfs, _, _ = render(tmp_path, profile)
    bridges = {b for d in [*profile.gpus, *profile.nics] for b in d.pcie_bridges}
    listed = {p.name for p in (sysfs / "bus" / "pci" / "devices").iterdir()}
    assert len(listed) == len(profile.gpus) + len(profile.nics) + len(bridges)  # the kernel lists bridges too
    switches = []
    for s, nic in enumerate(profile.nics):
        gpus = profile.gpus[2 * s : 2 * s + 2]
        paths = [pcie_path(sysfs, d) for d in (nic.pci_address, *(g.pci_bus_id for g in gpus))]
        assert all(p is not None for p in paths)
        assert {p.switch for p in paths if p} == {nic.pcie_bridges[1]}  # the upstream port
        assert {p.root for p in paths if p} == {nic.pcie_root}
        switches.append(nic.pcie_bridges[1])
        assert {g.numa_node for g in gpus} == {nic.numa_node} == {s // 2}
    assert len(set(switches)) == 4
    assert len({n.pcie_root for n in profile.nics}) == 2


def test_the_cluster_node_is_rendered_anew_when_its_profile_changes(tmp_path: Path) -> None:
    """A node rendered from an older profile (another board layout) would mix two hardware trees."""
    node = ClusterNode(tmp_path, tmp_path / "kubeconfig", "n")
    node.sim_node()
    mark = tmp_path / RENDERED_MARK
    fingerprint = mark.read_text()
    stale = tmp_path / "sys" / "devices" / "pci0000:15" / "0000:15:01.0" / "0000:16:00.0" / "from-an-old-layout"
    stale.write_text("x")
    node.sim_node()
    assert stale.exists() and mark.read_text() == fingerprint  # same profile: kept as it is
    mark.write_text("an older profile")
    node.sim_node()
    assert not stale.exists() and mark.read_text() == fingerprint
    assert (tmp_path / "sys" / "class" / "net" / "ens1f0np0" / "device").resolve().name == "0000:1a:00.0"


def test_a_smaller_cluster_node_keeps_a_nic_behind_every_pair_of_gpus(tmp_path: Path) -> None:
    """The third node of `hack/cluster.sh up --nodes 3` (4 GPUs, 2 NICs): the same board, so a GPU
    and a NIC behind one switch still exist there, and a node of another size is rendered anew."""
    small = ClusterNode(tmp_path, tmp_path / "kubeconfig", "n", gpus=4, nics=2).sim_node()
    assert [g.index for g in small.profile.gpus] == [0, 1, 2, 3]
    assert [n.ifname for n in small.profile.nics] == ["ens1f0np0", "ens2f0np0"]
    sysfs = tmp_path / "sys"
    for s, nic in enumerate(small.profile.nics):
        switch = {
            p.switch for p in (pcie_path(sysfs, g.pci_bus_id) for g in small.profile.gpus[2 * s : 2 * s + 2]) if p
        }
        assert switch == {nic.pcie_bridges[1]}
    big = ClusterNode(tmp_path, tmp_path / "kubeconfig", "n").sim_node()
    assert len(big.profile.gpus) == 8 and len(list((sysfs / "class" / "net").iterdir())) == 4
