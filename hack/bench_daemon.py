"""Benchmarks of the whole daemon process on the simulated node: health latency, flapping, footprint.

* netlink event -> slice: an address added in a test namespace until the slice shows it;
* event -> taint: an XID injected through the simulated NVML until the taint is in the API server's
  ResourceSlice, and until the kubelet's health stream says Unhealthy;
* flapping: ResourceSlice writes caused by a NIC link flapping 50 times in 10 s (sysfs mode), with
  the default debounce and with debounce 0 (then only the publisher's write coalescing limits it);
* footprint: the daemon's CPU time while idle and its resident memory, with 8 GPUs and 8 NICs, then
  its memory across 1,000 prepare/unprepare cycles of 1-GPU claims (a round of 8 concurrent ones
  after every 100), sampled after each 100: a leak shows as growth after the first rounds.

`python hack/bench_daemon.py [--quick]` prints JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench_slices import slice_writes

from demo.node import DRIVER, SimNode, stop_daemon
from sim.apiserver import SimApiServer
from sim.kubelet import ClaimRef, KubeletSim
from sim.nics import render_nic
from sim.nvml import append_event
from sim.profile import NicSpec, NodeProfile, h100_node
from sim.scheduler import Request, allocate, attribute, claim_object, published_devices

XID_EVENT = 0x8


def _wait(pred: Callable[[], bool], timeout: float, step: float = 0.002) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(step)
    return pred()


def _pct(values: Sequence[float], p: float) -> float:
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))] * 1000, 1)


class _Running:
    def __init__(self, srv: SimApiServer, node: SimNode, proc: subprocess.Popen[bytes], kubelet: KubeletSim) -> None:
        self.srv, self.node, self.proc, self.kubelet = srv, node, proc, kubelet

    def taints(self, device: str) -> list[dict[str, Any]]:
        for d in published_devices(self.srv, DRIVER, self.node.profile.name):
            if d["name"] == device:
                return d.get("taints") or []
        return []

    def slice_writes(self) -> int:
        return slice_writes(self.srv)


@contextmanager
def _daemon(profile: NodeProfile, *flags: str, expect: int | None = None) -> Iterator[_Running]:
    root = Path(tempfile.mkdtemp(prefix="tb-"))
    srv = SimApiServer().start()
    try:
        node = SimNode.create(root / "node", profile)
        srv.add_node(profile.name)
        kubeconfig = root / "kubeconfig"
        srv.write_kubeconfig(kubeconfig)
        proc = node.start_daemon(kubeconfig, root / "daemon.log", *flags)
        kubelet = KubeletSim(node.registry)
        kubelet.register(kubelet.wait_for_registration_socket(DRIVER, timeout=60))
        want = len(profile.gpus) + len(profile.nics) if expect is None else expect
        if not srv.wait_for(lambda: len(published_devices(srv, DRIVER, profile.name)) >= want, 60):
            raise RuntimeError("devices not published")
        try:
            yield _Running(srv, node, proc, kubelet)
        finally:
            kubelet.close()
            stop_daemon(proc)
    finally:
        srv.stop()
        shutil.rmtree(root, ignore_errors=True)


def bench_event_to_taint(events: int = 8) -> dict[str, Any]:
    """An XID on a different GPU each time, one second apart (isolated events, not a burst: a burst
    is coalesced by design); the quiet period is long, so each taint stays."""
    profile = h100_node("bench-health", gpus=events, nics=0)
    with _daemon(profile, "--device-kinds", "gpu", "--health-quiet-period", "3600") as d:
        watch = d.kubelet.watch_health("v1")
        watch.next(timeout=30)
        api, stream = [], []
        for i, gpu in enumerate(profile.gpus):
            name = f"gpu-{gpu.minor}"
            seen: list[float] = []

            def on_stream(name: str = name, seen: list[float] = seen) -> None:
                watch.wait_for(lambda s: any(r.device == name and r.health == "UNHEALTHY" for r in s), 10)
                seen.append(time.monotonic())

            def tainted(name: str = name) -> bool:
                return bool(d.taints(name))

            waiter = threading.Thread(target=on_stream)
            waiter.start()
            t0 = time.monotonic()
            append_event(d.node.root / "nvml-state.json", gpu.uuid, XID_EVENT, 48)
            if not _wait(tainted, 10):
                raise RuntimeError(f"taint of event {i} never appeared")
            api.append(time.monotonic() - t0)
            waiter.join(15)
            stream.append(seen[0] - t0)
            time.sleep(1.0)
        watch.cancel()
    return {
        "events": events,
        "to_taint_in_api_ms": {"p50": _pct(api, 50), "max": _pct(api, 100)},
        "to_health_stream_ms": {"p50": _pct(stream, 50), "max": _pct(stream, 100)},
    }


def bench_flapping(flaps: int = 50, seconds: float = 10.0, debounce: float = 2.0) -> dict[str, Any]:
    profile = h100_node("bench-flap", gpus=0, nics=1)
    nic = profile.nics[0]
    with _daemon(profile, "--device-kinds", "nic", "--link-debounce", str(debounce)) as d:
        base = d.slice_writes()
        net = d.node.sysfs / "class/net" / nic.ifname
        gap = seconds / (2 * flaps)
        for _ in range(flaps):
            (net / "operstate").write_text("down\n")
            (net / "carrier").write_text("0\n")
            time.sleep(gap)
            (net / "operstate").write_text("up\n")
            (net / "carrier").write_text("1\n")
            time.sleep(gap)
        time.sleep(max(3.0, 2 * debounce + 1))  # let any pending condition settle and be published
        writes = d.slice_writes() - base
    return {"flaps": flaps, "seconds": seconds, "debounce_s": debounce, "slice_writes": writes}


def bench_nic_event_to_slice(changes: int = 10) -> dict[str, Any]:
    """An address added with `ip` in a test namespace until the slice shows it (real netlink; root)."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return {"skipped": "needs root and iproute2 for a network namespace"}
    ns = f"tandem-bench-{os.getpid()}"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    root = Path(tempfile.mkdtemp(prefix="tb-"))
    try:

        def ip(*args: str) -> None:
            subprocess.run(["ip", "-n", ns, *args], check=True)

        ip("link", "add", "ens1f0np0", "address", "02:00:00:00:00:01", "type", "veth", "peer", "name", "peer0")
        ip("link", "set", "peer0", "up")
        ip("link", "set", "ens1f0np0", "up")
        spec = NicSpec(pci_address="0000:8a:00.0", pcie_root="pci0000:80", numa_node=0, ifname="ens1f0np0",
                       mac="02:00:00:00:00:01", rdma_device="mlx5_0", uverbs_index=0)  # fmt: skip
        render_nic(spec, root / "sys", root / "dev")
        flags = ("--device-kinds", "nic", "--netns", ns, "--nic-link-source", "netlink",
                 "--sysfs-root", str(root / "sys"), "--dev-root", str(root / "dev"))  # fmt: skip
        with _daemon(NodeProfile(name="bench-nic"), *flags, expect=1) as d:
            times = []
            for i in range(changes):
                address = f"192.0.2.{i + 1}/24"

                def reached(address: str = address) -> bool:
                    return _ipv4(d) == address

                t0 = time.monotonic()
                ip("addr", "add", address, "dev", "ens1f0np0")
                if not _wait(reached, 10):
                    raise RuntimeError("address change never reached the slice")
                times.append(time.monotonic() - t0)
                ip("addr", "del", address, "dev", "ens1f0np0")
                _wait(lambda: _ipv4(d) is None, 10)
                time.sleep(1.0)
        return {"changes": changes, "p50_ms": _pct(times, 50), "max_ms": _pct(times, 100)}
    finally:
        subprocess.run(["ip", "netns", "del", ns], check=False)
        shutil.rmtree(root, ignore_errors=True)


