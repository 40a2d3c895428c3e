"""The live-slice cache's merge of a list with what the watch applied while the list was in
flight: a deletion seen after the list's snapshot must not be undone, nor a newer list by an
older one; and a list from a server whose history went back (etcd restored) replaces it all."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import pytest
from waiting import poll

from driver.backoff import Backoff
from driver.kube.api import ApiError
from driver.slices.cache import LiveSlices


def _slice(name: str, rv: int) -> dict[str, Any]:
    return {"metadata": {"name": name, "resourceVersion": str(rv)}, "spec": {"pool": {"name": "n", "generation": 1}}}


class _Lists:
    """A server answering each list with the next of `answers`; `during` runs once the list's
    snapshot is taken, before the answer reaches the cache (what happens meanwhile in other threads)."""

    def __init__(self, *answers: tuple[list[dict[str, Any]], str]) -> None:
        self._answers = list(answers)
        self.during: Callable[[], None] | None = None

    def list_slices(self, node: str, driver: str) -> tuple[list[dict[str, Any]], str]:
        answer = self._answers.pop(0)
        during, self.during = self.during, None
        if during is not None:
            during()
        return answer


def _cache(api: _Lists) -> LiveSlices:
    return LiveSlices(
        api, "n", "d", threading.Condition(), lambda: None, threading.Event(), Backoff(), 300, lambda _exc: None
    )


def _names(cache: LiveSlices) -> list[str]:
    return sorted(s["metadata"]["name"] for s in cache.snapshot())


def test_a_deletion_the_watch_applied_while_a_list_was_in_flight_is_not_undone() -> None:
    """The kubelet's wipe or an admin deletes a slice as the publisher lists again (after a 409):
    the watch delivers the deletion, and no later event will ever name the slice again."""
    api = _Lists(([_slice("a", 90), _slice("b", 95)], "100"), ([_slice("a", 90), _slice("b", 95)], "200"))
    cache = _cache(api)
    cache.relist()
    api.during = lambda: cache._apply_event("DELETED", _slice("b", 210))
    assert cache.relist() == "200"
    assert _names(cache) == ["a"]


def test_a_slice_deleted_before_the_list_snapshot_and_created_again_is_kept() -> None:
    """What the list shows newer than the deletion is a slice made again under that name."""
    api = _Lists(([_slice("a", 90), _slice("b", 95)], "100"), ([_slice("a", 90), _slice("b", 220)], "230"))
    cache = _cache(api)
    cache.relist()
    api.during = lambda: cache._apply_event("DELETED", _slice("b", 210))
    cache.relist()
    assert _names(cache) == ["a", "b"]


def test_an_older_list_answered_after_a_newer_one_changes_nothing() -> None:
    """The watch thread and the publisher's worker may list at once; the answer with the older
    snapshot must not bring back what the newer one no longer has, nor move the version back."""
    api = _Lists(
        ([_slice("a", 90), _slice("b", 95)], "100"),
        ([_slice("a", 90), _slice("b", 95)], "200"),  # the worker's list, answered last
        ([_slice("a", 90)], "300"),  # the watch thread's, b deleted at 250 (its event long gone)
    )
    cache = _cache(api)
    cache.relist()
    api.during = lambda: cache.relist()  # the second list is merged while the first is in flight
    cache.relist()
    assert _names(cache) == ["a"]
    # A watch resuming from the older list replays c's creation (c deleted at 270, its deletion
    # still to come): the newer list at 300 already shows it gone.
    cache._apply_event("ADDED", _slice("c", 260))
    assert _names(cache) == ["a"]


def test_a_list_below_the_versions_already_met_resets_the_cache(caplog: pytest.LogCaptureFixture) -> None:
    """etcd restored from a backup taken before our write of c (150): the server's list answers
    at 120, and a cache that keeps what is "newer" than the list would keep c for ever."""
    api = _Lists(([_slice("a", 90), _slice("b", 95)], "100"), ([_slice("a", 90)], "120"))
    cache = _cache(api)
    cache.relist()
    with cache._cond:
        cache.put("c", _slice("c", 150))
    caplog.set_level(logging.WARNING, logger="driver.slices.cache")
    assert cache.relist() == "120"
    assert _names(cache) == ["a"] and cache.resets == 1 and cache.current
    (line,) = [r.getMessage() for r in caplog.records if r.name == "driver.slices.cache"]
    assert line.startswith("the API server's resourceVersion went back from 150 to 120 (etcd restored"), line
    # The restored server numbers on from 120: its next version of a is not "older" than the 150 once met.
    cache._apply_event("MODIFIED", _slice("a", 121))
    assert [s["metadata"]["resourceVersion"] for s in cache.snapshot()] == ["121"]


def test_a_list_asked_before_a_reset_does_not_bring_back_the_lost_history() -> None:
    """The worker and the watch thread list at once around a restore: the answer the old server
    gave (160) is merged after the restored server's (110), and must not put b and c back."""
    api = _Lists(
        ([_slice("a", 90), _slice("b", 95)], "100"),
        ([_slice("a", 90), _slice("b", 95), _slice("c", 150)], "160"),  # the old server's, answered last
        ([_slice("a", 90)], "110"),  # the restored server's
    )
    cache = _cache(api)
    cache.relist()
    with cache._cond:
        cache.put("c", _slice("c", 150))
    api.during = lambda: cache.relist()
    cache.relist()
    assert _names(cache) == ["a"] and cache.resets == 1


