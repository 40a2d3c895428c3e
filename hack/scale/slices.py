"""The ResourceSlices of every driver and node, from one watch: when each node's pool was first
complete (the start figure), and the devices Tandem published (the reference publishes the same)."""

from __future__ import annotations

import threading
import time
from collections import Counter
from typing import Any

from scale.api import Api
from scale.objects import family


class SliceWatch:
    def __init__(self, api: Api) -> None:
        self.api = api
        self.slices: dict[str, tuple[str, str, int]] = {}
        self.complete: dict[tuple[str, str], float] = {}
        self.expected: dict[tuple[str, str], int] = {}
        self.devices: dict[str, list[dict[str, Any]]] = {}
        self.cond = threading.Condition()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            try:
                listed = self.api.request("GET", "/apis/resource.k8s.io/v1/resourceslices")
                for s in listed["items"]:
                    self._on(s, False)
                rv = listed["metadata"]["resourceVersion"]
                for ev in self.api.watch(
                    f"/apis/resource.k8s.io/v1/resourceslices?watch=1&resourceVersion={rv}&timeoutSeconds=3600"
                ):
                    self._on(ev["object"], ev["type"] == "DELETED")
            except Exception:
                time.sleep(0.5)

    def _on(self, s: dict[str, Any], deleted: bool) -> None:
        t = time.monotonic()
        with self.cond:
            if "spec" in s:
                name, spec = s["metadata"]["name"], s["spec"]
                if deleted:
                    self.slices.pop(name, None)
                    self.devices.pop(name, None)
                else:
                    self.slices[name] = (
                        family(spec["driver"]),
                        spec.get("nodeName", ""),
                        len(spec.get("devices") or []),
                    )
                    self.devices[name] = spec.get("devices") or []
            counts: Counter[tuple[str, str]] = Counter()
            for d, n, c in self.slices.values():
                counts[(d, n)] += c
            for key, want in self.expected.items():
                if key not in self.complete and counts[key] >= want:
                    self.complete[key] = t
            self.cond.notify_all()

    def expect(self, driver: str, nodes: list[str], devices: int) -> None:
        with self.cond:
            for n in nodes:
                self.expected[(driver, n)] = devices
        self._on({}, False)

    def wait(self, driver: str, nodes: list[str], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with self.cond:
            while not all((driver, n) in self.complete for n in nodes):
                left = deadline - time.monotonic()
                if left <= 0:
                    done = sum((driver, n) in self.complete for n in nodes)
                    raise TimeoutError(f"{driver}: {done}/{len(nodes)} nodes published within {timeout} s")
                self.cond.wait(min(left, 1))

    def node_devices(self, driver: str, node: str) -> list[dict[str, Any]]:
        with self.cond:
            return [
                d
                for name, (drv, n, _) in self.slices.items()
                if drv == driver and n == node
                for d in self.devices[name]
            ]
