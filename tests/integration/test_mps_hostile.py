"""A hostile tenant against the real daemon's MPS control daemons (issue 22): a pod's container
holds its GPU's MPS pipe directory read-write, and its root replaces the daemon's PID file with a
FIFO, with a symlink to /dev/zero, or with another GPU's daemon's PID (and removes the control
socket). Then other claims, on the same GPU and on another, still prepare; a Tandem killed and
started again becomes healthy (registers, prepares) and adopts the running daemons; the daemon
of the other GPU is never signalled; and once every claim is unprepared nothing is left: no
daemon process, no MPS directory. And (issue 33) a daemon that dies is started again in a fresh
pipe directory, never in the one the tenant has had and planted a symlink and a FIFO in."""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import pytest
from mps_node import MpsNode
from waiting import poll

from driver.claims.gpu.mps_identity import PID_FILE
from driver.node.processes import identify, wait_gone


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


@pytest.mark.parametrize("at_pid_file", ["symlink", "fifo"])
def test_a_restarted_daemon_never_runs_in_the_directory_a_tenant_planted_in(
    node: MpsNode, tmp_path: Path, at_pid_file: str
) -> None:
    """The tenant's container has the pipe directory its runtime mounted (where `<gpu>/pipe` led)
    and plants a symlink to a host file and a FIFO in the names the daemon opens (the stand-in, as
    careless as a closed binary may be, opens its PID file by name); then the daemon dies. The one
    Tandem starts again runs in a new directory, which the claims' containers made from now on
    mount; nothing planted is followed or opened (the host file keeps its bytes, the FIFO never
    had a writer, a daemon blocked on it would not have started); the old directory is removed;
    a restarted Tandem adopts the new daemon with its directory from its own record."""
    node.start()
    mine, theirs = node.claim("mine", "gpu-0"), node.claim("theirs", "gpu-1")
    assert node.prepared(mine, theirs)
    (first,) = node.daemons("gpu-0")
    (victim,) = node.daemons("gpu-1")
    mounted = (node.mps / "gpu-0" / "pipe").resolve()  # what the runtime bind-mounted into the tenant's container
    assert node.daemon_pipes()[first] == mounted

    host_file = tmp_path / "host-file"
    host_file.write_text("the host's own\n")
    other = {PID_FILE: "control", "control": PID_FILE}
    planted = {"symlink": PID_FILE if at_pid_file == "symlink" else "control"}
    planted["fifo"] = other[planted["symlink"]]
    for name in planted.values():
        (mounted / name).unlink()
    (mounted / planted["symlink"]).symlink_to(host_file)
    os.mkfifo(mounted / planted["fifo"])
    reader = os.open(mounted / planted["fifo"], os.O_RDONLY | os.O_NONBLOCK)  # sees whatever a writer would write
    try:
        process = identify(first)
        assert process is not None
        os.kill(first, signal.SIGKILL)
        assert wait_gone(process, 30)

        neighbour = node.claim("neighbour", "gpu-0")
        assert node.prepared(neighbour), node.daemon.log_text()  # its prepare starts the GPU's daemon again
        assert host_file.read_text() == "the host's own\n"  # the symlink was never followed
        assert os.read(reader, 64) == b""  # the FIFO never had a writer
        (now,) = node.daemons("gpu-0")
        fresh = node.daemon_pipes()[now]
        assert now != first and fresh != mounted and fresh.parent == mounted.parent
        assert re.fullmatch(r"pipe-[0-9a-f]{16}", fresh.name)
        assert (node.mps / "gpu-0" / "pipe").resolve() == fresh  # what containers made from now on mount
        assert (fresh / PID_FILE).read_text() == f"{now}\n"
        assert not mounted.exists()  # the old directory is gone, its entries unlinked, not followed
    finally:
        os.close(reader)
    assert node.daemons("gpu-1") == [victim]

    node.kill()
    node.start()  # adopted by its record, which names its directory
    assert node.prepared(node.claim("late", "gpu-0")), node.daemon.log_text()
    assert node.daemons("gpu-0") == [now] and node.daemons("gpu-1") == [victim]
    assert (node.mps / "gpu-0" / "pipe").resolve() == fresh
