"""The nodes of the three-node cluster (`hack/cluster.sh up --nodes 3`), as the tests reach them.

Node 1 is the machine itself; nodes 2 and 3 run in network and mount namespaces of their own
(hack/cluster/nodes.sh), so what a test does on them from this process (tandemctl, a look at the
node's kubelet directory) it does through the node's namespaces or the node's directory.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kube import DRIVER, Cluster, attribute, wait_for

from demo.cluster_node import ClusterNode

NODES = 3
TANDEMCTL = str(Path(sys.executable).parent / "tandemctl")


@dataclass
class Node:
    cluster: Cluster
    index: int  # 1 is the machine's own node

    @property
    def name(self) -> str:
        return self.cluster.node_name if self.index == 1 else f"{self.cluster.node_name}-{self.index}"

    @property
    def state(self) -> Path:
        """The node's directory: what `hack/cluster.sh` keeps of it (its simulated hardware, Tandem's
        kubeconfig, logs); for nodes 2 and 3 also `root/`, their /var/lib/kubelet and /var/run/cdi."""
        return self.cluster.state if self.index == 1 else self.cluster.state / "nodes" / self.name

    @property
    def tandem(self) -> ClusterNode:
        gpus, nics = (8, 4) if self.index < 3 else (4, 2)  # as hack/cluster/nodes.sh sizes them
        return ClusterNode(self.state / "node", self.state / "tandem" / "kubeconfig", self.name, gpus, nics)

    @property
    def tandem_kubeconfig(self) -> Path:
        """Tandem's own credentials on this node: a token of its service account bound to this Node."""
        return self.state / "tandem" / "kubeconfig"

    @property
    def kubelet_kubeconfig(self) -> Path:
        """The kubelet's credentials: its client certificate, system:node:<name>."""
        pki = self.cluster.state / "pki"
        return pki / "kubelet.kubeconfig" if self.index == 1 else pki / "nodes" / self.name / "kubelet.kubeconfig"

    def in_node(self, *cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """`cmd` in the node's network and mount namespaces, as a process on that node would run."""
        prefix: list[str] = []
        if self.index > 1:
            holder = (self.state / "run" / "namespaces.pid").read_text().strip()
            prefix = ["nsenter", "--target", holder, "--mount", "--net", "--"]
        return subprocess.run([*prefix, *cmd], capture_output=True, text=True, timeout=60, check=check)

    def healthy(self) -> bool:
        """Tandem registered with this node's kubelet and serving, as `tandemctl health` judges it."""
        return self.in_node(TANDEMCTL, "health", check=False).returncode == 0

    def publisher(self) -> dict[str, Any]:
        """What `tandemctl health --json` says of Tandem's slice publisher: its syncs, its writes to
        the API server and `publishedAt`, when it last confirmed the live slices against a current watch."""
        out = self.in_node(TANDEMCTL, "health", "--json", check=False).stdout
        return json.loads(out)["daemon"]["slices"]

    def restart_tandem(self) -> None:
        """`hack/cluster.sh restart tandem NODE`: a fresh token bound to the Node, and the daemon."""
        self.cluster.cluster_sh("restart", "tandem", self.name)
        wait_for(f"Tandem on {self.name} registered with its kubelet", self.healthy, timeout=60)

    def slices(self) -> list[dict[str, Any]]:
        return self.cluster.get("resourceslices", selector=f"spec.nodeName={self.name},spec.driver={DRIVER}")

    def devices(self, kind: str) -> dict[str, dict[str, Any]]:
        """Tandem's published devices of one type on this node (gpu, nic), by name."""
        found = (d for s in self.slices() for d in s["spec"].get("devices") or [])
        return {d["name"]: d for d in found if attribute(d, "type") == kind}


def kubectl_as(cluster: Cluster, kubeconfig: Path, *args: str, body: dict[str, Any] | None = None) -> str:
    """kubectl with another identity's kubeconfig: '' when the API server allowed it, else its refusal."""
    proc = subprocess.run(
        ["kubectl", "--kubeconfig", str(kubeconfig), *args],
        input=json.dumps(body) if body is not None else None,
        capture_output=True, text=True, timeout=60, env=cluster.env,
    )  # fmt: skip
    return "" if proc.returncode == 0 else proc.stderr.strip() or f"exit {proc.returncode}"


def versions(slices: list[dict[str, Any]]) -> dict[str, str]:
    """Each slice's resourceVersion by name: equal before and after means nobody wrote it."""
    return {s["metadata"]["name"]: s["metadata"]["resourceVersion"] for s in slices}


def containers(cluster: Cluster, namespace: str, name: str) -> list[tuple[Any, ...]]:
    """What changes if a pod's container is restarted or replaced: its id, start, restart count."""
    p = cluster.get("pod", name, namespace)
    return [
        (p["metadata"]["uid"], c["containerID"], c["state"].get("running", {}).get("startedAt"), c["restartCount"])
        for c in p["status"]["containerStatuses"]
    ]
