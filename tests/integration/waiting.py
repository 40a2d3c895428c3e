"""Deadline polling for tests that watch a separate process: no fixed sleeps, no hoping."""

from __future__ import annotations

import time
from collections.abc import Callable


def poll(predicate: Callable[[], object], timeout: float = 30) -> bool:
    """True as soon as `predicate()` is truthy; False if it never was within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return bool(predicate())
