"""A stand-in for nvidia-ml-py's `pynvml` module, driven by a simulated node's state file.

Put this directory first on `sys.path` (or `PYTHONPATH`) and `import pynvml` loads this module
instead of the real binding: the driver's discovery and health code run unchanged against a
simulated node. The directory has no `__init__.py` on purpose, so that the module is importable
only under the real binding's name.

It mirrors the real binding where the driver can observe a difference: the same function names,
constants and error classes (one `NVMLError_*` subclass per `NVML_ERROR_*` code, and
`NVMLError(code)` building the subclass), strings returned as `str` but `busId` fields as `bytes`
(ctypes char arrays), ctypes structures for structured results, a reference-counted
`nvmlInit`/`nvmlShutdown`, and `nvmlDeviceIsMigDeviceHandle` returning a `c_uint` object.

State: the JSON file named by `TANDEM_SIM_NVML_STATE` (a `NodeProfile` as written by
`sim.nvml.write_state`), read at `nvmlInit` and re-read by any later call when the file
changes, so a test can hot-plug a GPU, switch MIG, mark a GPU lost or inject an error by
rewriting it. No variable, no file, or `{"driver_loaded": false}` means the kernel driver is not
loaded (`nvmlInit` raises `NVMLError_DriverNotLoaded`).

Injected failures (per GPU, from the profile): `nvml_errors` maps a function name to an
`NVML_ERROR_*` code raised by that function for that GPU, its MIG devices and its GPU and compute
instances; `lost` makes every call on the GPU raise `NVML_ERROR_GPU_IS_LOST`; `nvml_hang`
("before:<function>" / "after:<function>") blocks a MIG-changing call at that step until cleared,
so a test can kill the caller there.

MIG management (section "MIG" below): GPU instance profiles from the GPU's profile table, their
possible placements, GPU and compute instances made and destroyed with NVML's placement rules and
return codes, the kernel driver's capability files in the node's /proc (the state's `proc_root`),
and every change written back to the state file, since the hardware outlives the process.

Events: `<state file>.events` holds one JSON object per line
(`{"uuid": ..., "event_type": ..., "event_data": ..., "gi": ..., "ci": ...}`), appended by
`sim.nvml.append_event`. An event set sees the lines appended after its creation for the
devices registered on it; `nvmlEventSetWait_v2` blocks until one arrives or the timeout, as the
real wait blocks in the kernel driver (an inotify watch on the state file's directory wakes it when
the events or the state file change: no polling, and a wait that times out with neither changed
reads no file), and fails with `NVML_ERROR_GPU_IS_LOST` while a GPU registered on the set is
lost. ECC events count: `nvmlDeviceGetTotalEccErrors` is the profile's base count plus the ECC
events of that type raised on the GPU, as the driver counts the error it reports.

Memory health (profile fields): `ecc_enabled`, `ecc_{corrected,uncorrected}_{volatile,aggregate}`,
`remapped_rows_*` (Ampere and later) and `retired_pages_pending` (before Ampere). The GPU's
recovery action (`recovery_action`, an `NVML_GPU_RECOVERY_ACTION_*` value) is the field value
`NVML_FI_DEV_GET_GPU_RECOVERY_ACTION` of `nvmlDeviceGetFieldValues`; a GPU whose profile has none
(`null`) models a driver without that field: the call succeeds and the field's own `nvmlReturn`
is `NVML_ERROR_NOT_SUPPORTED`, as NVML reports a field it does not know.

Grey failures (profile fields, `sim.grey.set_gpu_signals`), what a GPU that still works shows
when it works worse: the PCIe link (`nvmlDeviceGet{Curr,Max,GpuMax}PcieLinkGeneration`,
`nvmlDeviceGet{Curr,Max}PcieLinkWidth`, `nvmlDeviceGetPcieReplayCounter`), where an idle GPU
(`utilization_gpu` 0) reports its link at `pcie_idle_gen` at most, as NVIDIA GPUs lower the link's
speed while idle, so only a GPU under load shows the generation its link trained to; the clocks
event reasons (`nvmlDeviceGetCurrentClocksEventReasons` and its deprecated Throttle name), the
profile's bits and GpuIdle while idle; NVLink (`nvmlDeviceGetNvLinkState` per link, NOT_SUPPORTED
on a GPU without links); and the field values `NVML_FI_DEV_PCIE_REPLAY_COUNTER`,
`NVML_FI_DEV_NVLINK_LINK_COUNT`, `NVML_FI_DEV_NVLINK_GET_STATE` (scopeId: the link) and the
NVLink error totals over all links (CRC flit, CRC data, replay, recovery). All of them are
NOT_SUPPORTED on a MIG device's handle, as NVML answers: the link and the clocks are the GPU's.

Usage (profile fields, `sim.nvml.set_usage`): a GPU's `utilization_gpu` and `utilization_memory`
are `nvmlDeviceGetUtilizationRates`' answer (NOT_SUPPORTED on a GPU in MIG mode and on its MIG
devices, as NVML documents), and a GPU's or MIG device's `memory_used_bytes` the `used` of
`nvmlDeviceGetMemoryInfo` on its handle.

The library is loaded once per process, at the first nvmlInit: when the state's `driver_version`
changes later (a driver upgrade), nvmlInit fails with NVML_ERROR_LIB_RM_VERSION_MISMATCH, as the
real library does in a process that outlived the upgrade.

Holding GPUs, as the real library does (seen on an H200 with driver 580.159.04): `nvmlInit` opens
the device file of every GPU before any handle is taken, and they are closed only when the
reference count falls back to zero. The process's holdings are written, on every change, to
`<state file>.clients/<pid>.json` (`{"pid", "initialised", "attached", "inits"}`: the reference
count, the GPUs held open, the nvmlInit calls that succeeded), so a test in another process can
tell whether the daemon holds NVML or a GPU (`sim.nvml.nvml_clients`) and refuse a GPU reset or a
driver unload as the real driver does while one is held.

This module is self-contained (imports nothing from `driver`): it runs in the daemon's process in
place of a vendor library.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import json
import os
import select
import shutil
import string
import sys
import threading
import time
import uuid as uuid_module
import weakref
from collections.abc import Callable
from ctypes import (
    POINTER,
    Structure,
    Union,
    c_char,
    c_double,
    c_int,
    c_int64,
    c_longlong,
    c_uint,
    c_uint32,
    c_ulong,
    c_ulonglong,
    c_ushort,
    pointer,
)
from typing import Any, NoReturn

STATE_ENV = "TANDEM_SIM_NVML_STATE"

# --- constants (values as in nvidia-ml-py) -------------------------------------------------------

NVML_SUCCESS = 0
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_ALREADY_INITIALIZED = 5
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_INSUFFICIENT_SIZE = 7
NVML_ERROR_INSUFFICIENT_POWER = 8
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_TIMEOUT = 10
NVML_ERROR_IRQ_ISSUE = 11
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_CORRUPTED_INFOROM = 14
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_RESET_REQUIRED = 16
NVML_ERROR_OPERATING_SYSTEM = 17
NVML_ERROR_LIB_RM_VERSION_MISMATCH = 18
NVML_ERROR_IN_USE = 19
NVML_ERROR_MEMORY = 20
NVML_ERROR_NO_DATA = 21
NVML_ERROR_VGPU_ECC_NOT_SUPPORTED = 22
NVML_ERROR_INSUFFICIENT_RESOURCES = 23
NVML_ERROR_FREQ_NOT_SUPPORTED = 24
NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25
NVML_ERROR_DEPRECATED = 26
NVML_ERROR_NOT_READY = 27
NVML_ERROR_GPU_NOT_FOUND = 28
NVML_ERROR_INVALID_STATE = 29
NVML_ERROR_RESET_TYPE_NOT_SUPPORTED = 30
NVML_ERROR_UNKNOWN = 999

NVML_BRAND_UNKNOWN = 0
NVML_BRAND_QUADRO = 1
NVML_BRAND_TESLA = 2
NVML_BRAND_NVS = 3
NVML_BRAND_GRID = 4
NVML_BRAND_GEFORCE = 5
NVML_BRAND_TITAN = 6
NVML_BRAND_NVIDIA_VAPPS = 7
NVML_BRAND_NVIDIA_VPC = 8
NVML_BRAND_NVIDIA_VCS = 9
NVML_BRAND_NVIDIA_VWS = 10
NVML_BRAND_NVIDIA_CLOUD_GAMING = 11
NVML_BRAND_QUADRO_RTX = 12
NVML_BRAND_NVIDIA_RTX = 13
NVML_BRAND_NVIDIA = 14
NVML_BRAND_GEFORCE_RTX = 15
NVML_BRAND_TITAN_RTX = 16

NVML_DEVICE_ARCH_KEPLER = 2
NVML_DEVICE_ARCH_MAXWELL = 3
NVML_DEVICE_ARCH_PASCAL = 4
NVML_DEVICE_ARCH_VOLTA = 5
NVML_DEVICE_ARCH_TURING = 6
NVML_DEVICE_ARCH_AMPERE = 7
NVML_DEVICE_ARCH_ADA = 8
NVML_DEVICE_ARCH_HOPPER = 9
NVML_DEVICE_ARCH_BLACKWELL = 10
NVML_DEVICE_ARCH_UNKNOWN = 0xFFFFFFFF

NVML_FEATURE_DISABLED = 0
NVML_FEATURE_ENABLED = 1

NVML_SINGLE_BIT_ECC = 0
NVML_DOUBLE_BIT_ECC = 1
NVML_MEMORY_ERROR_TYPE_CORRECTED = 0
NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
NVML_VOLATILE_ECC = 0
NVML_AGGREGATE_ECC = 1

NVML_VALUE_TYPE_DOUBLE = 0
NVML_VALUE_TYPE_UNSIGNED_INT = 1
NVML_VALUE_TYPE_UNSIGNED_LONG = 2
NVML_VALUE_TYPE_UNSIGNED_LONG_LONG = 3
NVML_VALUE_TYPE_SIGNED_LONG_LONG = 4
NVML_VALUE_TYPE_SIGNED_INT = 5
NVML_VALUE_TYPE_UNSIGNED_SHORT = 6

NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL = 38
NVML_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL = 45
NVML_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL = 52
NVML_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL = 59
NVML_FI_DEV_NVLINK_LINK_COUNT = 91
NVML_FI_DEV_PCIE_REPLAY_COUNTER = 94
NVML_FI_DEV_NVLINK_GET_STATE = 165
NVML_FI_DEV_GET_GPU_RECOVERY_ACTION = 230

NVML_NVLINK_MAX_LINKS = 36
NVML_NVLINK_STATE_INACTIVE = 0x0
NVML_NVLINK_STATE_ACTIVE = 0x1
NVML_NVLINK_STATE_SLEEP = 0x2
NVML_NVLINK_STATE_ACTIVE_TRAFFIC_DISABLED = 0x3

nvmlClocksEventReasonGpuIdle = 0x0000000000000001
nvmlClocksEventReasonApplicationsClocksSetting = 0x0000000000000002
nvmlClocksEventReasonSwPowerCap = 0x0000000000000004
nvmlClocksEventReasonHwSlowdown = 0x0000000000000008
nvmlClocksEventReasonSyncBoost = 0x0000000000000010
nvmlClocksEventReasonSwThermalSlowdown = 0x0000000000000020
nvmlClocksEventReasonHwThermalSlowdown = 0x0000000000000040
nvmlClocksEventReasonHwPowerBrakeSlowdown = 0x0000000000000080
nvmlClocksEventReasonDisplayClockSetting = 0x0000000000000100
nvmlClocksEventReasonNone = 0x0000000000000000

NVML_GPU_RECOVERY_ACTION_NONE = 0
NVML_GPU_RECOVERY_ACTION_GPU_RESET = 1
NVML_GPU_RECOVERY_ACTION_NODE_REBOOT = 2
NVML_GPU_RECOVERY_ACTION_DRAIN_P2P = 3
NVML_GPU_RECOVERY_ACTION_DRAIN_AND_RESET = 4
NVML_GPU_RECOVERY_ACTION_RECOVER_IMEX_DOMAIN = 5
NVML_GPU_RECOVERY_ACTION_BUS_RESET = 6
NVML_GPU_RECOVERY_ACTION_SYSTEM_REBOOT = 7

NVML_INIT_FLAG_NO_GPUS = 1 << 0
NVML_INIT_FLAG_NO_ATTACH = 1 << 1

NVML_DEVICE_UUID_BUFFER_SIZE = 80
NVML_DEVICE_UUID_V2_BUFFER_SIZE = 96
NVML_DEVICE_NAME_BUFFER_SIZE = 64
NVML_DEVICE_NAME_V2_BUFFER_SIZE = 96
NVML_SYSTEM_DRIVER_VERSION_BUFFER_SIZE = 80
NVML_DEVICE_PCI_BUS_ID_BUFFER_SIZE = 32
NVML_DEVICE_PCI_BUS_ID_BUFFER_V2_SIZE = 16
NVML_DEVICE_PCI_BUS_ID_LEGACY_FMT = "%04X:%02X:%02X.0"
NVML_DEVICE_PCI_BUS_ID_FMT = "%08X:%02X:%02X.0"

NVML_DEVICE_MIG_DISABLE = 0x0
NVML_DEVICE_MIG_ENABLE = 0x1

NVML_GPU_INSTANCE_PROFILE_1_SLICE = 0x0
NVML_GPU_INSTANCE_PROFILE_2_SLICE = 0x1
NVML_GPU_INSTANCE_PROFILE_3_SLICE = 0x2
NVML_GPU_INSTANCE_PROFILE_4_SLICE = 0x3
NVML_GPU_INSTANCE_PROFILE_7_SLICE = 0x4
NVML_GPU_INSTANCE_PROFILE_8_SLICE = 0x5
NVML_GPU_INSTANCE_PROFILE_6_SLICE = 0x6
NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1 = 0x7
NVML_GPU_INSTANCE_PROFILE_2_SLICE_REV1 = 0x8
NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV2 = 0x9
NVML_GPU_INSTANCE_PROFILE_1_SLICE_GFX = 0xA
NVML_GPU_INSTANCE_PROFILE_2_SLICE_GFX = 0xB
NVML_GPU_INSTANCE_PROFILE_4_SLICE_GFX = 0xC
NVML_GPU_INSTANCE_PROFILE_1_SLICE_NO_ME = 0xD
NVML_GPU_INSTANCE_PROFILE_2_SLICE_NO_ME = 0xE
NVML_GPU_INSTANCE_PROFILE_1_SLICE_ALL_ME = 0xF
NVML_GPU_INSTANCE_PROFILE_2_SLICE_ALL_ME = 0x10
NVML_GPU_INSTANCE_PROFILE_3_SLICE_GFX = 0x11
NVML_GPU_INSTANCE_PROFILE_COUNT = 0x12
nvmlGpuInstanceProfileInfo_v2 = 0x02000098

nvmlEventTypeSingleBitEccError = 0x0000000000000001
nvmlEventTypeDoubleBitEccError = 0x0000000000000002
nvmlEventTypePState = 0x0000000000000004
nvmlEventTypeXidCriticalError = 0x0000000000000008
nvmlEventTypeClock = 0x0000000000000010
nvmlEventTypePowerSourceChange = 0x0000000000000080
nvmlEventMigConfigChange = 0x0000000000000100
nvmlEventTypeSingleBitEccErrorStorm = 0x0000000000000200
nvmlEventTypeDramRetirementEvent = 0x0000000000000400
nvmlEventTypeDramRetirementFailure = 0x0000000000000800
nvmlEventTypeNonFatalPoisonError = 0x0000000000001000
nvmlEventTypeFatalPoisonError = 0x0000000000002000
nvmlEventTypeGpuUnavailableError = 0x0000000000004000
nvmlEventTypeGpuRecoveryAction = 0x0000000000008000
nvmlEventTypeNone = 0x0000000000000000
nvmlEventTypeAll = (
    nvmlEventTypeSingleBitEccError
    | nvmlEventTypeDoubleBitEccError
    | nvmlEventTypePState
    | nvmlEventTypeClock
    | nvmlEventTypePowerSourceChange
    | nvmlEventTypeXidCriticalError
    | nvmlEventMigConfigChange
    | nvmlEventTypeSingleBitEccErrorStorm
    | nvmlEventTypeDramRetirementEvent
    | nvmlEventTypeDramRetirementFailure
    | nvmlEventTypeNonFatalPoisonError
    | nvmlEventTypeFatalPoisonError
    | nvmlEventTypeGpuUnavailableError
    | nvmlEventTypeGpuRecoveryAction
)
# What a full GPU reports from nvmlDeviceGetSupportedEventTypes (a data-centre part's usual set).
_SUPPORTED_EVENTS = (
    nvmlEventTypeSingleBitEccError
    | nvmlEventTypeDoubleBitEccError
    | nvmlEventTypeXidCriticalError
    | nvmlEventMigConfigChange
    | nvmlEventTypePState
    | nvmlEventTypeClock
)

# --- errors (built exactly like the real binding's) ----------------------------------------------


class NVMLLibraryMismatchError(Exception):
    pass


class NVMLError(Exception):
    _valClassMapping: dict[int, type[NVMLError]] = {}
    _errcode_to_string = {
        NVML_ERROR_UNINITIALIZED: "Uninitialized",
        NVML_ERROR_INVALID_ARGUMENT: "Invalid Argument",
        NVML_ERROR_NOT_SUPPORTED: "Not Supported",
        NVML_ERROR_NO_PERMISSION: "Insufficient Permissions",
        NVML_ERROR_ALREADY_INITIALIZED: "Already Initialized",
        NVML_ERROR_NOT_FOUND: "Not Found",
        NVML_ERROR_INSUFFICIENT_SIZE: "Insufficient Size",
        NVML_ERROR_INSUFFICIENT_POWER: "Insufficient External Power",
        NVML_ERROR_DRIVER_NOT_LOADED: "Driver Not Loaded",
        NVML_ERROR_TIMEOUT: "Timeout",
        NVML_ERROR_IRQ_ISSUE: "Interrupt Request Issue",
        NVML_ERROR_LIBRARY_NOT_FOUND: "NVML Shared Library Not Found",
        NVML_ERROR_FUNCTION_NOT_FOUND: "Function Not Found",
        NVML_ERROR_CORRUPTED_INFOROM: "Corrupted infoROM",
        NVML_ERROR_GPU_IS_LOST: "GPU is lost",
        NVML_ERROR_RESET_REQUIRED: "GPU requires restart",
        NVML_ERROR_OPERATING_SYSTEM: "The operating system has blocked the request.",
        NVML_ERROR_LIB_RM_VERSION_MISMATCH: "RM has detected an NVML/RM version mismatch.",
        NVML_ERROR_MEMORY: "Insufficient Memory",
        NVML_ERROR_UNKNOWN: "Unknown Error",
    }

    value: int

    def __new__(cls, value: int) -> NVMLError:
        if cls == NVMLError:
            cls = NVMLError._valClassMapping.get(value, cls)
        obj = Exception.__new__(cls)
        obj.value = value
        return obj

    def __str__(self) -> str:
        return NVMLError._errcode_to_string.get(self.value, f"NVML Error with code {self.value}")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, NVMLError) and self.value == other.value

    __hash__ = Exception.__hash__


def nvmlExceptionClass(nvmlErrorCode: int) -> type[NVMLError]:
    if nvmlErrorCode not in NVMLError._valClassMapping:
        raise ValueError(f"nvmlErrorCode {nvmlErrorCode} is not valid")
    return NVMLError._valClassMapping[nvmlErrorCode]


def _extractNVMLErrorsAsClasses() -> None:
    """One subclass per code, e.g. NVML_ERROR_GPU_IS_LOST -> NVMLError_GpuIsLost."""
    this_module = sys.modules[__name__]
    for err_name in [x for x in dir(this_module) if x.startswith("NVML_ERROR_")]:
        class_name = "NVMLError_" + string.capwords(err_name.replace("NVML_ERROR_", ""), "_").replace("_", "")
        err_val = getattr(this_module, err_name)

        def gen_new(val: int) -> Any:
            def new(typ: type, *args: Any) -> NVMLError:
                return NVMLError.__new__(typ, val)

            return new

        new_error_class = type(class_name, (NVMLError,), {"__new__": gen_new(err_val)})
        new_error_class.__module__ = __name__
        setattr(this_module, class_name, new_error_class)
        NVMLError._valClassMapping[err_val] = new_error_class


_extractNVMLErrorsAsClasses()


def nvmlErrorString(result: int) -> str:
    return NVMLError._errcode_to_string.get(result, "Unknown Error")


# --- result structures (same fields as the real ctypes structures) -------------------------------


class c_nvmlMemory_t(Structure):
    _fields_ = [("total", c_ulonglong), ("free", c_ulonglong), ("used", c_ulonglong)]


class c_nvmlUtilization_t(Structure):
    _fields_ = [("gpu", c_uint), ("memory", c_uint)]


class nvmlPciInfo_t(Structure):
    _fields_ = [
        ("busIdLegacy", c_char * NVML_DEVICE_PCI_BUS_ID_BUFFER_V2_SIZE),
        ("domain", c_uint),
        ("bus", c_uint),
        ("device", c_uint),
        ("pciDeviceId", c_uint),
        ("pciSubSystemId", c_uint),
        ("busId", c_char * NVML_DEVICE_PCI_BUS_ID_BUFFER_SIZE),
    ]


class c_nvmlValue_t(Union):
    _fields_ = [
        ("dVal", c_double),
        ("uiVal", c_uint),
        ("ulVal", c_ulong),
        ("ullVal", c_ulonglong),
        ("sllVal", c_longlong),
        ("siVal", c_int),
        ("usVal", c_ushort),
    ]


class c_nvmlFieldValue_t(Structure):
    _fields_ = [
        ("fieldId", c_uint32),
        ("scopeId", c_uint32),
        ("timestamp", c_int64),
        ("latencyUsec", c_int64),
        ("valueType", c_uint),
        ("nvmlReturn", c_uint),
        ("value", c_nvmlValue_t),
    ]


class c_nvmlDeviceAttributes(Structure):
    _fields_ = [
        ("multiprocessorCount", c_uint),
        ("sharedCopyEngineCount", c_uint),
        ("sharedDecoderCount", c_uint),
        ("sharedEncoderCount", c_uint),
        ("sharedJpegCount", c_uint),
        ("sharedOfaCount", c_uint),
        ("gpuInstanceSliceCount", c_uint),
        ("computeInstanceSliceCount", c_uint),
        ("memorySizeMB", c_ulonglong),
    ]


class c_nvmlGpuInstanceProfileInfo_t(Structure):
    _fields_ = [
        ("id", c_uint),
        ("isP2pSupported", c_uint),
        ("sliceCount", c_uint),
        ("instanceCount", c_uint),
        ("multiprocessorCount", c_uint),
        ("copyEngineCount", c_uint),
        ("decoderCount", c_uint),
        ("encoderCount", c_uint),
        ("jpegCount", c_uint),
        ("ofaCount", c_uint),
        ("memorySizeMB", c_ulonglong),
    ]


class c_nvmlGpuInstanceProfileInfo_v2_t(Structure):
    _fields_ = [
        ("version", c_uint),
        ("id", c_uint),
        ("isP2pSupported", c_uint),
        ("sliceCount", c_uint),
        ("instanceCount", c_uint),
        ("multiprocessorCount", c_uint),
        ("copyEngineCount", c_uint),
        ("decoderCount", c_uint),
        ("encoderCount", c_uint),
        ("jpegCount", c_uint),
        ("ofaCount", c_uint),
        ("memorySizeMB", c_ulonglong),
        ("name", c_char * NVML_DEVICE_NAME_V2_BUFFER_SIZE),
    ]

    def __init__(self) -> None:
        super().__init__(version=nvmlGpuInstanceProfileInfo_v2)


class c_nvmlDevice_t:
    """A device handle. The real one is an opaque pointer; this one names the device by UUID so
    that it stays meaningful across state reloads (and fails like a lost GPU once it is gone)."""

    __slots__ = ("gpu_uuid", "mig_uuid")

    def __init__(self, gpu_uuid: str, mig_uuid: str = "") -> None:
        self.gpu_uuid = gpu_uuid
        self.mig_uuid = mig_uuid

    def __eq__(self, other: object) -> bool:
        return isinstance(other, c_nvmlDevice_t) and (self.gpu_uuid, self.mig_uuid) == (
            other.gpu_uuid,
            other.mig_uuid,
        )

    def __hash__(self) -> int:
        return hash((self.gpu_uuid, self.mig_uuid))

    def __repr__(self) -> str:
        return f"c_nvmlDevice_t({self.mig_uuid or self.gpu_uuid})"


class c_nvmlEventData_t:
    """Same field names as the real structure; `device` holds a handle object."""

    def __init__(self, device: c_nvmlDevice_t, eventType: int, eventData: int, gi: int, ci: int) -> None:
        self.device = device
        self.eventType = eventType
        self.eventData = eventData
        self.gpuInstanceId = gi
        self.computeInstanceId = ci


class c_nvmlEventSet_t:
    def __init__(self, cursor: int, changes: _Changes) -> None:
        self.cursor = cursor  # byte offset into the events file
        self.registered: dict[str, int] = {}  # GPU UUID -> event type mask
        self.changes = changes  # wakes a waiter when the events or state file changes
        # The last look at the files found nothing, and neither file has changed since: a wait
        # need not look again before it blocks (the real wait costs nothing but its wake).
        self.quiet = False


# --- simulated state -----------------------------------------------------------------------------

_lock = threading.RLock()
_refcount = 0
_inits = 0  # nvmlInit calls that succeeded, ever
_attached: set[str] = set()  # UUIDs of the GPUs this process holds open (until the refcount is zero)
_published: tuple[int, tuple[str, ...], int] | None = None  # what the clients file says
_library_version = ""  # the driver version of the library this process loaded, at its first nvmlInit
_state_path = ""
_state_key: tuple[int, int, int] | None = None
_gpus: list[dict[str, Any]] = []
_by_uuid: dict[str, dict[str, Any]] = {}  # the same GPUs by UUID: every call on a handle looks one up
_system: dict[str, Any] = {}


def _raise(code: int) -> NoReturn:
    raise NVMLError(code)


def _load(path: str) -> None:
    """(Re)read the state file; the caller holds the lock."""
    global _state_key, _gpus, _by_uuid, _system
    if not path:
        _raise(NVML_ERROR_DRIVER_NOT_LOADED)
    try:
        st = os.stat(path)
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        _raise(NVML_ERROR_DRIVER_NOT_LOADED)
    except OSError:
        _raise(NVML_ERROR_UNKNOWN)
    try:
        raw = json.loads(text) if text.strip() else {"driver_loaded": False}
        if not isinstance(raw, dict):
            raise ValueError("state is not an object")
        if raw.get("driver_loaded", True) is False:
            _raise(NVML_ERROR_DRIVER_NOT_LOADED)
        gpus = sorted((dict(g) for g in raw.get("gpus", [])), key=lambda g: int(g["index"]))
    except (ValueError, TypeError, KeyError):
        _raise(NVML_ERROR_UNKNOWN)
    _gpus = gpus
    _by_uuid = {}
    for g in gpus:
        _by_uuid.setdefault(str(g.get("uuid", "")), g)
    _system = raw
    _state_key = (st.st_ino, st.st_mtime_ns, st.st_size)


def _clients_dir() -> str:
    return _state_path + ".clients"


def _publish() -> None:
    """Write what this process holds to `<state>.clients/<pid>.json` when it changed (atomically,
    so a reader never sees half a file); the caller holds the lock."""
    global _published
    now = (_refcount, tuple(sorted(_attached)), _inits)
    if now == _published or not _state_path:
        return
    os.makedirs(_clients_dir(), exist_ok=True)
    path = os.path.join(_clients_dir(), f"{os.getpid()}.json")
    tmp = f"{path}.{threading.get_ident()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"pid": os.getpid(), "initialised": now[0], "attached": list(now[1]), "inits": now[2]}, f)
    os.replace(tmp, path)
    _published = now


def _current() -> list[dict[str, Any]]:
    """The GPUs of the current state, re-read when the file changed; requires nvmlInit."""
    with _lock:
        if _refcount == 0:
            _raise(NVML_ERROR_UNINITIALIZED)
        try:
            st = os.stat(_state_path)
            key = (st.st_ino, st.st_mtime_ns, st.st_size)
        except OSError:
            key = None
        if key != _state_key:
            _load(_state_path)
        return _gpus


def _find_gpu(uuid: str) -> dict[str, Any] | None:
    with _lock:
        _current()
        return _by_uuid.get(uuid)


def _resolve(func: str, handle: c_nvmlDevice_t) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The GPU (and MIG device) behind a handle, with the GPU's injected failures applied."""
    if not isinstance(handle, c_nvmlDevice_t):
        _raise(NVML_ERROR_INVALID_ARGUMENT)
    gpu = _find_gpu(handle.gpu_uuid)
    if gpu is None or gpu.get("lost"):
        _raise(NVML_ERROR_GPU_IS_LOST)
    code = gpu.get("nvml_errors", {}).get(func)
    if code:
        _raise(int(code))
    if not handle.mig_uuid:
        return gpu, None
    mig = next((m for m in _migs(gpu) if m["uuid"] == handle.mig_uuid), None)
    if mig is None:
        _raise(NVML_ERROR_INVALID_ARGUMENT)
    return gpu, mig


