"""Benchmarks of RDMA NIC discovery and its netlink watcher, in a throwaway network namespace.

Functions, not tests: hack/bench.py calls them; `python hack/bench_nic.py` prints their results as
JSON. All need root (network namespaces); without it they return {"skipped": reason}.

The NICs are veths that a rendered sysfs maps to RDMA functions as a node's sysfs maps a ConnectX
whose netdev is in another namespace: by the RoCE port's default GID, derived from the MAC (so
each veth gets its NicSpec's MAC).
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

from bench_daemon import _cpu_seconds, _daemon
from pyroute2 import IPRoute

from driver.discovery.nic.discover import NicDiscovery
from driver.discovery.nic.watcher import NicWatcher
from sim.nics import render_nic
from sim.profile import NicSpec, NodeProfile


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


def _rdma_nics(ns: str, root: Path, count: int) -> tuple[Path, Path]:
    """`count` veths rdma<i> (up) in `ns`, each rendered as an RDMA NIC; (sysfs, dev) roots."""
    sysfs, dev = root / "sys", root / "dev"
    lines = []
    for i in range(count):
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
        lines += [f"link add rdma{i} address {spec.mac} type veth peer name rdma{i}p"]
        lines += [f"link set rdma{i}p up", f"link set rdma{i} up"]
    _ip_batch(ns, lines)
    return sysfs, dev


def bench_nic_discovery(rdma_nics: int = 8, other_netdevs: int = 1000, runs: int = 10) -> dict[str, Any]:
    """Time of one full discovery with `rdma_nics` RDMA NICs among `other_netdevs` plain veths."""
    if reason := cannot_run():
        return {"skipped": reason}
    with netns() as ns, tempfile.TemporaryDirectory(prefix="bench-nic-") as tmp:
        _ip_batch(ns, [f"link add o{i} type veth peer name o{i}p" for i in range(other_netdevs // 2)])
        sysfs, _dev = _rdma_nics(ns, Path(tmp), rdma_nics)
        disc = NicDiscovery(sysfs, netns=ns)
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


def bench_veth_churn(pairs: int = 1000, seconds: float = 60.0, rdma_nics: int = 8) -> dict[str, Any]:
    """The daemon (a separate process, against the simulated API server) serving `rdma_nics` NICs
    of a namespace while `pairs` veth pairs are created, brought up and deleted there, evenly over
    `seconds`, each living about 3 s: what a CNI does on pod starts. Its CPU over the churn (and
    over an idle window of the same daemon before it, for comparison) and the slice writes. Goal:
    no write, under 5 % of a core. A watcher in this process with the daemon's filter counts the
    messages and what they cause."""
    if reason := cannot_run():
        return {"skipped": reason}
    with netns() as ns, tempfile.TemporaryDirectory(prefix="bench-churn-") as tmp:
        sysfs, dev = _rdma_nics(ns, Path(tmp), rdma_nics)
        flags = ("--device-kinds", "nic", "--netns", ns, "--nic-link-source", "netlink",
                 "--sysfs-root", str(sysfs), "--dev-root", str(dev))  # fmt: skip
        with _daemon(NodeProfile(name="bench-churn"), *flags, expect=rdma_nics) as d:
            calls: list[float] = []
            disc = NicDiscovery(sysfs, netns=ns)
            watcher = NicWatcher(lambda: calls.append(1), netns=ns, resync_period=3600, may_be_nic=disc.may_be_nic)
            watcher.start()
            try:
                time.sleep(3)  # start-up work (first discovery, publish) is not part of either window
                pid, idle_window = d.proc.pid, min(10.0, seconds)
                cpu0, t0 = _cpu_seconds(pid), time.monotonic()
                time.sleep(idle_window)
                idle_cpu = (_cpu_seconds(pid) - cpu0) / (time.monotonic() - t0)
                writes0, cpu0, start = d.slice_writes(), _cpu_seconds(pid), time.monotonic()
                _churn(ns, pairs, seconds)
                time.sleep(2)  # a rediscovery the last events caused would run within this
                wall = time.monotonic() - start
                cpu, writes = _cpu_seconds(pid) - cpu0, d.slice_writes() - writes0
            finally:
                watcher.stop()
    return {
        "veth_pairs": pairs,
        "rdma_nics": rdma_nics,
        "churn_seconds": round(wall, 1),
        "daemon_cpu_percent_of_a_core": round(100 * cpu / wall, 2),
        "daemon_idle_cpu_percent_of_a_core": round(100 * idle_cpu, 2),
        "slice_writes": writes,
        "netlink_messages": watcher.events,
        "messages_ignored": watcher.ignored,
        "rediscoveries_caused": len(calls),
        "tracked_links_after": watcher.tracked[0],
    }


def _churn(ns: str, pairs: int, seconds: float, lifetime: float = 3.0) -> None:
    """Create, bring up and later delete `pairs` veth pairs in `ns`, evenly over `seconds`."""
    alive: list[tuple[float, str]] = []
    with IPRoute(netns=ns, flags=0) as ipr:
        start = time.monotonic()
        for i in range(pairs):
            ipr.link("add", ifname=f"c{i}", kind="veth", peer=f"c{i}p")
            for name in (f"c{i}p", f"c{i}"):
                ipr.link("set", ifname=name, state="up")
            alive.append((time.monotonic() + lifetime, f"c{i}"))
            while alive and (alive[0][0] <= time.monotonic() or i == pairs - 1):
                ipr.link("del", ifname=alive.pop(0)[1])  # the peer goes with it
            time.sleep(max(0.0, start + (i + 1) * seconds / pairs - time.monotonic()))


def main() -> int:
    logging.basicConfig(level=logging.WARNING)
    out = {"discovery": bench_nic_discovery(), "events": bench_nic_events(), "veth_churn": bench_veth_churn()}
    json.dump(out, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
