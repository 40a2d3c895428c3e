"""A hostile tenant against the real daemon's MPS control daemons (issue 22): a pod's container
holds its GPU's MPS pipe directory read-write, and its root replaces the daemon's PID file with a
FIFO, with a symlink to /dev/zero, or with another GPU's daemon's PID (and removes the control
socket). Then other claims, on the same GPU and on another, still prepare; a Tandem killed and
started again becomes healthy (registers, prepares) and adopts the running daemons; the daemon
of the other GPU is never signalled; and once every claim is unprepared nothing is left: no
daemon process, no MPS directory."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from mps_node import MpsNode
from waiting import poll

from driver.claims.gpu.mps_identity import PID_FILE


@pytest.fixture
def node(apiserver, sim_node, start_daemon):
    n = MpsNode(apiserver, sim_node, start_daemon, gpus=2, capacity={"memory": "10Gi", "computePercent": "10"})
    yield n
    n.close()


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
def test_a_tenant_planting_in_its_pipe_directory_hurts_no_one_else(node: MpsNode, attack: str) -> None:
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
    (now,) = node.daemons("gpu-0")  # one, never doubled
    # A removed `control` cuts every client off the daemon: it is restarted, bound to a socket again;
    # otherwise it is adopted as it was.
    assert (now != own) if attack == "foreign-pid" else (now == own)
    assert node.daemons("gpu-1") == [victim]  # the other GPU's daemon is never touched

    assert node.kubelet.unprepare([mine, neighbour, late]) == {mine.uid: "", neighbour.uid: "", late.uid: ""}
    assert poll(lambda: node.daemons("gpu-0") == [] and not (node.mps / "gpu-0").exists(), 30), node.daemon.log_text()
    assert node.daemons("gpu-1") == [victim]  # never signalled
    assert node.kubelet.unprepare([theirs, elsewhere]) == {theirs.uid: "", elsewhere.uid: ""}
    assert poll(lambda: node.daemons("gpu-1") == [] and not (node.mps / "gpu-1").exists(), 30)