def _ipv4(d: _Running) -> str | None:
    for dev in published_devices(d.srv, DRIVER, d.node.profile.name):
        return (dev.get("attributes", {}).get("ipv4") or {}).get("string")
    return None


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _rss_mib(pid: int) -> float:
    return round(_status_kib(pid, "VmRSS") / 1024, 1)


def bench_footprint(seconds: float = 60.0, cycles: int = 1000) -> dict[str, Any]:
    profile = h100_node("bench-idle", gpus=8, nics=8)
    # h100_node puts NICs on the GPUs' roots; 8 NICs need their own bus numbers.
    for j, nic in enumerate(profile.nics):
        nic.pci_address = f"0000:{0xD0 + j:02x}:00.0"
    with _daemon(profile) as d:
        time.sleep(3)  # start-up work (first discovery, publish) is not idle time
        pid = d.proc.pid
        cpu0, t0 = _cpu_seconds(pid), time.monotonic()
        time.sleep(seconds)
        cpu = _cpu_seconds(pid) - cpu0
        wall = time.monotonic() - t0
        idle_rss = _rss_mib(pid)
        rss_by_cycle = _cycle_memory(d, cycles)
        return {
            "devices": 16,
            "idle_seconds": round(wall, 1),
            "idle_cpu_percent": round(100 * cpu / wall, 2),
            "rss_mib": idle_rss,
            "rss_mib_after_cycles": rss_by_cycle,
            "rss_growth_mib_after_first_100": round(
                rss_by_cycle[max(rss_by_cycle)] - rss_by_cycle[min(rss_by_cycle)], 1
            ),
            "rss_peak_mib": round(_status_kib(pid, "VmHWM") / 1024, 1),
        }


