"""A hostile tenant against the real daemon's MPS control daemons (issue 22): a pod's container
holds its GPU's MPS pipe directory read-write, and its root replaces the daemon's PID file with a
FIFO, with a symlink to /dev/zero, or with another GPU's daemon's PID (and removes the control
socket). Then other claims, on the same GPU and on another, still prepare; a Tandem killed and
started again becomes healthy (registers, prepares) and adopts the running daemons; the daemon
of the other GPU is never signalled; and once every claim is unprepared nothing is left: no
daemon process, no MPS directory."""

from __future__ import annotations

import os
import signal
import uuid
from pathlib import Path

import pytest
from kubelet_calls import registered
from waiting import poll

from demo.node import DRIVER
from driver.claims.gpu.mps import CONTROL_PROGRAM, PID_FILE
from sim.kubelet import ClaimRef, KubeletSim
from sim.profile import h100_node
from sim.scheduler import Request, allocate, claim_object, reserve

MPS = {"driver": DRIVER, "parameters": {"apiVersion": "tandem.dev/v1alpha1", "kind": "GpuConfig", "sharing": "MPS"}}


class Node:
    def __init__(self, apiserver, sim_node, start_daemon):
        self.apiserver = apiserver
        self.node = sim_node(h100_node("node-a", gpus=2, nics=0))
        self.start_daemon = start_daemon
        self.kubelet = KubeletSim(self.node.registry)
        self.mps = self.node.plugins / DRIVER / "mps"

    def start(self) -> None:
        self.daemon = self.start_daemon(self.node, "--gpu-sharing", "all")
        sock = self.kubelet.wait_for_registration_socket(DRIVER, timeout=60)
        assert poll(lambda: registered(self.kubelet, sock), 60), self.daemon.log_text()

    def kill(self) -> None:
        self.daemon.proc.send_signal(signal.SIGKILL)
        self.daemon.proc.wait(timeout=30)

    def claim(self, name: str, gpu: str) -> ClaimRef:
        request = Request("gpu", "gpu.tandem.dev", lambda d: d["name"] == gpu,
                          capacity={"memory": "10Gi", "computePercent": "10"})  # fmt: skip
        obj = claim_object("default", name, [request])
        obj["spec"]["devices"]["config"] = [{"requests": ["gpu"], "opaque": MPS}]
        claim = self.apiserver.create(obj)
        allocate(self.apiserver, claim, DRIVER, "node-a", [request])
        reserve(self.apiserver, claim, f"pod-{name}", str(uuid.uuid4()))
        return ClaimRef("default", name, claim["metadata"]["uid"])

    def prepared(self, *refs: ClaimRef) -> bool:
        results = self.kubelet.prepare(list(refs))
        return all(results[r.uid].error == "" for r in refs)

    def daemons(self, gpu: str) -> list[int]:
        """The live control daemons of `gpu` (by the pipe directory in their environment)."""
        pipe = f"CUDA_MPS_PIPE_DIRECTORY={self.mps / gpu / 'pipe'}".encode()
        out = []
        for proc in Path("/proc").iterdir():
            try:
                cmdline = (proc / "cmdline").read_bytes()
                environ = (proc / "environ").read_bytes().split(b"\0")
                state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                continue
            daemon = CONTROL_PROGRAM.encode() in cmdline and {b"-d", b"-f"} & set(cmdline.split(b"\0"))
            if daemon and pipe in environ and state != "Z":
                out.append(int(proc.name))
        return out


@pytest.fixture
def node(apiserver, sim_node, start_daemon):
    n = Node(apiserver, sim_node, start_daemon)
    yield n
    n.kubelet.close()
    for gpu in ("gpu-0", "gpu-1"):
        for pid in n.daemons(gpu):  # never leave a daemon behind, whatever failed
            os.kill(pid, signal.SIGKILL)


def _attack(pipe: Path, attack: str, other_daemon: int) -> None:
    """What the tenant's container root does to its pipe directory."""
    pid_file = pipe / PID_FILE
    pid_file.unlink()
    if attack == "fifo":
        os.mkfifo(pid_file)
    elif attack == "dev-zero":
        pid_file.symlink_to("/dev/zero")
    else:
        pid_file.write_text(f"{other_daemon}\n")
        (pipe / "control").unlink()


@pytest.mark.parametrize("attack", ["fifo", "dev-zero", "foreign-pid"])
def test_a_tenant_planting_in_its_pipe_directory_hurts_no_one_else(node: Node, attack: str) -> None:
    node.start()
    mine, theirs = node.claim("mine", "gpu-0"), node.claim("theirs", "gpu-1")
    assert node.prepared(mine, theirs)
    (victim,) = node.daemons("gpu-1")
    (own,) = node.daemons("gpu-0")
    _attack(node.mps / "gpu-0" / "pipe", attack, victim)

    neighbour, elsewhere = node.claim("neighbour", "gpu-0"), node.claim("elsewhere", "gpu-1")
    assert node.prepared(neighbour), node.daemon.log_text()  # the same GPU: its daemon found by its record
    assert node.prepared(elsewhere), node.daemon.log_text()
    node.kill()
    node.start()  # start-up syncs every daemon: nothing in the pipe directory stalls it
    late = node.claim("late", "gpu-0")
    assert node.prepared(late), node.daemon.log_text()
    assert node.daemons("gpu-0") == [own] and node.daemons("gpu-1") == [victim]  # adopted, not doubled

    assert node.kubelet.unprepare([mine, neighbour, late]) == {mine.uid: "", neighbour.uid: "", late.uid: ""}
    assert poll(lambda: node.daemons("gpu-0") == [] and not (node.mps / "gpu-0").exists(), 30), node.daemon.log_text()
    assert node.daemons("gpu-1") == [victim]  # never signalled
    assert node.kubelet.unprepare([theirs, elsewhere]) == {theirs.uid: "", elsewhere.uid: ""}
    assert poll(lambda: node.daemons("gpu-1") == [] and not (node.mps / "gpu-1").exists(), 30)
