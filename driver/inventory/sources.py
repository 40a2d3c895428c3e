"""Keeps one discovery source's share of the inventory fresh: periodically, on demand, with backoff.

A source that cannot run (NVML not loaded yet: the driver may start before the NVIDIA driver)
publishes nothing, says why once, and retries with exponential backoff instead of crash-looping.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

from driver.backoff import Backoff, Retry
from driver.errors import NodeError
from driver.inventory.store import Inventory
from driver.model import Device

log = logging.getLogger(__name__)


class SourceUnavailable(NodeError):
    """The whole source is unavailable (e.g. NVML cannot initialise); retried with backoff."""


class RefreshLoop:
    def __init__(
        self,
        name: str,
        discover: Callable[[], Sequence[Device]],
        inventory: Inventory,
        period: float,
        backoff: Backoff | None = None,
        wake_at: Callable[[], float | None] | None = None,
    ) -> None:
        """`wake_at`: a monotonic time at which the source wants to run again (a held change)."""
        self.name = name
        self._discover = discover
        self._inventory = inventory
        self._period = period
        self._wake_at = wake_at
        self._retry = Retry(backoff or Backoff())
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._runs = threading.Condition()
        self._started = self._finished = 0  # discoveries of the thread: the last started, finished
        self._thread = threading.Thread(target=self._run, name=f"discover-{name}", daemon=True)
        self.last_error = ""

    def start(self) -> None:
        self._thread.start()

    def wait_first_run(self, timeout: float) -> bool:
        """True once the first discovery has finished (successfully or not)."""
        with self._runs:
            return self._runs.wait_for(lambda: self._finished >= 1, timeout)

    def trigger(self) -> None:
        """Rediscover now (hot-plug, driver reload, a netlink event)."""
        self._wake.set()

    def refresh(self, timeout: float) -> bool:
        """Rediscover now and wait until a discovery that started after this call has put its
        devices into the inventory: for whoever changed the devices itself (a MIG partition made or
        destroyed by a prepare) and must not answer before the inventory knows. False after
        `timeout`, or at once when the loop's thread is not running (start-up, stop) or is the caller."""
        if not self._thread.is_alive() or threading.current_thread() is self._thread:
            self.trigger()
            return False
        with self._runs:
            target = self._started + 1  # one running now started before this call
            self._wake.set()
            done = self._runs.wait_for(lambda: self._finished >= target or self._stop.is_set(), timeout)
            return done and not self._stop.is_set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        with self._runs:
            self._runs.notify_all()
        self._thread.join(timeout=5)

    def run_once(self) -> float:
        """One discovery; returns how long to wait before the next one."""
        try:
            devices = self._discover()
        except SourceUnavailable as e:
            if str(e) != self.last_error:
                log.warning("%s discovery unavailable: %s; publishing none and retrying with backoff", self.name, e)
            self.last_error = str(e)
            self._inventory.replace(self.name, [])
            return self._retry.next()
        except Exception:
            log.exception("%s discovery failed; keeping the last known devices", self.name)
            return self._retry.next()
        if self.last_error:
            log.info("%s discovery available again", self.name)
        self.last_error = ""
        self._retry.reset()
        self._inventory.replace(self.name, devices)
        due = self._wake_at() if self._wake_at else None
        return self._period if due is None else min(self._period, max(0.0, due - time.monotonic()) + 0.01)

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._runs:
                self._started += 1
                run = self._started
            wait = self.run_once()
            with self._runs:
                self._finished = run
                self._runs.notify_all()
            self._wake.wait(timeout=wait)
            self._wake.clear()


class Coalescer:
    """Runs `fn` in its own thread after `delay` seconds without a new trigger: a burst of
    inventory changes becomes one run, and a slow run never blocks whoever triggered it."""

    def __init__(self, name: str, fn: Callable[[], object], delay: float = 0.5) -> None:
        self._fn = fn
        self._delay = delay
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def trigger(self) -> None:
        self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait()
            while self._wake.is_set() and not self._stop.is_set():  # quiet for `delay` seconds
                self._wake.clear()
                self._stop.wait(self._delay)
            if self._stop.is_set():
                return
            try:
                self._fn()
            except Exception:
                log.exception("%s failed; will run again on the next change", self._thread.name)
