"""The simulated API server's watch-list streams (`sendInitialEvents`), which client-go v0.37 uses by
default for informers: the Go reference drivers of hack/go-reference wait for the end-of-initial-events
bookmark before they publish anything, as they would against a real API server."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from sim.apiserver import SimApiServer

SLICES = "/apis/resource.k8s.io/v1/resourceslices"


@pytest.fixture
def srv() -> Iterator[SimApiServer]:
    with SimApiServer() as server:
        yield server


def create_slice(srv: SimApiServer, node: str) -> None:
    body = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"generateName": f"00000-gpu.example.com-{node}-"},
        "spec": {"driver": "gpu.example.com", "nodeName": node,
                 "pool": {"name": node, "generation": 1, "resourceSliceCount": 1}, "devices": []},
    }  # fmt: skip
    req = urllib.request.Request(srv.url + SLICES, data=json.dumps(body).encode(), method="POST")
    with urllib.request.urlopen(req, timeout=10) as resp:
        assert resp.status == 201


def watch_list_events(srv: SimApiServer, query: str) -> list[dict[str, Any]]:
    """Events of a watch-list stream up to (and with) its end-of-initial-events bookmark."""
    events = []
    with urllib.request.urlopen(f"{srv.url}{SLICES}?watch=true&{query}", timeout=10) as resp:
        for line in resp:
            event = json.loads(line)
            events.append(event)
            annotations = event["object"]["metadata"].get("annotations") or {}
            if event["type"] == "BOOKMARK" and annotations.get("k8s.io/initial-events-end") == "true":
                return events
    raise AssertionError(f"the stream ended without the end-of-initial-events bookmark: {events}")


def test_watch_list_sends_current_objects_then_the_end_bookmark(srv: SimApiServer) -> None:
    create_slice(srv, "node-a")
    create_slice(srv, "node-b")
    events = watch_list_events(srv, "sendInitialEvents=true&resourceVersionMatch=NotOlderThan&allowWatchBookmarks=true")
    assert [e["type"] for e in events] == ["ADDED", "ADDED", "BOOKMARK"]
    assert sorted(e["object"]["spec"]["nodeName"] for e in events[:2]) == ["node-a", "node-b"]
    last_rv = max(int(e["object"]["metadata"]["resourceVersion"]) for e in events[:2])
    assert int(events[-1]["object"]["metadata"]["resourceVersion"]) >= last_rv


@pytest.mark.parametrize(
    ("query", "message"),
    [
        ("sendInitialEvents=true&allowWatchBookmarks=true", "resourceVersionMatch"),
        ("sendInitialEvents=true&resourceVersionMatch=NotOlderThan", "allowWatchBookmarks"),
    ],
)
def test_watch_list_needs_what_a_real_server_needs(srv: SimApiServer, query: str, message: str) -> None:
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(f"{srv.url}{SLICES}?watch=true&{query}", timeout=10)
    assert err.value.code == 422
    assert message in json.loads(err.value.read())["message"]
