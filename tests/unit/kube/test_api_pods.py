"""The pods nominated to a node, listed and watched through the door (`KubeAPI.list_nominated_pods`,
`watch_nominated_pods`) against the simulated API server: every namespace, only this node's, and
a pod nominated after the list arrives on the watch."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from driver.kube.api import ApiError, KubeAPI
from sim.apiserver import SimApiServer

PODS = "/api/v1/pods"


@pytest.fixture
def srv() -> Iterator[SimApiServer]:
    with SimApiServer() as server:
        yield server


@pytest.fixture
def api(srv: SimApiServer, tmp_path: Path) -> Iterator[KubeAPI]:
    door = KubeAPI(str(srv.write_kubeconfig(tmp_path / "kubeconfig")))
    yield door
    door.close()


def pod(srv: SimApiServer, namespace: str, name: str, nominated: str | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"containers": [{"name": "c", "image": "busybox"}]},
    }
    if nominated:
        body["status"] = {"nominatedNodeName": nominated}
    return srv.create(body)


def nominate(srv: SimApiServer, namespace: str, name: str, node: str) -> None:
    obj = srv.get("pods", name, namespace)
    obj.setdefault("status", {})["nominatedNodeName"] = node
    srv.update(obj)


def test_the_list_holds_the_pods_of_every_namespace_nominated_to_this_node_only(
    srv: SimApiServer, api: KubeAPI
) -> None:
    pod(srv, "team-a", "p1", nominated="node-a")
    pod(srv, "team-b", "p2", nominated="node-a")
    pod(srv, "team-a", "elsewhere", nominated="node-b")
    pod(srv, "team-a", "waiting")
    items, rv = api.list_nominated_pods("node-a")
    assert sorted((p["metadata"]["namespace"], p["metadata"]["name"]) for p in items) == [
        ("team-a", "p1"),
        ("team-b", "p2"),
    ]
    assert rv == srv.store.list(srv.store.find_kind({"apiVersion": "v1", "kind": "Pod"}), None, lambda _o: True)[1]
    (request,) = [r for r in srv.requests if r.path == PODS]
    assert request.query == {"fieldSelector": "status.nominatedNodeName=node-a"}


def test_a_pod_nominated_after_the_list_comes_on_the_watch(srv: SimApiServer, api: KubeAPI) -> None:
    pod(srv, "team-a", "p1")
    items, rv = api.list_nominated_pods("node-a")
    assert items == []
    watch = api.watch_nominated_pods("node-a", rv, 30)
    got: list[tuple[str, str]] = []
    done = threading.Event()

    def read() -> None:
        with contextlib.suppress(ApiError):  # the stream stopped under it
            for etype, obj in watch:
                got.append((etype, obj["metadata"]["name"]))
                done.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    nominate(srv, "team-a", "p1", "node-b")  # another node's: never seen here
    pod(srv, "team-b", "p2")
    nominate(srv, "team-b", "p2", "node-a")
    assert done.wait(10)
    watch.stop()
    reader.join(10)
    assert got == [("ADDED", "p2")]  # a MODIFIED that enters the selector is an ADDED
    (request,) = [r for r in srv.requests if r.path == PODS and r.verb == "watch"]
    assert request.query == {
        "fieldSelector": "status.nominatedNodeName=node-a",
        "resourceVersion": rv,
        "allowWatchBookmarks": "true",
        "timeoutSeconds": "30",
        "watch": "true",
    }


def test_an_expired_resource_version_ends_the_watch_with_410(srv: SimApiServer, api: KubeAPI) -> None:
    srv.store.history = 1
    for name in ("p1", "p2", "p3"):
        pod(srv, "team-a", name)
    with pytest.raises(ApiError) as e:
        list(api.watch_nominated_pods("node-a", "1", 5))
    assert e.value.status == 410 and e.value.retryable
