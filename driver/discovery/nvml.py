"""NVML, the one door to the GPUs: loading it from the driver root, init and shutdown, its return
codes and strings. Shared by GPU discovery and the GPU health monitor.

The `pynvml` module is imported at run time only, so that a node without NVIDIA's library (or a
test with the simulation's fake first on the path) still imports the driver. NVML reference-counts
`nvmlInit`, so discovery's short init/shutdown pairs and the health monitor's long-lived session
do not disturb each other.
"""

from __future__ import annotations

import ctypes
import importlib
import logging
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

log = logging.getLogger(__name__)

# Return codes (stable ABI; the same in nvidia-ml-py and the simulation's fake).
ERROR_INVALID_ARGUMENT = 2
ERROR_NOT_SUPPORTED = 3
ERROR_NOT_FOUND = 6
ERROR_TIMEOUT = 10
ERROR_GPU_IS_LOST = 15
ERROR_GPU_NOT_FOUND = 28
# NVML as a whole is gone (driver unloaded, library mismatch): start over with a new nvmlInit.
# UNINITIALIZED, DRIVER_NOT_LOADED, LIBRARY_NOT_FOUND, LIB_RM_VERSION_MISMATCH.
REINIT_ERRORS = frozenset({1, 9, 12, 18})


class NvmlUnavailable(Exception):
    """NVML cannot be used at all right now (no library, driver not loaded, init failed)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class DeviceSkipped(Exception):
    """NVML cannot identify this device, so it is not published; args are (where, why)."""


_NVML_LIB_DIRS = ("usr/lib/x86_64-linux-gnu", "usr/lib/aarch64-linux-gnu", "usr/lib64", "lib64", "usr/lib")


def preload_nvml(driver_root: Path) -> Path | None:
    """Load libnvidia-ml.so.1 from the mounted host driver (e.g. /driver-root) before pynvml asks.

    pynvml dlopens the library by soname; glibc then reuses an already loaded library with that
    soname. Setting LD_LIBRARY_PATH to the host's library directory instead would pull the host's
    glibc into the container's process. With the default root `/` the normal search is right.
    """
    if driver_root == Path("/"):
        return None
    for d in _NVML_LIB_DIRS:
        candidate = driver_root / d / "libnvidia-ml.so.1"
        if candidate.exists():
            try:
                ctypes.CDLL(str(candidate), mode=ctypes.RTLD_GLOBAL)
            except OSError as e:
                log.warning("cannot load %s: %s", candidate, e)
                return None
            return candidate
    return None


def init_nvml(driver_root: Path) -> ModuleType:
    """The `pynvml` module, initialised; NvmlUnavailable (with the reason) when it cannot be."""
    try:
        nvml = importlib.import_module("pynvml")
    except ImportError as e:
        raise NvmlUnavailable(f"the pynvml module cannot be imported: {e}") from e
    preload_nvml(driver_root)
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as e:
        raise NvmlUnavailable(f"nvmlInit failed: {e}") from e
    return nvml


def shutdown_nvml(nvml: ModuleType) -> None:
    """The other half of `init_nvml`; a failure is logged, never raised (it is always cleanup)."""
    try:
        nvml.nvmlShutdown()
    except nvml.NVMLError as e:
        log.warning("nvmlShutdown failed: %s", e)


def optional(nvml: ModuleType, where: str, what: str, fn: Callable[..., Any], *args: Any) -> Any:
    """Call NVML for a property the device can be published without; None (logged) when it fails."""
    try:
        return fn(*args)
    except nvml.NVMLError as e:
        log.warning("%s: %s failed (%s); publishing without %s", where, fn.__name__, e, what)
        return None


def text(value: str | bytes) -> str:
    """An NVML string (bytes in older bindings, NUL-padded buffers) as plain text."""
    return (value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)).strip("\x00").strip()
