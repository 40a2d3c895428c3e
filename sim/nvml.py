"""Wiring for the fake `pynvml` (sim/fake_pynvml/pynvml.py): where it lives, its state file.

The fake reads a `NodeProfile` JSON file named by `TANDEM_SIM_NVML_STATE`. Tests running the
discovery in-process prepend `FAKE_PYNVML_DIR` to `sys.path`; a daemon started as a separate
process gets the same effect from `env_for()`. The state file is replaced atomically, so the fake
never reads a half-written node, and a rewrite (hot-plug, MIG change, lost GPU, injected error) is
seen by the fake at its next call.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from cdi import atomic_write
from sim.profile import GpuSpec, MigDeviceSpec, NodeProfile

FAKE_PYNVML_DIR: Path = Path(__file__).resolve().parent / "fake_pynvml"
STATE_ENV = "TANDEM_SIM_NVML_STATE"


def _replace(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, text.encode())


def write_state(profile: NodeProfile, path: Path, proc_root: Path | None = None) -> None:
    """Give the fake NVML this node (replacing any previous state in one step).

    `proc_root` is the node's rendered /proc, where the fake makes and removes the capability files
    of the MIG devices it creates, as the kernel driver does; without it the state keeps the one it
    had (a rewrite of the hardware does not move /proc).
    """
    data = json.loads(profile.to_json())
    if proc_root is None and path.exists():
        with contextlib.suppress(ValueError, OSError):
            proc_root = json.loads(path.read_text()).get("proc_root")
    if proc_root:
        data["proc_root"] = str(proc_root)
    _replace(path, json.dumps(data, indent=2))


def read_state(path: Path) -> NodeProfile:
    """The node as the fake NVML holds it now, MIG devices made or destroyed through it included."""
    raw = json.loads(path.read_text())
    raw.pop("proc_root", None)
    return NodeProfile.from_dict(raw)


def hung_at(state_path: Path) -> str:
    """The step a GPU's `nvml_hang` stopped a caller at (`before:<function>`), or "" while none has."""
    try:
        return state_path.with_name(state_path.name + ".hung").read_text().strip()
    except FileNotFoundError:
        return ""


def smi_faults_path(state_path: Path) -> Path:
    """GPU UUIDs whose `nvidia-smi compute-policy --set-timeslice` fails (sim/nvidia_smi.py)."""
    return state_path.with_name(state_path.name + ".smi-faults")


def set_compute_policy_fault(state_path: Path, uuid: str, failing: bool) -> None:
    """Make the simulated nvidia-smi fail (or work again) when it sets the time slice of `uuid`,
    as the real one fails on a GPU that fell off the bus."""
    path = smi_faults_path(state_path)
    try:
        faults = set(json.loads(path.read_text()))
    except FileNotFoundError:
        faults = set()
    faults = faults | {uuid} if failing else faults - {uuid}
    _replace(path, json.dumps(sorted(faults)))


def set_usage(state_path: Path, uuid: str, *, utilization: int | None = None, memory_used: int | None = None) -> None:
    """What the GPU or MIG device `uuid` is doing, as NVML will report it: the GPU's utilisation
    (percent) and the device's memory in use (bytes). Unchanged where None."""
    profile = read_state(state_path)
    for gpu in profile.gpus:
        devices: list[GpuSpec | MigDeviceSpec] = [gpu, *gpu.mig_devices]
        for device in devices:
            if device.uuid != uuid:
                continue
            if utilization is not None:
                if device is not gpu:
                    raise ValueError(f"{uuid} is a MIG device: NVML measures no utilisation of it")
                gpu.utilization_gpu = utilization
            if memory_used is not None:
                device.memory_used_bytes = memory_used
            write_state(profile, state_path)
            return
    raise LookupError(f"no GPU or MIG device {uuid} in {state_path}")


def write_driver_unloaded(path: Path) -> None:
    """Make the fake NVML behave as if the kernel driver were not loaded."""
    _replace(path, json.dumps({"driver_loaded": False}))


def events_path(state_path: Path) -> Path:
    return state_path.with_name(state_path.name + ".events")


