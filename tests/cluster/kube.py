"""The real cluster of hack/cluster.sh, as the end-to-end tests see it: kubectl, objects, waiting.

Everything goes through kubectl with the cluster's admin kubeconfig, as a user would; answers are
parsed from `-o json`. Waiting is deadline polling that says what it waited for and what it saw
last, so a failure explains itself.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import waiting
import yaml

from sim.nvml import STATE_ENV

REPO = Path(__file__).resolve().parents[2]
CLUSTER_SH = REPO / "hack" / "cluster.sh"
DRIVER = "tandem.dev"
# The venv's tandemctl; imported from here, not from conftest (pytest's `conftest` module is
# whichever folder's was loaded last).
TANDEMCTL = str(Path(sys.executable).parent / "tandemctl")
T = TypeVar("T")


class KubectlError(RuntimeError):
    pass


def cluster_env() -> dict[str, str] | None:
    """KUBECONFIG, PATH and TANDEM_TEST_IMAGE from `hack/cluster.sh env`; None when it is not built."""
    proc = subprocess.run([str(CLUSTER_SH), "env"], capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        return None
    env = dict(os.environ)
    for line in proc.stdout.splitlines():
        key, _, value = line.removeprefix("export ").partition("=")
        env[key] = value.replace("$PATH", os.environ.get("PATH", ""))
    return env


@dataclass
class Cluster:
    env: dict[str, str]
    node_name: str = "tandem-node"
    state: Path = Path(os.environ.get("TANDEM_CLUSTER_STATE", "/var/lib/tandem-cluster"))
    image: str = field(init=False)

    def __post_init__(self) -> None:
        self.image = self.env["TANDEM_TEST_IMAGE"]

    def kubectl(self, *args: str, stdin: str | None = None, check: bool = True, timeout: float = 120) -> str:
        proc = subprocess.run(
            ["kubectl", *args], input=stdin, capture_output=True, text=True, timeout=timeout, env=self.env
        )
        if check and proc.returncode != 0:
            raise KubectlError(f"kubectl {' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()}")
        return proc.stdout

    def apply(self, *objects: dict[str, Any] | Iterable[dict[str, Any]], namespace: str = "") -> None:
        docs: list[dict[str, Any]] = []
        for o in objects:
            docs.extend([o] if isinstance(o, dict) else o)
        self.kubectl("apply", *(["-n", namespace] if namespace else []), "-f", "-", stdin=yaml.safe_dump_all(docs))

    def get(self, kind: str, name: str = "", namespace: str = "", selector: str = "") -> Any:
        """One object (or None if it does not exist) by name; a list of items without a name."""
        args = ["get", kind, "-o", "json"]
        if name:
            args.insert(2, name)
        if namespace:
            args += ["-n", namespace]
        if selector:
            args += ["--field-selector", selector]
        proc = subprocess.run(["kubectl", *args], capture_output=True, text=True, timeout=60, env=self.env)
        if proc.returncode != 0:
            if "NotFound" in proc.stderr:
                return None
            raise KubectlError(f"kubectl {' '.join(args)}: {proc.stderr.strip()}")
        obj = json.loads(proc.stdout)
        return obj if name else obj["items"]

    def slices(self) -> list[dict[str, Any]]:
        return self.get("resourceslices", selector=f"spec.nodeName={self.node_name},spec.driver={DRIVER}")

    def devices(self) -> dict[str, dict[str, Any]]:
        """Every published device of Tandem on this node, by name."""
        return {d["name"]: d for s in self.slices() for d in s["spec"].get("devices") or []}

    def cluster_sh(self, *args: str, env: dict[str, str] | None = None, timeout: float = 600) -> str:
        proc = subprocess.run(
            [str(CLUSTER_SH), *args], capture_output=True, text=True, timeout=timeout, env={**self.env, **(env or {})}
        )
        if proc.returncode != 0:
            raise RuntimeError(f"hack/cluster.sh {' '.join(args)} failed: {proc.stderr[-3000:]}")
        return proc.stdout


def example(cluster: Cluster, name: str, script: str = "") -> list[dict[str, Any]]:
    """The objects of examples/<name>.yaml, as a user would apply them, with two changes only: no
    namespace (the caller applies them to its own) and the local test image (no registry here);
    `script`, when given, becomes every container's command."""
    docs = [d for d in yaml.safe_load_all((REPO / "examples" / f"{name}.yaml").read_text()) if d]
    for d in docs:
        d["metadata"].pop("namespace", None)
        for c in d.get("spec", {}).get("containers", []):
            c["image"] = cluster.image
            if script:
                c["command"] = ["sh", "-c", script]
    return docs


