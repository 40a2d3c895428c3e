"""NVML, the one door to the GPUs: loading it from the driver root, init and shutdown, its return
codes and strings. Shared by GPU discovery and the GPU health monitor.

The `pynvml` module is imported at run time only, so that a node without NVIDIA's library (or a
test with the simulation's fake first on the path) still imports the driver. NVML reference-counts
`nvmlInit`, so discovery's short init/shutdown pairs and the health monitor's long-lived session
do not disturb each other.

Letting go (`tandemctl release`, for a GPU reset or a driver upgrade): nvmlInit opens the device
file of every GPU (`/dev/nvidia<N>`, with `nvidiactl`, `nvidia-uvm` and the MIG capabilities),
before any handle is taken, and NVML closes them only when its reference count falls to zero
(seen on an H200 with driver 580.159.04; `NVML_INIT_FLAG_NO_ATTACH` opens none but then shows no
GPU at all). A process cannot hold some GPUs and let go of one: releasing a GPU means letting go
of NVML. So every nvmlInit of the process goes through one `NvmlAccess`, which counts them; a
release refuses new inits, has the holders shut down and waits until the count is zero, and no
init succeeds again until the reacquire. No thread initialises NVML behind the SRE's back: the
refusal is here, in the one door.

NVML's exceptions stay here too: what `init_nvml` hands out is an `NvmlDoor`, the `pynvml` module
as the driver sees it, whose `nvml*` functions raise `NvmlError` (with NVML's return code as
`value`, and NVML's message) where the library raises its `NVMLError`; its constants and ctypes
structures are the library's own. So nothing outside this module names `NVMLError`, and the
simulation's fake `pynvml` passes through the same door as the real one. A function is wrapped on
its first use and kept in the door, so the health thread's frequent calls cost one Python frame
more each.
"""

from __future__ import annotations

import ctypes
import importlib
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from types import ModuleType
from typing import Any

from driver.errors import DeviceError, NodeError, translating
from driver.node.driver_root import LIBRARY_DIRS, OutsideRoot, resolve_in_root

log = logging.getLogger(__name__)

# Return codes (stable ABI; the same in nvidia-ml-py and the simulation's fake).
ERROR_INVALID_ARGUMENT = 2
ERROR_NOT_SUPPORTED = 3
ERROR_NOT_FOUND = 6
ERROR_TIMEOUT = 10
ERROR_FUNCTION_NOT_FOUND = 13  # the library predates the function
ERROR_GPU_IS_LOST = 15
ERROR_GPU_NOT_FOUND = 28
ERROR_LIB_RM_VERSION_MISMATCH = 18  # the loaded library is not the kernel module's version
# NVML as a whole is gone (driver unloaded, library mismatch): start over with a new nvmlInit.
# UNINITIALIZED, DRIVER_NOT_LOADED, LIBRARY_NOT_FOUND, LIB_RM_VERSION_MISMATCH.
REINIT_ERRORS = frozenset({1, 9, 12, ERROR_LIB_RM_VERSION_MISMATCH})


class NvmlUnavailable(NodeError):
    """NVML cannot be used at all right now (no library, driver not loaded, init failed)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class NvmlReleased(NvmlUnavailable):
    """An SRE released NVML or a GPU (`tandemctl release`); this init must wait for a reacquire."""


class DeviceSkipped(DeviceError):
    """NVML cannot identify this device, so it is not published; args are (where, why)."""


class NvmlError(DeviceError):
    """An NVML call failed: `value` is NVML's return code (the ERROR_* constants here, or the
    door's NVML_ERROR_*), the message NVML's string for it."""

    def __init__(self, value: int, message: str) -> None:
        super().__init__(message)
        self.value = value


class NvmlDoor(ModuleType):
    """The `pynvml` module `library` with NVML's exceptions kept in (the module docstring): an
    `nvml*` function raises `NvmlError` for the library's `NVMLError`; anything else is the
    library's. `NVMLError` itself is not offered, so that no caller catches what never comes."""

    def __init__(self, library: ModuleType) -> None:
        super().__init__(library.__name__, library.__doc__)
        self._library = library

    def __getattr__(self, name: str) -> Any:  # only for names not yet in the door's namespace
        if name.startswith("NVMLError"):
            raise AttributeError(f"the NVML door raises driver.node.nvml.NvmlError, not pynvml.{name}")
        value = getattr(self._library, name)
        if name.startswith("nvml") and callable(value) and not isinstance(value, type):
            value = translating(value, self._library.NVMLError, _nvml_error)
            setattr(self, name, value)  # wrapped once; found without __getattr__ from now on
        return value


def _nvml_error(e: Any) -> NvmlError:
    return NvmlError(int(e.value), str(e))