def append_event(
    state_path: Path, uuid: str, event_type: int, event_data: int = 0, *, gi: int | None = None, ci: int | None = None
) -> None:
    """Raise an NVML event (e.g. nvmlEventTypeXidCriticalError with the XID as data) on a GPU.

    `uuid` is the full GPU's; `gi`/`ci` name the GPU and compute instance of a MIG device the
    event is attributed to (left out, the event carries NVML's 0xFFFFFFFF "no instance").
    One `write` of one whole line, so a reader polling the file never sees half an event.
    """
    event: dict[str, int | str] = {"uuid": uuid, "event_type": event_type, "event_data": event_data}
    if gi is not None:
        event["gi"] = gi
    if ci is not None:
        event["ci"] = ci
    line = json.dumps(event) + "\n"
    fd = os.open(events_path(state_path), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def env_for(state_path: Path) -> dict[str, str]:
    """Environment entries that make a child Python process load the fake NVML with this state."""
    existing = os.environ.get("PYTHONPATH", "")
    pythonpath = str(FAKE_PYNVML_DIR) + (os.pathsep + existing if existing else "")
    return {"PYTHONPATH": pythonpath, STATE_ENV: str(state_path)}


@contextlib.contextmanager
def fake_pynvml_in_process(state_path: Path) -> Iterator[ModuleType]:
    """Make `import pynvml` load the fake, in this process, for the duration of the block.

    Puts the fake first on `sys.path` (ahead of nvidia-ml-py's real module), points it at
    `state_path`, and afterwards restores `sys.path`, the environment and `sys.modules["pynvml"]`.
    """
    saved_module = sys.modules.pop("pynvml", None)
    saved_env = os.environ.get(STATE_ENV)
    saved_path = list(sys.path)
    sys.path.insert(0, str(FAKE_PYNVML_DIR))
    os.environ[STATE_ENV] = str(state_path)
    importlib.invalidate_caches()
    try:
        module = importlib.import_module("pynvml")
        if Path(module.__file__ or "").parent != FAKE_PYNVML_DIR:
            raise RuntimeError(f"`import pynvml` loaded {module.__file__}, not the fake")
        yield module
    finally:
        sys.modules.pop("pynvml", None)
        if saved_module is not None:
            sys.modules["pynvml"] = saved_module
        sys.path[:] = saved_path
        if saved_env is None:
            os.environ.pop(STATE_ENV, None)
        else:
            os.environ[STATE_ENV] = saved_env


# --- who holds NVML: GPU resets and driver unloads -----------------------------------------------


@dataclass(frozen=True)
class NvmlClient:
    """What one live process holds of the fake NVML (its `<state>.clients/<pid>.json`)."""

    pid: int
    initialised: int  # nvmlInit calls not yet matched by nvmlShutdown
    attached: frozenset[str]  # UUIDs of the GPUs it holds open
    inits: int  # nvmlInit calls that ever succeeded


class DeviceInUse(Exception):
    """A reset or unload the real driver would refuse, because a process holds what it needs."""


def nvml_clients(state_path: Path) -> dict[int, NvmlClient]:
    """The live processes that have used the fake NVML with this state, by PID.

    A process that died holds nothing (the kernel closed its files), whatever its file says.
    """
    out = {}
    for path in sorted(state_path.with_name(state_path.name + ".clients").glob("*.json")):
        raw = json.loads(path.read_text())
        pid = int(raw["pid"])
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        out[pid] = NvmlClient(pid, int(raw["initialised"]), frozenset(raw["attached"]), int(raw["inits"]))
    return out


def reset_gpu(profile: NodeProfile, state_path: Path, index: int) -> None:
    """`nvidia-smi -r -i <index>`: refused while a process holds the GPU, as the real reset is;
    otherwise it clears what a reset clears (the recovery action, a pending row remap)."""
    gpu = profile.gpus[index]
    users = sorted(c.pid for c in nvml_clients(state_path).values() if gpu.uuid in c.attached)
    if users:
        raise DeviceInUse(f"GPU {gpu.pci_bus_id} is in use by process(es) {users}")
    if gpu.recovery_action is not None:
        gpu.recovery_action = 0
    gpu.remapped_rows_pending = False
    write_state(profile, state_path)


def set_mig_mode(state_path: Path, index: int, enabled: bool) -> NodeProfile:
    """`nvidia-smi -i <index> -mig 1|0`: refused while a process holds the GPU, as the driver
    refuses it, and leaving MIG mode also while GPU instances exist on it. Returns the new node."""
    profile = read_state(state_path)
    gpu = profile.gpus[index]
    if not gpu.mig_capable:
        raise ValueError(f"GPU {gpu.pci_bus_id} does not support MIG")
    users = sorted(c.pid for c in nvml_clients(state_path).values() if gpu.uuid in c.attached)
    if users:
        raise DeviceInUse(f"GPU {gpu.pci_bus_id} is in use by process(es) {users}")
    if not enabled and gpu.mig_devices:
        raise DeviceInUse(f"GPU {gpu.pci_bus_id} has {len(gpu.mig_devices)} GPU instance(s): destroy them first")
    gpu.mig_mode = enabled
    write_state(profile, state_path)
    return profile


def unload_driver(state_path: Path) -> None:
    """`rmmod nvidia` before a driver upgrade: refused while any process has NVML open."""
    users = sorted(c.pid for c in nvml_clients(state_path).values() if c.initialised)
    if users:
        raise DeviceInUse(f"module nvidia is in use by process(es) {users}")
    write_driver_unloaded(state_path)
