"""Discover this machine's GPUs (real NVML) and RDMA NICs and print them as ResourceSlice YAML.

Run through hack/gpu-smoke.sh on a machine with an NVIDIA GPU. Nothing is written anywhere and no
cluster is needed: it shows exactly what the daemon would publish for this node.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import time
from pathlib import Path

import yaml

from driver.discovery.gpu.discover import GpuDiscovery
from driver.discovery.gpu.dynamic_mig import DynamicMigReader
from driver.discovery.nic.discover import NicDiscovery
from driver.discovery.nic.scan import NicDiscoveryError
from driver.node.nvml import DeviceSkipped, NvmlError, NvmlUnavailable, init_nvml, shutdown_nvml
from driver.slices.build import build_slices


def print_mig_placements() -> None:
    """Profiles and placements through the reader dynamic MIG publishes from, one GPU per line as a
    YAML comment; NVML's error instead where it refuses (a GPU without MIG support, say)."""
    nvml = init_nvml(Path("/"))  # through the door, as the daemon: NVML's errors are NvmlErrors
    try:
        reader = DynamicMigReader(nvml)
        for i in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(i)
            name = nvml.nvmlDeviceGetName(handle)
            try:
                mode = nvml.nvmlDeviceGetMigMode(handle)
            except NvmlError as e:
                mode = str(e)
            facts: list[dict[str, object]] | list[str]
            try:
                facts = [
                    {"id": f.id, "name": f.name, "slices": f.slices, "memoryMiB": f.memory_mb, "sms": f.multiprocessors,
                     "placements": [list(pl) for pl in f.placements]}
                    for f in reader.profiles(f"GPU {i}", handle)
                ]  # fmt: skip
            except DeviceSkipped as e:
                facts = [str(e)]
            print(f"# MIG {i} {name} mode={mode}: {json.dumps(facts)}")
    finally:
        shutdown_nvml(nvml)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--driver-name", default="tandem.dev")
    p.add_argument("--node-name", default=socket.gethostname().split(".")[0].lower())
    p.add_argument("--sysfs-root", default="/sys")
    p.add_argument("--list-attributes", action="store_true")
    p.add_argument(
        "--mig-placements",
        action="store_true",
        help="also print every GPU's MIG profiles and possible placements as real NVML reports them "
        "(read only; the simulated NVML's placement tables are checked against this)",
    )
    args = p.parse_args()
    if args.mig_placements:
        print_mig_placements()
    devices = []
    t0 = time.perf_counter()
    try:
        devices += GpuDiscovery(Path(args.sysfs_root), args.list_attributes).discover()
    except NvmlUnavailable as e:
        print(f"# NVML unavailable: {e}", file=sys.stderr)
    t1 = time.perf_counter()
    try:
        devices += NicDiscovery(Path(args.sysfs_root), args.list_attributes).discover()
    except NicDiscoveryError as e:
        print(f"# NIC discovery failed: {e}", file=sys.stderr)
    t2 = time.perf_counter()
    print(
        f"# {len(devices)} device(s); GPU discovery {1000 * (t1 - t0):.1f} ms, NIC discovery {1000 * (t2 - t1):.1f} ms"
    )
    slices = build_slices(devices, args.driver_name, args.node_name, "00000000-0000-0000-0000-000000000000", 1)
    yaml.safe_dump_all(slices, sys.stdout, sort_keys=False)
    return 0 if devices else 1


if __name__ == "__main__":
    sys.exit(main())
