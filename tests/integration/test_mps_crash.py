"""kill -9 of Tandem at each step of an MPS control daemon's life, with the daemon as a real
process: while `nvidia-cuda-mps-control -f` starts the daemon for a claim's prepare (before and
after it is up), and while the front end tells it to `quit` after the last claim's unprepare
(before and after). Then a restart: no second daemon and none left behind, every claim prepared
once. The stand-in control program stops at the chosen step and carries on once its caller is
dead (`sim.mps_control`), as the real program would."""

from __future__ import annotations

import json
import os
import signal
import uuid
from pathlib import Path

import pytest
from kubelet_calls import call_in_background, registered
from waiting import poll

from demo.node import DRIVER
from driver.claims.gpu.mps import CONTROL_PROGRAM, PID_FILE
from sim import nvml as sim_nvml
from sim.kubelet import ClaimRef, KubeletSim
from sim.profile import h100_node
from sim.scheduler import Request, allocate, claim_object, reserve

MPS = {"driver": DRIVER, "parameters": {"apiVersion": "tandem.dev/v1alpha1", "kind": "GpuConfig", "sharing": "MPS"}}


class Node:
    def __init__(self, apiserver, sim_node, start_daemon):
        self.apiserver = apiserver
        self.node = sim_node(h100_node("node-a", gpus=1, nics=0))
        self.start_daemon = start_daemon
        self.kubelet = KubeletSim(self.node.registry)
        self.state = self.node.root / "nvml-state.json"
        self.mps = self.node.plugins / DRIVER / "mps" / "gpu-0"

    def start(self) -> None:
        self.daemon = self.start_daemon(self.node, "--gpu-sharing", "all")
        sock = self.kubelet.wait_for_registration_socket(DRIVER, timeout=60)
        assert poll(lambda: registered(self.kubelet, sock), 60), self.daemon.log_text()

    def kill(self) -> None:
        self.daemon.proc.send_signal(signal.SIGKILL)
        self.daemon.proc.wait(timeout=30)

    def hang(self, step: str) -> None:
        self.state.with_name(self.state.name + ".hung").unlink(missing_ok=True)
        self.state.with_name(self.state.name + ".mps-hang").write_text(step)

    def claim(self, name: str) -> ClaimRef:
        request = Request("gpu", "gpu.tandem.dev", lambda d: d["name"] == "gpu-0",
                          capacity={"memory": "20Gi", "computePercent": "25"})  # fmt: skip
        obj = claim_object("default", name, [request])
        obj["spec"]["devices"]["config"] = [{"requests": ["gpu"], "opaque": MPS}]
        claim = self.apiserver.create(obj)
        allocate(self.apiserver, claim, DRIVER, "node-a", [request])
        reserve(self.apiserver, claim, f"pod-{name}", str(uuid.uuid4()))
        return ClaimRef("default", name, claim["metadata"]["uid"])

    def daemons(self) -> list[int]:
        """Every MPS control daemon process of this node's GPU 0 (by its pipe directory)."""
        out = []
        for proc in Path("/proc").iterdir():
            try:
                cmdline = (proc / "cmdline").read_bytes()
                environ = (proc / "environ").read_bytes().split(b"\0")
                state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                continue
            pipe = f"CUDA_MPS_PIPE_DIRECTORY={self.mps / 'pipe'}".encode()
            daemon = CONTROL_PROGRAM.encode() in cmdline and {b"-d", b"-f"} & set(cmdline.split(b"\0"))
            if daemon and pipe in environ and state != "Z":
                out.append(int(proc.name))
        return out

    def settled(self, count: int) -> bool:
        """`count` daemons, and when one, the one its PID file names (the one Tandem supervises)."""
        found = self.daemons()
        if len(found) != count:
            return False
        if count == 0:
            return not self.mps.exists()
        try:
            return int((self.mps / "pipe" / PID_FILE).read_text()) == found[0]
        except (OSError, ValueError):
            return False

    def daemon_checkpoint(self) -> dict:
        path = self.node.plugins / DRIVER / "checkpoint.json"
        return json.loads(path.read_text())["claims"] if path.exists() else {}


@pytest.fixture
def node(apiserver, sim_node, start_daemon):
    n = Node(apiserver, sim_node, start_daemon)
    yield n
    n.kubelet.close()
    for pid in n.daemons():  # never leave a daemon behind, whatever failed
        os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("step", ["before:mps-start", "after:mps-start"])
def test_kill_while_starting_the_mps_daemon(node: Node, step: str) -> None:
    node.start()
    ref = node.claim("a")
    node.hang(step)
    call_in_background(node.kubelet, "prepare", ref)
    assert poll(lambda: sim_nvml.hung_at(node.state) == step, 30), node.daemon.log_text()
    node.kill()
    node.hang("")  # the stand-in carries on: its caller is gone

    node.start()  # the dead instance's PrepareStarted is rolled back; a daemon no claim needs is stopped
    assert poll(lambda: node.settled(0), 40), (node.daemons(), node.daemon.log_text())
    result = node.kubelet.prepare([ref])[ref.uid]  # the kubelet retries
    assert result.error == ""
    assert poll(lambda: node.settled(1), 30), node.daemons()
    assert node.daemon_checkpoint()[ref.uid]["state"] == "PrepareCompleted"
    assert node.kubelet.unprepare([ref]) == {ref.uid: ""}
    assert poll(lambda: node.settled(0), 30), node.daemons()


@pytest.mark.parametrize("step", ["before:mps-quit", "after:mps-quit"])
def test_kill_while_stopping_the_mps_daemon(node: Node, step: str) -> None:
    node.start()
    a, b = node.claim("a"), node.claim("b")
    assert all(r.error == "" for r in node.kubelet.prepare([a, b]).values())
    assert node.settled(1)
    assert node.kubelet.unprepare([a]) == {a.uid: ""}
    assert node.settled(1)  # b still uses it
    node.hang(step)
    call_in_background(node.kubelet, "unprepare", b)
    assert poll(lambda: sim_nvml.hung_at(node.state) == step, 30), node.daemon.log_text()
    node.kill()
    node.hang("")

    node.start()  # b's record went before the stop: the daemon no claim needs goes, once
    assert poll(lambda: node.settled(0), 40), (node.daemons(), node.daemon.log_text())
    assert node.daemon_checkpoint() == {}
    assert node.kubelet.unprepare([b]) == {b.uid: ""}  # the kubelet's retry finds nothing to do
    again = node.claim("c")  # and the GPU is shared again: one new daemon
    assert node.kubelet.prepare([again])[again.uid].error == ""
    assert poll(lambda: node.settled(1), 30), node.daemons()
    assert node.kubelet.unprepare([again]) == {again.uid: ""}
    assert poll(lambda: node.settled(0), 30), node.daemons()
