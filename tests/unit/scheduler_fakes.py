"""The simulated API server with one node's devices published in one slice, and one claim at a time
allocated from it by the simulated scheduler: for tests of what the allocator makes of a device
(consumable capacity of shared GPUs and NICs)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from prepare_fakes import DRIVER, NODE

from driver.model import Device
from driver.slices.build import device_to_api
from sim.apiserver import SimApiServer
from sim.scheduler import Request, allocate, claim_object


@contextmanager
def published(devices: Iterable[Device]) -> Iterator[Any]:
    """A simulated API server whose one ResourceSlice holds `devices`."""
    with SimApiServer() as server:
        server.create({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"name": "s"},
            "spec": {"driver": DRIVER, "nodeName": NODE, "pool": {"name": NODE, "generation": 1, "resourceSliceCount": 1},
                     "devices": [device_to_api(d, {}, "") for d in devices]},
        })  # fmt: skip
        yield server


def allocate_one(srv: Any, name: str, request: Request) -> dict[str, Any]:
    """The allocation result of a new claim `name` of one request (LookupError: nothing fits)."""
    claim = srv.create(claim_object("default", name, [request]))
    return allocate(srv, claim, DRIVER, NODE, [request])["status"]["allocation"]["devices"]["results"][0]
