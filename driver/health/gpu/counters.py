"""What the GPU health monitor has seen since it started, counted for `/metrics`.

The monitor's thread writes the counters and other threads (the metrics endpoint, tests) read
them, so they sit behind one lock and a reader gets a copy that no later count changes.
"""

from __future__ import annotations

import copy
import threading
from dataclasses import dataclass, field


@dataclass
class GpuHealthCounters:
    """What the monitor has seen since it started; the metrics module exports these."""

    events: dict[str, int] = field(default_factory=dict)  # by type: xid, double_bit_ecc, ...
    xids: dict[int, int] = field(default_factory=dict)  # by XID number
    single_bit_ecc: int = 0
    double_bit_ecc: int = 0
    probes: int = 0
    errors: int = 0  # NVML failures of any kind (init, wait, probe, registration)
    nvml_inits: int = 0


class SharedCounters:
    """`GpuHealthCounters` behind a lock: counted by one thread, read by any."""

    def __init__(self) -> None:
        self._counters = GpuHealthCounters()
        self._lock = threading.Lock()

    def count(self, **deltas: int) -> None:
        """Adds each delta to the scalar counter of its name (`errors=1`, `probes=1`, ...)."""
        with self._lock:
            for name, n in deltas.items():
                setattr(self._counters, name, getattr(self._counters, name) + n)

    def event(self, name: str, xid: int | None = None) -> None:
        """One NVML event of type `name`; an XID event also counts under its number."""
        with self._lock:
            self._counters.events[name] = self._counters.events.get(name, 0) + 1
            if xid is not None:
                self._counters.xids[xid] = self._counters.xids.get(xid, 0) + 1

    def snapshot(self) -> GpuHealthCounters:
        with self._lock:
            return copy.deepcopy(self._counters)
