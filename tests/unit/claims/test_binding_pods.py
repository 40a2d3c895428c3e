"""The nominated-pods watch (`driver.claims.binding_pods.NominatedPods`) against the simulated API
server: pods nominated before the start and after it are both seen, a bound pod and another
node's pod are not, and a watch the server ends with 410 Gone lists again without losing a pod."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from waiting import poll

from driver.claims.binding_pods import NominatedPods
from driver.kube.api import KubeAPI
from sim.apiserver import SimApiServer


@pytest.fixture
def srv() -> Iterator[SimApiServer]:
    with SimApiServer() as server:
        yield server


@pytest.fixture
def api(srv: SimApiServer, tmp_path: Path) -> Iterator[KubeAPI]:
    door = KubeAPI(str(srv.write_kubeconfig(tmp_path / "kubeconfig")))
    yield door
    door.close()


def pod(srv: SimApiServer, name: str, claim: str, nominated: str, bound: str = "") -> dict[str, Any]:
    spec: dict[str, Any] = {
        "containers": [{"name": "c", "image": "x"}],
        "resourceClaims": [{"name": "r", "resourceClaimName": claim}],
    }
    if bound:
        spec["nodeName"] = bound
    return srv.create({
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "team"}, "spec": spec,
        "status": {"nominatedNodeName": nominated},
    })  # fmt: skip


class Seen:
    def __init__(self) -> None:
        self.claims: list[tuple[str, str]] = []
        self.lock = threading.Lock()

    def __call__(self, namespace: str, names: Sequence[str]) -> None:
        with self.lock:
            self.claims += [(namespace, n) for n in names]

    def names(self) -> set[str]:
        with self.lock:
            return {n for _, n in self.claims}


def test_nominated_pods_before_and_after_the_start_are_seen_bound_and_foreign_ones_not(
    srv: SimApiServer, api: KubeAPI
) -> None:
    pod(srv, "early", "claim-early", "node-a")
    pod(srv, "elsewhere", "claim-elsewhere", "node-b")
    seen = Seen()
    watcher = NominatedPods(api, "node-a", seen)
    watcher.start()
    try:
        assert poll(lambda: "claim-early" in seen.names(), 10)
        pod(srv, "late", "claim-late", "node-a")
        pod(srv, "bound", "claim-bound", "node-a", bound="node-a")
        assert poll(lambda: "claim-late" in seen.names(), 10)
        pod(srv, "marker", "claim-marker", "node-a")  # events arrive in order: after it, the bound pod was skipped
        assert poll(lambda: "claim-marker" in seen.names(), 10)
        assert seen.names() == {"claim-early", "claim-late", "claim-marker"}
        assert all(ns == "team" for ns, _ in seen.claims)
    finally:
        watcher.stop()


def test_a_watch_ended_by_410_gone_lists_again_and_misses_nothing(srv: SimApiServer, api: KubeAPI) -> None:
    seen = Seen()
    watcher = NominatedPods(api, "node-a", seen)
    watcher.start()
    try:
        pod(srv, "first", "claim-first", "node-a")
        assert poll(lambda: "claim-first" in seen.names(), 10)
        srv.faults.close_watches()  # the server drops every watch, as a restarted API server does
        pod(srv, "second", "claim-second", "node-a")
        assert poll(lambda: "claim-second" in seen.names(), 20)
    finally:
        watcher.stop()
