"""The simulated API server reads an apply body as the real one does: JSON (what client-go, kubectl
and the Python client send) and YAML text alike, and a body that is neither is a 400."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from sim.apiserver import SimApiServer

DRIVER = "gpu.example.com"
READY = {
    "type": "Ready",
    "status": "True",
    "reason": "Prepared",
    "message": "",
    "lastTransitionTime": "2026-01-01T00:00:00Z",
}


@pytest.fixture
def srv() -> Iterator[SimApiServer]:
    """A claim allocated two devices, whose status the tests apply."""
    results = [{"request": "gpus", "driver": DRIVER, "pool": "node-a", "device": d} for d in ("gpu-0", "gpu-1")]
    with SimApiServer() as server:
        server.create(
            {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "ResourceClaim",
                "metadata": {"name": "claim", "namespace": "default"},
                "spec": {"devices": {"requests": [{"name": "gpus", "exactly": {"deviceClassName": DRIVER}}]}},
                "status": {"allocation": {"devices": {"results": results}}},
            }
        )
        yield server


def _apply(srv: SimApiServer, body: bytes) -> int:
    url = f"{srv.url}/apis/resource.k8s.io/v1/namespaces/default/resourceclaims/claim/status?fieldManager=tandem&force=true"
    req = urllib.request.Request(
        url, data=body, method="PATCH", headers={"Content-Type": "application/apply-patch+yaml"}
    )
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status
    except urllib.error.HTTPError as e:
        return e.code


def _status(entries: list[dict[str, Any]]) -> dict[str, Any]:
    meta = {"name": "claim", "namespace": "default"}
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": meta,
        "status": {"devices": entries},
    }


def _devices(srv: SimApiServer) -> list[dict[str, Any]]:
    return srv.get("resourceclaims", "claim", "default")["status"].get("devices", [])


def test_a_json_apply_body_is_read_as_json(srv: SimApiServer) -> None:
    assert (
        _apply(
            srv,
            json.dumps(
                _status([{"driver": DRIVER, "pool": "node-a", "device": "gpu-0", "conditions": [READY]}])
            ).encode(),
        )
        == 200
    )
    assert [d["device"] for d in _devices(srv)] == ["gpu-0"]


def test_a_yaml_apply_body_is_read_as_yaml(srv: SimApiServer) -> None:
    yaml_text = """\
apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata: {name: claim, namespace: default}
status:
  devices:
  - driver: gpu.example.com
    pool: node-a
    device: gpu-1
    conditions:
    - {type: Ready, status: "True", reason: Prepared, message: "", lastTransitionTime: "2026-01-01T00:00:00Z"}
"""
    assert _apply(srv, yaml_text.encode()) == 200
    (entry,) = _devices(srv)
    assert entry["device"] == "gpu-1" and entry["conditions"][0]["status"] == "True"  # a string, as quoted


def test_an_apply_body_that_is_neither_is_a_400(srv: SimApiServer) -> None:
    assert _apply(srv, b"status: [unclosed") == 400
    assert _devices(srv) == []
