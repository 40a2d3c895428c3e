"""Benchmarks of the ResourceSlice publisher against the simulated API server.

Functions, not tests: hack/bench.py calls them; `python hack/bench_slices.py [--quick]` prints
their results as JSON. Each one starts its own simulated API server and publisher.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from driver.kube.api import KubeAPI
from driver.model import Device, DeviceKind
from driver.slices.publisher import PublisherOptions, SlicePublisher
from sim.apiserver import RequestRecord, SimApiServer

DRIVER = "tandem.example.com"
NODE = "bench-node"
_WRITES = {"POST", "PUT", "DELETE", "PATCH"}


def _device(i: int, model: str = "H100") -> Device:
    return Device(
        name=f"gpu-{i:04d}",
        kind=DeviceKind.GPU,
        attributes={"index": i, "model": model},
        capacity={"memory": "80Gi"},
    )


class _Devices:
    def __init__(self, devices: Sequence[Device]) -> None:
        self._lock = threading.Lock()
        self._devices = list(devices)

    def get(self) -> list[Device]:
        with self._lock:
            return list(self._devices)

    def change(self, index: int, model: str) -> None:
        with self._lock:
            self._devices[index] = _device(index, model)


@contextmanager
def _publishing(n_devices: int) -> Iterator[tuple[SimApiServer, SlicePublisher, _Devices]]:
    srv = SimApiServer().start()
    srv.add_node(NODE)
    with tempfile.TemporaryDirectory() as tmp:
        kubeconfig = Path(tmp) / "kubeconfig"
        srv.write_kubeconfig(kubeconfig)
        api = KubeAPI(str(kubeconfig))
        devices = _Devices([_device(i) for i in range(n_devices)])
        pub = SlicePublisher(api, DRIVER, NODE, devices.get, PublisherOptions())
        try:
            yield srv, pub, devices
        finally:
            pub.stop()
            api.close()
            srv.stop()


def slice_writes(srv: SimApiServer) -> int:
    """ResourceSlice writes in the server's request log: what a publisher costs the API server."""
    # Annotated: the simulation is not type-checked, and its `requests` property reads as no list.
    records: list[RequestRecord] = srv.requests
    return sum(1 for r in records if r.method in _WRITES and r.resource == "resourceslices")


def bench_publish(n_devices: int) -> dict[str, Any]:
    """Time from start to a complete pool, and the writes it took."""
    with _publishing(n_devices) as (srv, pub, _):
        start = time.monotonic()
        pub.start()
        synced = pub.wait_synced(60)
        elapsed = time.monotonic() - start
        return {
            "devices": n_devices,
            "synced": synced,
            "seconds": round(elapsed, 3),
            "writes": slice_writes(srv),
            "slices": len(srv.list("resourceslices")),
        }


def bench_steady_state(seconds: float = 60) -> dict[str, Any]:
    """Writes while nothing changes (must be 0), with a trigger every second as noise."""
    with _publishing(64) as (srv, pub, _):
        pub.start()
        synced = pub.wait_synced(60)
        srv.clear_requests()
        syncs = pub.stats.syncs
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            pub.trigger()
            time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
        return {
            "seconds": seconds,
            "synced": synced,
            "writes": slice_writes(srv),
            "syncs": pub.stats.syncs - syncs,
        }


def bench_burst(changes: int = 100) -> dict[str, Any]:
    """Writes caused by `changes` device changes spread over one second (64 devices, 1 slice)."""
    with _publishing(64) as (srv, pub, devices):
        pub.start()
        pub.wait_synced(60)
        srv.clear_requests()
        start = time.monotonic()
        for n in range(changes):
            devices.change(n % 64, f"model-{n}")
            pub.trigger()
            time.sleep(max(0.0, start + (n + 1) / changes - time.monotonic()))
        synced = pub.wait_synced(60)
        return {
            "changes": changes,
            "synced": synced,
            "writes": slice_writes(srv),
            "seconds_to_synced": round(time.monotonic() - start, 3),
        }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="steady state for 5 s instead of 60 s")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    result = {
        "publish": [bench_publish(n) for n in (1, 64, 1000)],
        "steady_state": bench_steady_state(5 if args.quick else 60),
        "burst": bench_burst(100),
    }
    json.dump(result, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
