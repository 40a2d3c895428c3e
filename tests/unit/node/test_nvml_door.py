"""The NVML door keeps NVML's exceptions in: what `init_nvml` hands out raises `NvmlError` (a
Tandem `DeviceError` with NVML's return code) where pynvml raises its `NVMLError`, and nothing
outside the door names `NVMLError`. The fake pynvml passes through it as the real one does."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from driver.node.nvml import ERROR_GPU_IS_LOST, NvmlDoor, NvmlError, NvmlUnavailable, init_nvml, shutdown_nvml
from sim import nvml as sim_nvml
from sim.profile import NodeProfile, h100_node

DRIVER = Path(__file__).resolve().parents[3] / "driver"
DOOR = DRIVER / "node" / "nvml.py"


class Node:
    def __init__(self, door: ModuleType, library: ModuleType, profile: NodeProfile, state: Path) -> None:
        self.door, self.library, self.profile, self.state = door, library, profile, state

    def fail(self, gpu: int, function: str, code: int) -> None:
        self.profile.gpus[gpu].nvml_errors = {function: code}
        sim_nvml.write_state(self.profile, self.state)


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    """Two GPUs behind the fake pynvml; NVML initialised through the door, as the driver does."""
    profile = h100_node(gpus=2, nics=0)
    state = tmp_path / "nvml.json"
    sim_nvml.write_state(profile, state)
    with sim_nvml.fake_pynvml_in_process(state) as library:
        door = init_nvml(Path("/"))
        try:
            yield Node(door, library, profile, state)
        finally:
            shutdown_nvml(door)


def test_an_nvml_failure_surfaces_as_tandems_error(node: Node) -> None:
    nvml = node.door
    handle = nvml.nvmlDeviceGetHandleByIndex(1)
    node.fail(1, "nvmlDeviceGetUUID", ERROR_GPU_IS_LOST)
    with pytest.raises(NvmlError) as caught:
        nvml.nvmlDeviceGetUUID(handle)
    e = caught.value
    assert not isinstance(e, node.library.NVMLError)
    assert e.value == ERROR_GPU_IS_LOST == nvml.NVML_ERROR_GPU_IS_LOST
    assert str(e) == str(node.library.NVMLError(ERROR_GPU_IS_LOST))  # NVML's own message
    assert e.kind == "device"
    assert isinstance(e.__cause__, node.library.NVMLError)  # kept for the log's traceback


def test_the_door_is_the_library_but_for_its_errors(node: Node) -> None:
    nvml, library = node.door, node.library
    assert isinstance(nvml, NvmlDoor) and isinstance(nvml, ModuleType)  # callers' annotations hold
    assert nvml.NVML_ERROR_NOT_SUPPORTED == library.NVML_ERROR_NOT_SUPPORTED
    assert nvml.c_nvmlGpuInstancePlacement_t is library.c_nvmlGpuInstancePlacement_t
    assert int(nvml.nvmlDeviceGetCount()) == 2
    for name in ("NVMLError", "NVMLError_GpuIsLost"):
        with pytest.raises(AttributeError, match="NvmlError"):
            getattr(nvml, name)
    with pytest.raises(AttributeError):
        nvml.nvmlNoSuchFunction  # noqa: B018  (getattr with a default, for newer functions, must work)


def test_a_function_is_wrapped_once_and_keeps_its_name(node: Node) -> None:
    """The health thread calls NVML often: after the first call a function is found directly."""
    first = node.door.nvmlDeviceGetCount
    assert node.door.nvmlDeviceGetCount is first
    assert "nvmlDeviceGetCount" in vars(node.door)
    assert first.__name__ == "nvmlDeviceGetCount"  # what `optional` logs


def test_a_failed_init_is_nvml_unavailable(tmp_path: Path) -> None:
    """NvmlAccess.init catches the door's error for the failed nvmlInit (the library's would escape)."""
    profile = h100_node(gpus=1, nics=0)
    state = tmp_path / "nvml.json"
    sim_nvml.write_state(profile, state)
    sim_nvml.write_driver_unloaded(state)
    with sim_nvml.fake_pynvml_in_process(state) as library, pytest.raises(NvmlUnavailable) as caught:
        init_nvml(Path("/"))
    assert isinstance(caught.value.__cause__, NvmlError)
    assert caught.value.__cause__.value == library.NVML_ERROR_DRIVER_NOT_LOADED


def test_nothing_outside_the_door_imports_pynvml_or_names_its_error() -> None:
    """pynvml is imported at run time, so import-linter cannot see who uses it: this guard can."""
    naming = [
        f"{path.relative_to(DRIVER.parent)}:{n}: {line.strip()}"
        for path in sorted(DRIVER.rglob("*.py"))
        if path != DOOR
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"NVMLError|import pynvml|import_module\(.pynvml", line)
    ]
    assert naming == [], "go through driver.node.nvml (init_nvml) and catch its NvmlError"
