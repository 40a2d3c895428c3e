"""RefreshLoop.refresh: a caller that changed the devices itself (a MIG partition made by a
prepare) waits until a discovery that started after its call is in the inventory."""

from __future__ import annotations

import threading

from driver.inventory.sources import RefreshLoop
from driver.inventory.store import Inventory


class Discovery:
    """Counts discoveries; the first one can be held in progress."""

    def __init__(self) -> None:
        self.runs = 0
        self.first_started = threading.Event()
        self.release_first = threading.Event()

    def __call__(self) -> list:
        self.runs += 1
        if self.runs == 1:
            self.first_started.set()
            assert self.release_first.wait(10)
        return []


def test_refresh_waits_for_a_discovery_that_started_after_the_call() -> None:
    discovery = Discovery()
    loop = RefreshLoop("gpu", discovery, Inventory(), period=3600)
    loop.start()
    try:
        assert discovery.first_started.wait(10)
        # The discovery running now started before the call: it does not count.
        answer: list[tuple[bool, int]] = []
        waiter = threading.Thread(target=lambda: answer.append((loop.refresh(timeout=10), discovery.runs)))
        waiter.start()
        waiter.join(0.2)
        assert waiter.is_alive(), "refresh returned while only an older discovery ran"
        discovery.release_first.set()
        waiter.join(10)
        assert answer == [(True, 2)]
    finally:
        discovery.release_first.set()
        loop.stop()


def test_refresh_before_the_loop_runs_only_triggers() -> None:
    discovery = Discovery()
    discovery.release_first.set()
    loop = RefreshLoop("gpu", discovery, Inventory(), period=3600)
    assert loop.refresh(timeout=10) is False  # at once: start-up must not wait for a thread not started
    assert discovery.runs == 0


def test_stop_ends_a_wait() -> None:
    discovery = Discovery()
    loop = RefreshLoop("gpu", discovery, Inventory(), period=3600)
    loop.start()
    assert discovery.first_started.wait(10)
    answer: list[bool] = []
    waiter = threading.Thread(target=lambda: answer.append(loop.refresh(timeout=30)))
    waiter.start()
    stopper = threading.Thread(target=loop.stop)
    stopper.start()
    waiter.join(10)
    discovery.release_first.set()
    stopper.join(10)
    assert answer == [False]
