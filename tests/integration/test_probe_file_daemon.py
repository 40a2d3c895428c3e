"""The DaemonSet's probes, exactly as daemonset.yaml writes them, against the daemon as a real
process: alive but not ready while its ResourceSlices cannot be published, ready once they are,
and no longer alive once the daemon stops refreshing its verdict (SIGSTOP: wedged)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import yaml
from waiting import wait_for

from demo.node import DRIVER, SimNode, stop_daemon
from driver.kubelet.liveness import PROBE_VALID
from sim.apiserver import SimApiServer
from sim.profile import h100_node
from sim.scheduler import published_devices

NODE = "node-p"
POD_UID = "0b7f7e4c-9d7c-4f0e-8c55-probe0000001"
REPO = Path(__file__).resolve().parents[2]


def _probes() -> dict[str, list[str]]:
    (ds,) = [d for d in yaml.safe_load_all((REPO / "daemonset.yaml").read_text()) if d and d["kind"] == "DaemonSet"]
    container = ds["spec"]["template"]["spec"]["containers"][0]
    return {p: container[f"{p}Probe"]["exec"]["command"] for p in ("startup", "liveness", "readiness")}


def _run(probe: str, node: SimNode) -> subprocess.CompletedProcess[str]:
    """The probe as the kubelet runs it: in the container's environment (the parts it reads)."""
    env = {"KUBELET_PLUGINS_DIRECTORY_PATH": str(node.plugins), "DRIVER_NAME": DRIVER, "POD_UID": POD_UID}
    env["PATH"] = os.environ["PATH"]
    return subprocess.run(_probes()[probe], env=env, capture_output=True, text=True, timeout=10)


def test_the_daemonsets_probes_against_the_daemon(short_tmp: Path) -> None:
    gone = SimApiServer().start()
    kubeconfig = gone.write_kubeconfig(short_tmp / "kubeconfig")
    port = int(gone.url.rsplit(":", 1)[1])
    gone.stop()
    node = SimNode.create(short_tmp / NODE, h100_node(NODE, gpus=2, nics=0))
    daemon = node.start_daemon(kubeconfig, node.root / "daemon.log", "-v", "--pod-uid", POD_UID)
    server: SimApiServer | None = None
    try:
        log = lambda: (node.root / "daemon.log").read_text()  # noqa: E731
        wait_for("the start-up probe", lambda: _run("startup", node).returncode == 0, timeout=60)
        assert _run("liveness", node).returncode == 0, "a restart brings no API server back"
        ready = _run("readiness", node)
        assert ready.returncode == 1 and ready.stdout.startswith("not ready: no ResourceSlices published"), ready

        server = SimApiServer().start(port)
        server.add_node(NODE)
        wait_for("the devices published", lambda: len(published_devices(server, DRIVER, NODE)) >= 2, timeout=90)
        wait_for("ready", lambda: _run("readiness", node).returncode == 0, timeout=60)
        assert _run("liveness", node).returncode == 0, log()

        os.kill(daemon.pid, signal.SIGSTOP)  # wedged: nothing refreshes the verdict
        stopped = time.monotonic()
        assert _run("liveness", node).returncode == 0, "a verdict holds for its window"
        wait_for("liveness to fail", lambda: _run("liveness", node).returncode == 1, timeout=PROBE_VALID + 15)
        assert time.monotonic() - stopped > PROBE_VALID - 11, "not before the verdict could expire"
        out = _run("liveness", node)
        assert "the daemon stopped refreshing it" in out.stdout and _run("readiness", node).returncode == 1
        os.kill(daemon.pid, signal.SIGCONT)
        wait_for("alive again", lambda: _run("liveness", node).returncode == 0, timeout=30)
    finally:
        os.kill(daemon.pid, signal.SIGCONT)
        assert stop_daemon(daemon) == 0
        if server is not None:
            server.stop()
    assert not list(node.plugins.glob(f"{DRIVER}/probe*")), "stop removes its probe file"
