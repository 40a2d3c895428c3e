"""Benchmark of NIC health debounce: how many condition changes (and so slice writes) a flapping
link causes, against real netlink in a throwaway network namespace.

A function, not a test: hack/bench.py calls it; `python hack/bench_nic_health.py` prints its
result as JSON. Needs root (network namespaces); without it it returns {"skipped": reason}.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench_nic import cannot_run, netns
from pyroute2 import IPRoute

from driver.discovery.nic.discover import NicDiscovery
from driver.health.nic.monitor import NicHealthMonitor
from driver.inventory.store import Inventory
from sim.nics import render_nic
from sim.profile import NicSpec


def _wait(cond: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def bench_flap_condition_changes(flaps: int = 50, spread_s: float = 10.0, debounce: float = 2.0) -> dict[str, Any]:
    """Condition changes caused by one NIC's link going down and up `flaps` times, spread evenly
    over `spread_s` seconds, with the monitor's `debounce`; ends up, as a flapping cable does
    once it is reseated."""
    if reason := cannot_run():
        return {"skipped": reason}
    with netns() as ns, tempfile.TemporaryDirectory(prefix="bench-nic-health-") as tmp:
        # The NIC's MAC: its RoCE port's default GID is what ties the veth to the rendered function.
        subprocess.run(["ip", "-n", ns, "link", "add", "fl0", "address", "02:00:00:00:00:10", "type", "veth",
                        "peer", "name", "fl0p"], check=True)  # fmt: skip
        subprocess.run(["ip", "-n", ns, "link", "set", "fl0p", "up"], check=True)
        subprocess.run(["ip", "-n", ns, "link", "set", "fl0", "up"], check=True)
        sysfs, dev = Path(tmp) / "sys", Path(tmp) / "dev"
        spec = NicSpec(
            pci_address="0000:10:00.0",
            pcie_root="pci0000:00",
            numa_node=0,
            ifname="fl0",
            mac="02:00:00:00:00:10",
            rdma_device="mlx5_0",
            uverbs_index=0,
        )
        render_nic(spec, sysfs, dev)
        inventory = Inventory()
        inventory.replace("nic", NicDiscovery(sysfs, netns=ns).discover())
        published: list[float] = []
        inventory.subscribe(lambda: published.append(time.monotonic()))
        monitor = NicHealthMonitor(inventory, sysfs_root=sysfs, netns=ns, debounce=debounce)
        monitor.start()
        try:
            monitor.poll()
            with IPRoute(netns=ns, flags=0) as ipr:
                index = ipr.link_lookup(ifname="fl0")[0]
                start = time.monotonic()
                for i in range(2 * flaps):
                    ipr.link("set", index=index, state="down" if i % 2 == 0 else "up")
                    time.sleep(max(0.0, start + (i + 1) * spread_s / (2 * flaps) - time.monotonic()))
                end = time.monotonic()
            seen = _wait(lambda: monitor.link_transitions >= 2 * flaps, timeout=10)
            monitor.poll()
            settled = _wait(monitor.settled, timeout=debounce + 10)
            taints = [f"{t.key}={t.value}" for d in inventory.devices() for t in d.taints]
        finally:
            monitor.stop()
    return {
        "flaps": flaps,
        "spread_s": round(end - start, 3),
        "debounce_s": debounce,
        "netlink_events": monitor.netlink_events,
        "link_transitions": monitor.link_transitions,
        "all_flaps_seen": seen,
        "condition_changes": monitor.condition_changes,
        "inventory_changes": len(published),  # what the slice publisher would be told about
        "settled": settled,
        "taints_after": taints,
    }


def main() -> int:
    logging.basicConfig(level=logging.WARNING)
    json.dump({"flap_condition_changes": bench_flap_condition_changes()}, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
