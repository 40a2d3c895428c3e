"""What the publisher tells while its slices cannot be published: failures counted by a bounded
reason, one ERROR line per outage and an INFO line when it ends, the node unready until the first
publish, and a cache whose watch failed confirming nothing. Against a refused port and the
simulated API server's faults, over HTTP."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from waiting import wait_for

from driver.backoff import Backoff
from driver.kube.api import ApiError, Conflict, KubeAPI
from driver.model import Device, DeviceKind
from driver.slices.cache import LiveSlices
from driver.slices.progress import REASONS, PublishProgress
from driver.slices.publisher import PublisherOptions, SlicePublisher
from sim.apiserver import SimApiServer

NODE = "node-a"
DRIVER = "tandem.example.com"
SERVER = "https://api.example:6443"
FAST = PublisherOptions(min_write_interval=0.05, debounce=0.01, resync_period=0.5, backoff_initial=0.02,
                        backoff_max=0.2, watch_timeout=30)  # fmt: skip
LOGGER = "driver.slices.progress"
REFUSED = ApiError("get node n: connection refused: ConnectionRefusedError: [Errno 111]", unreachable=True)


class Clocks:
    """Wall and monotonic time that move only when a test says so."""

    def __init__(self) -> None:
        self.wall = 1_735_819_381.0  # 2025-01-02T12:03:01Z
        self.mono = 100.0

    def progress(self, remind_every: float = 300.0) -> PublishProgress:
        return PublishProgress(SERVER, remind_every=remind_every, clock=lambda: self.wall, monotonic=lambda: self.mono)


def _lines(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == level]


def test_failures_are_counted_under_a_bounded_reason() -> None:
    progress = Clocks().progress()
    assert progress.errors() == dict.fromkeys(REASONS, 0), "every series exists from the start"
    for exc in (
        REFUSED,
        ApiError("list slices: HTTP 401 Unauthorized", 401),
        ApiError("create slice: HTTP 403 Forbidden: 'no'", 403),
        ApiError("create slice: HTTP 403 Forbidden: 'no'", 403),
        ApiError("get node n: HTTP 500 Internal Server Error", 500),
        ApiError("server returned a slice without metadata.name", retryable=True),  # answered, oddly
        Conflict("update slice: HTTP 409 Conflict", 409),
        ValueError("a bug"),
    ):
        progress.failed(exc)
    assert progress.errors() == {"unreachable": 1, "unauthorized": 1, "forbidden": 2, "other": 4}


def test_one_error_line_per_outage_rate_limited_and_one_info_line_when_it_ends(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    clocks = Clocks()
    progress = clocks.progress(remind_every=300)
    for _ in range(5):  # retries with backoff: not one ERROR each
        progress.failed(REFUSED)
        clocks.mono += 30
    assert _lines(caplog, logging.ERROR) == [
        f"ResourceSlices cannot be published: the API server at {SERVER} cannot be reached: {REFUSED}; "
        "retrying with backoff"
    ]
    assert len(_lines(caplog, logging.DEBUG)) == 4
    clocks.mono += 300
    progress.failed(REFUSED)
    reminder = _lines(caplog, logging.ERROR)[1]
    assert reminder.startswith("ResourceSlices still cannot be published: the API server at")
    assert reminder.endswith("(since 2025-01-02T12:03:01Z, 6 failed attempt(s))")
    assert not _lines(caplog, logging.INFO)

    progress.published()
    assert _lines(caplog, logging.INFO) == [
        "ResourceSlices published again, after 6 failed attempt(s) since 2025-01-02T12:03:01Z"
    ]
    progress.published()  # every later confirmation is quiet
    progress.failed(REFUSED)  # a new outage: its own first ERROR line at once
    assert len(_lines(caplog, logging.ERROR)) == 3 and len(_lines(caplog, logging.INFO)) == 1


def test_unready_until_the_first_publish_degraded_by_an_outage_after_it() -> None:
    clocks = Clocks()
    progress = clocks.progress()
    assert progress.unready() == ["no ResourceSlices published yet"] and progress.problems() == []
    progress.failed(REFUSED)
    clocks.wall += 10
    progress.failed(ApiError("list slices: HTTP 403 Forbidden: 'resourceslices is forbidden'", 403))
    assert progress.unready() == [
        f"no ResourceSlices published: the API server at {SERVER} forbids it (RBAC): list slices: HTTP 403 "
        "Forbidden: 'resourceslices is forbidden' (since 2025-01-02T12:03:01Z, 2 failed attempt(s))"
    ]
    assert progress.problems() == [] and progress.published_at is None
    summary = progress.summary()
    assert (summary["failedAttempts"], summary["failureReason"], summary["publishedAt"]) == (2, "forbidden", None)

    progress.published()
    assert progress.unready() == [] and progress.problems() == [] and progress.published_at == clocks.wall
    assert "failingSince" not in progress.summary()
    clocks.wall += 60
    progress.failed(ApiError("list slices: HTTP 401 Unauthorized", 401))
    assert progress.unready() == [], "the scheduler still has the slices last published"
    assert progress.problems() == [
        f"ResourceSlices not confirmed since 2025-01-02T12:03:11Z: the API server at {SERVER} does not accept "
        "Tandem's credentials: list slices: HTTP 401 Unauthorized (since 2025-01-02T12:04:11Z, 1 failed attempt(s))"
    ]


def test_a_failure_that_is_not_the_api_doors_is_escaped() -> None:
    """The door escapes what the server says; anything else is escaped here before a log or a
    terminal sees it."""
    progress = Clocks().progress()
    progress.failed(RuntimeError("forged\nE0102 line \x1b[2J\u202egone"))
    (reason,) = progress.unready()
    assert "\n" not in reason and "\x1b" not in reason and "\u202e" not in reason
    assert "RuntimeError: 'forged\\nE0102 line \\x1b[2J\\u202egone'" in reason


class _Watches:
    """A server whose watches fail with `statuses`, one per opening, and then stay open, quiet,
    until stopped."""

    def __init__(self, *statuses: int) -> None:
        self._statuses = list(statuses)
        self._quiet = threading.Event()
        self.lists = 0

    def list_slices(self, node: str, driver: str) -> tuple[list[dict[str, object]], str]:
        self.lists += 1
        return [], "5"

    def watch_slices(self, node: str, driver: str, rv: str, timeout: int) -> _Watches:
        if self._statuses:
            status = self._statuses.pop(0)
            raise ApiError(f"watch slices: HTTP {status}", status, retryable=True)
        return self

    def __iter__(self) -> Iterator[tuple[str, dict[str, object]]]:
        self._quiet.wait()
        return iter(())

    def stop(self) -> None:
        self._quiet.set()


def test_an_expired_watch_is_not_a_failure_a_broken_one_is() -> None:
    """410 Gone is how a watch whose resourceVersion left the server's history ends: listed again,
    not counted. Any other failure is counted, and the cache is not current until listed again."""
    failures: list[BaseException] = []
    stop, api = threading.Event(), _Watches(410, 500)
    cache = LiveSlices(api, "n", "d", threading.Condition(), lambda: None, stop,  # type: ignore[arg-type]
                       Backoff(initial=0.01, maximum=0.01), 300, failures.append)  # fmt: skip
    cache.relist()
    cache.start_watch("5")
    try:
        wait_for("a list after each failed watch", lambda: api.lists >= 3, timeout=30)
        assert [getattr(e, "status", None) for e in failures] == [500]
        wait_for("the cache current again", lambda: cache.current, timeout=30)
    finally:
        stop.set()
        cache.stop_watch()
        api.stop()
        cache.join(5)


# -- the publisher, over HTTP ----------------------------------------------------------------------


@pytest.fixture
def closed_port(tmp_path: Path) -> Iterator[tuple[KubeAPI, int]]:
    """A KubeAPI whose kubeconfig names a port that nothing listens on (the server was stopped)."""
    srv = SimApiServer().start()
    kubeconfig = srv.write_kubeconfig(tmp_path / "kubeconfig")
    port = int(srv.url.rsplit(":", 1)[1])
    srv.stop()
    api = KubeAPI(str(kubeconfig))
    yield api, port
    api.close()


@pytest.fixture
def sim_api(tmp_path: Path) -> Iterator[tuple[SimApiServer, KubeAPI]]:
    """The simulated API server with this node, and a KubeAPI talking to it."""
    with SimApiServer() as srv:
        srv.add_node(NODE)
        api = KubeAPI(str(srv.write_kubeconfig(tmp_path / "kubeconfig")))
        yield srv, api
        api.close()


@pytest.fixture
def publishers() -> Iterator[list[SlicePublisher]]:
    started: list[SlicePublisher] = []
    yield started
    for pub in started:
        pub.stop()


def _publisher(api: KubeAPI, started: list[SlicePublisher]) -> SlicePublisher:
    pub = SlicePublisher(api, DRIVER, NODE, lambda: [Device("gpu-0", DeviceKind.GPU, attributes={"index": 0})], FAST)
    started.append(pub)
    pub.start()
    return pub


def _server_on(port: int) -> SimApiServer:
    srv = SimApiServer().start(port)
    srv.add_node(NODE)
    return srv


def _reasons(pub: SlicePublisher) -> dict[str, int]:
    return dict(pub.stats.error_reasons)


def test_a_refused_port_is_counted_told_and_ends_when_the_server_appears(
    closed_port: tuple[KubeAPI, int], publishers: list[SlicePublisher], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    api, port = closed_port
    pub = _publisher(api, publishers)
    wait_for("three refused Node lookups", lambda: _reasons(pub)["unreachable"] >= 3, timeout=30)
    stats = pub.stats
    assert stats.errors == stats.error_reasons["unreachable"] and stats.published_at is None
    (reason,) = pub.progress.unready()
    assert reason.startswith(
        f"no ResourceSlices published: the API server at http://127.0.0.1:{port} cannot be reached: "
        f"get node {NODE}: connection refused"
    )
    assert len(_lines(caplog, logging.ERROR)) == 1, "one ERROR line for the outage, not one per retry"

    srv = _server_on(port)
    try:
        assert pub.wait_synced(30)
        wait_for("the publish confirmed", lambda: pub.stats.published_at is not None, timeout=30)
        assert pub.progress.unready() == [] and pub.progress.problems() == []
        assert [s["spec"]["nodeName"] for s in srv.list("resourceslices")] == [NODE]
        (info,) = _lines(caplog, logging.INFO)
        assert info.startswith("ResourceSlices published again, after ")
    finally:
        srv.stop()


def test_rbac_faults_are_told_apart_from_an_unreachable_server(
    sim_api: tuple[SimApiServer, KubeAPI], publishers: list[SlicePublisher], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    srv, api = sim_api
    srv.faults.inject(method="GET", path=f"/api/v1/nodes/{NODE}$", status=403, count=2)
    srv.faults.inject(method="GET", path="resourceslices$", status=401, count=1)
    pub = _publisher(api, publishers)
    wait_for("the publish confirmed", lambda: pub.stats.published_at is not None, timeout=30)
    assert _reasons(pub) == {"unreachable": 0, "unauthorized": 1, "forbidden": 2, "other": 0}
    (error,) = _lines(caplog, logging.ERROR)
    assert error == (
        f"ResourceSlices cannot be published: the API server at {srv.url} forbids it (RBAC): get node "
        f"{NODE}: HTTP 403 Forbidden: 'injected fault: 403'; retrying with backoff"
    )
    assert len(_lines(caplog, logging.INFO)) == 1, "one outage of three failures, whatever their reasons"


def test_a_sync_against_a_cache_whose_watch_failed_confirms_nothing(
    sim_api: tuple[SimApiServer, KubeAPI], publishers: list[SlicePublisher]
) -> None:
    """The watch breaks at idle and cannot be opened again: the resyncs that agree with the cache
    compare with a copy that may be stale, so only a list that succeeds again ends the outage."""
    srv, api = sim_api
    pub = _publisher(api, publishers)
    wait_for("the first publish", lambda: pub.stats.published_at is not None, timeout=30)
    srv.faults.inject(method="GET", path="resourceslices$", status=503, count=10**6)
    srv.faults.close_watches()
    wait_for("the watch refused", lambda: _reasons(pub)["other"] >= 1, timeout=30)
    first = pub.stats.published_at  # the last confirmation before the outage
    syncs = pub.stats.syncs
    pub.trigger()
    wait_for("two more syncs", lambda: pub.stats.syncs >= syncs + 2, timeout=30)
    assert pub.stats.published_at == first
    (problem,) = pub.progress.problems()
    assert problem.startswith("ResourceSlices not confirmed since ") and "HTTP 503" in problem
    assert pub.progress.unready() == [], "the scheduler still has the slices published before"

    srv.faults.clear()
    wait_for("confirmed again", lambda: (pub.stats.published_at or 0) > (first or 0), timeout=30)
    assert pub.progress.problems() == []
