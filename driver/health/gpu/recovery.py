"""The GPU's recovery action as NVML reports it: the field value `NVML_FI_DEV_GET_GPU_RECOVERY_ACTION`.

`nvmlDeviceGetFieldValues` succeeds when it could fill any field and gives each field its own
return code. A driver that predates the field answers NOT_SUPPORTED in that code (so does a GPU
without it), and a library that predates the call has no such function (FUNCTION_NOT_FOUND):
both mean "not reported", and the policy falls back to the Xid catalog (`policy`).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from driver.health.gpu.nvml_events import LOST_ERRORS
from driver.health.gpu.policy import GpuHealthPolicy
from driver.model import Condition
from driver.node.nvml import ERROR_FUNCTION_NOT_FOUND, ERROR_NOT_SUPPORTED, REINIT_ERRORS, NvmlError

RECOVERY_ACTION_FIELD = 230  # NVML_FI_DEV_GET_GPU_RECOVERY_ACTION
_SUCCESS = 0
# nvmlValueType_t -> the member of c_nvmlValue_t that holds it (the action is an unsigned int).
_VALUE_MEMBERS = {1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}


def read_recovery_action(nvml: ModuleType, handle: Any) -> int | None:
    """The GPU's recovery action (an `NVML_GPU_RECOVERY_ACTION_*` value), or None when the driver
    does not report one; any other failure of the call is raised for the caller to judge."""
    try:
        values = nvml.nvmlDeviceGetFieldValues(handle, [RECOVERY_ACTION_FIELD])
    except NvmlError as e:
        if e.value in (ERROR_NOT_SUPPORTED, ERROR_FUNCTION_NOT_FOUND):
            return None
        raise
    value = values[0]
    member = _VALUE_MEMBERS.get(int(value.valueType))
    if int(value.nvmlReturn) != _SUCCESS or member is None:
        return None
    return int(getattr(value.value, member))


def recovery_conditions(
    nvml: ModuleType, handle: Any, policy: GpuHealthPolicy, conds: list[Condition], failures: list[str]
) -> None:
    """The probe's reading: a `recovery-action` condition while the driver asks for one."""
    try:
        action = read_recovery_action(nvml, handle)
    except NvmlError as e:
        if e.value in LOST_ERRORS or e.value in REINIT_ERRORS:
            raise
        failures.append(f"nvmlDeviceGetFieldValues: {e}")
        return
    cond = None if action is None else policy.recovery_action(action)
    if cond is not None:
        conds.append(cond)
