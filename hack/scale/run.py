"""The scale bench's run: the control plane from the launcher, N simulated nodes each with Tandem
and the Go reference driver, the kubelet stand-in, and the measuring windows (idle, the two
workloads' churn, idle again). The package docstring says what is measured and why so.

    .venv/bin/python hack/bench.py --only scale [--quick]     (TANDEM_SCALE_NODES=N for fewer nodes)
    PYTHONPATH=hack .venv/bin/python -m scale.run [--quick] [--nodes N] [--pods N] [--rate R] [--keep]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import bench_reference

from scale.control_plane import ControlPlane
from scale.drivers import Drivers, log
from scale.measure import Sampler, apiserver_requests, audit_counts, pct
from scale.objects import DRIVER, GPUS, NICS, PATHS, REF, pod_object, ref_devices, ref_objects, template
from scale.procs import mem_kib, stop, succeeds, wait_until
from scale.slices import SliceWatch

HACK = Path(__file__).resolve().parents[1]
REPO = HACK.parent
WORKLOADS = ("pair", "gpu")


@dataclass
class Plan:
    nodes: int = 100
    pods: int = 1000  # per workload, alternating between the two drivers
    rate: float = 5.0  # pods created per second
    hold: float = 5.0  # seconds a pod runs before it Succeeds
    idle: float = 60.0


class StandInProcess:
    """The kubelet stand-in (scale.standin) and what it says: registrations, pods done."""

    def __init__(self, state: Path, kubeconfig: Path, nodes: dict[str, dict[str, str]], hold: float) -> None:
        self.results = state / "standin-results.json"
        cfg = {"kubeconfig": str(kubeconfig), "nodes": nodes, "hold": hold, "results": str(self.results)}
        (state / "standin.json").write_text(json.dumps(cfg))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HACK), str(REPO)])}
        with open(state / "logs" / "standin.log", "ab") as err:
            self.popen = subprocess.Popen(
                [sys.executable, "-m", "scale.standin", str(state / "standin.json")],
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                env=env,
                start_new_session=True,
            )
        self.cond = threading.Condition()
        self.last: dict[str, str] = {}  # the last line of each kind but "done"
        self.done: Counter[str] = Counter()  # pods Succeeded, by namespace
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.popen.stdout
        for line in self.popen.stdout:
            kind, _, rest = line.strip().partition(" ")
            with self.cond:
                if kind == "done":
                    self.done[rest] += 1
                else:
                    self.last[kind] = rest
                self.cond.notify_all()

    def wait(self, what: str, pred: Callable[[], bool], timeout: float) -> None:
        with self.cond:
            if not self.cond.wait_for(pred, timeout):
                raise TimeoutError(f"the kubelet stand-in: {what} not within {timeout} s")

    def results_by_pod(self) -> dict[tuple[str, str], dict[str, Any]]:
        """Each pod's times, once the stand-in has stopped and written them."""
        self.popen.send_signal(signal.SIGTERM)
        self.popen.wait(60)
        results: dict[str, dict[str, Any]] = json.loads(self.results.read_text())
        return {(r["ns"], r["name"]): r for r in results.values()}