def _migs(gpu: dict[str, Any]) -> list[dict[str, Any]]:
    """The MIG devices: compute instances (a GPU instance without one is no MIG device yet)."""
    if not gpu.get("mig_mode"):
        return []
    made = [m for m in gpu.get("mig_devices", []) if m.get("ci_id") is not None]
    return sorted(made, key=lambda m: (m["gi_id"], m["ci_id"]))


def _full_gpu(func: str, handle: c_nvmlDevice_t) -> dict[str, Any]:
    """Functions NVML does not support on a MIG device handle."""
    gpu, mig = _resolve(func, handle)
    if mig is not None:
        _raise(NVML_ERROR_NOT_SUPPORTED)
    return gpu


# --- library lifecycle and system queries --------------------------------------------------------


def nvmlInitWithFlags(flags: int) -> None:
    """A process loads the library once and keeps it: after a driver upgrade its old library
    meets the new kernel module, and nvmlInit fails with LIB_RM_VERSION_MISMATCH until the
    process is restarted, as with the real library."""
    global _refcount, _state_path, _inits, _library_version
    with _lock:
        path = os.environ.get(STATE_ENV, "")
        _load(path)
        _state_path = path
        version = str(_system.get("driver_version", ""))
        _library_version = _library_version or version
        if version != _library_version:
            _raise(NVML_ERROR_LIB_RM_VERSION_MISMATCH)
        _refcount += 1
        _inits += 1
        _attached.update(g["uuid"] for g in _gpus)  # every GPU's device file, opened at init
        _publish()