def attribute(device: dict[str, Any], name: str) -> Any:
    """A published attribute's value, whatever its type; Tandem's own are published without domain."""
    value = (device.get("attributes") or {}).get(name) or {}
    return next(iter(value.values()), None)


def wait_for(what: str, probe: Callable[[], T], timeout: float = 60, interval: float = 0.25) -> T:
    """`waiting.wait_for`, riding out a kubectl call that fails or hangs while the cluster changes."""
    return waiting.wait_for(what, probe, timeout, interval, retry_on=(KubectlError, subprocess.TimeoutExpired))


def claim_template(name: str, requests: list[dict[str, Any]], constraints: list[dict[str, Any]] | None = None,
                   config: list[dict[str, Any]] | None = None) -> dict[str, Any]:  # fmt: skip
    devices: dict[str, Any] = {"requests": requests}
    if constraints:
        devices["constraints"] = constraints
    if config:
        devices["config"] = config
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": name},
        "spec": {"spec": {"devices": devices}},
    }


def request(name: str, device_class: str, selector: str = "", count: int = 1) -> dict[str, Any]:
    exactly: dict[str, Any] = {"deviceClassName": device_class, "count": count}
    if selector:
        exactly["selectors"] = [{"cel": {"expression": selector}}]
    return {"name": name, "exactly": exactly}


