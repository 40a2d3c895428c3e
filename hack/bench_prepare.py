"""Prepare/unprepare latency of the real daemon process against the simulated cluster and node.

Compared in the same run with the gRPC floor: an empty NodePrepareResources call, which does no
work at all. Claims are prepared one per call, as the kubelet does for separate pods; "concurrent"
means that many calls in flight at once. `python hack/bench_prepare.py [--quick]` prints JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from demo.node import DRIVER, SimNode, stop_daemon
from sim.apiserver import SimApiServer
from sim.kubelet import ClaimRef, KubeletSim
from sim.profile import GpuSpec, NicSpec, NodeProfile
from sim.scheduler import Request, allocate, attribute, claim_object, published_devices

GPU = Request("gpu", "gpu.tandem.dev", lambda d: attribute(d, "type") == "gpu")
NIC = Request("nic", "nic.tandem.dev", lambda d: attribute(d, "type") == "nic")
SHAPES: dict[str, list[Request]] = {
    "1-gpu": [GPU],
    "1-nic": [NIC],
    "4-gpu+4-nic": [
        Request("gpu", "gpu.tandem.dev", GPU.match, count=4),
        Request("nic", "nic.tandem.dev", NIC.match, count=4),
    ],
}


def big_node(name: str, gpus: int, nics: int) -> NodeProfile:
    """Enough GPUs and NICs for 64 concurrent 4+4 claims, each on its own PCI bus."""

    def bdf(i: int, fn: int) -> tuple[str, str]:
        domain, bus = divmod(i, 200)
        return f"{domain:04x}:{bus + 0x10:02x}:00.{fn}", f"pci{domain:04x}:{bus + 0x10:02x}"

    g = []
    for i in range(gpus):
        addr, root = bdf(i, 0)
        g.append(GpuSpec(index=i, minor=i, uuid=f"GPU-{i:08x}-0000-4000-8000-{i:012x}", name="NVIDIA H100 80GB HBM3",
                         pci_bus_id=addr, pcie_root=root, numa_node=i % 2, memory_bytes=80 * 2**30))  # fmt: skip
    n = []
    for j in range(nics):
        addr, root = bdf(j, 1)
        n.append(NicSpec(pci_address=addr, pcie_root=root, numa_node=j % 2, ifname=f"rdma{j}",
                         mac=f"b8:3f:d2:00:{j // 256:02x}:{j % 256:02x}", rdma_device=f"mlx5_{j}",
                         uverbs_index=j, ipv4=[f"10.{j // 256}.{j % 256}.1/16"]))  # fmt: skip
    return NodeProfile(name=name, gpus=g, nics=n)


def _percentiles(samples: Sequence[float]) -> dict[str, float]:
    ordered = sorted(samples)

    def pct(p: float) -> float:
        return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]

    return {"p50_ms": round(pct(50) * 1000, 2), "p99_ms": round(pct(99) * 1000, 2), "n": len(ordered)}


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


class Bench:
    def __init__(self, root: Path, gpus: int, nics: int) -> None:
        self.srv = SimApiServer().start()
        self.profile = big_node("bench-node", gpus, nics)
        self.node = SimNode.create(root / "node", self.profile)
        self.srv.add_node(self.profile.name)
        kubeconfig = root / "kubeconfig"
        self.srv.write_kubeconfig(kubeconfig)
        self.proc = self.node.start_daemon(kubeconfig, root / "daemon.log")
        self.kubelet = KubeletSim(self.node.registry)
        self.kubelet.register(self.kubelet.wait_for_registration_socket(DRIVER, timeout=60))
        want = gpus + nics
        if not self.srv.wait_for(lambda: len(published_devices(self.srv, DRIVER, self.profile.name)) >= want, 120):
            raise RuntimeError("devices were not published")
        self.counter = 0

    def close(self) -> None:
        self.kubelet.close()
        stop_daemon(self.proc)
        self.srv.stop()

    def floor(self, calls: int) -> dict[str, float]:
        return _percentiles([_timed(lambda: self.kubelet.prepare([])) for _ in range(calls)])

    def claims(self, shape: list[Request], count: int) -> list[ClaimRef]:
        refs: list[ClaimRef] = []
        taken: set[str] = set()
        for _ in range(count):
            self.counter += 1
            name = f"bench-{self.counter}"
            claim = self.srv.create(claim_object("default", name, shape))
            claim = allocate(self.srv, claim, DRIVER, self.profile.name, shape, taken=taken)
            taken |= {r["device"] for r in claim["status"]["allocation"]["devices"]["results"]}
            refs.append(ClaimRef("default", name, claim["metadata"]["uid"]))
        return refs

    def cpu_seconds(self) -> float:
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def run(self, shape: list[Request], concurrency: int, rounds: int) -> dict[str, Any]:
        prep, unprep = [], []
        cpu = 0.0
        for _ in range(rounds):
            refs = self.claims(shape, concurrency)

            def one(ref: ClaimRef, op: str) -> float:
                t0 = time.perf_counter()
                if op == "prepare":
                    err = self.kubelet.prepare([ref])[ref.uid].error
                else:
                    err = self.kubelet.unprepare([ref])[ref.uid]
                if err:
                    raise RuntimeError(f"{op} failed: {err}")
                return time.perf_counter() - t0

            with ThreadPoolExecutor(max_workers=concurrency) as pool:
                t0, c0 = time.perf_counter(), self.cpu_seconds()
                prep += list(pool.map(lambda r: one(r, "prepare"), refs))
                prep_wall = time.perf_counter() - t0
                cpu += self.cpu_seconds() - c0
                unprep += list(pool.map(lambda r: one(r, "unprepare"), refs))
            for ref in refs:
                self.srv.delete("resourceclaims", ref.name, ref.namespace)
        return {
            "prepare": _percentiles(prep),
            "unprepare": _percentiles(unprep),
            "last_round_prepare_wall_ms": round(prep_wall * 1000, 1),
            # The daemon's own CPU per prepared claim: with 2 cores shared with the simulated API
            # server and kubelet, this (not a lock) bounds concurrent throughput.
            "daemon_cpu_ms_per_prepare": round(cpu * 1000 / (rounds * concurrency), 2),
        }


def bench_prepare(quick: bool = False) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="tb-"))
    levels = [1, 16] if quick else [1, 16, 64]
    bench = Bench(root, gpus=4 * max(levels), nics=4 * max(levels))
    try:
        out: dict[str, Any] = {"floor_empty_prepare": bench.floor(50 if quick else 200)}
        for shape_name, shape in SHAPES.items():
            for level in levels:
                rounds = 20 if level == 1 and not quick else (5 if level == 1 else 2)
                out[f"{shape_name} x{level}"] = bench.run(shape, level, rounds)
        out["floor_empty_prepare_after"] = bench.floor(50)
        return out
    finally:
        bench.close()
        shutil.rmtree(root, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    json.dump(bench_prepare(args.quick), sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
