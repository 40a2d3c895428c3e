"""A node whose ResourceSlices cannot be published says so, with the daemon as a real process.

Its kubeconfig names a port nothing listens on (the API server there was stopped): `tandemctl
health` is unhealthy and says why, the readiness probe fails while the liveness probe passes, the
metrics count the refused attempts, and the log has one ERROR line for them. Then the API server
comes up on that port: the slices are published, and health, readiness and the metrics recover.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from waiting import wait_for

from demo.node import DRIVER, SimNode, stop_daemon
from driver.ctl import commands as ctl
from sim.apiserver import SimApiServer
from sim.kubelet import KubeletSim
from sim.profile import h100_node
from sim.scheduler import published_devices

NODE = "node-o"


@pytest.fixture
def closed_port(short_tmp: Path) -> tuple[Path, int]:
    """A kubeconfig naming a port that nothing listens on: the API server there was stopped."""
    gone = SimApiServer().start()
    kubeconfig = gone.write_kubeconfig(short_tmp / "kubeconfig")
    port = int(gone.url.rsplit(":", 1)[1])
    gone.stop()
    return kubeconfig, port


@pytest.fixture
def node(short_tmp: Path) -> SimNode:
    return SimNode.create(short_tmp / NODE, h100_node(NODE, gpus=2, nics=2))


@pytest.fixture
def kubelet(node: SimNode) -> Iterator[KubeletSim]:
    with KubeletSim(node.registry) as k:
        yield k


def _health(node: SimNode, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    """`tandemctl health` against the node's status socket, in this process (the same code path)."""
    capsys.readouterr()
    rc = ctl.main(["--kubelet-plugins-dir", str(node.plugins), "health", *args])
    return rc, capsys.readouterr().out


def _probe(node: SimNode, *args: str) -> subprocess.CompletedProcess[str]:
    """The DaemonSet's probe command, as a process of its own."""
    cmd = [sys.executable, "-m", "driver", "liveness", "--kubelet-registrar-dir", str(node.registry)]
    cmd += ["--kubelet-plugins-dir", str(node.plugins), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


def _metrics(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_an_unreachable_api_server_is_told_everywhere_and_publishing_recovers_when_it_comes(
    closed_port: tuple[Path, int], node: SimNode, kubelet: KubeletSim, capsys: pytest.CaptureFixture[str]
) -> None:
    kubeconfig, port = closed_port
    log = node.root / "daemon.log"
    daemon = node.start_daemon(kubeconfig, log, "-v", "--metrics-address", "127.0.0.1:0")
    server: SimApiServer | None = None
    try:
        kubelet.register(kubelet.wait_for_registration_socket(DRIVER, timeout=60))
        found = wait_for(
            "the metrics port", lambda: re.search(r"serving metrics on 127\.0\.0\.1:(\d+)", log.read_text())
        )
        metrics_port = int(found[1])

        def failed_attempts() -> int:
            rc, out = _health(node, capsys, "--json")
            return int(json.loads(out)["daemon"]["slices"].get("failedAttempts", 0)) if rc in (0, 1) else 0

        wait_for("three refused attempts", lambda: failed_attempts() >= 3, timeout=60)
        rc, out = _health(node, capsys)
        assert rc == ctl.EXIT_DEGRADED, out
        status, reason = out.splitlines()[:2]
        assert status == "unhealthy"
        assert reason.startswith(
            f"  - no ResourceSlices published: the API server at http://127.0.0.1:{port} cannot be reached: "
            f"get node {NODE}: connection refused"
        ), out
        assert re.search(r"\(since \d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ, \d+ failed attempt\(s\)\)$", reason), reason

        ready = _probe(node, "--ready")
        assert ready.returncode == 1 and "not ready: no ResourceSlices published" in ready.stderr, ready.stderr
        alive = _probe(node)
        assert alive.returncode == 0, f"a restart brings no API server back: {alive.stderr}"

        samples = _metrics(metrics_port)
        assert samples[("tandem_slice_errors_total", (("reason", "unreachable"),))] >= 3
        assert samples[("tandem_slice_errors_total", (("reason", "forbidden"),))] == 0
        assert samples[("tandem_slices_published_timestamp_seconds", ())] == 0

        text = log.read_text()
        errors = [line for line in text.splitlines() if " E driver.slices.progress: " in line]
        assert len(errors) == 1 and "ResourceSlices cannot be published" in errors[0], errors
        configuration = json.loads(re.search(r"configuration (\{.*\})$", text, re.MULTILINE)[1])
        assert configuration["node_name"] == NODE and configuration["kubeconfig"] == str(kubeconfig)

        # The API server comes (back) where the kubeconfig points.
        server = SimApiServer().start(port)
        server.add_node(NODE)
        wait_for("the devices published", lambda: len(published_devices(server, DRIVER, NODE)) >= 4, timeout=90)
        wait_for("tandemctl health healthy", lambda: _health(node, capsys)[0] == 0, timeout=60)
        ready = _probe(node, "--ready")
        assert ready.returncode == 0, ready.stderr
        assert _metrics(metrics_port)[("tandem_slices_published_timestamp_seconds", ())] > 0
        assert "I driver.slices.progress: ResourceSlices published again, after " in log.read_text()
    finally:
        stop_daemon(daemon)
        if server is not None:
            server.stop()
