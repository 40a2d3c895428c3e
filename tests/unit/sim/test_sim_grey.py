"""The simulated node shows every grey-failure signal as NVML and the kernel do, and `sim.grey`
changes them while a daemon runs: the fake NVML's PCIe, clocks and NVLink answers (idle links
slow down, MIG handles and lost GPUs answer as NVML does), the PCIe link and AER files of every
function and bridge, a netdev's carrier history and an RDMA port's rate and counters, each in the
kernel's own format; counters survive a second rendering and stop or wrap at their widths."""

from __future__ import annotations

import fcntl
import importlib.util
import inspect
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from sim import grey
from sim import nvml as sim_nvml
from sim.fstree import pci_device_dir
from sim.nics import rate_string
from sim.profile import NodeProfile, a100_mig_node, h100_node
from sim.sysfs import render_node

# What NVML calls each signal, and the profile field that sets it (a value unlike the default).
PCIE_CALLS = {
    "nvmlDeviceGetMaxPcieLinkGeneration": ("pcie_link_gen_max", 4),
    "nvmlDeviceGetGpuMaxPcieLinkGeneration": ("pcie_link_gen_gpu_max", 6),
    "nvmlDeviceGetCurrPcieLinkWidth": ("pcie_link_width", 8),
    "nvmlDeviceGetMaxPcieLinkWidth": ("pcie_link_width_max", 32),
    "nvmlDeviceGetPcieReplayCounter": ("pcie_replay_counter", 7),
}
NEW_CALLS = [
    *PCIE_CALLS,
    "nvmlDeviceGetCurrPcieLinkGeneration",
    "nvmlDeviceGetCurrentClocksEventReasons",
    "nvmlDeviceGetCurrentClocksThrottleReasons",
    "nvmlDeviceGetNvLinkState",
]
FI_CRC_FLIT, FI_CRC_DATA, FI_REPLAY, FI_RECOVERY = 38, 45, 52, 59
FI_LINK_COUNT, FI_PCIE_REPLAY, FI_NVLINK_STATE, FI_RECOVERY_ACTION = 91, 94, 165, 230
UINT, ULL = 1, 3  # NVML_VALUE_TYPE_UNSIGNED_INT, NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
OK, INVALID, NOT_SUPPORTED = 0, 2, 3

CORRECTABLE = ["RxErr", "BadTLP", "BadDLLP", "Rollover", "Timeout", "NonFatalErr", "CorrIntErr", "HeaderOF"]
UNCORRECTABLE = [
    "Undefined",
    "DLP",
    "SDES",
    "TLP",
    "FCP",
    "CmpltTO",
    "CmpltAbrt",
    "UnxCmplt",
    "RxOF",
    "MalfTLP",
    "ECRC",
    "UnsupReq",
    "ACSViol",
    "UncorrIntErr",
    "BlockedTLP",
    "AtomicOpBlocked",
    "TLPBlockedErr",
    "PoisonTLPBlocked",
]
PORT_COUNTERS = {
    "symbol_error",
    "link_error_recovery",
    "link_downed",
    "port_rcv_errors",
    "local_link_integrity_errors",
    "excessive_buffer_overrun_errors",
    "port_xmit_discards",
    "port_xmit_wait",
    "port_rcv_data",
    "port_xmit_data",
}
HW_COUNTERS = {
    "out_of_sequence",
    "packet_seq_err",
    "implied_nak_seq_err",
    "local_ack_timeout_err",
    "req_transport_retries_exceeded",
    "duplicate_request",
    "rnr_nak_retry_err",
    "out_of_buffer",
    "np_ecn_marked_roce_packets",
    "np_cnp_sent",
    "rp_cnp_handled",
    "rp_cnp_ignored",
}


def _aer(names: list[str], total: str, counts: dict[str, int] | None = None) -> str:
    counts = counts or {}
    return "".join(f"{n} {counts.get(n, 0)}\n" for n in [*names, total])


# --- fake NVML -------------------------------------------------------------------------------------


@pytest.fixture
def fake(tmp_path: Path) -> Iterator[tuple[ModuleType, Path]]:
    state = tmp_path / "nvml.json"
    with sim_nvml.fake_pynvml_in_process(state) as module:
        yield module, state


def _started(fake: tuple[ModuleType, Path], profile: NodeProfile) -> tuple[Any, Path, Any]:
    """The fake NVML on `profile`, initialised, and a handle to its first GPU."""
    pynvml, state = fake
    sim_nvml.write_state(profile, state)
    pynvml.nvmlInit()
    return pynvml, state, pynvml.nvmlDeviceGetHandleByIndex(0)