GREY_OFF = (
    "--grey-threshold",
    "period=1000000",
    "--grey-threshold",
    "window=2000000",
    "--grey-threshold",
    "rising-reads=1",
)


def _idle_cpu(profile: NodeProfile, seconds: float, *flags: str) -> float:
    """Percent of a core the daemon spends idle over `seconds`, after its start-up work."""
    with _daemon(profile, *flags) as d:
        time.sleep(3)  # start-up work (first discovery, publish, first grey round) is not idle time
        cpu0, t0 = _cpu_seconds(d.proc.pid), time.monotonic()
        time.sleep(seconds)
        return 100 * (_cpu_seconds(d.proc.pid) - cpu0) / (time.monotonic() - t0)


def bench_grey_idle_cost(seconds: float = 120.0) -> dict[str, Any]:
    """What the grey-failure reads cost an idle 8-GPU + 8-NIC node: the daemon idle with them off
    (a period longer than the run), at their default period (30 s), and at a period of 1 s, which
    gives the cost of one round with little noise; off and default alternate twice."""
    profile = h100_node("bench-grey", gpus=8, nics=8)
    for j, nic in enumerate(profile.nics):
        nic.pci_address = f"0000:{0xD0 + j:02x}:00.0"
    off = [_idle_cpu(profile, seconds, *GREY_OFF) for _ in range(2)]
    default = [_idle_cpu(profile, seconds) for _ in range(2)]
    fast_flags = ("--grey-threshold", "period=1")
    fast = _idle_cpu(profile, seconds / 2, *fast_flags)
    per_round_ms = 10 * (fast - statistics.mean(off))  # percent of a core at one round a second
    return {
        "idle_seconds_each": seconds,
        "grey_off_cpu_percent": [round(v, 3) for v in off],
        "grey_default_cpu_percent": [round(v, 3) for v in default],
        "increase_percent_of_a_core": round(statistics.mean(default) - statistics.mean(off), 3),
        "grey_every_1s_cpu_percent": round(fast, 3),
        "one_round_ms": round(per_round_ms, 2),
        "one_round_at_30s_percent_of_a_core": round(per_round_ms / 30 / 10, 4),
    }


def _cycle_memory(d: _Running, cycles: int, every: int = 100, concurrent: int = 8) -> dict[int, float]:
    """RSS (MiB) after every `every` prepare/unprepare cycles, each block followed by a round of
    `concurrent` claims prepared at once (one per GPU), as pods starting together."""
    gpu = Request("gpu", "gpu.tandem.dev", lambda dev: attribute(dev, "type") == "gpu")
    node, counter, out = d.node.profile.name, 0, {}

    def claims(n: int, distinct: bool) -> list[ClaimRef]:
        nonlocal counter
        refs, taken = [], set[str]()
        for _ in range(n):
            counter += 1
            claim = d.srv.create(claim_object("default", f"fp-{counter}", [gpu]))
            claim = allocate(d.srv, claim, DRIVER, node, [gpu], taken=taken if distinct else None)
            taken |= {r["device"] for r in claim["status"]["allocation"]["devices"]["results"]}
            refs.append(ClaimRef("default", f"fp-{counter}", claim["metadata"]["uid"]))
        return refs

    def cycle(refs: list[ClaimRef]) -> None:
        for uid, result in d.kubelet.prepare(refs).items():
            if result.error:
                raise RuntimeError(f"prepare of {uid} failed: {result.error}")
        if any(d.kubelet.unprepare(refs).values()):
            raise RuntimeError("unprepare failed")
        for ref in refs:
            d.srv.delete("resourceclaims", ref.name, ref.namespace)

    with ThreadPoolExecutor(concurrent) as pool:
        for done in range(every, cycles + 1, every):
            for ref in claims(every, distinct=False):
                cycle([ref])
            list(pool.map(lambda ref: cycle([ref]), claims(concurrent, distinct=True)))
            out[done] = _rss_mib(d.proc.pid)
    return out


def _status_kib(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    out = {
        "event_to_taint": bench_event_to_taint(),
        "nic_address_to_slice": bench_nic_event_to_slice(),
        "flapping_debounced": bench_flapping(),
        "flapping_no_debounce": bench_flapping(debounce=0.0),
        "footprint": bench_footprint(10 if args.quick else 60, 200 if args.quick else 1000),
    }
    json.dump(out, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
