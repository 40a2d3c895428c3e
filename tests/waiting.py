"""Deadline polling for tests that watch a separate process or a real cluster: no fixed sleeps, no hoping."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def wait_for(
    what: str,
    probe: Callable[[], T],
    timeout: float = 60,
    interval: float = 0.05,
    retry_on: tuple[type[BaseException], ...] = (),
) -> T:
    """The first truthy answer of `probe`. On timeout, an AssertionError that names `what` and the
    last answer (or the last exception of `retry_on`), so a failure explains itself."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            last = probe()
        except retry_on as e:
            last = e
        else:
            if last:
                return last
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}; last seen: {last!r}"[:4000])
        time.sleep(interval)


def poll(predicate: Callable[[], object], timeout: float = 30) -> bool:
    """True as soon as `predicate()` is truthy; False if it never was within `timeout` seconds."""
    try:
        wait_for("", predicate, timeout)
    except AssertionError:
        return False
    return True