def _busy(gpus: int = 1) -> NodeProfile:
    profile = h100_node(gpus=gpus, nics=0)
    for gpu in profile.gpus:
        gpu.utilization_gpu = 60
    return profile


def _load(path: Path, name: str) -> ModuleType:
    """A module from its file, registered while it runs (both bindings look themselves up there)."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[name]
    return module


def test_the_new_calls_and_constants_are_nvidia_ml_pys() -> None:
    spec = importlib.util.find_spec("pynvml")
    assert spec is not None and spec.origin is not None
    assert Path(spec.origin).parent != sim_nvml.FAKE_PYNVML_DIR, "the real nvidia-ml-py must be installed"
    real = _load(Path(spec.origin), "real_pynvml_grey")
    fake = _load(sim_nvml.FAKE_PYNVML_DIR / "pynvml.py", "fake_pynvml_grey")
    for name in NEW_CALLS:
        assert list(inspect.signature(getattr(fake, name)).parameters) == list(
            inspect.signature(getattr(real, name)).parameters
        ), name
    reasons = [n for n in vars(fake) if n.startswith("nvmlClocksEventReason")]
    assert len(reasons) == 10
    for name in [*reasons, "NVML_NVLINK_STATE_ACTIVE", "NVML_NVLINK_STATE_INACTIVE", "NVML_FEATURE_ENABLED"]:
        assert getattr(fake, name) == getattr(real, name), name
    for fid in (FI_CRC_FLIT, FI_CRC_DATA, FI_REPLAY, FI_RECOVERY, FI_LINK_COUNT, FI_PCIE_REPLAY, FI_NVLINK_STATE):
        names = [n for n, v in vars(real).items() if n.startswith("NVML_FI_DEV_") and v == fid]
        assert names and all(getattr(fake, n) == fid for n in names), fid


def test_a_healthy_h100_under_load(fake: tuple[ModuleType, Path]) -> None:
    pynvml, _, handle = _started(fake, _busy())
    assert pynvml.nvmlDeviceGetCurrPcieLinkGeneration(handle) == 5
    assert pynvml.nvmlDeviceGetMaxPcieLinkGeneration(handle) == 5
    assert pynvml.nvmlDeviceGetGpuMaxPcieLinkGeneration(handle) == 5
    assert pynvml.nvmlDeviceGetCurrPcieLinkWidth(handle) == 16
    assert pynvml.nvmlDeviceGetMaxPcieLinkWidth(handle) == 16
    assert pynvml.nvmlDeviceGetPcieReplayCounter(handle) == 0
    assert pynvml.nvmlDeviceGetCurrentClocksEventReasons(handle) == 0
    assert [pynvml.nvmlDeviceGetNvLinkState(handle, link) for link in range(18)] == [1] * 18


def test_each_pcie_call_reports_its_own_field(fake: tuple[ModuleType, Path]) -> None:
    pynvml, state, handle = _started(fake, _busy())
    uuid = pynvml.nvmlDeviceGetUUID(handle)
    for call, (field, value) in PCIE_CALLS.items():
        assert getattr(pynvml, call)(handle) != value, call
        grey.set_gpu_signals(state, uuid, **{field: value})
        assert getattr(pynvml, call)(handle) == value, call


def test_an_idle_gpu_slows_its_link_and_says_it_is_idle(fake: tuple[ModuleType, Path]) -> None:
    """Real NVIDIA GPUs drop the link's speed while idle; NVML names the idleness in the clocks
    event reasons, which is how a reader tells the downshift from a degraded link."""
    pynvml, state, handle = _started(fake, h100_node(gpus=1, nics=0))  # utilisation 0
    uuid = pynvml.nvmlDeviceGetUUID(handle)
    assert pynvml.nvmlDeviceGetCurrPcieLinkGeneration(handle) == 1
    assert pynvml.nvmlDeviceGetMaxPcieLinkGeneration(handle) == 5
    assert pynvml.nvmlDeviceGetCurrentClocksEventReasons(handle) == pynvml.nvmlClocksEventReasonGpuIdle
    grey.set_gpu_signals(state, uuid, pcie_link_gen=3, pcie_idle_gen=4)
    assert pynvml.nvmlDeviceGetCurrPcieLinkGeneration(handle) == 3  # never above what it trained to
    sim_nvml.set_usage(state, uuid, utilization=40)
    assert pynvml.nvmlDeviceGetCurrPcieLinkGeneration(handle) == 3
    grey.set_gpu_signals(state, uuid, pcie_link_gen=5)
    assert pynvml.nvmlDeviceGetCurrPcieLinkGeneration(handle) == 5
    assert pynvml.nvmlDeviceGetCurrentClocksEventReasons(handle) == 0


def test_clocks_event_reasons_add_the_profiles_bits_to_idleness(fake: tuple[ModuleType, Path]) -> None:
    pynvml, state, handle = _started(fake, _busy())
    uuid = pynvml.nvmlDeviceGetUUID(handle)
    held = pynvml.nvmlClocksEventReasonHwThermalSlowdown | pynvml.nvmlClocksEventReasonHwPowerBrakeSlowdown
    grey.set_gpu_signals(state, uuid, clocks_event_reasons=held)
    assert pynvml.nvmlDeviceGetCurrentClocksEventReasons(handle) == 0xC0
    assert pynvml.nvmlDeviceGetCurrentClocksThrottleReasons(handle) == 0xC0
    sim_nvml.set_usage(state, uuid, utilization=0)
    assert pynvml.nvmlDeviceGetCurrentClocksEventReasons(handle) == 0xC1


def test_nvlink_state_per_link(fake: tuple[ModuleType, Path]) -> None:
    pynvml, state, handle = _started(fake, _busy())
    grey.set_gpu_signals(state, pynvml.nvmlDeviceGetUUID(handle), nvlink_down=[3, 17])
    states = [pynvml.nvmlDeviceGetNvLinkState(handle, link) for link in range(18)]
    assert [link for link, s in enumerate(states) if s == pynvml.NVML_FEATURE_DISABLED] == [3, 17]
    assert states.count(pynvml.NVML_FEATURE_ENABLED) == 16
    for link in (18, -1):
        with pytest.raises(pynvml.NVMLError_InvalidArgument):
            pynvml.nvmlDeviceGetNvLinkState(handle, link)


def test_a_gpu_without_nvlink_does_not_support_it(fake: tuple[ModuleType, Path]) -> None:
    pynvml, _, handle = _started(fake, a100_mig_node(gpus=1, per_gpu=0))  # nvlink_count 0
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceGetNvLinkState(handle, 0)
    fields = [FI_LINK_COUNT, (FI_NVLINK_STATE, 0), FI_CRC_FLIT, FI_CRC_DATA, FI_REPLAY, FI_RECOVERY, FI_PCIE_REPLAY]
    values = pynvml.nvmlDeviceGetFieldValues(handle, fields)
    assert [v.nvmlReturn for v in values] == [NOT_SUPPORTED] * 6 + [OK]


def test_field_values_of_the_link_and_nvlink(fake: tuple[ModuleType, Path]) -> None:
    pynvml, state, handle = _started(fake, _busy())
    grey.set_gpu_signals(
        state,
        pynvml.nvmlDeviceGetUUID(handle),
        pcie_replay_counter=12,
        nvlink_down=[5],
        nvlink_errors={"crc_flit": 2**33, "crc_data": 4, "replay": 5, "recovery": 6},
        recovery_action=1,
    )
    fields = [FI_PCIE_REPLAY, FI_LINK_COUNT, (FI_NVLINK_STATE, 5), (FI_NVLINK_STATE, 0), (FI_NVLINK_STATE, 18)]
    fields += [FI_CRC_FLIT, FI_CRC_DATA, FI_REPLAY, FI_RECOVERY, FI_RECOVERY_ACTION, 1]
    values = pynvml.nvmlDeviceGetFieldValues(handle, fields)
    assert [v.nvmlReturn for v in values] == [OK] * 4 + [INVALID] + [OK] * 5 + [NOT_SUPPORTED]
    assert [(v.fieldId, v.scopeId) for v in values[2:5]] == [(165, 5), (165, 0), (165, 18)]
    uints = [values[i] for i in (0, 1, 2, 3, 9)]
    assert [v.valueType for v in uints] == [UINT] * 5
    assert [v.value.uiVal for v in uints] == [12, 18, pynvml.NVML_NVLINK_STATE_INACTIVE, 1, 1]
    totals = values[5:9]
    assert [v.valueType for v in totals] == [ULL] * 4
    assert [v.value.ullVal for v in totals] == [2**33, 4, 5, 6]


def test_a_mig_device_handle_supports_none_of_it(fake: tuple[ModuleType, Path]) -> None:
    profile = a100_mig_node(gpus=1, per_gpu=1)
    profile.gpus[0].nvlink_count = 12
    pynvml, _, handle = _started(fake, profile)
    mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, 0)
    for call in NEW_CALLS:
        args = (mig, 0) if call == "nvmlDeviceGetNvLinkState" else (mig,)
        getattr(pynvml, call)(handle, *args[1:])  # the GPU's own handle answers
        with pytest.raises(pynvml.NVMLError_NotSupported):
            getattr(pynvml, call)(*args)
    fields = [FI_PCIE_REPLAY, FI_LINK_COUNT, (FI_NVLINK_STATE, 0), FI_CRC_FLIT, FI_REPLAY, FI_RECOVERY_ACTION]
    assert [v.nvmlReturn for v in pynvml.nvmlDeviceGetFieldValues(handle, fields)] == [OK] * 6
    assert [v.nvmlReturn for v in pynvml.nvmlDeviceGetFieldValues(mig, fields)] == [NOT_SUPPORTED] * 6


@pytest.mark.parametrize("call", [*NEW_CALLS, "nvmlDeviceGetFieldValues"])
def test_injected_errors_and_a_lost_gpu_reach_every_new_call(fake: tuple[ModuleType, Path], call: str) -> None:
    pynvml, state, handle = _started(fake, _busy())
    uuid = pynvml.nvmlDeviceGetUUID(handle)
    args = {"nvmlDeviceGetNvLinkState": (0,), "nvmlDeviceGetFieldValues": ([FI_PCIE_REPLAY],)}.get(call, ())
    getattr(pynvml, call)(handle, *args)
    grey.set_gpu_signals(state, uuid, nvml_errors={call: pynvml.NVML_ERROR_UNKNOWN})
    with pytest.raises(pynvml.NVMLError_Unknown):
        getattr(pynvml, call)(handle, *args)
    others = [c for c in NEW_CALLS if c != call]
    for other in others:  # an error injected under one name is that call's alone
        getattr(pynvml, other)(handle, *((0,) if other == "nvmlDeviceGetNvLinkState" else ()))
    grey.set_gpu_signals(state, uuid, nvml_errors={}, lost=True)
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        getattr(pynvml, call)(handle, *args)


def test_state_written_before_the_signals_existed_reads_as_a_healthy_gpu(fake: tuple[ModuleType, Path]) -> None:
    new = {
        "pcie_link_gen",
        "pcie_link_gen_max",
        "pcie_link_gen_gpu_max",
        "pcie_idle_gen",
        "pcie_link_width",
        "pcie_link_width_max",
        "pcie_replay_counter",
        "clocks_event_reasons",
        "nvlink_count",
        "nvlink_down",
        "nvlink_errors",
    }
    node = h100_node(gpus=2, nics=1)
    node.gpus[0].utilization_gpu = 60
    raw = json.loads(node.to_json())
    raw["gpus"] = [{k: v for k, v in g.items() if k not in new} for g in raw["gpus"]]
    raw["nics"] = [{k: v for k, v in n.items() if k != "fw_ver"} for n in raw["nics"]]
    profile = NodeProfile.from_dict(raw)
    gpu = profile.gpus[0]
    assert (gpu.pcie_link_gen, gpu.pcie_idle_gen, gpu.pcie_link_width, gpu.nvlink_count) == (5, 1, 16, 0)
    assert (gpu.nvlink_down, gpu.nvlink_errors, gpu.clocks_event_reasons) == ([], {}, 0)
    assert profile.nics[0].fw_ver == "28.39.1002"
    pynvml, state = fake
    state.write_text(json.dumps(raw))
    pynvml.nvmlInit()
    busy, idle = pynvml.nvmlDeviceGetHandleByIndex(0), pynvml.nvmlDeviceGetHandleByIndex(1)
    calls = ["nvmlDeviceGetCurrPcieLinkGeneration", *PCIE_CALLS, "nvmlDeviceGetCurrentClocksEventReasons"]
    assert [getattr(pynvml, call)(busy) for call in calls] == [5, 5, 5, 16, 16, 0, 0]
    assert [getattr(pynvml, call)(idle) for call in calls] == [1, 5, 5, 16, 16, 0, 1]
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceGetNvLinkState(busy, 0)


def test_set_gpu_signals_refuses_unknown_fields_and_gpus(tmp_path: Path) -> None:
    state, proc = tmp_path / "nvml.json", tmp_path / "proc"
    profile = h100_node(gpus=2, nics=0)
    sim_nvml.write_state(profile, state, proc)
    before = state.read_text()
    with pytest.raises(ValueError, match="pcie_link_speed"):
        grey.set_gpu_signals(state, profile.gpus[0].uuid, pcie_link_gen=3, pcie_link_speed=3)
    with pytest.raises(LookupError):
        grey.set_gpu_signals(state, "GPU-nope", pcie_link_gen=3)
    assert state.read_text() == before
    grey.set_gpu_signals(state, profile.gpus[1].uuid, pcie_link_gen=3, nvlink_down=[1])
    after = sim_nvml.read_state(state)
    assert (after.gpus[1].pcie_link_gen, after.gpus[1].nvlink_down) == (3, [1])
    assert (after.gpus[0].pcie_link_gen, after.gpus[0].nvlink_down) == (5, [])
    assert json.loads(state.read_text())["proc_root"] == str(proc)  # the MIG capabilities still land there


def test_set_gpu_signals_changes_the_state_under_the_fakes_lock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fake NVML holds `<state>.lock` while it rewrites the state (a MIG change): a test's
    change made then would lose the daemon's, or the daemon's the test's."""
    state = tmp_path / "nvml.json"
    profile = h100_node(gpus=1, nics=0)
    sim_nvml.write_state(profile, state)
    held_while_read: list[bool] = []
    read = sim_nvml.read_state

    def probing(path: Path) -> NodeProfile:
        fd = os.open(f"{state}.lock", os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            held_while_read.append(False)
        except BlockingIOError:
            held_while_read.append(True)
        finally:
            os.close(fd)
        return read(path)

    monkeypatch.setattr(grey, "read_state", probing)
    grey.set_gpu_signals(state, profile.gpus[0].uuid, pcie_replay_counter=1)
    assert held_while_read == [True]


# --- sysfs -----------------------------------------------------------------------------------------


def render(tmp_path: Path, profile: NodeProfile) -> Path:
    sysfs = tmp_path / "sys"
    render_node(profile, sysfs, tmp_path / "dev", tmp_path / "proc")
    return sysfs


def _fn(sysfs: Path, bdf: str) -> Path:
    return (sysfs / "bus" / "pci" / "devices" / bdf).resolve()


def _link(directory: Path) -> tuple[str, ...]:
    names = ("current_link_speed", "current_link_width", "max_link_speed", "max_link_width")
    return tuple((directory / n).read_text() for n in names)


GEN5_X16 = ("32.0 GT/s PCIe\n", "16\n", "32.0 GT/s PCIe\n", "16\n")


def test_every_function_and_bridge_shows_its_link_and_aer_statistics(tmp_path: Path) -> None:
    profile = h100_node(gpus=2, nics=1)
    sysfs = render(tmp_path, profile)
    devices = [*(g.pci_bus_id for g in profile.gpus), profile.nics[0].pci_address]
    bridges = {b for g in profile.gpus for b in g.pcie_bridges} | set(profile.nics[0].pcie_bridges)
    assert len(bridges) == 5  # a root port, a switch's upstream port, a downstream port each
    for bdf in [*devices, *bridges]:
        fn = _fn(sysfs, bdf)
        assert _link(fn) == GEN5_X16, bdf
        assert (fn / "aer_dev_correctable").read_text() == _aer(CORRECTABLE, "TOTAL_ERR_COR"), bdf
        assert (fn / "aer_dev_nonfatal").read_text() == _aer(UNCORRECTABLE, "TOTAL_ERR_NONFATAL"), bdf
        assert (fn / "aer_dev_fatal").read_text() == _aer(UNCORRECTABLE, "TOTAL_ERR_FATAL"), bdf


def test_a_gpus_function_and_its_port_show_the_link_it_trained_to(tmp_path: Path) -> None:
    profile = h100_node(gpus=1, nics=0)
    gpu = profile.gpus[0]
    gpu.pcie_link_gen, gpu.pcie_link_width, gpu.pcie_link_gen_gpu_max = 4, 8, 5
    sysfs = render(tmp_path, profile)
    trained = ("16.0 GT/s PCIe\n", "8\n", "32.0 GT/s PCIe\n", "16\n")
    assert _link(_fn(sysfs, gpu.pci_bus_id)) == trained
    root_port, upstream, downstream = gpu.pcie_bridges
    assert _link(_fn(sysfs, downstream)) == trained
    assert _link(_fn(sysfs, upstream)) == _link(_fn(sysfs, root_port)) == GEN5_X16


def test_a_netdevs_carrier_history_starts_with_its_link(tmp_path: Path) -> None:
    profile = h100_node(gpus=0, nics=2)
    profile.nics[1].operstate = "down"
    sysfs = render(tmp_path, profile)
    for nic, counts in zip(profile.nics, (("1\n", "0\n", "1\n"), ("0\n", "0\n", "0\n")), strict=True):
        net = sysfs / "class" / "net" / nic.ifname
        names = ("carrier_up_count", "carrier_down_count", "carrier_changes")
        assert tuple((net / n).read_text() for n in names) == counts


def test_an_rdma_device_shows_its_firmware_rate_and_zeroed_counters(tmp_path: Path) -> None:
    profile = h100_node(gpus=0, nics=1)
    sysfs = render(tmp_path, profile)
    rdma = sysfs / "class" / "infiniband" / "mlx5_0"
    assert (rdma / "fw_ver").read_text() == "28.39.1002\n"
    port = rdma / "ports" / "1"
    assert (port / "rate").read_text() == "400 Gb/sec (4X NDR)\n"
    assert {p.name: p.read_text() for p in (port / "counters").iterdir()} == dict.fromkeys(PORT_COUNTERS, "0\n")
    hw = {p.name: p.read_text() for p in (port / "hw_counters").iterdir()}
    assert hw == {**dict.fromkeys(HW_COUNTERS, "0\n"), "lifespan": "10\n"}


@pytest.mark.parametrize(
    ("mbps", "rate"),
    [
        (800000, "800 Gb/sec (8X NDR)\n"),
        (400000, "400 Gb/sec (4X NDR)\n"),
        (200000, "200 Gb/sec (4X HDR)\n"),
        (100000, "100 Gb/sec (4X EDR)\n"),
        (50000, "50 Gb/sec (2X EDR)\n"),
        (40000, "40 Gb/sec (4X QDR)\n"),
        (25000, "25 Gb/sec (1X EDR)\n"),
        (10000, "10 Gb/sec (1X QDR)\n"),
        (-1, "2.5 Gb/sec (1X SDR)\n"),  # a link down: the kernel's default
    ],
)
def test_a_ports_rate_as_the_kernel_prints_it(mbps: int, rate: str) -> None:
    assert rate_string(mbps) == rate


def test_rendering_again_keeps_what_the_running_node_changed(tmp_path: Path) -> None:
    profile = h100_node(gpus=1, nics=1)
    sysfs = render(tmp_path, profile)
    nic, gpu = profile.nics[0], profile.gpus[0]
    grey.set_pcie_link(sysfs, nic.pci_address, speed_gts=8.0, width=4)
    grey.add_aer(sysfs, gpu.pci_bus_id, "correctable", "BadTLP", 2)
    grey.flap(sysfs, nic.ifname)
    grey.add_port_counter(sysfs, nic.rdma_device, 1, "symbol_error", 3)
    grey.add_port_counter(sysfs, nic.rdma_device, 1, "out_of_sequence", 4)
    files = {p.resolve() for p in (sysfs / "devices").rglob("*") if p.is_file() and p.name != "config"}
    before = {p: p.read_text() for p in files}
    nic.fw_ver = "28.40.1000"
    render(tmp_path, profile)
    after = {p: p.read_text() for p in files}
    rdma = sysfs / "class" / "infiniband" / nic.rdma_device
    assert {p for p in before if before[p] != after[p]} == {(rdma / "fw_ver").resolve()}  # the profile's change
    assert (_fn(sysfs, nic.pci_address) / "current_link_width").read_text() == "4\n"
    assert (rdma / "ports" / "1" / "counters" / "symbol_error").read_text() == "3\n"


# --- sim.grey on sysfs -----------------------------------------------------------------------------


@pytest.fixture
def node(tmp_path: Path) -> tuple[Path, NodeProfile]:
    profile = h100_node(gpus=2, nics=2)
    return render(tmp_path, profile), profile


def test_set_pcie_link_retrains_the_function_and_the_port_above_it(node: tuple[Path, NodeProfile]) -> None:
    sysfs, profile = node
    nic = profile.nics[0]
    root_port, upstream, downstream = nic.pcie_bridges
    grey.set_pcie_link(sysfs, nic.pci_address, width=8)
    degraded = ("32.0 GT/s PCIe\n", "8\n", "32.0 GT/s PCIe\n", "16\n")
    assert _link(_fn(sysfs, nic.pci_address)) == _link(_fn(sysfs, downstream)) == degraded
    grey.set_pcie_link(sysfs, nic.pci_address, speed_gts=16.0)
    slower = ("16.0 GT/s PCIe\n", "8\n", "32.0 GT/s PCIe\n", "16\n")
    assert _link(_fn(sysfs, nic.pci_address)) == _link(_fn(sysfs, downstream)) == slower
    assert _link(_fn(sysfs, upstream)) == _link(_fn(sysfs, root_port)) == GEN5_X16
    assert _link(_fn(sysfs, profile.nics[1].pci_address)) == GEN5_X16
    grey.set_pcie_link(sysfs, upstream, speed_gts=2.5, width=1)  # a switch's uplink: the root port trains too
    assert _link(_fn(sysfs, root_port))[:2] == _link(_fn(sysfs, upstream))[:2] == ("2.5 GT/s PCIe\n", "1\n")


def test_set_pcie_link_refuses_a_link_no_end_could_train_to(node: tuple[Path, NodeProfile]) -> None:
    sysfs, profile = node
    bdf = profile.gpus[0].pci_bus_id
    for speed, width in ((20.0, None), (64.0, None), (None, 32), (None, 0)):
        with pytest.raises(ValueError):
            grey.set_pcie_link(sysfs, bdf, speed_gts=speed, width=width)
    assert _link(_fn(sysfs, bdf)) == GEN5_X16
    with pytest.raises(LookupError):
        grey.set_pcie_link(sysfs, "0000:ee:00.0", width=8)


def test_set_pcie_link_of_a_function_on_the_root_bus_has_no_port_to_change(tmp_path: Path) -> None:
    fn = pci_device_dir(tmp_path, "0000:00:02.0", "pci0000:00", 0, 0x15B3, 0x1021, None)
    grey.set_pcie_link(tmp_path, "0000:00:02.0", speed_gts=8.0)
    assert _link(fn) == ("8.0 GT/s PCIe\n", "16\n", "32.0 GT/s PCIe\n", "16\n")
    assert not (fn.parent / "current_link_speed").exists()


def test_add_aer_raises_the_named_line_and_the_total(node: tuple[Path, NodeProfile]) -> None:
    sysfs, profile = node
    bdf, port = profile.gpus[0].pci_bus_id, profile.gpus[0].pcie_bridges[-1]
    grey.add_aer(sysfs, bdf, "correctable", "BadTLP", 3)
    grey.add_aer(sysfs, bdf, "correctable", "RxErr")
    grey.add_aer(sysfs, port, "nonfatal", "CmpltTO", 2)
    grey.add_aer(sysfs, bdf, "fatal", "PoisonTLPBlocked")
    fn = _fn(sysfs, bdf)
    assert (fn / "aer_dev_correctable").read_text() == _aer(
        CORRECTABLE, "TOTAL_ERR_COR", {"BadTLP": 3, "RxErr": 1, "TOTAL_ERR_COR": 4}
    )
    assert (fn / "aer_dev_nonfatal").read_text() == _aer(UNCORRECTABLE, "TOTAL_ERR_NONFATAL")
    assert (fn / "aer_dev_fatal").read_text() == _aer(
        UNCORRECTABLE, "TOTAL_ERR_FATAL", {"PoisonTLPBlocked": 1, "TOTAL_ERR_FATAL": 1}
    )
    assert (_fn(sysfs, port) / "aer_dev_nonfatal").read_text() == _aer(
        UNCORRECTABLE, "TOTAL_ERR_NONFATAL", {"CmpltTO": 2, "TOTAL_ERR_NONFATAL": 2}
    )
    for severity, name, n in (("uncorrectable", "DLP", 1), ("correctable", "CmpltTO", 1), ("fatal", "DLP", -1)):
        with pytest.raises(ValueError):
            grey.add_aer(sysfs, bdf, severity, name, n)


def test_flap_takes_the_carrier_down_and_up(node: tuple[Path, NodeProfile]) -> None:
    sysfs, profile = node
    net = sysfs / "class" / "net" / profile.nics[0].ifname
    (net / "carrier").write_text("0\n")
    grey.flap(sysfs, profile.nics[0].ifname, times=2)
    grey.flap(sysfs, profile.nics[0].ifname)
    names = ("carrier_down_count", "carrier_up_count", "carrier_changes", "carrier")
    assert tuple((net / n).read_text() for n in names) == ("3\n", "4\n", "7\n", "1\n")
    other = sysfs / "class" / "net" / profile.nics[1].ifname
    assert (other / "carrier_changes").read_text() == "1\n"


def test_only_a_link_that_is_up_can_flap(tmp_path: Path) -> None:
    profile = h100_node(gpus=0, nics=1)
    profile.nics[0].operstate = "down"
    sysfs = render(tmp_path, profile)
    with pytest.raises(ValueError):
        grey.flap(sysfs, profile.nics[0].ifname)
    with pytest.raises(LookupError):
        grey.flap(sysfs, "eth9")


@pytest.mark.parametrize(
    ("name", "adds", "value"),
    [
        ("symbol_error", [65534, 10, 1], 65535),  # 16 bits: stops at all ones and stays
        ("link_error_recovery", [300], 255),
        ("link_downed", [254, 1], 255),
        ("port_rcv_errors", [70000], 65535),
        ("local_link_integrity_errors", [9, 9], 15),
        ("excessive_buffer_overrun_errors", [16], 15),
        ("port_xmit_discards", [65536], 65535),
        ("port_xmit_wait", [2**32 + 5], 2**32 - 1),
        ("port_xmit_data", [2**40], 2**40),
        ("out_of_sequence", [2**32 - 1, 3], 2),  # 32 bits: wraps around
        ("local_ack_timeout_err", [2**32], 0),
        ("np_cnp_sent", [2**32 + 5], 2**32 + 5),  # 64 bits
        ("rp_cnp_handled", [2**64 - 1, 2], 1),
    ],
)
def test_port_counters_stop_or_wrap_at_their_width(
    node: tuple[Path, NodeProfile], name: str, adds: list[int], value: int
) -> None:
    sysfs, profile = node
    for n in adds:
        grey.add_port_counter(sysfs, profile.nics[1].rdma_device, 1, name, n)
    group = "counters" if name in PORT_COUNTERS else "hw_counters"
    port = sysfs / "class" / "infiniband" / profile.nics[1].rdma_device / "ports" / "1"
    assert (port / group / name).read_text() == f"{value}\n"
    assert (sysfs / "class/infiniband" / profile.nics[0].rdma_device / "ports/1" / group / name).read_text() == "0\n"


def test_add_port_counter_refuses_what_is_no_counter(node: tuple[Path, NodeProfile]) -> None:
    sysfs, profile = node
    rdma = profile.nics[0].rdma_device
    for name, n in (("lifespan", 1), ("symbol_errors", 1), ("symbol_error", -1)):
        with pytest.raises(ValueError):
            grey.add_port_counter(sysfs, rdma, 1, name, n)
    with pytest.raises(LookupError):
        grey.add_port_counter(sysfs, rdma, 2, "symbol_error", 1)
    with pytest.raises(LookupError):
        grey.add_port_counter(sysfs, "mlx5_9", 1, "symbol_error", 1)


def test_set_netdev_speed_changes_the_speed_and_the_ports_rate(node: tuple[Path, NodeProfile]) -> None:
    sysfs, profile = node
    nic, other = profile.nics
    grey.set_netdev_speed(sysfs, nic.ifname, 200000)
    assert (sysfs / "class" / "net" / nic.ifname / "speed").read_text() == "200000\n"
    port = sysfs / "class" / "infiniband" / nic.rdma_device / "ports" / "1"
    assert (port / "rate").read_text() == "200 Gb/sec (4X HDR)\n"
    assert (sysfs / "class" / "net" / other.ifname / "speed").read_text() == "400000\n"
    assert (sysfs / "class/infiniband" / other.rdma_device / "ports/1/rate").read_text() == "400 Gb/sec (4X NDR)\n"


def test_each_change_replaces_a_file_in_one_step(node: tuple[Path, NodeProfile]) -> None:
    """A new file takes the old one's name: a reader that opened the old one reads it whole, and
    nothing half-written stays beside it."""
    sysfs, profile = node
    nic = profile.nics[0]
    counter = sysfs / "class" / "infiniband" / nic.rdma_device / "ports" / "1" / "counters" / "link_downed"
    with counter.open() as reader:
        grey.add_port_counter(sysfs, nic.rdma_device, 1, "link_downed", 1)
        assert (reader.read(), counter.read_text()) == ("0\n", "1\n")
    grey.set_pcie_link(sysfs, nic.pci_address, width=4)
    grey.add_aer(sysfs, nic.pci_address, "fatal", "DLP")
    grey.flap(sysfs, nic.ifname)
    grey.set_netdev_speed(sysfs, nic.ifname, 100000)
    assert [p for p in sysfs.rglob("*") if p.name.startswith(".")] == []