def nvmlInit() -> None:
    nvmlInitWithFlags(0)


def nvmlShutdown() -> None:
    global _refcount
    with _lock:
        if _refcount == 0:
            _raise(NVML_ERROR_UNINITIALIZED)
        _refcount -= 1
        if _refcount == 0:
            _attached.clear()  # the last shutdown lets go of every GPU
        _publish()


def nvmlSystemGetDriverVersion() -> str:
    _current()
    return str(_system.get("driver_version", ""))


def nvmlSystemGetCudaDriverVersion() -> int:
    _current()
    return int(_system.get("cuda_driver_version", 0))


def nvmlSystemGetCudaDriverVersion_v2() -> int:
    return nvmlSystemGetCudaDriverVersion()


def nvmlDeviceGetCount() -> int:
    return len(_current())


# --- handles -------------------------------------------------------------------------------------


def nvmlDeviceGetHandleByIndex(index: int) -> c_nvmlDevice_t:
    gpus = _current()
    if not 0 <= index < len(gpus):
        _raise(NVML_ERROR_INVALID_ARGUMENT)
    handle = c_nvmlDevice_t(gpus[index]["uuid"])
    _resolve("nvmlDeviceGetHandleByIndex", handle)
    return handle


def nvmlDeviceGetHandleByUUID(uuid: str | bytes) -> c_nvmlDevice_t:
    text = uuid.decode() if isinstance(uuid, bytes) else uuid
    for gpu in _current():
        if gpu["uuid"] == text:
            handle = c_nvmlDevice_t(text)
        else:
            mig = next((m for m in _migs(gpu) if m["uuid"] == text), None)
            if mig is None:
                continue
            handle = c_nvmlDevice_t(gpu["uuid"], text)
        _resolve("nvmlDeviceGetHandleByUUID", handle)
        return handle
    _raise(NVML_ERROR_NOT_FOUND)


