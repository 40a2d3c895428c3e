"""Fixtures of the end-to-end suite: the real cluster of hack/cluster.sh and Tandem serving it.

The suite needs a running cluster: `hack/e2e.sh` (or `hack/test.sh` as root with Go) brings one
up and sets TANDEM_E2E=1, and then a cluster that cannot be reached is a failure. Run on its own
without a cluster, every test here is skipped with that reason.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kube import DRIVER, TANDEMCTL, Cluster, cluster_env, wait_for

from demo.cluster_node import ClusterNode


@pytest.fixture(scope="session")
def cluster() -> Cluster:
    required = os.environ.get("TANDEM_E2E") == "1"
    env = cluster_env()
    reason = "the real cluster is not up: run hack/e2e.sh (needs root and Go)"
    if env is None:
        if required:
            pytest.fail(f"hack/cluster.sh env failed: {reason}")
        pytest.skip(reason)
    c = Cluster(env)
    try:
        c.kubectl("get", "--raw", "/readyz", timeout=10)
    except Exception as e:
        if required:
            pytest.fail(f"the cluster's API server does not answer: {e}")
        pytest.skip(f"{reason} ({e})")
    return c


class Tandem:
    """The Tandem node process of the cluster: restart it with other flags, kill it, read its state."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.node = ClusterNode(cluster.state / "node", cluster.state / "tandem" / "kubeconfig", cluster.node_name)
        self.flags: tuple[str, ...] = ()

    @property
    def cdi_root(self) -> Path:
        return Path("/var/run/cdi")

    def health(self) -> tuple[int, str]:
        """`tandemctl health`: its exit code and what it printed."""
        proc = subprocess.run([TANDEMCTL, "health"], capture_output=True, text=True, timeout=30)
        return proc.returncode, proc.stdout + proc.stderr

    def healthy(self) -> bool:
        """Registered with the kubelet and serving, as `tandemctl health` judges it."""
        return self.health()[0] == 0

    def start(self, *flags: str) -> None:
        self.flags = flags
        self.node.start("--log-format", "json", *flags)
        wait_for("Tandem registered with the kubelet", self.healthy, timeout=60)

    def restart(self, *flags: str) -> None:
        self.node.stop()
        self.start(*flags)

    def ensure(self, *flags: str) -> None:
        """Running with exactly these flags."""
        if self.node.pid() is None or self.flags != flags:
            self.restart(*flags)

    def prepared_claims(self) -> list[dict[str, Any]]:
        out = subprocess.run(
            [TANDEMCTL, "claims", "--json"],
            capture_output=True, text=True, timeout=30, check=True,
        )  # fmt: skip
        return json.loads(out.stdout)["claims"]

    def files(self) -> list[str]:
        """Tandem's files in the CDI directory: claim specs and device-metadata specs."""
        return sorted(p.name for p in self.cdi_root.glob(f"*{DRIVER}*"))


@pytest.fixture(scope="session")
def tandem(cluster: Cluster) -> Iterator[Tandem]:
    t = Tandem(cluster)
    t.ensure()
    yield t
    t.ensure()  # leave the cluster as `hack/cluster.sh up` made it


@pytest.fixture
def namespace(cluster: Cluster, request: pytest.FixtureRequest) -> Iterator[str]:
    """A namespace of this test's own; deleted afterwards, with everything in it, before the next test."""
    name = f"e2e-{request.node.name.removeprefix('test_')[:40].replace('_', '-').lower()}-{secrets.token_hex(2)}"
    name = "".join(c for c in name if c.isalnum() or c == "-").strip("-")
    cluster.kubectl("create", "namespace", name)
    yield name
    # Pods and claims first, waiting for them (the namespace controller alone takes ~10 s to start),
    # so the next test starts on a node where nothing of this one is still prepared.
    for kind in ("pods", "resourceclaims"):
        cluster.kubectl("delete", kind, "--all", "-n", name, "--wait=true", "--timeout=120s", check=False, timeout=150)
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)
