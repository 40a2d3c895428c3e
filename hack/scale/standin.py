"""The kubelet's part for every node, in a process of its own (`python -m scale.standin CONFIG`).

Upstream's hollow node (`cmd/kubemark`) cannot serve: `cmd/kubemark/app/hollow_node.go` builds its
kubelet with `cm.NewStubContainerManager()`, whose `PrepareDynamicResources` and
`UnprepareDynamicResources` return nil without calling any plugin
(`pkg/kubelet/cm/container_manager_stub.go`), so no DRA driver would ever be called. The stand-in
keeps each Node Ready as the kubelet does (a Lease renewed every 10 s, the status every 5 min),
registers every driver through its registration socket (`sim.kubelet.KubeletSim`), watches the
pods bound to its nodes, GETs each pod's claims, calls NodePrepareResources on the driver's real
socket, marks the pod Running; after a hold it calls NodeUnprepareResources and marks the pod
Succeeded (so the claim controller frees the devices). It says on stdout what the bench waits for
("nodes-ready", "registered N", "done NAMESPACE"), and writes each pod's times at SIGTERM.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import queue
import signal
import sys
import threading
import time
import traceback
import urllib.parse
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from scale.api import Api, ApiError
from sim.kubelet import ClaimRef, KubeletSim

Pod = dict[str, Any]


def now_rfc3339(micro: bool = False) -> str:
    t = datetime.now(UTC)
    return t.strftime("%Y-%m-%dT%H:%M:%S.%fZ") if micro else t.strftime("%Y-%m-%dT%H:%M:%SZ")


def _guard(fn: Callable[[], None]) -> Callable[[], None]:
    """`fn` for a thread of its own: a failure is printed, not lost."""

    def run() -> None:
        try:
            fn()
        except Exception:
            traceback.print_exc()
            sys.stderr.flush()

    return run


class StandIn:
    def __init__(self, cfg: dict[str, Any]) -> None:
        self.cfg = cfg
        self.api = Api.from_kubeconfig(Path(cfg["kubeconfig"]))
        self.nodes: dict[str, dict[str, str]] = cfg["nodes"]  # node -> driver -> registry dir
        self.hold = float(cfg["hold"])
        self.plugins: dict[tuple[str, str], KubeletSim] = {}
        self.pool = ThreadPoolExecutor(max_workers=32, thread_name_prefix="pod")
        self.results: dict[str, dict[str, Any]] = {}
        self.refs: dict[str, dict[str, list[ClaimRef]]] = {}  # pod uid -> driver -> its prepared claims
        self.lock = threading.Lock()
        self.timers: queue.PriorityQueue[tuple[float, int, Pod]] = queue.PriorityQueue()
        self.seq = 0
        self.stopping = threading.Event()

    def run(self) -> None:
        signal.signal(signal.SIGTERM, lambda *_: self.stopping.set())
        self.make_nodes()
        print("nodes-ready", flush=True)
        for target in (self.heartbeats, self.timer_loop, self.watch_pods, self.register_plugins):
            threading.Thread(target=_guard(target), daemon=True, name=target.__name__).start()
        self.stopping.wait()
        Path(self.cfg["results"]).write_text(json.dumps(self.results))
        os._exit(0)

    # Nodes and their heartbeats, as the kubelet keeps them.
    def make_nodes(self) -> None:
        with ThreadPoolExecutor(8) as ex:
            list(ex.map(self.make_node, self.nodes))

    def make_node(self, node: str) -> None:
        labels = {"kubernetes.io/hostname": node, "kubernetes.io/os": "linux", "tandem.dev/enabled": "true"}
        obj = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": node, "labels": labels}}
        with contextlib.suppress(ApiError):
            self.api.request("POST", "/api/v1/nodes", obj)
        self.node_status(node)
        got = self.api.request("GET", f"/api/v1/nodes/{node}")
        owner = {"apiVersion": "v1", "kind": "Node", "name": node, "uid": got["metadata"]["uid"]}
        lease = {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {"name": node, "namespace": "kube-node-lease", "ownerReferences": [owner]},
            "spec": {"holderIdentity": node, "leaseDurationSeconds": 40, "renewTime": now_rfc3339(True)},
        }
        with contextlib.suppress(ApiError):
            self.api.request("POST", "/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases", lease)

    def node_status(self, node: str) -> None:
        t = now_rfc3339()
        res = {"cpu": "192", "memory": "2Ti", "pods": "110"}
        ready = {"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "kubelet stand-in"}
        body = {
            "status": {
                "capacity": res,
                "allocatable": res,
                "conditions": [{**ready, "lastHeartbeatTime": t, "lastTransitionTime": t}],
                "nodeInfo": {"kubeletVersion": "v1.37.2", "operatingSystem": "linux", "architecture": "amd64"},
            }
        }
        self.api.request("PATCH", f"/api/v1/nodes/{node}/status", body, "application/strategic-merge-patch+json")

    def heartbeats(self) -> None:
        last_status = time.monotonic()
        while not self.stopping.wait(10):
            for node in self.nodes:
                with contextlib.suppress(Exception):
                    self.api.request(
                        "PATCH",
                        f"/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/{node}",
                        {"spec": {"renewTime": now_rfc3339(True)}},
                        "application/merge-patch+json",
                    )
            if time.monotonic() - last_status >= 300:
                last_status = time.monotonic()
                for node in self.nodes:
                    with contextlib.suppress(Exception):
                        self.node_status(node)

    # Plugin registration, as the kubelet's plugin watcher finds the registration sockets.
    def register_plugins(self) -> None:
        pending = [(n, d) for n, drivers in self.nodes.items() for d in drivers]
        while pending and not self.stopping.is_set():
            left = []
            for node, driver in pending:
                sim = KubeletSim(Path(self.nodes[node][driver]))
                try:
                    sim.register(sim.wait_for_registration_socket(driver, timeout=0))
                except Exception:
                    left.append((node, driver))
                    continue
                self.plugins[(node, driver)] = sim
            pending = left
            print(f"registered {len(self.plugins)}", flush=True)
            if pending:
                time.sleep(0.5)

    # Pods bound to the nodes.
    def watch_pods(self) -> None:
        sel = urllib.parse.quote("spec.nodeName!=")
        while not self.stopping.is_set():
            listed = self.api.request("GET", f"/api/v1/pods?fieldSelector={sel}")
            for pod in listed["items"]:
                self.on_pod(pod)
            rv = listed["metadata"]["resourceVersion"]
            query = f"watch=1&fieldSelector={sel}&resourceVersion={rv}&allowWatchBookmarks=true&timeoutSeconds=3600"
            try:
                for ev in self.api.watch(f"/api/v1/pods?{query}"):
                    if ev["type"] in ("ADDED", "MODIFIED"):
                        self.on_pod(ev["object"])
            except Exception:
                traceback.print_exc()

    def on_pod(self, pod: Pod) -> None:
        md, spec, status = pod["metadata"], pod["spec"], pod.get("status") or {}
        node = spec.get("nodeName")
        if node not in self.nodes or md.get("deletionTimestamp") or status.get("phase") not in (None, "Pending"):
            return
        uid = md["uid"]
        with self.lock:
            if uid in self.results:
                return
            self.results[uid] = {"name": md["name"], "ns": md["namespace"], "node": node, "bound": time.time()}
        self.pool.submit(_guard(lambda: self.start_pod(pod)))

    def claims_of(self, pod: Pod) -> dict[str, list[ClaimRef]]:
        by_driver: dict[str, list[ClaimRef]] = defaultdict(list)
        ns = pod["metadata"]["namespace"]
        for s in (pod.get("status") or {}).get("resourceClaimStatuses") or []:
            name = s.get("resourceClaimName")
            if not name:
                continue
            claim = self.api.request("GET", f"/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaims/{name}")
            for d in {r["driver"] for r in claim["status"]["allocation"]["devices"]["results"]}:
                by_driver[d].append(ClaimRef(ns, name, claim["metadata"]["uid"]))
        return by_driver

    def start_pod(self, pod: Pod) -> None:
        uid, node = pod["metadata"]["uid"], pod["spec"]["nodeName"]
        rec = self.results[uid]
        rec["prep_start"] = time.time()
        for attempt in range(10):
            try:
                by_driver = self.claims_of(pod)
                rec["drivers"] = sorted(by_driver)
                t0 = time.time()
                for driver, refs in by_driver.items():
                    answers = self.plugins[(node, driver)].prepare(refs)
                    errors = [r.error for r in answers.values() if r.error]
                    if errors:
                        raise RuntimeError("; ".join(errors))
                rec["prep_ms"] = (time.time() - t0) * 1000
                rec["prep_end"] = time.time()
                break
            except Exception as e:
                rec.setdefault("errors", []).append(str(e)[:300])
                print(f"prepare {rec['ns']}/{rec['name']} on {node}: {e}", file=sys.stderr, flush=True)
                time.sleep(min(2.0, 0.2 * 2**attempt))
        else:
            return
        self.set_phase(pod, "Running")
        rec["running"] = time.time()
        with self.lock:
            self.refs[uid] = by_driver
            self.seq += 1
            self.timers.put((time.monotonic() + self.hold, self.seq, pod))

    def timer_loop(self) -> None:
        while not self.stopping.is_set():
            due, seq, pod = self.timers.get()
            delay = due - time.monotonic()
            if delay > 0:
                time.sleep(min(delay, 0.5))
                self.timers.put((due, seq, pod))
                continue
            self.pool.submit(_guard(functools.partial(self.finish_pod, pod)))

    def finish_pod(self, pod: Pod) -> None:
        uid, node = pod["metadata"]["uid"], pod["spec"]["nodeName"]
        rec = self.results[uid]
        t0 = time.time()
        with self.lock:
            refs = self.refs.pop(uid)
        for driver, claims in refs.items():
            errs = self.plugins[(node, driver)].unprepare(claims)
            if any(errs.values()):
                rec.setdefault("errors", []).append(f"unprepare: {errs}")
        rec["unprep_ms"] = (time.time() - t0) * 1000
        self.set_phase(pod, "Succeeded")
        rec["done"] = time.time()
        with self.lock:  # two threads' prints interleave ("done scale-pairdone scale-pair"): one at a time
            print(f"done {rec['ns']}", flush=True)  # the bench counts these instead of listing pods

    def set_phase(self, pod: Pod, phase: str) -> None:
        t = now_rfc3339()
        running = phase == "Running"
        if running:
            state: dict[str, Any] = {"running": {"startedAt": t}}
        else:
            state = {"terminated": {"exitCode": 0, "reason": "Completed", "startedAt": t, "finishedAt": t}}
        ready = "True" if running else "False"
        kinds = (
            ("PodReadyToStartContainers", "True"),
            ("Initialized", "True"),
            ("Ready", ready),
            ("ContainersReady", ready),
        )
        container = {"name": "w", "image": "busybox", "imageID": "", "ready": running, "started": running}
        body = {
            "status": {
                "phase": phase,
                "hostIP": "127.0.0.1",
                "startTime": t,
                "conditions": [{"type": c, "status": s, "lastTransitionTime": t} for c, s in kinds],
                "containerStatuses": [{**container, "restartCount": 0, "state": state}],
            }
        }
        md = pod["metadata"]
        path = f"/api/v1/namespaces/{md['namespace']}/pods/{md['name']}/status"
        self.api.request("PATCH", path, body, "application/strategic-merge-patch+json")


if __name__ == "__main__":
    StandIn(json.loads(Path(sys.argv[1]).read_text())).run()