def nvmlDeviceGetIndex(handle: c_nvmlDevice_t) -> int:
    gpu = _full_gpu("nvmlDeviceGetIndex", handle)
    return [g["uuid"] for g in _current()].index(gpu["uuid"])


# --- identity and properties ---------------------------------------------------------------------


def nvmlDeviceGetMinorNumber(handle: c_nvmlDevice_t) -> int:
    return int(_full_gpu("nvmlDeviceGetMinorNumber", handle)["minor"])


def nvmlDeviceGetUUID(handle: c_nvmlDevice_t) -> str:
    gpu, mig = _resolve("nvmlDeviceGetUUID", handle)
    return str((mig or gpu)["uuid"])


def nvmlDeviceGetName(handle: c_nvmlDevice_t) -> str:
    gpu, mig = _resolve("nvmlDeviceGetName", handle)
    if mig is not None:
        return f"{gpu['name']} MIG {mig['profile']}"
    return str(gpu["name"])


def nvmlDeviceGetBrand(handle: c_nvmlDevice_t) -> int:
    gpu, _ = _resolve("nvmlDeviceGetBrand", handle)
    return int(gpu.get("brand", NVML_BRAND_NVIDIA))


def nvmlDeviceGetArchitecture(handle: c_nvmlDevice_t) -> int:
    gpu, _ = _resolve("nvmlDeviceGetArchitecture", handle)
    return int(gpu.get("architecture", NVML_DEVICE_ARCH_UNKNOWN))


def nvmlDeviceGetCudaComputeCapability(handle: c_nvmlDevice_t) -> tuple[int, int]:
    gpu, _ = _resolve("nvmlDeviceGetCudaComputeCapability", handle)
    major, minor = gpu.get("cuda_compute_capability", (9, 0))
    return (int(major), int(minor))


def nvmlDeviceGetMemoryInfo(handle: c_nvmlDevice_t, version: int | None = None) -> c_nvmlMemory_t:
    """A MIG device's handle gives its own memory, as NVML's per-instance answer does."""
    gpu, mig = _resolve("nvmlDeviceGetMemoryInfo", handle)
    device = mig or gpu
    total = int(device["memory_bytes"])
    used = min(int(device.get("memory_used_bytes", 0)), total)
    return c_nvmlMemory_t(total=total, free=total - used, used=used)


def nvmlDeviceGetUtilizationRates(handle: c_nvmlDevice_t) -> c_nvmlUtilization_t:
    """NVML measures no utilisation on a MIG-enabled GPU: NOT_SUPPORTED for the GPU's handle and
    its MIG devices' alike."""
    gpu, mig = _resolve("nvmlDeviceGetUtilizationRates", handle)
    if mig is not None or gpu.get("mig_mode"):
        _raise(NVML_ERROR_NOT_SUPPORTED)
    return c_nvmlUtilization_t(gpu=int(gpu.get("utilization_gpu", 0)), memory=int(gpu.get("utilization_memory", 0)))


def nvmlDeviceGetPciInfo_v3(handle: c_nvmlDevice_t) -> nvmlPciInfo_t:
    gpu = _full_gpu("nvmlDeviceGetPciInfo", handle)
    domain_s, bus_s, devfn = str(gpu["pci_bus_id"]).split(":")
    dev_s, _fn = devfn.split(".")
    domain, bus, dev = int(domain_s, 16), int(bus_s, 16), int(dev_s, 16)
    vendor = int(gpu.get("pci_vendor_id", 0x10DE))
    device = int(gpu.get("pci_device_id", 0))
    return nvmlPciInfo_t(
        busIdLegacy=(NVML_DEVICE_PCI_BUS_ID_LEGACY_FMT % (domain, bus, dev)).encode(),
        domain=domain,
        bus=bus,
        device=dev,
        pciDeviceId=(device << 16) | vendor,
        pciSubSystemId=(0x16C1 << 16) | vendor,
        busId=(NVML_DEVICE_PCI_BUS_ID_FMT % (domain, bus, dev)).encode(),
    )


def nvmlDeviceGetPciInfo(handle: c_nvmlDevice_t) -> nvmlPciInfo_t:
    return nvmlDeviceGetPciInfo_v3(handle)


# --- MIG: profiles, placements, GPU instances and compute instances -------------------------------
#
# The GPU's profile table (`mig_profiles`, a sim.profile.MigProfileSpec per profile) is its NVML
# geometry. A GPU instance occupies `size` memory slices from a possible placement `start`; NVML
# refuses one that overlaps another (INSUFFICIENT_RESOURCES), one over its profile's instanceCount,
# one that needs more compute slices or media engines (decoders, encoders, JPEG, OFA: the GPU has
# as many of each as the profile holding the most) than are left, a placement the profile does not
# have (INVALID_ARGUMENT), and anything while MIG mode is off (NOT_SUPPORTED). Its ID is the GPU's
# hardware slot for that memory span (swizzle ID: 0 the whole GPU; 1-2 halves; 3-6 quarters; 7-14
# eighths), as `nvidia-smi mig -lgi` shows. A compute instance makes the MIG device (UUID, name,
# `/proc/driver/nvidia/capabilities/gpu<m>/mig/gi<g>/ci<c>/access`); destroying a GPU instance that
# still has compute instances is NVML_ERROR_IN_USE. Every change is written back to the state file
# (under `<state>.lock`): the hardware outlives the process that changed it.

NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE = 0x0
NVML_COMPUTE_INSTANCE_PROFILE_2_SLICE = 0x1
NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE = 0x2
NVML_COMPUTE_INSTANCE_PROFILE_4_SLICE = 0x3
NVML_COMPUTE_INSTANCE_PROFILE_7_SLICE = 0x4
NVML_COMPUTE_INSTANCE_PROFILE_COUNT = 0x9
NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED = 0x0
nvmlComputeInstanceProfileInfo_v2 = 0x02000088

_CI_SLICES = {0x0: 1, 0x1: 2, 0x2: 3, 0x3: 4, 0x4: 7}  # the compute instance profiles modelled
_DRIVER_PROFILE_COUNT = 0x11  # GPU instance profile enums a 580 driver knows (H200, 580.159.04)
_MAX_SLICES = 7
_GPU_UUID_SIZE = NVML_DEVICE_UUID_V2_BUFFER_SIZE


class c_nvmlGpuInstancePlacement_t(Structure):
    _fields_ = [("start", c_uint), ("size", c_uint)]


class c_nvmlComputeInstancePlacement_t(Structure):
    _fields_ = [("start", c_uint), ("size", c_uint)]


class c_nvmlComputeInstanceProfileInfo_v2_t(Structure):
    _fields_ = [
        ("version", c_uint),
        ("id", c_uint),
        ("sliceCount", c_uint),
        ("instanceCount", c_uint),
        ("multiprocessorCount", c_uint),
        ("sharedCopyEngineCount", c_uint),
        ("sharedDecoderCount", c_uint),
        ("sharedEncoderCount", c_uint),
        ("sharedJpegCount", c_uint),
        ("sharedOfaCount", c_uint),
        ("name", c_char * NVML_DEVICE_NAME_V2_BUFFER_SIZE),
    ]

    def __init__(self) -> None:
        super().__init__(version=nvmlComputeInstanceProfileInfo_v2)


class struct_c_nvmlGpuInstance_t(Structure):
    """Opaque in the real binding; here it names the instance, so a handle outlives state reloads."""

    _fields_ = [("gpu_uuid", c_char * _GPU_UUID_SIZE), ("id", c_uint)]


c_nvmlGpuInstance_t = POINTER(struct_c_nvmlGpuInstance_t)


class struct_c_nvmlComputeInstance_t(Structure):
    _fields_ = [("gpu_uuid", c_char * _GPU_UUID_SIZE), ("gi", c_uint), ("id", c_uint)]


c_nvmlComputeInstance_t = POINTER(struct_c_nvmlComputeInstance_t)


class c_nvmlGpuInstanceInfo_t:
    """Same field names as the real structure; `device` holds a handle object."""

    def __init__(self, device: c_nvmlDevice_t, id: int, profileId: int, start: int, size: int) -> None:
        self.device = device
        self.id = id
        self.profileId = profileId
        self.placement = c_nvmlGpuInstancePlacement_t(start, size)


class c_nvmlComputeInstanceInfo_t:
    def __init__(self, device: c_nvmlDevice_t, gi: Any, id: int, profileId: int, start: int, size: int) -> None:
        self.device = device
        self.gpuInstance = gi
        self.id = id
        self.profileId = profileId
        self.placement = c_nvmlComputeInstancePlacement_t(start, size)


_instance_handles: dict[tuple[str, int, int], Structure] = {}  # kept alive, as NVML keeps its own


def _gi_handle(uuid: str, gi: int) -> Any:
    key = (uuid, gi, -1)
    if key not in _instance_handles:
        _instance_handles[key] = struct_c_nvmlGpuInstance_t(uuid.encode(), gi)
    return pointer(_instance_handles[key])


def _ci_handle(uuid: str, gi: int, ci: int) -> Any:
    key = (uuid, gi, ci)
    if key not in _instance_handles:
        _instance_handles[key] = struct_c_nvmlComputeInstance_t(uuid.encode(), gi, ci)
    return pointer(_instance_handles[key])


def _target(ref: Any) -> Any:
    """What a `byref(x)` or `pointer(x)` argument points to (or `x` itself)."""
    obj = getattr(ref, "_obj", None)
    if obj is not None:
        return obj
    return ref.contents if hasattr(ref, "contents") else ref


def _gi_slices(profile: str) -> int:
    """Compute slices of the GPU instance: "1g.10gb" -> 1, "1c.2g.20gb" -> 2."""
    for part in profile.split("."):
        if part.endswith("g") and part[:-1].isdigit():
            return int(part[:-1])
    return 0


def _ci_slices(profile: str) -> int:
    """Compute slices of the compute instance: "1c.2g.20gb" -> 1, a whole instance's "2g.20gb" -> 2."""
    head = profile.split(".")[0]
    return int(head[:-1]) if head.endswith("c") and head[:-1].isdigit() else _gi_slices(profile)


