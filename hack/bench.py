"""Tandem's benchmark: every figure the issues ask for, measured on the simulated node and cluster.

Speed and memory are measured here, never asserted in timed tests. Sections:

  discovery  GPU discovery (8 H100; 8 A100 with 56 MIG devices), NIC discovery among 1,000 netdevs,
             GPU and NIC discovery with the HGX board's PCIe switch trees (8 GPUs, 8 NICs, 1,000 netdevs),
             the daemon's CPU and slice writes while 1,000 veth pairs come and go next to 8 NICs
  slices     publish time and writes for 1/64/1,000 devices, steady-state writes, a 100-change burst
  prepare    prepare/unprepare latency (1 GPU, 1 NIC, 4 GPU + 4 NIC; 1, 16, 64 concurrent) vs the gRPC floor
  mig        dynamic MIG: prepare/unprepare of a claim that carves a 1g partition vs a whole GPU, and the
             publication of 8 GPUs' partitions (devices, counter sets, slices, bytes, time, writes)
  sharing    MPS-shared GPU: prepare of the first share (starts the GPU's MPS daemon) and of a second
             (reuses it), their unprepares (the last stops it), vs a claim for a whole GPU
  health     NVML event -> condition, event -> taint in the API and -> health stream, flapping, idle CPU, RSS
             (idle, and across 1,000 prepare/unprepare cycles), the idle cost of the grey-failure reads
  cluster    pod create-to-Running with 1-GPU and GPU+NIC claims in the real cluster (hack/cluster.sh up),
             and the share spent in Tandem's NodePrepareResources
  binding    dynamic-MIG pod create-to-Running with and without binding conditions, and from a partition
             failure on one GPU to the pod Running on the other (real cluster)
  reference  Tandem side by side with Go drivers on the official kubeletplugin helper, minimal and doing
             Tandem's work, in one run: issue 13's table with ratios (Tandem alone without Go)
  scale      N nodes (100; TANDEM_SCALE_NODES=N, --quick 10) on one real control plane, each with Tandem and the
             Go reference driver publishing the same devices, a kubelet stand-in for all: time to all slices
             published, idle and churn API requests, GPU+NIC and 1-GPU pods at a steady rate, CPU and memory

`python hack/bench.py [--quick] [--only SECTION ...]` prints JSON (the reference section also prints
its table on stderr). The NIC netns cases need root and report why they were skipped otherwise.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_binding
import bench_cluster
import bench_daemon
import bench_health
import bench_mig
import bench_nic
import bench_nic_health
import bench_prepare
import bench_reference
import bench_sharing
import bench_slices
import bench_topology
from scale.run import bench_scale

from driver.discovery.gpu.discover import GpuDiscovery
from sim import nvml as sim_nvml
from sim.profile import NodeProfile, a100_mig_node, h100_node
from sim.sysfs import render_node


def _gpu_discovery(profile: NodeProfile, runs: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-disc-") as tmp:
        root = Path(tmp)
        render_node(profile, root / "sys", root / "dev", root / "proc")
        state = root / "nvml.json"
        sim_nvml.write_state(profile, state)
        with sim_nvml.fake_pynvml_in_process(state):
            disc = GpuDiscovery(root / "sys", proc_root=root / "proc")
            times, count = [], 0
            for _ in range(runs):
                t0 = time.perf_counter()
                count = len(disc.discover())
                times.append(time.perf_counter() - t0)
    return {"devices": count, "median_ms": round(statistics.median(times) * 1000, 2), "runs": runs}


def discovery(quick: bool) -> dict[str, Any]:
    runs = 5 if quick else 20
    return {
        "gpu_8_h100": _gpu_discovery(h100_node(gpus=8, nics=0), runs),
        "gpu_8_a100_56_mig": _gpu_discovery(a100_mig_node(gpus=8, per_gpu=7), runs),
        "nic_8_rdma_among_1000_netdevs": bench_nic.bench_nic_discovery(runs=3 if quick else 10),
        "hgx_switches_8_gpus_8_nics_among_1000_netdevs": bench_topology.bench_topology_discovery(
            runs=3 if quick else 10
        ),
        "nic_100_address_changes_in_1s": bench_nic.bench_nic_events(),
        "nic_veth_churn_1000_pairs_in_60s": (
            bench_nic.bench_veth_churn(pairs=200, seconds=12.0) if quick else bench_nic.bench_veth_churn()
        ),
        "nic_address_change_to_slice_daemon": bench_daemon.bench_nic_event_to_slice(),
    }


def slices(quick: bool) -> dict[str, Any]:
    return {
        "publish": {n: bench_slices.bench_publish(n) for n in (1, 64, 1000)},
        "steady_state": bench_slices.bench_steady_state(5 if quick else 60),
        "burst_100_changes_in_1s": bench_slices.bench_burst(100),
    }


def prepare(quick: bool) -> dict[str, Any]:
    return bench_prepare.bench_prepare(quick)


def mig(quick: bool) -> dict[str, Any]:
    return bench_mig.bench_mig(quick)


def sharing(quick: bool) -> dict[str, Any]:
    return bench_sharing.bench_sharing(quick)


def health(quick: bool) -> dict[str, Any]:
    return {
        "nvml_event_to_inventory": bench_health.bench_gpu_event_to_condition(),
        "daemon_event_to_taint": bench_daemon.bench_event_to_taint(),
        "flapping_50_in_10s_debounced": bench_daemon.bench_flapping(),
        "flapping_50_in_10s_no_debounce": bench_daemon.bench_flapping(debounce=0.0),
        "flapping_netns_condition_changes": bench_nic_health.bench_flap_condition_changes(),
        "footprint_8_gpus_8_nics": bench_daemon.bench_footprint(10 if quick else 60, 200 if quick else 1000),
        "grey_failure_reads_idle_cost": bench_daemon.bench_grey_idle_cost(20 if quick else 120),
    }


def cluster(quick: bool) -> dict[str, Any]:
    return {"pod_start": bench_cluster.bench_pod_start(pods=5 if quick else 20)}


def binding(quick: bool) -> dict[str, Any]:
    return bench_binding.bench_binding(pods=5 if quick else 20, failovers=2 if quick else 5)


def reference(quick: bool) -> dict[str, Any]:
    """The figures as JSON, and issue 13's table on stderr (stdout stays JSON); without Go the
    table says why and shows Tandem's figures alone."""
    result = bench_reference.bench_reference(quick)
    print(result["table"], file=sys.stderr, flush=True)
    return result


def scale(quick: bool) -> dict[str, Any]:
    return bench_scale(quick)


SECTIONS = {
    "discovery": discovery,
    "slices": slices,
    "prepare": prepare,
    "mig": mig,
    "sharing": sharing,
    "health": health,
    "cluster": cluster,
    "binding": binding,
    "reference": reference,
    "scale": scale,
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer runs and shorter idle windows")
    parser.add_argument("--only", nargs="+", choices=sorted(SECTIONS), default=list(SECTIONS))
    args = parser.parse_args()
    out: dict[str, Any] = {}
    for name in args.only:
        t0 = time.monotonic()
        out[name] = SECTIONS[name](args.quick)
        print(f"# {name}: {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
    json.dump(out, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
