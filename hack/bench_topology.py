"""Discovery with the HGX board's PCIe switch trees: 8 GPUs and 8 NICs behind 4 switches, the NICs'
netdevs among 1,000 other netdevs in a throwaway network namespace.

Functions, not tests: hack/bench.py calls them; `python hack/bench_topology.py` prints the result
as JSON. Needs root (network namespaces); without it, {"skipped": reason}. The NICs' netdevs are
veths with the NICs' MACs, which the rendered sysfs maps to their PCI functions as a node's sysfs
maps a ConnectX netdev in another namespace (by the RoCE port's default GID).
"""

from __future__ import annotations

import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_nic import _ip_batch, cannot_run, netns

from driver.discovery.gpu.discover import GpuDiscovery
from driver.discovery.nic.discover import NicDiscovery
from driver.discovery.topology import topology
from sim import nvml as sim_nvml
from sim.profile import h100_node
from sim.sysfs import render_node


def _ms(times: list[float]) -> dict[str, float]:
    return {"median_ms": round(statistics.median(times) * 1000, 2), "max_ms": round(max(times) * 1000, 2)}


def bench_topology_discovery(gpus: int = 8, nics: int = 8, other_netdevs: int = 1000, runs: int = 10) -> dict[str, Any]:
    """Full GPU and NIC discovery passes, and the topology reading alone (path, switch, NUMA)."""
    if reason := cannot_run():
        return {"skipped": reason}
    profile = h100_node("bench-topo", gpus=gpus, nics=nics)
    with netns() as ns, tempfile.TemporaryDirectory(prefix="bench-topo-") as tmp:
        root = Path(tmp)
        render_node(profile, root / "sys", root / "dev", root / "proc")
        for nic in profile.nics:  # in another namespace: the kernel shows no netdev entry for it
            entry = root / "sys" / "class" / "net" / nic.ifname
            shutil.rmtree(entry.resolve())
            entry.unlink()
        lines = [f"link add o{i} type veth peer name o{i}p" for i in range(other_netdevs // 2)]
        for nic in profile.nics:
            lines += [f"link add {nic.ifname} address {nic.mac} type veth peer name {nic.ifname}p"]
            lines += [f"link set {nic.ifname}p up", f"link set {nic.ifname} up"]
        _ip_batch(ns, lines)
        state = root / "nvml.json"
        sim_nvml.write_state(profile, state)
        bdfs = [g.pci_bus_id for g in profile.gpus] + [n.pci_address for n in profile.nics]
        with sim_nvml.fake_pynvml_in_process(state):
            gpu_discovery = GpuDiscovery(root / "sys", proc_root=root / "proc")
            nic_discovery = NicDiscovery(root / "sys", netns=ns, proc_root=root / "proc")
            found = (len(gpu_discovery.discover()), len(nic_discovery.discover()))  # warm-up
            switches = {topology(root / "sys", b, False).attributes.get("pcieSwitch") for b in bdfs}
            gpu_times, nic_times, topo_times = [], [], []
            for _ in range(runs):
                t0 = time.perf_counter()
                gpu_discovery.discover()
                t1 = time.perf_counter()
                nic_discovery.discover()
                t2 = time.perf_counter()
                for b in bdfs:
                    topology(root / "sys", b, True)
                t3 = time.perf_counter()
                gpu_times.append(t1 - t0)
                nic_times.append(t2 - t1)
                topo_times.append(t3 - t2)
    return {
        "gpus_found": found[0],
        "nics_found": found[1],
        "switches": len(switches - {None}),
        "netdevs": other_netdevs + 2 * nics + 1,
        "runs": runs,
        "gpu_discovery": _ms(gpu_times),
        "nic_discovery": _ms(nic_times),
        "topology_of_16_devices": _ms(topo_times),
    }


if __name__ == "__main__":
    json.dump(bench_topology_discovery(runs=int(sys.argv[1]) if len(sys.argv) > 1 else 10), sys.stdout, indent=2)
    print()