class _Outage:
    """A server that goes away under an open watch and comes back between two of the cache's
    tries: the first list after the failed watch is refused, anything later answers (a watch
    from the last version seen too, as a restarted kube-apiserver does when nothing was written)."""

    def __init__(self, stop: threading.Event) -> None:
        self._stop = stop
        self.calls: list[str] = []

    def watch_slices(self, node: str, driver: str, rv: str, timeout: int) -> Any:
        self.calls.append(f"watch {rv}")
        if len(self.calls) == 1:
            raise ApiError("watch slices: connection reset", unreachable=True)
        return _OpenWatch(self._stop)

    def list_slices(self, node: str, driver: str) -> tuple[list[dict[str, Any]], str]:
        self.calls.append("list")
        if self.calls.count("list") == 1:
            raise ApiError("list slices: connection refused", unreachable=True)
        return [_slice("a", 90)], "120"


class _OpenWatch:
    """A watch that stays open, quiet, until the test ends."""

    def __init__(self, stop: threading.Event) -> None:
        self._stop = stop

    def __iter__(self) -> _OpenWatch:
        return self

    def __next__(self) -> tuple[str, dict[str, Any]]:
        self._stop.wait()
        raise StopIteration

    def stop(self) -> None:
        self._stop.set()


def test_after_a_failed_watch_the_cache_is_current_again_only_through_a_list() -> None:
    """A watch resumed without a list leaves the cache not current for its whole life (minutes),
    and the publisher confirms nothing meanwhile: the watch waits for a list that succeeds."""
    stop, cond, failures = threading.Event(), threading.Condition(), []
    api = _Outage(stop)
    cache = LiveSlices(api, "n", "d", cond, lambda: None, stop, Backoff(initial=0.01, maximum=0.02), 300,
                       failures.append)  # fmt: skip
    cache.listed = cache.current = True  # the list before the watch
    cache.start_watch("100")
    try:
        assert poll(lambda: len(api.calls) >= 4, 10), api.calls  # the watch open again: the outage is over
        assert cache.current, api.calls
        assert api.calls == ["watch 100", "list", "list", "watch 120"]
        assert len(failures) == 2 and _names(cache) == ["a"]
    finally:
        stop.set()
        cache.join(5)


class _Stop(threading.Event):
    """The cache's stop event, which records each wait instead of waiting, and is set at the `last`."""

    def __init__(self, last: int) -> None:
        super().__init__()
        self.last = last
        self.waits: list[float] = []

    def wait(self, timeout: float | None = None) -> bool:
        self.waits.append(round(timeout or 0.0, 6))
        if len(self.waits) >= self.last:
            self.set()
        return self.is_set()


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


class _Breaking:
    """Watches that each fail: the first two at once (the server still away), the third after
    it was open 30 s (a working watch, broken by a new outage); every list answers."""

    def __init__(self, clock: _Clock) -> None:
        self._clock = clock
        self.watches = 0

    def watch_slices(self, node: str, driver: str, rv: str, timeout: int) -> Any:
        self.watches += 1
        if self.watches == 3:
            self._clock.now += 30
        raise ApiError("watch slices: connection reset", unreachable=True)

    def list_slices(self, node: str, driver: str) -> tuple[list[dict[str, Any]], str]:
        return [_slice("a", 90)], "120"


def test_a_watch_that_worked_and_broke_starts_a_new_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    """After an outage the next one's first list waits the first delay again, not the grown one
    of the outage before (tests/cluster/test_health.py saw the broken watch, not the unreachable
    server, for the seconds in between)."""
    clock = _Clock()
    monkeypatch.setattr("driver.slices.cache.time", clock)
    stop, api = _Stop(last=3), _Breaking(clock)
    cache = LiveSlices(
        api,
        "n",
        "d",
        threading.Condition(),
        lambda: None,
        stop,
        Backoff(initial=1.0, maximum=100.0, jitter=0.0),
        300,
        lambda _exc: None,
    )
    cache._watch_loop("100")
    assert stop.waits == [1.0, 2.0, 1.0]
