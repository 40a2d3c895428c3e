"""The two drivers on every node: each node's simulated hardware and directories, tokens bound to
its Node, and all N instances of one driver started at once, timed until every node's devices are
published."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from demo.node import SimNode
from scale.api import Api, write_token_kubeconfig
from scale.measure import pct
from scale.objects import DRIVER, GPUS, NAMESPACE, NICS, REF, REF_NAMES
from scale.procs import Proc, cpu_s, spawn
from scale.slices import SliceWatch
from sim.profile import h100_node

REPO = Path(__file__).resolve().parents[2]


def log(msg: str) -> None:
    print(f"# scale {time.strftime('%H:%M:%S')} {msg}", file=sys.stderr, flush=True)


def image_like() -> dict[str, str]:
    """Tandem started from this checkout as the image starts it: with its modules' bytecode compiled
    (pip compiles at install; without it every instance compiles the whole driver again, 0.3 CPU-s,
    when PYTHONDONTWRITEBYTECODE is set as here) and its commit in TANDEM_COMMIT (the image's
    build arg; otherwise every instance asks git). Returns the environment to add."""
    fake_nvml = REPO / "sim" / "fake_pynvml"
    compile_all = [sys.executable, "-m", "compileall", "-q", "driver", "cdi", str(fake_nvml)]
    subprocess.run(compile_all, cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=False)
    return {"TANDEM_COMMIT": head.stdout.strip()} if head.returncode == 0 else {}


class Drivers:
    def __init__(self, state: Path, nodes: list[str], refdriver: Path) -> None:
        self.state, self.nodes, self.refdriver = state, nodes, refdriver
        self.ref_name = {node: REF_NAMES[i % 2] for i, node in enumerate(nodes)}  # REF_NAMES says why
        self.sim: dict[str, SimNode] = {}
        self.procs: dict[str, dict[str, Proc]] = {DRIVER: {}, REF: {}}

    def node_dir(self, node: str) -> Path:
        return self.state / "nodes" / node

    def registries(self, node: str) -> dict[str, str]:
        """Each driver's registration directory on `node`, by its name there (the stand-in's view)."""
        d = self.node_dir(node)
        return {DRIVER: str(d / "registry"), self.ref_name[node]: str(d / "ref" / "registry")}

    def render_nodes(self) -> None:
        for node in self.nodes:
            self.sim[node] = SimNode.create(self.node_dir(node), h100_node(node, GPUS, NICS))
            for d in ("registry", "plugins", "cdi"):
                (self.node_dir(node) / "ref" / d).mkdir(parents=True, exist_ok=True)

    def tokens(self, api: Api) -> None:
        """Each instance's token, of its driver's service account and bound to its Node."""

        def one(node: str) -> None:
            uid = api.request("GET", f"/api/v1/nodes/{node}")["metadata"]["uid"]
            for driver, sa in ((DRIVER, "tandem-driver"), (REF, "ref-driver")):
                bound = {"kind": "Node", "apiVersion": "v1", "name": node, "uid": uid}
                req = {
                    "apiVersion": "authentication.k8s.io/v1",
                    "kind": "TokenRequest",
                    "spec": {"expirationSeconds": 86400, "boundObjectRef": bound},
                }
                tok = api.request("POST", f"/api/v1/namespaces/{NAMESPACE}/serviceaccounts/{sa}/token", req)
                path = self.node_dir(node) / ("kubeconfig" if driver == DRIVER else "ref/kubeconfig")
                write_token_kubeconfig(path, api, tok["status"]["token"])

        with ThreadPoolExecutor(8) as ex:
            list(ex.map(one, self.nodes))

    def write_ref_devices(self, node: str, devices: list[dict[str, Any]]) -> None:
        (self.node_dir(node) / "ref" / "devices.json").write_text(json.dumps(devices))

    def _start(self, driver: str, node: str, as_in_image: dict[str, str]) -> Proc:
        d = self.node_dir(node)
        if driver == DRIVER:
            sim = self.sim[node]
            path = os.pathsep.join([sim.env["PYTHONPATH"], str(REPO)])
            env = {**os.environ, **sim.env, **as_in_image, "PYTHONPATH": path}
            return spawn(f"tandem-{node}", sim.daemon_args(d / "kubeconfig"), d / "tandem.log", env)
        r = d / "ref"
        args = [str(self.refdriver), "-mode", "tandem-work", "-driver-name", self.ref_name[node], "-node-name", node]
        args += ["-kubeconfig", str(r / "kubeconfig"), "-kubelet-registrar-dir", str(r / "registry")]
        args += ["-kubelet-plugins-dir", str(r / "plugins"), "-cdi-root", str(r / "cdi")]
        args += ["-devices-file", str(r / "devices.json"), "-checkpoint-fsync=false"]
        return spawn(f"go-{node}", args, r / "refdriver.log")

    def start_all(self, driver: str, slices: SliceWatch) -> dict[str, Any]:
        """Every instance of `driver` at once, until every node's slices are published."""
        log(f"starting {len(self.nodes)} instances of {driver}")
        procs = self.procs[driver]
        as_in_image = image_like() if driver == DRIVER else {}
        t0 = time.monotonic()
        for node in self.nodes:
            procs[node] = self._start(driver, node, as_in_image)
        spawned = time.monotonic() - t0
        try:
            slices.wait(driver, self.nodes, 600)
        finally:
            dead = [n for n, p in procs.items() if p.exited()]
            if dead:
                log(f"{driver}: {len(dead)} instances exited, e.g. {dead[0]}")
        per = [slices.complete[(driver, n)] - procs[n].started for n in self.nodes]
        cpu = [cpu_s(procs[n].pid) for n in self.nodes]
        return {
            # CPU each instance spent from its start until all were published: how many cores a
            # start of all N at once needs to publish within a given time.
            "cpu_s_per_instance_to_published": round(statistics.mean(cpu), 2),
            "all_published_s": round(max(slices.complete[(driver, n)] for n in self.nodes) - t0, 1),
            "spawn_all_s": round(spawned, 1),
            "per_instance_start_to_published_s": {"p50": pct(per, 0.5), "max": round(max(per), 1)},
        }