def preload_nvml(driver_root: Path) -> Path | None:
    """Load libnvidia-ml.so.1 from the mounted host driver (e.g. /driver-root) before pynvml asks.

    pynvml dlopens the library by soname; glibc then reuses an already loaded library with that
    soname. Setting LD_LIBRARY_PATH to the host's library directory instead would pull the host's
    glibc into the container's process. With the default root `/` the normal search is right.

    Links are resolved inside the driver root (`resolve_in_root`): Debian's packaged driver links
    `libnvidia-ml.so.1` to `/etc/alternatives/...`, an absolute target that names a file of the
    host's tree, not of this pod's. Returns the file loaded.
    """
    if driver_root == Path("/"):
        return None
    for d in LIBRARY_DIRS:  # where the driver installs its 64-bit libraries, as for containers
        name = PurePosixPath(d, "libnvidia-ml.so.1")
        if not os.path.lexists(driver_root / name):
            continue
        try:
            real = resolve_in_root(driver_root, name)
        except OutsideRoot as e:
            log.warning("not loading %s: %s", driver_root / name, e)
            continue
        try:
            ctypes.CDLL(str(real), mode=ctypes.RTLD_GLOBAL)
        except OSError as e:
            log.warning("cannot load %s: %s", real, e)
            return None
        return real
    return None


class NvmlAccess:
    """Every nvmlInit and nvmlShutdown of this process, and whether an SRE has released NVML.

    One per process (`NVML_ACCESS`), as NVML's own reference count is. Listeners are told (in the
    releasing thread) whenever the release changes, so a long-lived session can close itself;
    `generation` tells a session opened before that it must.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._open = 0  # nvmlInit calls not yet matched by an nvmlShutdown
        self._released = ""  # why NVML is released; "" when it is not
        self._generation = 0
        self._listeners: list[Callable[[], None]] = []

    def subscribe(self, callback: Callable[[], None]) -> None:
        with self._cond:
            self._listeners.append(callback)

    def unsubscribe(self, callback: Callable[[], None]) -> None:
        with self._cond:
            if callback in self._listeners:  # a monitor may be stopped twice
                self._listeners.remove(callback)

    def released(self) -> str:
        """Why NVML is released (`tandemctl release`), or "" when it is not."""
        with self._cond:
            return self._released

    def generation(self) -> int:
        with self._cond:
            return self._generation

    def open_sessions(self) -> int:
        with self._cond:
            return self._open

    def init(self, driver_root: Path) -> ModuleType:
        """The `pynvml` module behind its door (`NvmlDoor`), initialised; NvmlReleased while NVML
        is released, NvmlUnavailable (with the reason) when NVML cannot be initialised."""
        try:
            nvml = NvmlDoor(importlib.import_module("pynvml"))
        except ImportError as e:
            raise NvmlUnavailable(f"the pynvml module cannot be imported: {e}") from e
        with self._cond:  # held through nvmlInit, so a release never misses an init in flight
            if self._released:
                raise NvmlReleased(self._released)
            preload_nvml(driver_root)
            try:
                nvml.nvmlInit()
            except NvmlError as e:
                why = f"nvmlInit failed: {e}"
                if e.value == ERROR_LIB_RM_VERSION_MISMATCH:  # a process keeps the library it loaded
                    why += "; the driver was upgraded under this process: restart it to load the new library"
                raise NvmlUnavailable(why) from e
            self._open += 1
        return nvml

    def shutdown(self, nvml: ModuleType) -> None:
        """The other half of `init`; a failure is logged, never raised (it is always cleanup)."""
        try:
            nvml.nvmlShutdown()
        except NvmlError as e:
            log.warning("nvmlShutdown failed: %s", e)
        with self._cond:
            self._open -= 1  # this init is matched whether or not the library agreed
            self._cond.notify_all()

    def set_released(self, why: str, timeout: float) -> bool:
        """Release NVML (`why`: what for, as refused inits report it) or, with "", take it back.
        A release refuses every init and waits until every open one is shut down (listeners are
        told, so long-lived sessions close): only then has NVML let go of the GPUs. True when that
        happened within `timeout` (or nothing was open); either way the release stays in force."""
        with self._cond:
            self._released = why
            self._generation += 1
            listeners = list(self._listeners)
        for callback in listeners:
            callback()
        if not why:
            return True
        with self._cond:
            return self._cond.wait_for(lambda: self._open == 0, timeout)

    def wait_for_change(self, generation: int, timeout: float) -> bool:
        """Block until the release changed since `generation`, or `timeout`; whether it did."""
        with self._cond:
            return self._cond.wait_for(lambda: self._generation != generation, timeout)


NVML_ACCESS = NvmlAccess()


def init_nvml(driver_root: Path) -> ModuleType:
    """`NVML_ACCESS.init`: the `pynvml` module, initialised (see `NvmlAccess.init`)."""
    return NVML_ACCESS.init(driver_root)


def shutdown_nvml(nvml: ModuleType) -> None:
    """`NVML_ACCESS.shutdown`: the other half of `init_nvml`."""
    NVML_ACCESS.shutdown(nvml)


def optional(where: str, what: str, fn: Callable[..., Any], *args: Any) -> Any:
    """Call NVML for a property the device can be published without; None (logged) when it fails."""
    try:
        return fn(*args)
    except NvmlError as e:
        log.warning("%s: %s failed (%s); publishing without %s", where, fn.__name__, e, what)
        return None


def text(value: str | bytes) -> str:
    """An NVML string (bytes in older bindings, NUL-padded buffers) as plain text."""
    return (value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)).strip("\x00").strip()
