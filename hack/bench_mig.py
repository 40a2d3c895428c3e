"""Dynamic MIG benchmarks: what carving a partition adds to a prepare, and what publishing
partitions of 8 GPUs costs.

* `bench_carving`: the real daemon process (`--dynamic-mig all`) on a simulated node with one H100
  in MIG mode and one without: prepare and unprepare latency of a claim for a 1g partition (the
  fake NVML makes and destroys the GPU and compute instance, and writes its state file, as a real
  GPU's driver call takes its own time on top) against a claim for a whole GPU in the same run,
  and the ResourceSlice writes the carving caused (none: a partition's published form never changes).
* `bench_publication`: 8 H100s in MIG mode served dynamically: discovery time, devices, counter
  sets, slices and their size, and a publish to the simulated API server (time, writes).

`python hack/bench_mig.py [--quick]` prints JSON.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from bench_slices import slice_writes

from demo.node import DRIVER, SimNode, stop_daemon
from driver.discovery.gpu.discover import GpuDiscovery
from driver.kube.api import KubeAPI
from driver.slices.build import build_slices
from driver.slices.publisher import SlicePublisher
from sim import nvml as sim_nvml
from sim.apiserver import SimApiServer
from sim.kubelet import ClaimRef, KubeletSim
from sim.profile import h100_node
from sim.scheduler import Request, allocate, claim_object, reserve
from sim.sysfs import render_node

SHAPES = {
    "1g-partition": Request("mig", "mig.tandem.dev", lambda d: d["name"] == "gpu-0-mig-1g-10gb-p3"),
    "whole-gpu-no-mig": Request("gpu", "gpu.tandem.dev", lambda d: d["name"] == "gpu-1"),
}


def _ms(values: list[float]) -> dict[str, float]:
    return {"median_ms": round(statistics.median(values) * 1000, 2), "max_ms": round(max(values) * 1000, 2)}


def _complete(srv: SimApiServer, devices: int) -> bool:
    """The pool holds `devices` devices and all its slices (devices and counters) are written."""
    slices = [s["spec"] for s in srv.list("resourceslices")]
    count = sum(len(s.get("devices") or []) for s in slices)
    return count >= devices and bool(slices) and len(slices) == slices[0]["pool"]["resourceSliceCount"]


def bench_carving(runs: int) -> dict[str, Any]:
    profile = h100_node("bench-mig", gpus=2, nics=0, mig_capable=True)
    profile.gpus[0].mig_mode = True
    with tempfile.TemporaryDirectory(prefix="bm-") as tmp, SimApiServer() as srv:
        srv.start()
        srv.add_node(profile.name)
        node = SimNode.create(Path(tmp) / "n", profile)
        kubeconfig = Path(tmp) / "kubeconfig"
        srv.write_kubeconfig(kubeconfig)
        proc = node.start_daemon(kubeconfig, Path(tmp) / "daemon.log", "--dynamic-mig", "all")
        kubelet = KubeletSim(node.registry)
        try:
            kubelet.register(kubelet.wait_for_registration_socket(DRIVER, timeout=60))
            deadline = time.monotonic() + 60
            while not _complete(srv, 26) and time.monotonic() < deadline:
                time.sleep(0.1)
            out: dict[str, Any] = {}
            for shape, req in SHAPES.items():
                prep, unprep, writes = [], [], 0
                for i in range(runs):
                    claim = srv.create(claim_object("default", f"{shape}-{i}", [req]))
                    allocate(srv, claim, DRIVER, profile.name, [req])
                    reserve(srv, claim, f"pod-{i}", str(uuid.uuid4()))
                    ref = ClaimRef("default", claim["metadata"]["name"], claim["metadata"]["uid"])
                    srv.clear_requests()
                    t0 = time.perf_counter()
                    error = kubelet.prepare([ref])[ref.uid].error
                    prep.append(time.perf_counter() - t0)
                    assert not error, error
                    t0 = time.perf_counter()
                    assert kubelet.unprepare([ref]) == {ref.uid: ""}
                    unprep.append(time.perf_counter() - t0)
                    srv.delete("resourceclaims", ref.name, "default")
                    time.sleep(0.3)  # the rediscovery a MIG change triggers, and any slice write, land here
                    writes += slice_writes(srv)
                out[shape] = {"prepare": _ms(prep), "unprepare": _ms(unprep), "slice_writes": writes, "runs": runs}
            return out
        finally:
            kubelet.close()
            stop_daemon(proc)


def bench_publication(runs: int) -> dict[str, Any]:
    profile = h100_node("bench-mig", gpus=8, nics=0, mig_capable=True)
    for gpu in profile.gpus:
        gpu.mig_mode = True
    with tempfile.TemporaryDirectory(prefix="bm-") as tmp:
        root = Path(tmp)
        render_node(profile, root / "sys", root / "dev", root / "proc")
        sim_nvml.write_state(profile, root / "nvml.json", proc_root=root / "proc")
        with sim_nvml.fake_pynvml_in_process(root / "nvml.json"):
            disc = GpuDiscovery(root / "sys", proc_root=root / "proc", dynamic_mig=lambda minor, uuid: True)
            times = []
            for _ in range(runs):
                t0 = time.perf_counter()
                devices = disc.discover()
                times.append(time.perf_counter() - t0)
        built = build_slices(devices, DRIVER, profile.name, "uid", 0)
        with SimApiServer() as srv:
            srv.start()
            srv.add_node(profile.name)
            kubeconfig = srv.write_kubeconfig(root / "kubeconfig")
            api = KubeAPI(str(kubeconfig))
            pub = SlicePublisher(api, DRIVER, profile.name, lambda: devices)
            t0 = time.monotonic()
            pub.start()
            synced = pub.wait_synced(60)
            seconds = time.monotonic() - t0
            writes = slice_writes(srv)
            pub.stop()
            api.close()
    return {
        "gpus": 8,
        "discovery": {**_ms(times), "runs": runs},
        "devices": len(devices),
        "counter_sets": sum(len(s["spec"].get("sharedCounters", [])) for s in built),
        "slices": len(built),
        "slice_bytes": sum(len(json.dumps(s, separators=(",", ":"))) for s in built),
        "publish": {"synced": synced, "seconds": round(seconds, 3), "writes": writes},
    }


def bench_mig(quick: bool) -> dict[str, Any]:
    return {"carving": bench_carving(5 if quick else 20), "publication_8_gpus": bench_publication(3 if quick else 10)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer runs")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    print(json.dumps(bench_mig(args.quick), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
