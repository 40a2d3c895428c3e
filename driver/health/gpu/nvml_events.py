"""NVML events for the GPU health monitor: which events it wants, the session that holds the
event set, and registering the GPUs that answer.

Events are a prompt, not the truth (the probe re-reads the state): a GPU that cannot be
registered is `unmonitored` (a condition says so), never silently unwatched.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from driver.errors import NodeError
from driver.node.nvml import (
    ERROR_GPU_IS_LOST,
    ERROR_GPU_NOT_FOUND,
    ERROR_NOT_FOUND,
    REINIT_ERRORS,
    NvmlError,
    shutdown_nvml,
)

log = logging.getLogger(__name__)

SINGLE_BIT = 0x1  # nvmlEventTypeSingleBitEccError
DOUBLE_BIT = 0x2  # nvmlEventTypeDoubleBitEccError
XID = 0x8  # nvmlEventTypeXidCriticalError
WANTED_EVENTS = XID | DOUBLE_BIT | SINGLE_BIT
EVENT_NAMES = {XID: "xid", DOUBLE_BIT: "double_bit_ecc", SINGLE_BIT: "single_bit_ecc"}

# The GPU itself is gone (fallen off the bus, removed): it is lost, not broken.
LOST_ERRORS = frozenset({ERROR_GPU_IS_LOST, ERROR_NOT_FOUND, ERROR_GPU_NOT_FOUND})


class NvmlGone(NodeError):
    """NVML itself went away; the session must be closed and NVML initialised again."""


@dataclass
class Session:
    """Everything that lives between one nvmlInit and its nvmlShutdown."""

    nvml: ModuleType
    generation: int = 0  # `NvmlAccess.generation` when it opened: a release since closes it
    event_set: Any = None
    registered: dict[str, Any] = field(default_factory=dict)  # GPU UUID -> handle
    handle_uuids: dict[Any, str] = field(default_factory=dict)  # handle key -> GPU UUID
    unmonitored: dict[str, str] = field(default_factory=dict)  # GPU UUID -> why not


def handle_key(handle: Any) -> Any:
    """A hashable identity for an NVML device handle: the pointer's address for the real binding."""
    try:
        return ctypes.cast(handle, ctypes.c_void_p).value
    except (ctypes.ArgumentError, TypeError):
        return handle


def close(s: Session) -> None:
    """Free the event set and shut NVML down; failures are only logged (this is cleanup)."""
    nvml = s.nvml
    if s.event_set is not None:
        with contextlib.suppress(NvmlError):
            nvml.nvmlEventSetFree(s.event_set)
    shutdown_nvml(nvml)


def register(s: Session, answering: dict[str, Any], on_error: Callable[[], None]) -> None:
    """Watch every answering GPU; start a new event set when a watched one stopped answering.

    NVML cannot unregister a device, and a set holding a lost GPU fails every wait, so a GPU
    that left means a fresh set (events in between are lost; the probe still sees the state).
    """
    nvml = s.nvml
    for uuid in set(s.unmonitored) - set(answering):
        del s.unmonitored[uuid]
    if s.event_set is not None and set(s.registered) - set(answering):
        with contextlib.suppress(NvmlError):
            nvml.nvmlEventSetFree(s.event_set)
        s.event_set = None
    if s.event_set is None:
        s.registered.clear()
        s.handle_uuids.clear()
        if not answering:
            return
        try:
            s.event_set = nvml.nvmlEventSetCreate()
        except NvmlError as e:
            if e.value in REINIT_ERRORS:
                raise
            on_error()
            for uuid in answering:
                s.unmonitored[uuid] = f"nvmlEventSetCreate: {e}"
            return
    for uuid, handle in answering.items():
        if uuid in s.registered:
            continue
        try:
            mask = int(nvml.nvmlDeviceGetSupportedEventTypes(handle)) & WANTED_EVENTS
            if not mask & XID:
                s.unmonitored[uuid] = "the GPU does not report XID events"
                continue
            nvml.nvmlDeviceRegisterEvents(handle, mask, s.event_set)
        except NvmlError as e:
            if e.value in REINIT_ERRORS:
                raise
            on_error()
            if s.unmonitored.get(uuid) is None:
                log.warning("GPU %s: cannot register for NVML events: %s", uuid, e)
            s.unmonitored[uuid] = f"nvmlDeviceRegisterEvents: {e}"
            continue
        s.registered[uuid] = handle
        s.handle_uuids[handle_key(handle)] = uuid
        s.unmonitored.pop(uuid, None)
        log.info("GPU %s: watching NVML events 0x%x", uuid, mask)
