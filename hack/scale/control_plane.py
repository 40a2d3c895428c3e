"""The bench's control plane, started by the cluster's launcher (`hack/cluster.sh control-plane`)
so that the figures are measured on the Kubernetes the cluster tests run: the same certificates,
components, flags and feature gates (hack/cluster/components.conf). What the bench needs beside
them is the launcher's `scale` profile, passed here and written in that file: ports of its own, so
that it never meets a cluster that is up, an audit log of the drivers' requests, and the
controller manager's and scheduler's client rate limits of a large cluster."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

from scale.api import Api
from scale.objects import USERS
from scale.procs import Proc

REPO = Path(__file__).resolve().parents[2]
LAUNCHER = REPO / "hack" / "cluster.sh"
PROFILE = "scale"
COMPONENTS = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler")
# Only the two drivers' requests, each with its user: who sent what (the API server's
# apiserver_request_total has no user-agent label).
AUDIT_POLICY = {
    "apiVersion": "audit.k8s.io/v1",
    "kind": "Policy",
    "omitStages": ["RequestReceived", "ResponseStarted"],
    "rules": [{"level": "Metadata", "users": list(USERS.values())}, {"level": "None"}],
}


class ControlPlane:
    def __init__(self, state: Path) -> None:
        self.state = state
        self.logs = state / "logs"
        self.procs: dict[str, Proc] = {}

    def _launcher(self, command: str) -> None:
        env = {**os.environ, "TANDEM_CLUSTER_STATE": str(self.state), "TANDEM_CLUSTER_PROFILE": PROFILE}
        subprocess.run([str(LAUNCHER), "control-plane", command], env=env, check=True, stdout=subprocess.DEVNULL)

    def up(self) -> Api:
        """Starts it (the launcher waits until the API server is ready) and returns the admin's client."""
        self.logs.mkdir(parents=True, exist_ok=True)
        (self.state / "audit-policy.json").write_text(json.dumps(AUDIT_POLICY))  # components.conf names it
        self._launcher("up")
        for name in COMPONENTS:
            pid = int((self.state / "run" / f"{name}.pid").read_text())
            self.procs[name] = Proc(name, pid, time.monotonic())
        return Api.from_kubeconfig(self.state / "pki" / "admin.kubeconfig")

    def down(self) -> None:
        self._launcher("down")
