"""The fake NVML's MIG management behaves like NVML on A100/H100/H200-class and Blackwell GPUs:
profiles and their IDs, possible placements, GPU and compute instances made and destroyed with
NVML's return codes (media engines one instance holds refused to another), the kernel driver's
capability files, failures injected at each step, and state that outlives the process."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from ctypes import byref, c_uint
from pathlib import Path
from types import ModuleType

import pytest
from mig_fakes import h100_in_mig_mode
from waiting import poll

from sim import nvml as sim_nvml
from sim.profile import A100_40GB_MIG, H200_MIG, RTX_PRO_6000_MIG, NodeProfile, h100_node
from sim.sysfs import mig_ci_cap_minor, mig_gi_cap_minor

H100_PLACEMENTS = {  # profile -> (starts, size): NVIDIA's MIG user guide, H100 80GB
    "1g.10gb": ([0, 1, 2, 3, 4, 5, 6], 1),
    "1g.10gb+me": ([0, 1, 2, 3, 4, 5, 6], 1),
    "1g.20gb": ([0, 2, 4, 6], 2),
    "2g.20gb": ([0, 2, 4], 2),
    "3g.40gb": ([0, 4], 4),
    "4g.40gb": ([0], 4),
    "7g.80gb": ([0], 8),
}


@pytest.fixture
def mig_node(tmp_path: Path) -> Iterator[tuple[ModuleType, Path, NodeProfile]]:
    with h100_in_mig_mode(tmp_path) as node:
        yield node


def _profiles(pynvml: ModuleType, handle: object) -> dict[str, object]:
    out = {}
    for enum in range(pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT):
        try:
            info = pynvml.nvmlDeviceGetGpuInstanceProfileInfo(handle, enum)
        except (pynvml.NVMLError_NotSupported, pynvml.NVMLError_InvalidArgument):
            continue
        out[info.name.decode().removeprefix("MIG ")] = info
    return out


def _placements(pynvml: ModuleType, handle: object, profile_id: int) -> list[tuple[int, int]]:
    count = c_uint(0)
    pynvml.nvmlDeviceGetGpuInstancePossiblePlacements(handle, profile_id, None, byref(count))
    array = (pynvml.c_nvmlGpuInstancePlacement_t * count.value)()
    pynvml.nvmlDeviceGetGpuInstancePossiblePlacements(handle, profile_id, array, byref(count))
    return [(p.start, p.size) for p in array[: count.value]]


def _create(pynvml: ModuleType, handle: object, profile_id: int, start: int, size: int) -> object:
    placement = pynvml.c_nvmlGpuInstancePlacement_t(start, size)
    return pynvml.nvmlDeviceCreateGpuInstanceWithPlacement(handle, profile_id, byref(placement))


def test_profiles_ids_and_placements_of_an_h100(mig_node: tuple[ModuleType, Path, NodeProfile]) -> None:
    pynvml, _, _ = mig_node
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    profiles = _profiles(pynvml, handle)
    assert sorted(profiles) == sorted(H100_PLACEMENTS)
    assert {n: p.id for n, p in profiles.items()} == {
        "1g.10gb": 19, "1g.10gb+me": 20, "1g.20gb": 15, "2g.20gb": 14, "3g.40gb": 9, "4g.40gb": 5, "7g.80gb": 0,
    }  # fmt: skip
    assert profiles["1g.10gb+me"].instanceCount == 1 and profiles["1g.10gb"].instanceCount == 7
    for name, (starts, size) in H100_PLACEMENTS.items():
        assert _placements(pynvml, handle, profiles[name].id) == [(s, size) for s in starts], name
    too_short = (pynvml.c_nvmlGpuInstancePlacement_t * 2)()
    count = c_uint(2)
    with pytest.raises(pynvml.NVMLError_InsufficientSize):
        pynvml.nvmlDeviceGetGpuInstancePossiblePlacements(handle, 19, too_short, byref(count))
    assert count.value == 7


def test_h200_and_a100_profile_names() -> None:
    # As real NVML lists them on an H200 (driver 580.159.04), and the A100 40GB of the MIG user guide.
    assert [p.name for p in H200_MIG] == [
        "1g.18gb",
        "1g.18gb+me",
        "1g.35gb",
        "2g.35gb",
        "3g.71gb",
        "4g.71gb",
        "7g.141gb",
    ]
    assert [p.name for p in A100_40GB_MIG][::3] == ["1g.5gb", "2g.10gb", "7g.40gb"]


def test_a_blackwell_refuses_an_instance_whose_media_engines_another_holds(tmp_path: Path) -> None:
    """RTX PRO 6000 Blackwell, as `nvidia-smi mig -lgip` lists it: "+me.all" holds every media
    engine, so NVML makes no other GPU instance that needs one beside it; a "-me" one needs none."""
    with h100_in_mig_mode(tmp_path, RTX_PRO_6000_MIG) as (pynvml, _, _):
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        profiles = _profiles(pynvml, handle)
        assert {n: p.id for n, p in profiles.items()} == {
            "1g.24gb": 14, "1g.24gb+me": 21, "1g.24gb+gfx": 47, "1g.24gb-me": 67, "1g.24gb+me.all": 65,
            "2g.48gb": 5, "2g.48gb+gfx": 35, "2g.48gb-me": 66, "2g.48gb+me.all": 64, "4g.96gb": 0, "4g.96gb+gfx": 32,
        }  # fmt: skip
        every = profiles["1g.24gb+me.all"]
        assert (every.decoderCount, every.encoderCount, every.jpegCount, every.ofaCount) == (4, 4, 4, 1)
        _create(pynvml, handle, 65, 0, 1)  # 1g.24gb+me.all on memory slice 0
        with pytest.raises(pynvml.NVMLError_InsufficientResources):
            _create(pynvml, handle, 14, 1, 1)  # 1g.24gb: a decoder, an encoder, a JPEG engine
        with pytest.raises(pynvml.NVMLError_InsufficientResources):
            _create(pynvml, handle, 21, 1, 1)  # 1g.24gb+me: the OFA too
        _create(pynvml, handle, 67, 1, 1)  # 1g.24gb-me: none
        _create(pynvml, handle, 66, 2, 2)  # 2g.48gb-me: none


def test_placement_rules(mig_node: tuple[ModuleType, Path, NodeProfile]) -> None:
    pynvml, _, _ = mig_node
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    _create(pynvml, handle, 9, 4, 4)  # 3g.40gb on memory slices 4-7
    with pytest.raises(pynvml.NVMLError_InsufficientResources):
        _create(pynvml, handle, 15, 6, 2)  # 1g.20gb on 6-7 overlaps it
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        _create(pynvml, handle, 14, 1, 2)  # 2g.20gb has no placement at 1
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        _create(pynvml, handle, 14, 0, 4)  # nor that size
    _create(pynvml, handle, 20, 0, 1)  # the one media-extension instance
    with pytest.raises(pynvml.NVMLError_InsufficientResources):
        _create(pynvml, handle, 20, 1, 1)  # a second: instanceCount 1 (the single OFA)
    gi = _create(pynvml, handle, 19, 3, 1)
    info = pynvml.nvmlGpuInstanceGetInfo(gi)
    assert (info.id, info.profileId, info.placement.start, info.placement.size) == (10, 19, 3, 1)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        _create(pynvml, pynvml.nvmlDeviceGetHandleByIndex(1), 19, 0, 1)  # MIG mode is off there


def test_instances_make_mig_devices_and_capabilities(
    mig_node: tuple[ModuleType, Path, NodeProfile], tmp_path: Path
) -> None:
    pynvml, state, _ = mig_node
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    gi = _create(pynvml, handle, 15, 2, 2)  # 1g.20gb on memory slices 2-3: GPU instance 4
    caps = tmp_path / "proc/driver/nvidia/capabilities/gpu0/mig"
    assert (caps / "gi4/access").read_text().startswith(f"DeviceFileMinor: {mig_gi_cap_minor(0, 4)}\n")
    with pytest.raises(pynvml.NVMLError_NotFound):
        pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, 0)  # no compute instance: no MIG device yet
    ci_info = pynvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(
        gi, pynvml.NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE, pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED
    )
    assert (ci_info.sliceCount, ci_info.name) == (1, b"MIG 1g.20gb")
    ci = pynvml.nvmlGpuInstanceCreateComputeInstance(gi, ci_info.id)
    assert pynvml.nvmlComputeInstanceGetInfo(ci).id == 0
    mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, 0)
    assert pynvml.nvmlDeviceGetName(mig) == "NVIDIA H100 80GB HBM3 MIG 1g.20gb"
    assert (pynvml.nvmlDeviceGetGpuInstanceId(mig), pynvml.nvmlDeviceGetComputeInstanceId(mig)) == (4, 0)
    assert pynvml.nvmlDeviceGetUUID(mig).startswith("MIG-")
    assert (caps / "gi4/ci0/access").read_text().startswith(f"DeviceFileMinor: {mig_ci_cap_minor(0, 4, 0)}\n")
    # The hardware outlives the process: the state file holds the instance.
    held = sim_nvml.read_state(state).gpus[0].mig_devices
    assert [(m.profile, m.gi_id, m.ci_id, m.placement_start) for m in held] == [("1g.20gb", 4, 0, 2)]
    found = (pynvml.c_nvmlGpuInstance_t * 4)()
    count = c_uint(0)
    pynvml.nvmlDeviceGetGpuInstances(handle, 15, found, byref(count))
    assert count.value == 1 and pynvml.nvmlGpuInstanceGetInfo(found[0]).id == 4
    with pytest.raises(pynvml.NVMLError_InUse):
        pynvml.nvmlGpuInstanceDestroy(gi)  # its compute instance first
    pynvml.nvmlComputeInstanceDestroy(ci)
    assert not (caps / "gi4/ci0").exists() and (caps / "gi4/access").exists()
    pynvml.nvmlGpuInstanceDestroy(gi)
    assert not (caps / "gi4").exists()
    assert sim_nvml.read_state(state).gpus[0].mig_devices == []
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        pynvml.nvmlGpuInstanceGetInfo(gi)  # a stale handle


@pytest.mark.parametrize(
    "function",
    [
        "nvmlDeviceCreateGpuInstanceWithPlacement",
        "nvmlGpuInstanceCreateComputeInstance",
        "nvmlComputeInstanceDestroy",
        "nvmlGpuInstanceDestroy",
    ],
)
def test_failure_injected_at_each_step(mig_node: tuple[ModuleType, Path, NodeProfile], function: str) -> None:
    pynvml, state, _ = mig_node
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    steps = [
        ("nvmlDeviceCreateGpuInstanceWithPlacement", lambda: _create(pynvml, handle, 19, 0, 1)),
        ("nvmlGpuInstanceCreateComputeInstance", lambda: pynvml.nvmlGpuInstanceCreateComputeInstance(gi, 0)),
        ("nvmlComputeInstanceDestroy", lambda: pynvml.nvmlComputeInstanceDestroy(ci)),
        ("nvmlGpuInstanceDestroy", lambda: pynvml.nvmlGpuInstanceDestroy(gi)),
    ]
    gi = ci = None
    for name, step in steps:
        if name == function:
            profile = sim_nvml.read_state(state)
            profile.gpus[0].nvml_errors = {function: pynvml.NVML_ERROR_UNKNOWN}
            sim_nvml.write_state(profile, state)
            with pytest.raises(pynvml.NVMLError_Unknown):
                step()
            return
        result = step()
        gi = result if name == "nvmlDeviceCreateGpuInstanceWithPlacement" else gi
        ci = result if name == "nvmlGpuInstanceCreateComputeInstance" else ci


def test_hang_stops_a_caller_at_a_step_and_lets_go(mig_node: tuple[ModuleType, Path, NodeProfile]) -> None:
    pynvml, state, _ = mig_node
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    profile = sim_nvml.read_state(state)
    profile.gpus[0].nvml_hang = "after:nvmlDeviceCreateGpuInstanceWithPlacement"
    sim_nvml.write_state(profile, state)
    done = threading.Event()
    caller = threading.Thread(target=lambda: (_create(pynvml, handle, 19, 0, 1), done.set()), daemon=True)
    caller.start()
    assert poll(lambda: sim_nvml.hung_at(state) == "after:nvmlDeviceCreateGpuInstanceWithPlacement", 10)
    assert not done.is_set()
    held = sim_nvml.read_state(state)
    assert [(m.gi_id, m.ci_id) for m in held.gpus[0].mig_devices] == [(7, None)]  # made, not yet returned
    held.gpus[0].nvml_hang = ""
    sim_nvml.write_state(held, state)
    assert done.wait(10)
    caller.join(10)


def test_mig_mode_is_not_left_while_instances_exist_or_the_gpu_is_held(
    mig_node: tuple[ModuleType, Path, NodeProfile],
) -> None:
    pynvml, state, _ = mig_node
    with pytest.raises(sim_nvml.DeviceInUse, match="in use by process"):
        sim_nvml.set_mig_mode(state, 0, False)  # this process holds NVML, so every GPU
    pynvml.nvmlShutdown()
    try:
        pynvml.nvmlInit()
        _create(pynvml, pynvml.nvmlDeviceGetHandleByIndex(0), 19, 0, 1)
        pynvml.nvmlShutdown()
        with pytest.raises(sim_nvml.DeviceInUse, match="GPU instance"):
            sim_nvml.set_mig_mode(state, 0, False)
        assert sim_nvml.set_mig_mode(state, 1, True).gpus[1].mig_mode
    finally:
        pynvml.nvmlInit()


# Read from real NVML on an H200 (driver 580.159.04, nvidia-ml-py, MIG mode off), enum by enum:
# (id, name, slices, instances, SMs, copy engines, decoders, encoders, JPEG, OFA, memory MiB,
# placements); an int is the error code NVML answered.
REAL_H200: dict[int, tuple | int] = {
    0: (19, "MIG 1g.18gb", 1, 7, 16, 1, 1, 0, 1, 0, 16384, [(s, 1) for s in range(7)]),
    1: (14, "MIG 2g.35gb", 2, 3, 32, 2, 2, 0, 2, 0, 33280, [(0, 2), (2, 2), (4, 2)]),
    2: (9, "MIG 3g.71gb", 3, 2, 60, 3, 3, 0, 3, 0, 71424, [(0, 4), (4, 4)]),
    3: (5, "MIG 4g.71gb", 4, 1, 64, 4, 4, 0, 4, 0, 71424, [(0, 4)]),
    4: (0, "MIG 7g.141gb", 7, 1, 132, 8, 7, 0, 7, 1, 143360, [(0, 8)]),
    7: (20, "MIG 1g.18gb+me", 1, 1, 16, 1, 1, 0, 1, 1, 16384, [(s, 1) for s in range(7)]),
    9: (15, "MIG 1g.35gb", 1, 4, 26, 1, 1, 0, 1, 0, 33280, [(0, 2), (2, 2), (4, 2), (6, 2)]),
    **{e: 3 for e in (5, 6, 8, 10, 11, 12, 13, 14, 15, 16)},
    17: 2,
}


def test_an_h200_answers_as_real_nvml_did(tmp_path: Path) -> None:
    profile = h100_node(gpus=1, nics=0, mig_capable=True)
    profile.gpus[0].name, profile.gpus[0].mig_profiles = "NVIDIA H200", list(H200_MIG)
    sim_nvml.write_state(profile, tmp_path / "nvml.json")
    with sim_nvml.fake_pynvml_in_process(tmp_path / "nvml.json") as pynvml:
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        for enum, real in REAL_H200.items():
            try:
                i = pynvml.nvmlDeviceGetGpuInstanceProfileInfo(handle, enum)
            except pynvml.NVMLError as e:
                assert e.value == real, enum
                continue
            seen = (i.id, i.name.decode(), i.sliceCount, i.instanceCount, i.multiprocessorCount, i.copyEngineCount,
                    i.decoderCount, i.encoderCount, i.jpegCount, i.ofaCount, i.memorySizeMB,
                    _placements(pynvml, handle, i.id))  # fmt: skip
            assert seen == real, enum
        # MIG mode off, as on that GPU:
        assert pynvml.nvmlDeviceGetMaxMigDeviceCount(handle) == 0
        with pytest.raises(pynvml.NVMLError_NotSupported):
            pynvml.nvmlDeviceGetAttributes(handle)  # MIG device handles only
        found, count = (pynvml.c_nvmlGpuInstance_t * 16)(), c_uint(5)
        pynvml.nvmlDeviceGetGpuInstances(handle, 19, found, byref(count))
        assert count.value == 0
        with pytest.raises(pynvml.NVMLError_NotFound):
            pynvml.nvmlDeviceGetGpuInstanceById(handle, 7)
        with pytest.raises(pynvml.NVMLError_NotSupported):
            _create(pynvml, handle, 19, 0, 1)
        pynvml.nvmlShutdown()
