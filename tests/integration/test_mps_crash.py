"""kill -9 of Tandem at each step of an MPS control daemon's life, with the daemon as a real
process: while `nvidia-cuda-mps-control -f` starts the daemon for a claim's prepare (before and
after it is up), and while the front end tells it to `quit` after the last claim's unprepare
(before and after). Then a restart: no second daemon and none left behind, every claim prepared
once. The stand-in control program stops at the chosen step and carries on once its caller is
dead (`sim.mps_control`), as the real program would."""

from __future__ import annotations

import json

import pytest
from kubelet_calls import call_in_background
from mps_node import MpsNode
from waiting import poll

from demo.node import DRIVER
from driver.claims.gpu.mps_identity import PID_FILE
from sim import nvml as sim_nvml


class Node(MpsNode):
    """One GPU, whose control daemon the stand-in control program can be made to hang at a step of."""

    def __init__(self, apiserver, sim_node, start_daemon):
        super().__init__(apiserver, sim_node, start_daemon, gpus=1, capacity={"memory": "20Gi", "computePercent": "25"})
        self.state = self.node.root / "nvml-state.json"
        self.gpu_mps = self.mps / "gpu-0"

    def hang(self, step: str) -> None:
        self.state.with_name(self.state.name + ".hung").unlink(missing_ok=True)
        self.state.with_name(self.state.name + ".mps-hang").write_text(step)

    def settled(self, count: int) -> bool:
        """`count` daemons, and when one, the one its PID file names (the one Tandem supervises)."""
        found = self.daemons()
        if len(found) != count:
            return False
        if count == 0:
            return not self.gpu_mps.exists()
        try:
            return int((self.gpu_mps / "pipe" / PID_FILE).read_text()) == found[0]
        except (OSError, ValueError):
            return False

    def daemon_checkpoint(self) -> dict:
        path = self.node.plugins / DRIVER / "checkpoint.json"
        return json.loads(path.read_text())["claims"] if path.exists() else {}


@pytest.fixture
def node(apiserver, sim_node, start_daemon):
    n = Node(apiserver, sim_node, start_daemon)
    yield n
    n.close()


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