def pod(
    cluster: Cluster,
    name: str,
    script: str,
    claims: dict[str, str] | None = None,
    limits: dict[str, str] | None = None,
    tolerations: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """A busybox pod running `script`; `claims` maps the pod's claim names to ResourceClaimTemplates."""
    container: dict[str, Any] = {"name": "main", "image": cluster.image, "command": ["sh", "-c", script]}
    spec: dict[str, Any] = {"restartPolicy": "Never", "terminationGracePeriodSeconds": 1, "containers": [container]}
    if claims:
        spec["resourceClaims"] = [{"name": n, "resourceClaimTemplateName": t} for n, t in claims.items()]
        container["resources"] = {"claims": [{"name": n} for n in claims]}
    if limits:
        container.setdefault("resources", {})["limits"] = limits
    if tolerations:
        spec["tolerations"] = tolerations
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


def pod_phase(cluster: Cluster, namespace: str, name: str) -> str:
    p = cluster.get("pod", name, namespace)
    return (p or {}).get("status", {}).get("phase", "")


def wait_pod(cluster: Cluster, namespace: str, name: str, phases: tuple[str, ...] = ("Succeeded",),
             timeout: float = 90) -> dict[str, Any]:  # fmt: skip
    """The pod once in one of `phases`; fails at once (with its events) if it ends in another."""

    def probe() -> dict[str, Any] | None:
        p = cluster.get("pod", name, namespace)
        phase = (p or {}).get("status", {}).get("phase", "")
        if phase in phases:
            return p
        if phase in ("Succeeded", "Failed"):
            events = cluster.kubectl(
                "get", "events", "-n", namespace, "--field-selector", f"involvedObject.name={name}"
            )
            logs = cluster.kubectl("logs", "-n", namespace, name, check=False)
            raise AssertionError(f"pod {name} ended {phase}, not {phases}:\n{events}\n{logs}")
        return None

    try:
        return wait_for(f"pod {namespace}/{name} in {phases}", probe, timeout=timeout)
    except AssertionError as e:
        raise AssertionError(f"{e}\n{why_pending(cluster, namespace, name)}") from None


def why_pending(cluster: Cluster, namespace: str, name: str) -> str:
    """What the scheduler, the kubelet and Tandem said about a pod that did not get where a test
    waited for it: its events, its claims' allocation and status, and the tail of Tandem's log."""
    events = cluster.kubectl("get", "events", "-n", namespace, "-o", "wide", check=False)
    claims = cluster.kubectl("get", "resourceclaims", "-n", namespace, "-o", "yaml", check=False)
    tails = []
    for log in (cluster.state / "node" / "tandem.log", cluster.state / "logs" / "kubelet.log"):
        text = log.read_text(errors="replace") if log.exists() else "(missing)"
        # The kubelet logs much; its lines about DRA are the ones that explain a pod stuck on a claim.
        lines = [line for line in text.splitlines()[-400:] if "tandem" in log.name or "DRA" in line]
        tails.append(f"{log} (tail):\n" + "\n".join(lines)[-3000:])
    return f"events:\n{events}\nclaims:\n{claims[-4000:]}\n" + "\n".join(tails)


def host_link(name: str) -> dict[str, Any] | None:
    """`ip -j address show` of one of the host's netdevs; None when the host has no such netdev."""
    proc = subprocess.run(["ip", "-j", "address", "show", "dev", name], capture_output=True, text=True)
    return json.loads(proc.stdout)[0] if proc.returncode == 0 else None


def logs(cluster: Cluster, namespace: str, name: str) -> str:
    return cluster.kubectl("logs", "-n", namespace, name)


DONE = "=== done"


def report_script(script: str) -> str:
    """`script`, then a marker, then sleep: the pod stays Running (and its claims allocated) for the
    test, and ends at once on SIGTERM (a shell as PID 1 ignores it, which would cost the grace period)."""
    return f"trap 'exit 0' TERM; {script}; echo '{DONE}'; sleep 3600 & wait"


def wait_report(cluster: Cluster, namespace: str, name: str, timeout: float = 90) -> str:
    """What a pod running `report_script` printed, once it printed all of it."""
    wait_pod(cluster, namespace, name, ("Running",), timeout=timeout)
    out = wait_for(f"pod {name}'s report", lambda: DONE in (text := logs(cluster, namespace, name)) and text, 30)
    return out.split(DONE)[0]


# Images of the project's Dockerfile, built into the node's containerd by the tests that deploy
# the driver as a pod (`hack/cluster.sh image TAG`); the second is the target of a rolling update.
DRIVER_IMAGES = ("localhost/tandem-driver:e2e-a", "localhost/tandem-driver:e2e-b")


def on_sim_node(ds: dict[str, Any], node_root: Path, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Tandem's DaemonSet (daemonset.yaml's, or the chart's render) pointed at the simulated node's
    hardware, in place; nothing else of it changes.

    The simulated sysfs, /dev, NVIDIA driver root and NVML state live under `node_root` on the
    host; the pod mounts that directory at the same path (CDI specs name host paths) and loads the
    fake NVML module from it (`fake_pynvml`, copied there by the caller). `env` sets more of the
    container's variables (a test's flags), over these."""
    spec = ds["spec"]["template"]["spec"]
    container = spec["containers"][0]
    variables = {e["name"]: e for e in container["env"]}
    for name, value in {
        "SYSFS_ROOT": node_root / "sys",
        "DEV_ROOT": node_root / "dev",
        # The simulated kernel's device majors: prepare makes nvidia-uvm from them on first use.
        "PROC_ROOT": node_root / "proc",
        "NVIDIA_DRIVER_ROOT": node_root / "nvidia",
        "NVIDIA_DRIVER_ROOT_HOST": node_root / "nvidia",
        "NIC_LINK_SOURCE": "sysfs",
        STATE_ENV: node_root / "nvml-state.json",
        "PYTHONPATH": node_root / "fake_pynvml",
        **(env or {}),
    }.items():
        variables[name] = {"name": name, "value": str(value)}
    container["env"] = list(variables.values())
    spec["volumes"].append({"name": "sim-node", "hostPath": {"path": str(node_root), "type": "Directory"}})
    container["volumeMounts"].append({"name": "sim-node", "mountPath": str(node_root)})
    # The driver finds the node's cgroup hierarchies below SYSFS_ROOT (MPS daemons get cgroups of
    # their own there, to outlive the container): the host's, where the DaemonSet mounts them.
    for m in [m for m in container["volumeMounts"] if m["mountPath"] == "/sys/fs/cgroup"]:
        container["volumeMounts"].append({**m, "mountPath": str(node_root / "sys" / "fs" / "cgroup")})
    return ds


DRIVER_NAMESPACE = "tandem-system"  # daemonset.yaml's


def daemonset(node_root: Path, image: str) -> dict[str, Any]:
    """The DaemonSet of daemonset.yaml, pointed at the simulated node's hardware, with `image`."""
    docs = [d for d in yaml.safe_load_all((REPO / "daemonset.yaml").read_text()) if d]
    (ds,) = [d for d in docs if d["kind"] == "DaemonSet"]
    ds["spec"]["template"]["spec"]["containers"][0]["image"] = image
    return on_sim_node(ds, node_root)


def driver_pods(cluster: Cluster) -> list[dict[str, Any]]:
    """The driver pods of daemonset.yaml's namespace that are not being deleted."""
    return [p for p in cluster.get("pods", namespace=DRIVER_NAMESPACE) if not p["metadata"].get("deletionTimestamp")]


def ready(p: dict[str, Any]) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions") or [])