class ScaleBench:
    def __init__(self, plan: Plan, state: Path, refdriver: Path) -> None:
        self.plan, self.state = plan, state
        self.cp = ControlPlane(state)
        self.nodes = [f"scale-node-{i:03d}" for i in range(plan.nodes)]
        self.drivers = Drivers(state, self.nodes, refdriver)
        self.standin: StandInProcess | None = None
        self.created: dict[tuple[str, str], tuple[float, str]] = {}  # (ns, pod) -> (created, driver)
        self.out: dict[str, Any] = {"plan": asdict(plan)}

    def run(self) -> dict[str, Any]:
        t = time.monotonic()
        api = self.api = self.cp.up()
        for obj in ref_objects():
            api.request("POST", PATHS[obj["kind"]], obj)
        log(f"control plane up in {time.monotonic() - t:.0f} s; rendering {len(self.nodes)} simulated nodes")
        self.drivers.render_nodes()
        registries = {n: self.drivers.registries(n) for n in self.nodes}
        standin = self.standin = StandInProcess(
            self.state, self.cp.state / "pki" / "admin.kubeconfig", registries, self.plan.hold
        )
        standin.wait("nodes-ready", lambda: "nodes-ready" in standin.last, 120)
        wait_until("nodes Ready and untainted", 120, self.nodes_ready, self.cp.procs, every=1)
        self.drivers.tokens(api)
        slices = SliceWatch(api)
        # Tandem: every instance at once; then the Go driver with the devices Tandem published.
        slices.expect(DRIVER, self.nodes, GPUS + NICS)
        self.out["start"] = {DRIVER: self.drivers.start_all(DRIVER, slices)}
        for node in self.nodes:
            self.drivers.write_ref_devices(node, ref_devices(slices.node_devices(DRIVER, node)))
        slices.expect(REF, self.nodes, GPUS + NICS)
        self.out["start"][REF] = self.drivers.start_all(REF, slices)
        want = 2 * len(self.nodes)
        standin.wait("every driver registered", lambda: int(standin.last.get("registered", 0)) >= want, 300)
        procs = self.drivers.procs
        groups = {
            "tandem_total": [p.pid for p in procs[DRIVER].values()],
            "go_total": [p.pid for p in procs[REF].values()],
            **{n: [p.pid] for n, p in self.cp.procs.items()},
            "kubelet_standin": [standin.popen.pid],
        }
        self.sampler = Sampler(groups)
        self.out["idle"] = self.window("idle", lambda: self.sleep(self.plan.idle))
        for workload in WORKLOADS:
            self.out[workload] = self.window(workload, functools.partial(self.churn, workload))
        self.out["idle_after"] = self.window("idle_after", lambda: self.sleep(min(30.0, self.plan.idle)))
        self.collect_latencies(standin.results_by_pod())
        return self.out

    def nodes_ready(self) -> bool:
        items = self.api.request("GET", "/api/v1/nodes?labelSelector=tandem.dev%2Fenabled%3Dtrue")["items"]
        ready = [n for n in items if not n["spec"].get("taints") and _ready(n)]
        return len(ready) >= len(self.nodes)

    def sleep(self, secs: float) -> dict[str, Any]:
        time.sleep(secs)  # an idle window: nothing to wait for, by design
        return {}

    def window(self, name: str, body: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        log(f"window {name}")
        a, wall0, req0 = self.sampler.mark(), time.time(), apiserver_requests(self.api)
        extra = body()
        b, wall1, req1 = self.sampler.mark(), time.time(), apiserver_requests(self.api)
        out = self.sampler.between(a, b)
        out["apiserver_requests_per_s"] = round((req1 - req0) / (wall1 - wall0), 1)
        time.sleep(2)  # the audit log is written in batches (about 1 s)
        out["driver_requests"] = audit_counts(self.state / "audit.log", wall0, wall1)
        n = len(self.nodes)
        for key, driver in (("tandem", DRIVER), ("go", REF)):
            rss, pss = map(sum, zip(*(mem_kib(p.pid) for p in self.drivers.procs[driver].values()), strict=True))
            cores = out["cpu_cores"][f"{key}_total"]
            out[f"{key}_memory"] = {
                "rss_total_mib": rss // 1024,
                "pss_total_mib": pss // 1024,
                "rss_per_instance_mib": round(rss / n / 1024, 1),
            }
            out[f"{key}_cpu_per_instance_pct_core"] = round(100 * cores / n, 3)
        out.update(extra)
        return out

    def churn(self, workload: str) -> dict[str, Any]:
        """Pods of `workload` created at the plan's steady rate, alternating between the drivers,
        until every one has Succeeded."""
        ns = f"scale-{workload}"
        self.api.request(
            "POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}}
        )
        sa = f"/api/v1/namespaces/{ns}/serviceaccounts/default"
        wait_until("the default service account", 60, lambda: succeeds(lambda: self.api.request("GET", sa)))
        for driver in (DRIVER, REF):
            self.api.request(
                "POST", f"/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaimtemplates", template(driver, workload)
            )
        t0 = time.monotonic() + 0.5
        wall_off = time.time() - time.monotonic()

        def create(i: int) -> None:
            # Alternating ABBA, not ABAB: in strict alternation each driver's pods always follow
            # the other's by the same interval, and whatever recurs with that phase (the claim
            # controller's or the scheduler's work for the previous pod) falls on one driver only.
            driver = (DRIVER, REF, REF, DRIVER)[i % 4]
            name = f"{workload}-{i:05d}"
            delay = t0 + i / self.plan.rate - time.monotonic()
            if delay > 0:
                time.sleep(delay)  # the steady creation schedule
            tc = time.monotonic() + wall_off
            pod = pod_object(name, f"{workload}-{driver.replace('.', '-')}", driver)
            self.api.request("POST", f"/api/v1/namespaces/{ns}/pods", pod)
            self.created[(ns, name)] = (tc, driver)

        with ThreadPoolExecutor(8) as ex:
            list(ex.map(create, range(self.plan.pods)))
        create_s = time.monotonic() - t0
        # Until every pod Succeeded (the stand-in ran it, held it and released its claims).
        assert self.standin
        standin = self.standin
        standin.wait(f"{workload} pods done", lambda: standin.done[ns] >= self.plan.pods, 600)
        return {"pods": self.plan.pods, "create_rate_per_s": round(self.plan.pods / create_s, 1)}

    def collect_latencies(self, by_pod: dict[tuple[str, str], dict[str, Any]]) -> None:
        for workload in WORKLOADS:
            ns = f"scale-{workload}"
            per: dict[str, dict[str, list[float]]] = {d: {} for d in (DRIVER, REF)}
            missing: Counter[str] = Counter()
            bound_times, errors = [], 0
            created = {name: v for (n, name), v in self.created.items() if n == ns}
            for name, (tc, driver) in created.items():
                r = by_pod.get((ns, name))
                if r is None or "running" not in r:
                    missing[driver] += 1
                    continue
                errors += bool(r.get("errors"))
                bound_times.append(r["bound"])
                figures = {
                    "bound_ms": (r["bound"] - tc) * 1000,
                    "running_ms": (r["running"] - tc) * 1000,
                    "prepare_ms": r["prep_ms"],
                    "standin_wait_ms": (r["prep_start"] - r["bound"]) * 1000,
                    "status_patch_ms": (r["running"] - r["prep_end"]) * 1000,
                    "unprepare_ms": r.get("unprep_ms", 0),
                }
                for key, value in figures.items():
                    per[driver].setdefault(key, []).append(value)
            first = min(tc for tc, _ in created.values())
            out = self.out[workload]
            out["scheduling_pods_per_s"] = (
                round(len(bound_times) / (max(bound_times) - first), 1) if bound_times else None
            )
            out["pods_with_retried_prepare"] = errors
            for d, m in per.items():
                out[d] = {k: {"p50": pct(v, 0.5), "p99": pct(v, 0.99), "n": len(v)} for k, v in m.items()}
                out[d]["missing"] = missing[d]
            t, g = (out[d].get("running_ms", {}).get("p99") for d in (DRIVER, REF))
            out["running_p99_tandem_over_go"] = round(t / g, 2) if t and g else None

    def close(self) -> None:
        if self.standin:
            stop(self.standin.popen)
        for group in self.drivers.procs.values():
            with ThreadPoolExecutor(16) as ex:
                list(ex.map(lambda p: stop(p.popen, 20) if p.popen else None, group.values()))
        self.cp.down()


def _ready(node: dict[str, Any]) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in node["status"].get("conditions", []))


