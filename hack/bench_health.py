"""Benchmark of the GPU health path: an NVML event until its condition is in the inventory.

A function, not a test: hack/bench.py calls it; `python hack/bench_health.py` prints its result as
JSON. It runs the monitor in-process against the fake pynvml on a rendered simulated node. The
fake's event wait blocks until its events file changes (inotify), as the real NVML's wait returns
as the driver posts the event. The API side (inventory -> ResourceSlice taint) is measured
separately.
"""

from __future__ import annotations

import json
import logging
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from driver.discovery.gpu.discover import GpuDiscovery
from driver.health.gpu.monitor import GpuHealthMonitor
from driver.health.gpu.policy import GpuHealthPolicy
from driver.inventory.store import Inventory
from sim import nvml as sim_nvml
from sim.profile import h100_node
from sim.sysfs import render_node

XID_EVENT = 0x8  # nvmlEventTypeXidCriticalError


def _percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(round(p / 100 * (len(ordered) - 1)), len(ordered) - 1)]


def bench_gpu_event_to_condition(events: int = 20, gpus: int = 8, timeout_s: float = 10.0) -> dict[str, Any]:
    """Append XID events one at a time (a new XID each, spread over the GPUs, at random gaps) and
    time each until the inventory shows its condition."""
    with tempfile.TemporaryDirectory(prefix="bench-health-") as tmp_name:
        tmp = Path(tmp_name)
        profile = h100_node(gpus=gpus, nics=0)
        render_node(profile, tmp / "sys", tmp / "dev", tmp / "proc")
        state = tmp / "nvml.json"
        sim_nvml.write_state(profile, state)
        with sim_nvml.fake_pynvml_in_process(state):
            inventory = Inventory()
            inventory.replace("gpu", GpuDiscovery(tmp / "sys", proc_root=tmp / "proc").discover())
            monitor = GpuHealthMonitor(inventory, GpuHealthPolicy(), driver_root=Path("/"))
            expected: tuple[str, str] = ("", "")
            seen = threading.Event()

            def on_change() -> None:
                device = inventory.get(expected[0])
                if device is not None and any(t.key.endswith("/xid") and t.value == expected[1] for t in device.taints):
                    seen.set()

            inventory.subscribe(on_change)
            monitor.start()
            try:
                if not monitor.trigger_probe(wait=timeout_s):
                    return {"error": "the monitor did not start probing"}
                latencies = []
                for i in range(events):
                    gpu, xid = i % gpus, 200 + i
                    expected = (f"gpu-{profile.gpus[gpu].minor}", str(xid))
                    seen.clear()
                    # Land at a random point of the monitor's wait, not right as it returns from the last event.
                    time.sleep(random.uniform(0.02, 0.06))
                    start = time.perf_counter()
                    sim_nvml.append_event(state, profile.gpus[gpu].uuid, XID_EVENT, xid)
                    if not seen.wait(timeout_s):
                        return {"error": f"event {i} (XID {xid}) never reached the inventory"}
                    latencies.append(time.perf_counter() - start)
            finally:
                monitor.stop()
    ms = [x * 1000 for x in latencies]
    return {
        "events": events,
        "p50_ms": round(statistics.median(ms), 2),
        "p99_ms": round(_percentile(ms, 99), 2),
        "max_ms": round(max(ms), 2),
        "note": "the fake NVML's event wait blocks until its event file changes (inotify), as the real one blocks",
    }


def main() -> int:
    logging.basicConfig(level=logging.ERROR)
    json.dump({"gpu_event_to_condition": bench_gpu_event_to_condition()}, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
