"""Evidence that a GPU was reset, for the conditions that clear only on it.

A reset-class XID (`policy.RESET_XIDS`: 48 double-bit ECC, 79 fallen off the bus, ...) on a
driver or GPU that reports no recovery action has nothing that says when the GPU is well again:
NVML has no reset counter, and a quiet period without a new XID proves only that nothing ran into
the fault again. So such a condition is held until there is evidence (`HealthState.clear_reset`):

* `tandemctl reacquire` of a released GPU (`release`): a release is the window Tandem opens for
  `nvidia-smi -r` (a reset needs nobody holding the GPU), so release-then-reacquire is the reset path;
* `tandemctl clear <device> --reason` (`GpuReleases.clear`): the operator's word, kept with who,
  why and when in `<data dir>/cleared.json`;
* the monitor's own probe finding a GPU that was lost (NVML's GPU_IS_LOST, which holds until the
  GPU is reset or re-enumerated) answering again. A GPU that leaves the inventory and comes back
  under its UUID starts clean anyway: what was known of it is forgotten (`GpuConditions.forget_gone`).

A held condition outlives a restart of the daemon (`held`); a reboot is evidence.

Process-wide, like `node.nvml.NVML_ACCESS`: the status socket and the releases on one side and the
monitor's thread on the other are built apart. Pending evidence is kept per GPU (the latest), so
it is bounded by the number of GPUs however often an operator repeats it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

EVERY_GPU = ""  # evidence about every GPU: all of NVML was released and reacquired


class ResetEvidence:
    """Evidence handed from any thread to the GPU health monitor, which takes it in its loop."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: dict[str, str] = {}  # GPU UUID (EVERY_GPU: all) -> why
        self._listeners: list[Callable[[], None]] = []

    def report(self, gpu: str, why: str) -> None:
        """`gpu` (a UUID, or EVERY_GPU) was reset or declared healthy, because `why`."""
        with self._lock:
            self._pending[gpu] = why
            listeners = list(self._listeners)
        for wake in listeners:
            wake()

    def take(self) -> dict[str, str]:
        """The evidence reported since the last take: GPU UUID (or EVERY_GPU) -> why."""
        with self._lock:
            pending, self._pending = self._pending, {}
        return pending

    def subscribe(self, wake: Callable[[], None]) -> None:
        with self._lock:
            self._listeners.append(wake)

    def unsubscribe(self, wake: Callable[[], None]) -> None:
        with self._lock:
            if wake in self._listeners:
                self._listeners.remove(wake)


RESET_EVIDENCE = ResetEvidence()