def _table(gpu: dict[str, Any]) -> list[dict[str, Any]]:
    return list(gpu.get("mig_profiles", [])) if gpu.get("mig_capable") else []


def _profile_of(gpu: dict[str, Any], name: str) -> dict[str, Any] | None:
    """The GPU instance profile of a MIG device name ("1c.3g.40gb" is a compute instance of 3g.40gb)."""
    gi_name = name.split(".", 1)[1] if name.split(".")[0].endswith("c") else name
    return next((p for p in _table(gpu) if p["name"] == gi_name), None)


def _gis(gpu: dict[str, Any]) -> dict[int, list[dict[str, Any]]]:
    """GPU instance ID -> its entries (one per compute instance; one with ci_id None before any)."""
    out: dict[int, list[dict[str, Any]]] = {}
    for m in gpu.get("mig_devices", []) if gpu.get("mig_mode") else []:
        out.setdefault(int(m["gi_id"]), []).append(m)
    return out


def _gi_id(start: int, size: int) -> int:
    return {8: 0, 4: 1 + start // 4, 2: 3 + start // 2}.get(size, 7 + start)


def _mig_gpu(func: str, device: c_nvmlDevice_t, *, mig_mode: bool = True) -> dict[str, Any]:
    gpu = _full_gpu(func, device)
    if not gpu.get("mig_capable") or (mig_mode and not gpu.get("mig_mode")):
        _raise(NVML_ERROR_NOT_SUPPORTED)
    return gpu


def _instance(func: str, handle: Any, *, ci: bool = False) -> tuple[dict[str, Any], list[dict[str, Any]], int]:
    """The GPU, the GPU instance's entries and the compute instance ID (-1) behind a handle."""
    kind = c_nvmlComputeInstance_t if ci else c_nvmlGpuInstance_t
    if not isinstance(handle, kind) or not handle:
        _raise(NVML_ERROR_INVALID_ARGUMENT)
    inst = handle.contents
    gpu = _mig_gpu(func, c_nvmlDevice_t(inst.gpu_uuid.decode()))
    gi = int(inst.gi if ci else inst.id)
    entries = _gis(gpu).get(gi)
    if entries is None or (ci and not any(m["ci_id"] == inst.id for m in entries)):
        _raise(NVML_ERROR_INVALID_ARGUMENT)  # destroyed since: the handle is stale
    return gpu, entries, int(inst.id) if ci else -1


def _hang(uuid: str, when: str, func: str) -> None:
    """Block while the GPU's `nvml_hang` names this step, saying so in `<state>.hung` (tests kill here)."""
    step = f"{when}:{func}"
    gpu = _find_gpu(uuid)
    if gpu is None or gpu.get("nvml_hang") != step:
        return
    with open(_state_path + ".hung", "w", encoding="utf-8") as f:
        f.write(step + "\n")
    while True:
        time.sleep(0.02)
        try:
            with open(_state_path, encoding="utf-8") as f:
                gpus = json.load(f).get("gpus", [])
        except (OSError, ValueError):
            continue
        if not any(g.get("uuid") == uuid and g.get("nvml_hang") == step for g in gpus):
            return


def _change(func: str, uuid: str, change: Callable[[dict[str, Any]], Any]) -> Any:
    """Apply `change` to the GPU in the state file, read fresh and written back under its lock."""
    _hang(uuid, "before", func)
    with _lock:
        fd = os.open(_state_path + ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            _load(_state_path)
            gpu = _find_gpu(uuid)
            if gpu is None or gpu.get("lost"):
                _raise(NVML_ERROR_GPU_IS_LOST)
            result = change(gpu)
            tmp = f"{_state_path}.{os.getpid()}.{threading.get_ident()}.tmp"
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump({**_system, "gpus": _gpus}, f, indent=2)
            os.replace(tmp, _state_path)
            _load(_state_path)
        finally:
            os.close(fd)
    _hang(uuid, "after", func)
    return result


def _capability(gpu: dict[str, Any], rel: str, present: bool) -> None:
    """Create or remove `/proc/driver/nvidia/capabilities/gpu<m>/mig/<rel>/access` as the kernel
    driver does, with the minor its static table (`driver/nvidia-caps/mig-minors`) gives it."""
    proc = str(_system.get("proc_root") or "")
    if not proc:
        return
    base = os.path.join(proc, "driver", "nvidia", "capabilities", f"gpu{gpu['minor']}", "mig", rel)
    if not present:
        shutil.rmtree(base, ignore_errors=True)
        return
    try:
        with open(os.path.join(proc, "driver", "nvidia-caps", "mig-minors"), encoding="utf-8") as f:
            table = dict(line.rsplit(" ", 1) for line in f.read().splitlines() if " " in line)
    except OSError:
        return
    minor = table.get(f"gpu{gpu['minor']}/{rel}/access")
    if minor is None:
        return
    os.makedirs(base, exist_ok=True)
    with open(os.path.join(base, "access"), "w", encoding="utf-8") as f:
        f.write(f"DeviceFileMinor: {minor}\nDeviceFileMode: 292\nDeviceFileModify: 1\n")


def nvmlDeviceGetMigMode(device: c_nvmlDevice_t) -> list[int]:
    gpu = _full_gpu("nvmlDeviceGetMigMode", device)
    if not gpu.get("mig_capable"):
        _raise(NVML_ERROR_NOT_SUPPORTED)
    mode = NVML_DEVICE_MIG_ENABLE if gpu.get("mig_mode") else NVML_DEVICE_MIG_DISABLE
    return [mode, mode]


def nvmlDeviceGetMaxMigDeviceCount(device: c_nvmlDevice_t) -> int:
    """0 while MIG mode is off, as real NVML answers (H200, driver 580.159.04)."""
    gpu = _full_gpu("nvmlDeviceGetMaxMigDeviceCount", device)
    return _MAX_SLICES if gpu.get("mig_capable") and gpu.get("mig_mode") else 0


def nvmlDeviceGetMigDeviceHandleByIndex(device: c_nvmlDevice_t, index: int) -> c_nvmlDevice_t:
    gpu = _full_gpu("nvmlDeviceGetMigDeviceHandleByIndex", device)
    if not gpu.get("mig_capable") or not gpu.get("mig_mode"):
        _raise(NVML_ERROR_NOT_SUPPORTED if not gpu.get("mig_capable") else NVML_ERROR_INVALID_ARGUMENT)
    migs = _migs(gpu)
    if not 0 <= index < _MAX_SLICES:
        _raise(NVML_ERROR_INVALID_ARGUMENT)
    if index >= len(migs):
        _raise(NVML_ERROR_NOT_FOUND)
    return c_nvmlDevice_t(gpu["uuid"], migs[index]["uuid"])


def nvmlDeviceIsMigDeviceHandle(device: c_nvmlDevice_t) -> c_uint:
    _, mig = _resolve("nvmlDeviceIsMigDeviceHandle", device)
    return c_uint(1 if mig is not None else 0)


def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(migDevice: c_nvmlDevice_t) -> c_nvmlDevice_t:
    gpu, mig = _resolve("nvmlDeviceGetDeviceHandleFromMigDeviceHandle", migDevice)
    if mig is None:
        _raise(NVML_ERROR_INVALID_ARGUMENT)
    return c_nvmlDevice_t(gpu["uuid"])


def _mig_only(func: str, device: c_nvmlDevice_t) -> dict[str, Any]:
    _, mig = _resolve(func, device)
    if mig is None:
        _raise(NVML_ERROR_INVALID_ARGUMENT)
    return mig


def nvmlDeviceGetGpuInstanceId(device: c_nvmlDevice_t) -> int:
    return int(_mig_only("nvmlDeviceGetGpuInstanceId", device)["gi_id"])


def nvmlDeviceGetComputeInstanceId(device: c_nvmlDevice_t) -> int:
    return int(_mig_only("nvmlDeviceGetComputeInstanceId", device)["ci_id"])


def nvmlDeviceGetAttributes_v2(device: c_nvmlDevice_t) -> c_nvmlDeviceAttributes:
    """MIG device handles only: NOT_SUPPORTED for a GPU, as real NVML answers (H200, 580.159.04)."""
    _, mig = _resolve("nvmlDeviceGetAttributes", device)
    if mig is None:
        _raise(NVML_ERROR_NOT_SUPPORTED)
    return c_nvmlDeviceAttributes(
        multiprocessorCount=int(mig["multiprocessors"]),
        sharedCopyEngineCount=int(mig.get("copy_engines", 0)),
        sharedDecoderCount=int(mig.get("decoders", 0)),
        sharedEncoderCount=int(mig.get("encoders", 0)),
        sharedJpegCount=int(mig.get("jpeg", 0)),
        sharedOfaCount=int(mig.get("ofa", 0)),
        gpuInstanceSliceCount=_gi_slices(mig["profile"]),
        computeInstanceSliceCount=_ci_slices(mig["profile"]),
        memorySizeMB=int(mig["memory_bytes"]) // 2**20,
    )


def nvmlDeviceGetAttributes(device: c_nvmlDevice_t) -> c_nvmlDeviceAttributes:
    return nvmlDeviceGetAttributes_v2(device)


def nvmlDeviceGetGpuInstanceProfileInfo(device: c_nvmlDevice_t, profile: int, version: int = 2) -> Any:
    """`profile` is an NVML_GPU_INSTANCE_PROFILE_* value; the result's `id` is the profile ID."""
    gpu = _mig_gpu("nvmlDeviceGetGpuInstanceProfileInfo", device, mig_mode=False)
    if not 0 <= profile < _DRIVER_PROFILE_COUNT or version not in (1, 2):
        _raise(NVML_ERROR_INVALID_ARGUMENT)  # as a 580 driver answers 0x11 (3_SLICE_GFX), newer than it
    spec = next((p for p in _table(gpu) if p["enum"] == profile), None)
    if spec is None:
        _raise(NVML_ERROR_NOT_SUPPORTED)
    info = c_nvmlGpuInstanceProfileInfo_v2_t() if version == 2 else c_nvmlGpuInstanceProfileInfo_t()
    info.id, info.isP2pSupported, info.sliceCount = spec["id"], 1, spec["slices"]
    info.instanceCount, info.multiprocessorCount = spec["instances"], spec["multiprocessors"]
    info.copyEngineCount, info.decoderCount = spec["copy_engines"], spec["decoders"]
    info.encoderCount = spec["encoders"]
    info.jpegCount, info.ofaCount, info.memorySizeMB = spec["jpeg"], spec["ofa"], spec["memory_mb"]
    if version == 2:
        info.name = f"MIG {spec['name']}".encode()
    return info


nvmlDeviceGetGpuInstanceProfileInfoV = nvmlDeviceGetGpuInstanceProfileInfo


def _spec_by_id(gpu: dict[str, Any], profile_id: int) -> dict[str, Any]:
    spec = next((p for p in _table(gpu) if p["id"] == profile_id), None)
    if spec is None:
        _raise(NVML_ERROR_INVALID_ARGUMENT)
    return spec


def nvmlDeviceGetGpuInstancePossiblePlacements(device: c_nvmlDevice_t, profileId: int, placementsRef: Any,
                                               countRef: Any) -> int:  # fmt: skip
    """`nvmlDeviceGetGpuInstancePossiblePlacements_v2`: with `placementsRef` None only the count;
    otherwise fills the array (NVML_ERROR_INSUFFICIENT_SIZE when the count says it is too short)."""
    gpu = _mig_gpu("nvmlDeviceGetGpuInstancePossiblePlacements", device, mig_mode=False)
    spec = _spec_by_id(gpu, profileId)
    count = _target(countRef)
    starts = list(spec["starts"])
    if placementsRef is not None:
        if count.value < len(starts):
            count.value = len(starts)
            _raise(NVML_ERROR_INSUFFICIENT_SIZE)
        array = _target(placementsRef)
        for i, start in enumerate(starts):
            array[i].start, array[i].size = start, spec["size"]
    count.value = len(starts)
    return NVML_SUCCESS


def _check_placement(gpu: dict[str, Any], spec: dict[str, Any], start: int) -> None:
    """The placement rules NVML applies to a new GPU instance (section comment)."""
    if start not in spec["starts"]:
        _raise(NVML_ERROR_INVALID_ARGUMENT)
    gis = [(entries[0], _profile_of(gpu, entries[0]["profile"])) for entries in _gis(gpu).values()]
    span = set(range(start, start + spec["size"]))
    for m, _ in gis:
        if span & set(range(int(m["placement_start"]), int(m["placement_start"]) + int(m["placement_size"]))):
            _raise(NVML_ERROR_INSUFFICIENT_RESOURCES)
    if sum(1 for _, p in gis if p is not None and p["id"] == spec["id"]) >= spec["instances"]:
        _raise(NVML_ERROR_INSUFFICIENT_RESOURCES)
    whole = max(_table(gpu), key=lambda p: p["slices"])
    if sum(_gi_slices(m["profile"]) for m, _ in gis) + spec["slices"] > whole["slices"]:
        _raise(NVML_ERROR_INSUFFICIENT_RESOURCES)
    for engine in ("decoders", "encoders", "jpeg", "ofa"):
        have = max(p[engine] for p in _table(gpu))
        if spec[engine] and sum(p[engine] for _, p in gis if p is not None) + spec[engine] > have:
            _raise(NVML_ERROR_INSUFFICIENT_RESOURCES)


def _create_gi(func: str, device: c_nvmlDevice_t, profile_id: int, start: int | None) -> Any:
    uuid = _mig_gpu(func, device)["uuid"]

    def create(gpu: dict[str, Any]) -> int:
        if not gpu.get("mig_mode"):
            _raise(NVML_ERROR_NOT_SUPPORTED)
        spec = _spec_by_id(gpu, profile_id)
        chosen = start
        if chosen is None:  # the first placement that fits, as nvmlDeviceCreateGpuInstance picks
            for candidate in spec["starts"]:
                try:
                    _check_placement(gpu, spec, candidate)
                except NVMLError:
                    continue
                chosen = candidate
                break
            else:
                _raise(NVML_ERROR_INSUFFICIENT_RESOURCES)
        _check_placement(gpu, spec, chosen)
        gi = _gi_id(chosen, spec["size"])
        gpu.setdefault("mig_devices", []).append(
            {"profile": spec["name"], "gi_id": gi, "ci_id": None, "placement_start": chosen,
             "placement_size": spec["size"], "memory_bytes": spec["memory_mb"] * 2**20,
             "multiprocessors": spec["multiprocessors"], "uuid": "", "copy_engines": spec["copy_engines"],
             "decoders": spec["decoders"], "encoders": spec["encoders"], "jpeg": spec["jpeg"], "ofa": spec["ofa"]}
        )  # fmt: skip
        _capability(gpu, f"gi{gi}", True)
        return gi

    return _gi_handle(uuid, _change(func, uuid, create))


def nvmlDeviceCreateGpuInstance(device: c_nvmlDevice_t, profileId: int) -> Any:
    return _create_gi("nvmlDeviceCreateGpuInstance", device, profileId, None)


def nvmlDeviceCreateGpuInstanceWithPlacement(device: c_nvmlDevice_t, profileId: int, placement: Any) -> Any:
    """`placement`: a c_nvmlGpuInstancePlacement_t, by reference (`byref`/`pointer`) as the C call takes it."""
    where = _target(placement)
    if not isinstance(where, c_nvmlGpuInstancePlacement_t):
        _raise(NVML_ERROR_INVALID_ARGUMENT)
    if where.size != _spec_by_id(_mig_gpu("nvmlDeviceCreateGpuInstanceWithPlacement", device), profileId)["size"]:
        _raise(NVML_ERROR_INVALID_ARGUMENT)
    return _create_gi("nvmlDeviceCreateGpuInstanceWithPlacement", device, profileId, int(where.start))


def nvmlDeviceGetGpuInstances(device: c_nvmlDevice_t, profileId: int, gpuInstancesRef: Any, countRef: Any) -> int:
    """None while MIG mode is off (a count of 0, no error, as real NVML answers)."""
    gpu = _mig_gpu("nvmlDeviceGetGpuInstances", device, mig_mode=False)
    spec = _spec_by_id(gpu, profileId)
    found = sorted(g for g, e in _gis(gpu).items() if (_profile_of(gpu, e[0]["profile"]) or {}).get("id") == spec["id"])
    array = _target(gpuInstancesRef)
    if len(array) < len(found):
        _raise(NVML_ERROR_INSUFFICIENT_SIZE)
    for i, gi in enumerate(found):
        array[i] = _gi_handle(gpu["uuid"], gi)
    _target(countRef).value = len(found)
    return NVML_SUCCESS


def nvmlDeviceGetGpuInstanceById(device: c_nvmlDevice_t, gpuInstanceId: int) -> Any:
    gpu = _mig_gpu("nvmlDeviceGetGpuInstanceById", device, mig_mode=False)  # MIG off: NOT_FOUND
    if gpuInstanceId not in _gis(gpu):
        _raise(NVML_ERROR_NOT_FOUND)
    return _gi_handle(gpu["uuid"], gpuInstanceId)


def nvmlGpuInstanceGetInfo(gpuInstance: Any) -> c_nvmlGpuInstanceInfo_t:
    gpu, entries, _ = _instance("nvmlGpuInstanceGetInfo", gpuInstance)
    m, spec = entries[0], _profile_of(gpu, entries[0]["profile"])
    return c_nvmlGpuInstanceInfo_t(c_nvmlDevice_t(gpu["uuid"]), int(m["gi_id"]), spec["id"] if spec else 0xFFFFFFFF,
                                   int(m["placement_start"]), int(m["placement_size"]))  # fmt: skip


def _gi_spec(gpu: dict[str, Any], entries: list[dict[str, Any]]) -> dict[str, Any]:
    spec = _profile_of(gpu, entries[0]["profile"])
    if spec is None:
        _raise(NVML_ERROR_NOT_SUPPORTED)
    return spec


def nvmlGpuInstanceGetComputeInstanceProfileInfo(gpuInstance: Any, profile: int, engProfile: int,
                                                 version: int = 2) -> c_nvmlComputeInstanceProfileInfo_v2_t:  # fmt: skip
    gpu, entries, _ = _instance("nvmlGpuInstanceGetComputeInstanceProfileInfo", gpuInstance)
    spec = _gi_spec(gpu, entries)
    if engProfile != NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED or version != 2:
        _raise(NVML_ERROR_INVALID_ARGUMENT)
    slices = _CI_SLICES.get(profile, 0)
    if not 0 < slices <= spec["slices"] or (spec["slices"] == 4 and slices == 3):
        _raise(NVML_ERROR_NOT_SUPPORTED)
    info = c_nvmlComputeInstanceProfileInfo_v2_t()
    info.id, info.sliceCount, info.instanceCount = profile, slices, spec["slices"] // slices
    info.multiprocessorCount = spec["multiprocessors"] * slices // spec["slices"]
    info.sharedCopyEngineCount, info.sharedDecoderCount = spec["copy_engines"], spec["decoders"]
    info.sharedEncoderCount, info.sharedJpegCount, info.sharedOfaCount = spec["encoders"], spec["jpeg"], spec["ofa"]
    whole = slices == spec["slices"]
    info.name = f"MIG {spec['name'] if whole else f'{slices}c.' + spec['name']}".encode()
    return info


nvmlGpuInstanceGetComputeInstanceProfileInfoV = nvmlGpuInstanceGetComputeInstanceProfileInfo


def _create_ci(func: str, gpuInstance: Any, profile_id: int, start: int | None) -> Any:
    gpu, entries, _ = _instance(func, gpuInstance)
    uuid, gi = gpu["uuid"], int(entries[0]["gi_id"])

    def create(gpu: dict[str, Any]) -> int:
        entries = _gis(gpu).get(gi)
        if entries is None:
            _raise(NVML_ERROR_INVALID_ARGUMENT)
        spec = _gi_spec(gpu, entries)
        slices = _CI_SLICES.get(profile_id, 0)
        if not 0 < slices <= spec["slices"]:
            _raise(NVML_ERROR_INVALID_ARGUMENT)
        made = [m for m in entries if m["ci_id"] is not None]
        used = sorted(int(m["ci_start"]) for m in made if "ci_start" in m)
        if sum(_ci_slices(m["profile"]) for m in made) + slices > spec["slices"]:
            _raise(NVML_ERROR_INSUFFICIENT_RESOURCES)
        first = start if start is not None else next(s for s in range(spec["slices"]) if s not in used)
        ci = min(set(range(8)) - {int(m["ci_id"]) for m in made})
        entry = entries[0] if entries[0]["ci_id"] is None else dict(entries[0])
        entry.update(
            profile=spec["name"] if slices == spec["slices"] else f"{slices}c.{spec['name']}", ci_id=ci, ci_start=first,
            multiprocessors=spec["multiprocessors"] * slices // spec["slices"], uuid=f"MIG-{uuid_module.uuid4()}",
        )  # fmt: skip
        if entry is not entries[0]:
            gpu["mig_devices"].append(entry)
        _capability(gpu, f"gi{gi}/ci{ci}", True)
        return ci

    return _ci_handle(uuid, gi, _change(func, uuid, create))


def nvmlGpuInstanceCreateComputeInstance(gpuInstance: Any, profileId: int) -> Any:
    return _create_ci("nvmlGpuInstanceCreateComputeInstance", gpuInstance, profileId, None)


def nvmlGpuInstanceCreateComputeInstanceWithPlacement(gpuInstance: Any, profileId: int, placement: Any) -> Any:
    where = _target(placement)
    if not isinstance(where, c_nvmlComputeInstancePlacement_t):
        _raise(NVML_ERROR_INVALID_ARGUMENT)
    return _create_ci("nvmlGpuInstanceCreateComputeInstanceWithPlacement", gpuInstance, profileId, int(where.start))


def nvmlGpuInstanceGetComputeInstances(gpuInstance: Any, profileId: int, computeInstancesRef: Any,
                                       countRef: Any) -> int:  # fmt: skip
    gpu, entries, _ = _instance("nvmlGpuInstanceGetComputeInstances", gpuInstance)
    spec = _gi_spec(gpu, entries)
    slices = _CI_SLICES.get(profileId, 0)
    found = sorted(int(m["ci_id"]) for m in entries if m["ci_id"] is not None
                   and (_ci_slices(m["profile"]) if m["profile"] != spec["name"] else spec["slices"]) == slices)  # fmt: skip
    array = _target(computeInstancesRef)
    if len(array) < len(found):
        _raise(NVML_ERROR_INSUFFICIENT_SIZE)
    for i, ci in enumerate(found):
        array[i] = _ci_handle(gpu["uuid"], int(entries[0]["gi_id"]), ci)
    _target(countRef).value = len(found)
    return NVML_SUCCESS


def nvmlGpuInstanceGetComputeInstanceById(gpuInstance: Any, computeInstanceId: int) -> Any:
    gpu, entries, _ = _instance("nvmlGpuInstanceGetComputeInstanceById", gpuInstance)
    if not any(m["ci_id"] == computeInstanceId for m in entries):
        _raise(NVML_ERROR_NOT_FOUND)
    return _ci_handle(gpu["uuid"], int(entries[0]["gi_id"]), computeInstanceId)


def nvmlComputeInstanceGetInfo_v2(computeInstance: Any) -> c_nvmlComputeInstanceInfo_t:
    gpu, entries, ci = _instance("nvmlComputeInstanceGetInfo", computeInstance, ci=True)
    m = next(m for m in entries if m["ci_id"] == ci)
    slices = _ci_slices(m["profile"])
    profile = next((p for p, s in _CI_SLICES.items() if s == slices), 0)
    gi = _gi_handle(gpu["uuid"], int(m["gi_id"]))
    return c_nvmlComputeInstanceInfo_t(c_nvmlDevice_t(gpu["uuid"]), gi, ci, profile, int(m.get("ci_start", 0)), slices)


def nvmlComputeInstanceGetInfo(computeInstance: Any) -> c_nvmlComputeInstanceInfo_t:
    return nvmlComputeInstanceGetInfo_v2(computeInstance)


def nvmlComputeInstanceDestroy(computeInstance: Any) -> int:
    gpu, entries, ci = _instance("nvmlComputeInstanceDestroy", computeInstance, ci=True)
    gi = int(entries[0]["gi_id"])

    def destroy(gpu: dict[str, Any]) -> None:
        entries = _gis(gpu).get(gi, [])
        mine = next((m for m in entries if m["ci_id"] == ci), None)
        if mine is None:
            _raise(NVML_ERROR_INVALID_ARGUMENT)
        if len(entries) > 1:
            gpu["mig_devices"].remove(mine)
        else:  # the GPU instance stays, without compute instances
            mine.update(ci_id=None, uuid="", profile=_gi_spec(gpu, entries)["name"])
            mine.pop("ci_start", None)
        _capability(gpu, f"gi{gi}/ci{ci}", False)

    _change("nvmlComputeInstanceDestroy", gpu["uuid"], destroy)
    return NVML_SUCCESS


def nvmlGpuInstanceDestroy(gpuInstance: Any) -> int:
    gpu, entries, _ = _instance("nvmlGpuInstanceDestroy", gpuInstance)
    gi = int(entries[0]["gi_id"])

    def destroy(gpu: dict[str, Any]) -> None:
        entries = _gis(gpu).get(gi)
        if entries is None:
            _raise(NVML_ERROR_INVALID_ARGUMENT)
        if any(m["ci_id"] is not None for m in entries):
            _raise(NVML_ERROR_IN_USE)  # its compute instances must go first
        gpu["mig_devices"].remove(entries[0])
        _capability(gpu, f"gi{gi}", False)

    _change("nvmlGpuInstanceDestroy", gpu["uuid"], destroy)
    return NVML_SUCCESS


# --- memory health: ECC counters, row remapping, page retirement -------------------------------


def _ecc_events(uuid: str, event_type: int) -> int:
    """ECC events raised on this GPU so far: each one is an error the counters must include."""
    try:
        with open(_events_path(), "rb") as f:
            lines = f.read().splitlines()
    except OSError:
        return 0
    count = 0
    for line in lines:
        try:
            ev = json.loads(line)
            if str(ev["uuid"]) == uuid and int(ev["event_type"]) == event_type:
                count += 1
        except (ValueError, KeyError, TypeError):
            continue
    return count


def nvmlDeviceGetEccMode(handle: c_nvmlDevice_t) -> list[int]:
    gpu = _full_gpu("nvmlDeviceGetEccMode", handle)
    mode = NVML_FEATURE_ENABLED if gpu.get("ecc_enabled", True) else NVML_FEATURE_DISABLED
    return [mode, mode]


def nvmlDeviceGetTotalEccErrors(handle: c_nvmlDevice_t, errorType: int, counterType: int) -> int:
    """The profile's base count plus every ECC event of that type raised since (as the driver
    counts the error it reports). Not supported while ECC is disabled, like the real call."""
    gpu = _full_gpu("nvmlDeviceGetTotalEccErrors", handle)
    if not gpu.get("ecc_enabled", True):
        _raise(NVML_ERROR_NOT_SUPPORTED)
    if errorType not in (NVML_MEMORY_ERROR_TYPE_CORRECTED, NVML_MEMORY_ERROR_TYPE_UNCORRECTED) or counterType not in (
        NVML_VOLATILE_ECC,
        NVML_AGGREGATE_ECC,
    ):
        _raise(NVML_ERROR_INVALID_ARGUMENT)
    corrected = errorType == NVML_MEMORY_ERROR_TYPE_CORRECTED
    kind = "corrected" if corrected else "uncorrected"
    event = nvmlEventTypeSingleBitEccError if corrected else nvmlEventTypeDoubleBitEccError
    total = int(gpu.get(f"ecc_{kind}_volatile", 0)) + _ecc_events(gpu["uuid"], event)
    if counterType == NVML_AGGREGATE_ECC:
        total += int(gpu.get(f"ecc_{kind}_aggregate", 0))
    return total


def nvmlDeviceGetRemappedRows(device: c_nvmlDevice_t) -> tuple[int, int, int, int]:
    """(correctable rows, uncorrectable rows, remapping pending, remapping failed): Ampere and later."""
    gpu = _full_gpu("nvmlDeviceGetRemappedRows", device)
    if int(gpu.get("architecture", NVML_DEVICE_ARCH_UNKNOWN)) < NVML_DEVICE_ARCH_AMPERE:
        _raise(NVML_ERROR_NOT_SUPPORTED)
    return (
        int(gpu.get("remapped_rows_correctable", 0)),
        int(gpu.get("remapped_rows_uncorrectable", 0)),
        1 if gpu.get("remapped_rows_pending") else 0,
        1 if gpu.get("remapped_rows_failure") else 0,
    )


def nvmlDeviceGetRetiredPagesPendingStatus(device: c_nvmlDevice_t) -> int:
    """Dynamic page retirement: before Ampere only (row remapping replaced it)."""
    gpu = _full_gpu("nvmlDeviceGetRetiredPagesPendingStatus", device)
    arch = int(gpu.get("architecture", NVML_DEVICE_ARCH_UNKNOWN))
    if NVML_DEVICE_ARCH_AMPERE <= arch < NVML_DEVICE_ARCH_UNKNOWN or not gpu.get("ecc_enabled", True):
        _raise(NVML_ERROR_NOT_SUPPORTED)
    return NVML_FEATURE_ENABLED if gpu.get("retired_pages_pending") else NVML_FEATURE_DISABLED


# --- grey failures: PCIe link, clocks, NVLink -----------------------------------------------------

# A healthy H100 SXM's signals: what a state file written before the fields existed means.
_HEALTHY = {
    "pcie_link_gen": 5,
    "pcie_link_gen_max": 5,
    "pcie_link_gen_gpu_max": 5,
    "pcie_idle_gen": 1,
    "pcie_link_width": 16,
    "pcie_link_width_max": 16,
    "pcie_replay_counter": 0,
    "clocks_event_reasons": 0,
    "nvlink_count": 0,
}


def _signal(gpu: dict[str, Any], name: str) -> int:
    return int(gpu.get(name, _HEALTHY[name]))


def _idle(gpu: dict[str, Any]) -> bool:
    """Nothing kept the GPU busy over the last sample: it saves power, on its link and its clocks."""
    return int(gpu.get("utilization_gpu", 0)) == 0


def nvmlDeviceGetCurrPcieLinkGeneration(handle: c_nvmlDevice_t) -> int:
    """The generation now: an idle GPU's link runs slower than it trained to (module docstring)."""
    gpu = _full_gpu("nvmlDeviceGetCurrPcieLinkGeneration", handle)
    trained = _signal(gpu, "pcie_link_gen")
    return min(trained, _signal(gpu, "pcie_idle_gen")) if _idle(gpu) else trained


def nvmlDeviceGetMaxPcieLinkGeneration(handle: c_nvmlDevice_t) -> int:
    """The most the GPU and the system's slot can do together."""
    return _signal(_full_gpu("nvmlDeviceGetMaxPcieLinkGeneration", handle), "pcie_link_gen_max")


def nvmlDeviceGetGpuMaxPcieLinkGeneration(handle: c_nvmlDevice_t) -> int:
    """The most the GPU alone can do, whatever slot it sits in."""
    return _signal(_full_gpu("nvmlDeviceGetGpuMaxPcieLinkGeneration", handle), "pcie_link_gen_gpu_max")


def nvmlDeviceGetCurrPcieLinkWidth(handle: c_nvmlDevice_t) -> int:
    return _signal(_full_gpu("nvmlDeviceGetCurrPcieLinkWidth", handle), "pcie_link_width")


def nvmlDeviceGetMaxPcieLinkWidth(handle: c_nvmlDevice_t) -> int:
    return _signal(_full_gpu("nvmlDeviceGetMaxPcieLinkWidth", handle), "pcie_link_width_max")


def nvmlDeviceGetPcieReplayCounter(handle: c_nvmlDevice_t) -> int:
    return _signal(_full_gpu("nvmlDeviceGetPcieReplayCounter", handle), "pcie_replay_counter")


def _clocks_event_reasons(func: str, handle: c_nvmlDevice_t) -> int:
    gpu = _full_gpu(func, handle)
    idle = nvmlClocksEventReasonGpuIdle if _idle(gpu) else nvmlClocksEventReasonNone
    return _signal(gpu, "clocks_event_reasons") | idle


def nvmlDeviceGetCurrentClocksEventReasons(handle: c_nvmlDevice_t) -> int:
    return _clocks_event_reasons("nvmlDeviceGetCurrentClocksEventReasons", handle)


def nvmlDeviceGetCurrentClocksThrottleReasons(handle: c_nvmlDevice_t) -> int:
    """The deprecated name, a C function of its own: an error injected under one leaves the other."""
    return _clocks_event_reasons("nvmlDeviceGetCurrentClocksThrottleReasons", handle)


def nvmlDeviceGetNvLinkState(device: c_nvmlDevice_t, link: int) -> int:
    gpu = _full_gpu("nvmlDeviceGetNvLinkState", device)
    links = _signal(gpu, "nvlink_count")
    if links == 0:
        _raise(NVML_ERROR_NOT_SUPPORTED)
    if not 0 <= link < links:
        _raise(NVML_ERROR_INVALID_ARGUMENT)
    return NVML_FEATURE_DISABLED if link in gpu.get("nvlink_down", []) else NVML_FEATURE_ENABLED


# --- field values --------------------------------------------------------------------------------

_NVLINK_ERROR_FIELDS = {  # field: its key in the profile's `nvlink_errors`
    NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL: "crc_flit",
    NVML_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL: "crc_data",
    NVML_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL: "replay",
    NVML_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL: "recovery",
}
_NVLINK_FIELDS = (NVML_FI_DEV_NVLINK_LINK_COUNT, NVML_FI_DEV_NVLINK_GET_STATE, *_NVLINK_ERROR_FIELDS)


def _field(gpu: dict[str, Any], fid: int, scope: int) -> tuple[int, int, int]:
    """One field of a full GPU: (its nvmlReturn, valueType, value)."""
    uint, ull = NVML_VALUE_TYPE_UNSIGNED_INT, NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
    action = gpu.get("recovery_action")
    if fid == NVML_FI_DEV_GET_GPU_RECOVERY_ACTION and action is not None:
        return NVML_SUCCESS, uint, int(action)
    if fid == NVML_FI_DEV_PCIE_REPLAY_COUNTER:
        return NVML_SUCCESS, uint, _signal(gpu, "pcie_replay_counter")
    links = _signal(gpu, "nvlink_count")
    if fid not in _NVLINK_FIELDS or links == 0:
        return NVML_ERROR_NOT_SUPPORTED, 0, 0
    if fid == NVML_FI_DEV_NVLINK_LINK_COUNT:
        return NVML_SUCCESS, uint, links
    if fid == NVML_FI_DEV_NVLINK_GET_STATE:
        if not 0 <= scope < links:
            return NVML_ERROR_INVALID_ARGUMENT, 0, 0
        down = scope in gpu.get("nvlink_down", [])
        return NVML_SUCCESS, uint, NVML_NVLINK_STATE_INACTIVE if down else NVML_NVLINK_STATE_ACTIVE
    return NVML_SUCCESS, ull, int(gpu.get("nvlink_errors", {}).get(_NVLINK_ERROR_FIELDS[fid], 0))


def nvmlDeviceGetFieldValues(handle: c_nvmlDevice_t, fieldIds: list[int | tuple[int, int]]) -> Any:
    """Like NVML: the call succeeds and each field carries its own `nvmlReturn`. Modelled: the
    recovery action, the PCIe replay counter and the NVLink fields (module docstring); every other
    field, the recovery action of a GPU whose profile has none (a driver before the field existed),
    the NVLink fields of a GPU without links and every field of a MIG device are NOT_SUPPORTED."""
    gpu, mig = _resolve("nvmlDeviceGetFieldValues", handle)
    values = (c_nvmlFieldValue_t * len(fieldIds))()
    for i, field_id in enumerate(fieldIds):
        fid, scope = field_id if isinstance(field_id, tuple) else (field_id, 0)
        values[i].fieldId, values[i].scopeId = fid, scope
        values[i].timestamp = time.time_ns() // 1000
        ret, value_type, value = (NVML_ERROR_NOT_SUPPORTED, 0, 0) if mig is not None else _field(gpu, fid, scope)
        values[i].nvmlReturn = ret
        if ret == NVML_SUCCESS:
            values[i].valueType = value_type
            if value_type == NVML_VALUE_TYPE_UNSIGNED_LONG_LONG:
                values[i].value.ullVal = value
            else:
                values[i].value.uiVal = value
    return values


# --- events --------------------------------------------------------------------------------------


def _events_path() -> str:
    return _state_path + ".events"


class _Changes:
    """Wakes a waiter when the state or the events file changes: an inotify watch on their
    directory (through ctypes: the standard library has no binding) that ignores the other files
    there, where the kernel has inotify; else a 20 ms poll.

    The watch exists before the waiter first looks at the files, so a change made between its
    look and its wait is still pending when it waits: nothing is missed. For the same reason a
    wait that saw no change needs no second look: the look before it still holds."""

    _MASK = 0x2 | 0x8 | 0x80 | 0x100  # IN_MODIFY | IN_CLOSE_WRITE | IN_MOVED_TO | IN_CREATE
    _OVERFLOW = 0x4000  # IN_Q_OVERFLOW: always reported, names no file

    def __init__(self, state_path: str) -> None:
        self._names = {os.fsencode(os.path.basename(p)) for p in (state_path, state_path + ".events")}
        self._fd = -1
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
            directory = os.path.dirname(os.path.abspath(state_path))
            if fd >= 0 and libc.inotify_add_watch(fd, os.fsencode(directory), self._MASK) < 0:
                os.close(fd)
                fd = -1
            self._fd = fd
        except (OSError, AttributeError):
            self._fd = -1
        if self._fd >= 0:
            weakref.finalize(self, os.close, self._fd)

    def drain(self) -> None:
        """Forget the changes seen so far (the caller is about to look at the files)."""
        self._changed()

    def wait(self, seconds: float) -> bool:
        """Until one of the two files changes after the last `drain`, or `seconds` (0: whether one
        has): whether one may have changed (always, without inotify: the caller must look)."""
        if self._fd < 0:
            time.sleep(min(0.02, seconds))
            return True
        deadline = time.monotonic() + seconds
        while True:
            remaining = deadline - time.monotonic()
            if not select.select([self._fd], [], [], max(0.0, remaining))[0]:
                return False
            if self._changed():
                return True
            if remaining <= 0:
                return False

    def _changed(self) -> bool:
        """Read the pending notifications: whether one was about the state or the events file
        (or may have been: the kernel's queue overflowed and dropped some)."""
        changed = False
        with contextlib.suppress(BlockingIOError):
            while self._fd >= 0 and (data := os.read(self._fd, 4096)):
                offset = 0
                while offset < len(data):  # struct inotify_event: wd, mask, cookie, len, name[len]
                    mask = int.from_bytes(data[offset + 4 : offset + 8], sys.byteorder)
                    length = int.from_bytes(data[offset + 12 : offset + 16], sys.byteorder)
                    changed |= bool(mask & self._OVERFLOW)
                    changed |= data[offset + 16 : offset + 16 + length].rstrip(b"\0") in self._names
                    offset += 16 + length
        return changed


def nvmlEventSetCreate() -> c_nvmlEventSet_t:
    _current()
    changes = _Changes(_state_path)
    try:
        cursor = os.path.getsize(_events_path())
    except OSError:
        cursor = 0
    return c_nvmlEventSet_t(cursor, changes)


def nvmlDeviceGetSupportedEventTypes(handle: c_nvmlDevice_t) -> int:
    _full_gpu("nvmlDeviceGetSupportedEventTypes", handle)
    return _SUPPORTED_EVENTS


def nvmlDeviceRegisterEvents(handle: c_nvmlDevice_t, eventTypes: int, eventSet: c_nvmlEventSet_t) -> None:
    gpu = _full_gpu("nvmlDeviceRegisterEvents", handle)
    if eventTypes & ~_SUPPORTED_EVENTS:
        _raise(NVML_ERROR_NOT_SUPPORTED)
    eventSet.registered[gpu["uuid"]] = eventSet.registered.get(gpu["uuid"], 0) | eventTypes


def _next_event(eventSet: c_nvmlEventSet_t) -> c_nvmlEventData_t | None:
    try:
        with open(_events_path(), "rb") as f:
            f.seek(eventSet.cursor)
            data = f.read()
    except OSError:
        return None
    for line in data.splitlines(keepends=True):
        if not line.endswith(b"\n"):
            break  # a line still being written
        eventSet.cursor += len(line)
        try:
            ev = json.loads(line)
            uuid, etype = str(ev["uuid"]), int(ev["event_type"])
        except (ValueError, KeyError, TypeError):
            continue
        if eventSet.registered.get(uuid, 0) & etype:
            gi, ci = int(ev.get("gi", 0xFFFFFFFF)), int(ev.get("ci", 0xFFFFFFFF))
            return c_nvmlEventData_t(c_nvmlDevice_t(uuid), etype, int(ev.get("event_data", 0)), gi, ci)
    return None


def nvmlEventSetWait_v2(eventSet: c_nvmlEventSet_t, timeoutms: int) -> c_nvmlEventData_t:
    """The next event, or NVML_ERROR_TIMEOUT. The files are looked at only when they may have
    changed since the last look that found nothing (`quiet`), so a caller that waits in a loop
    pays per timeout what it pays the real library: the wake, no file reads."""
    deadline = time.monotonic() + timeoutms / 1000
    looked = False
    while True:
        if not eventSet.quiet:
            eventSet.changes.drain()
            gpus = _current()
            if any(g.get("lost") for g in gpus if g["uuid"] in eventSet.registered):
                _raise(NVML_ERROR_GPU_IS_LOST)  # as the real wait does while a GPU in the set is off the bus
            event = _next_event(eventSet)
            if event is not None:
                return event  # more may be queued: the next wait looks again
            eventSet.quiet = looked = True
        else:
            with _lock:
                if _refcount == 0:
                    _raise(NVML_ERROR_UNINITIALIZED)
        remaining = deadline - time.monotonic()
        # Past the deadline a fresh look is the answer; a quiet set still asks whether it is stale.
        if (looked and remaining <= 0) or not eventSet.changes.wait(max(0.0, remaining)):
            _raise(NVML_ERROR_TIMEOUT)
        eventSet.quiet = False


def nvmlEventSetWait(eventSet: c_nvmlEventSet_t, timeoutms: int) -> c_nvmlEventData_t:
    return nvmlEventSetWait_v2(eventSet, timeoutms)


def nvmlEventSetFree(eventSet: c_nvmlEventSet_t) -> None:
    eventSet.registered.clear()
