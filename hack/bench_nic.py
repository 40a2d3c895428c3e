"""Benchmarks of RDMA NIC discovery and its netlink watcher, in a throwaway network namespace.

Functions, not tests: hack/bench.py calls them; `python hack/bench_nic.py` prints their results as
JSON. Both need root (network namespaces); without it they return {"skipped": reason}.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pyroute2 import IPRoute

from driver.discovery.nic import NicDiscovery
from driver.discovery.nic_watcher import NicWatcher
from sim.nics import render_nic
from sim.profile import NicSpec


def cannot_run() -> str | None:
    """Why the netns benchmarks cannot run here (shared with bench_nic_health), or None."""
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    if shutil.which("ip") is None:
        return "needs iproute2's `ip`"
    return None


@contextmanager
def netns() -> Iterator[str]:
    name = f"tandem-bench-{uuid.uuid4().hex[:8]}"
    subprocess.run(["ip", "netns", "add", name], check=True, capture_output=True)
    try:
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False)


def _ip_batch(ns: str, lines: list[str]) -> None:
    subprocess.run(["ip", "-n", ns, "-b", "-"], input="\n".join(lines) + "\n", check=True, text=True)


def bench_nic_discovery(rdma_nics: int = 8, other_netdevs: int = 1000, runs: int = 10) -> dict[str, Any]:
    """Time of one full discovery with `rdma_nics` RDMA NICs among `other_netdevs` plain veths."""
    if reason := cannot_run():
        return {"skipped": reason}
    with netns() as ns, tempfile.TemporaryDirectory(prefix="bench-nic-") as tmp:
        lines = [f"link add o{i} type veth peer name o{i}p" for i in range(other_netdevs // 2)]
        lines += [f"link add rdma{i} type veth peer name rdma{i}p" for i in range(rdma_nics)]
        _ip_batch(ns, lines)
        sysfs, dev = Path(tmp) / "sys", Path(tmp) / "dev"
        for i in range(rdma_nics):
            spec = NicSpec(
                pci_address=f"0000:{0x10 + i:02x}:00.0",
                pcie_root="pci0000:00",
                numa_node=0,
                ifname=f"rdma{i}",
                mac=f"02:00:00:00:00:{i:02x}",
                rdma_device=f"mlx5_{i}",
                uverbs_index=i,
            )
            render_nic(spec, sysfs, dev)
        disc = NicDiscovery(sysfs, dev, netns=ns)
        found = len(disc.discover())  # warm-up
        times = []
        for _ in range(runs):
            start = time.perf_counter()
            disc.discover()
            times.append(time.perf_counter() - start)
    return {
        "netdevs": other_netdevs + 2 * rdma_nics + 1,  # each RDMA veth has an unmapped peer; lo
        "rdma_nics_found": found,
        "runs": runs,
        "median_ms": round(statistics.median(times) * 1000, 2),
        "max_ms": round(max(times) * 1000, 2),
    }


def bench_nic_events(changes: int = 100, spread_s: float = 1.0) -> dict[str, Any]:
    """Callbacks caused by `changes` address additions spread evenly over `spread_s` seconds."""
    if reason := cannot_run():
        return {"skipped": reason}
    with netns() as ns:
        _ip_batch(ns, ["link add ev0 type veth peer name ev0p"])
        calls: list[float] = []
        watcher = NicWatcher(lambda: calls.append(time.monotonic()), netns=ns, resync_period=3600)
        watcher.start()
        try:
            with IPRoute(netns=ns, flags=0) as ipr:
                index = ipr.link_lookup(ifname="ev0")[0]
                start = time.monotonic()
                for i in range(changes):
                    ipr.addr("add", index=index, address=f"10.70.{i // 250}.{i % 250 + 1}", prefixlen=16)
                    time.sleep(max(0.0, start + (i + 1) * spread_s / changes - time.monotonic()))
                last_change = time.monotonic()
            deadline = time.monotonic() + 10
            while not (watcher.events >= changes and watcher.idle) and time.monotonic() < deadline:
                time.sleep(0.01)
        finally:
            watcher.stop()
    return {
        "address_changes": changes,
        "spread_s": round(last_change - start, 3),
        "netlink_events": watcher.events,
        "callbacks": len(calls),
        "first_callback_after_first_change_ms": round((calls[0] - start) * 1000, 1) if calls else None,
        "last_callback_after_last_change_ms": round((calls[-1] - last_change) * 1000, 1) if calls else None,
    }


def main() -> int:
    logging.basicConfig(level=logging.WARNING)
    json.dump({"discovery": bench_nic_discovery(), "events": bench_nic_events()}, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
