"""What the probe reads of a GPU's memory: rows waiting for a reset, and errors no event reported.

Row remapping (Ampere and later), else page retirement, says whether the GPU waits for a reset;
both are HARD conditions, stated afresh by every probe. The volatile ECC counters are the truth
about ECC errors and events only a prompt: `EccLedger` tells from two readings how many errors
the events did not already report (a lost event, say); `EventRate` counts the corrected ones
within a window, for the single-bit rate notice.
"""

from __future__ import annotations

import collections
from collections.abc import Collection
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from driver.health.gpu.nvml_events import LOST_ERRORS
from driver.health.gpu.policy import GpuHealthPolicy
from driver.model import Condition
from driver.node.nvml import ERROR_NOT_SUPPORTED, REINIT_ERRORS, NvmlError

CORRECTED = 0  # NVML_MEMORY_ERROR_TYPE_CORRECTED
UNCORRECTED = 1  # NVML_MEMORY_ERROR_TYPE_UNCORRECTED
VOLATILE = 0  # NVML_VOLATILE_ECC


class EventRate:
    """Occurrences within a sliding window (single-bit ECC errors per GPU)."""

    def __init__(self, window: float) -> None:
        self.window = window
        self._samples: collections.deque[tuple[float, int]] = collections.deque()
        self._total = 0

    def add(self, count: int, now: float) -> int:
        """Record `count` occurrences at `now`; the total within the window ending at `now`."""
        if count > 0:
            self._samples.append((now, count))
            self._total += count
        while self._samples and self._samples[0][0] <= now - self.window:
            self._total -= self._samples.popleft()[1]
        return self._total


def memory_conditions(
    nvml: ModuleType, handle: Any, policy: GpuHealthPolicy, conds: list[Condition], failures: list[str]
) -> None:
    """Row remapping (Ampere and later), else page retirement: what waits for a GPU reset."""
    try:
        corrected, uncorrected, pending, failed = nvml.nvmlDeviceGetRemappedRows(handle)
    except NvmlError as e:
        if e.value in LOST_ERRORS or e.value in REINIT_ERRORS:
            raise
        if e.value != ERROR_NOT_SUPPORTED:
            failures.append(f"nvmlDeviceGetRemappedRows: {e}")
            return
    else:
        rows = f"{int(corrected)} correctable and {int(uncorrected)} uncorrectable row(s) remapped"
        if int(pending):
            conds.append(policy.row_remap_pending(f"a row remapping is pending ({rows})"))
        if int(failed):
            conds.append(policy.row_remap_failed(f"a row remapping failed ({rows})"))
        return
    try:
        pending = nvml.nvmlDeviceGetRetiredPagesPendingStatus(handle)
    except NvmlError as e:
        if e.value in LOST_ERRORS or e.value in REINIT_ERRORS:
            raise
        if e.value != ERROR_NOT_SUPPORTED:
            failures.append(f"nvmlDeviceGetRetiredPagesPendingStatus: {e}")
        return
    if int(pending):
        conds.append(policy.row_remap_pending("a page retirement is pending"))


@dataclass
class _Ecc:
    """One GPU's volatile ECC counter as last read, and errors events reported since."""

    last: int | None = None
    by_events: int = 0


class EccLedger:
    """Per (GPU UUID, error type): the counter as last read and the errors events reported since."""

    def __init__(self) -> None:
        self._ecc: dict[tuple[str, int], _Ecc] = {}

    def reported(self, uuid: str, kind: int) -> None:
        """An event reported one error of `kind`."""
        self._track(uuid, kind).by_events += 1

    def unreadable(self, uuid: str, kind: int) -> None:
        """The counter cannot be read: start over at the next reading."""
        track = self._track(uuid, kind)
        track.last, track.by_events = None, 0

    def unreported(self, uuid: str, kind: int, total: int) -> int:
        """Errors since the last reading that no event reported; 0 on a first reading or a reset."""
        track = self._track(uuid, kind)
        if track.last is None or total < track.last:  # first reading, or the driver reloaded
            track.last, track.by_events = total, 0
            return 0
        delta, track.last = total - track.last, total
        unreported = max(delta - track.by_events, 0)
        track.by_events = max(track.by_events - delta, 0)
        return unreported

    def read(self, nvml: ModuleType, uuid: str, handle: Any, kind: int, failures: list[str]) -> int:
        """Read the GPU's volatile counter of `kind`: the errors no event reported (`unreported`).
        An unreadable counter starts over; one the GPU does not support (ECC off) is no failure."""
        try:
            total = int(nvml.nvmlDeviceGetTotalEccErrors(handle, kind, VOLATILE))
        except NvmlError as e:
            if e.value in LOST_ERRORS or e.value in REINIT_ERRORS:
                raise
            self.unreadable(uuid, kind)
            if e.value != ERROR_NOT_SUPPORTED:
                failures.append(f"nvmlDeviceGetTotalEccErrors: {e}")
            return 0
        return self.unreported(uuid, kind, total)

    def keep_only(self, uuids: Collection[str]) -> None:
        """Forget the GPUs that left."""
        for key in [k for k in self._ecc if k[0] not in uuids]:
            del self._ecc[key]

    def _track(self, uuid: str, kind: int) -> _Ecc:
        return self._ecc.setdefault((uuid, kind), _Ecc())