def bench_scale(
    quick: bool, nodes: int | None = None, pods: int | None = None, rate: float | None = None, keep: bool = False
) -> dict[str, Any]:
    """The `scale` section of hack/bench.py."""
    n = nodes or int(os.environ.get("TANDEM_SCALE_NODES", "10" if quick else "100"))
    plan = Plan(
        nodes=n,
        pods=200 if quick else 1000,
        rate=4.0 if quick else 5.0,
        hold=3.0 if quick else 5.0,
        idle=20.0 if quick else 60.0,
    )
    plan.pods = pods or plan.pods
    plan.rate = rate or plan.rate
    binary, why = bench_reference.build_reference()
    if binary is None:
        return {"skipped": f"the Go reference driver: {why}"}
    state = Path(tempfile.mkdtemp(prefix="tandem-scale-"))
    bench = ScaleBench(plan, state, binary)
    t0, load0 = time.monotonic(), Path("/proc/loadavg").read_text().split()[:3]
    try:
        out = bench.run()
    finally:
        bench.close()
        if keep:
            log(f"state kept in {state}")
        else:
            shutil.rmtree(state, ignore_errors=True)
    out["machine"] = {
        "cores": os.cpu_count(),
        "loadavg_before": load0,
        "loadavg_after": Path("/proc/loadavg").read_text().split()[:3],
        "wall_s": round(time.monotonic() - t0),
    }
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--nodes", type=int)
    p.add_argument("--pods", type=int, help="pods per workload (half for each driver)")
    p.add_argument("--rate", type=float, help="pods created per second")
    p.add_argument("--keep", action="store_true", help="keep the state directory (logs, audit log)")
    a = p.parse_args()
    json.dump(bench_scale(a.quick, a.nodes, a.pods, a.rate, a.keep), sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
