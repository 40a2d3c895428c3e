"""Exponential backoff with jitter, shared by every retry loop (discovery, slice publishing).

Jitter keeps a fleet of nodes that lost the API server at the same moment from retrying in
lock-step when it comes back.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Backoff:
    initial: float = 1.0
    maximum: float = 60.0
    factor: float = 2.0
    jitter: float = 0.2  # +/- this fraction of the delay

    def base_delay(self, attempt: int) -> float:
        """Delay before retry number `attempt` (0-based), without jitter."""
        return min(self.initial * self.factor ** min(attempt, 64), self.maximum)

    def delay(self, attempt: int) -> float:
        return self.base_delay(attempt) * (1 + random.uniform(-self.jitter, self.jitter))


class Retry:
    """Counts consecutive failures of one operation and hands out the delay before the next try."""

    def __init__(self, policy: Backoff) -> None:
        self.policy = policy
        self.attempt = 0

    def next(self, at_least: float = 0.0) -> float:
        """The delay before the next try: the policy's, or `at_least` when the other side asked
        for longer (an API server's Retry-After, already bounded by the door that read it)."""
        delay = max(self.policy.delay(self.attempt), at_least)
        self.attempt += 1
        return delay

    def reset(self) -> None:
        self.attempt = 0


class KeepTrying:
    """Tries `attempt` every `every` seconds, in a thread of its own, until it succeeds (returns
    True) or `stop()`: for what becomes possible only once another process lets go of something
    (a port the other instance of a rolling update holds)."""

    def __init__(self, attempt: Callable[[], bool], every: float, name: str) -> None:
        self._attempt, self._every = attempt, every
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _run(self) -> None:
        while not self._stop.wait(self._every):
            if self._attempt():
                return
