"""An MPS control daemon outlives Tandem's container: Tandem, a real process, runs in a cgroup of its
own as a container does, and is torn down the way the runtime tears a container down (every process
of that cgroup killed: `runc kill --all`); the daemon of a prepared MPS claim, which Tandem moved
into a cgroup of the GPU's own (driver/node/cgroups.py), still answers through its control pipe,
and the restarted Tandem adopts it (no second daemon) and stops it, and removes its cgroup, when
the last claim is unprepared. The node's cgroup tree is the real one (root only), the rest is the
simulated node's."""

from __future__ import annotations

import os
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from mps_node import MpsNode
from waiting import poll

from driver.claims.gpu.mps_identity import CONTROL_PROGRAM
from driver.node.cgroups import Cgroup, hierarchies, owner_name

SYS = Path("/sys")

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not hierarchies(SYS), reason="moving processes between cgroups needs root and a cgroup tree"
)


class Node(MpsNode):
    """One GPU; Tandem runs in a cgroup standing for its container, made afresh at each start."""

    def __init__(self, apiserver, sim_node, start_daemon):
        super().__init__(apiserver, sim_node, start_daemon, gpus=1, capacity={"memory": "20Gi", "computePercent": "25"})
        (self.node.sysfs / "fs").mkdir(parents=True, exist_ok=True)
        (self.node.sysfs / "fs" / "cgroup").symlink_to("/sys/fs/cgroup")  # the node's real hierarchies
        self.owner = f"test-{uuid.uuid4().hex[:12]}"
        self.containers: list[Cgroup] = []

    def start(self) -> None:
        super().start()
        container = Cgroup(hierarchies(SYS), self.owner, f"container-{len(self.containers)}")
        container.enter(self.daemon.proc.pid, 10)
        self.containers.append(container)

    def tear_down_container(self) -> None:
        """What the runtime does when a container without a PID namespace of its own stops."""
        assert self.containers[-1].kill_all(30)
        self.daemon.proc.wait(timeout=30)

    def gpu_cgroup(self) -> Cgroup:
        return Cgroup(hierarchies(SYS), owner_name(self.mps.parent), "gpu-0")

    def answers(self) -> bool:
        program = self.node.nvidia_root / "usr" / "bin" / CONTROL_PROGRAM
        env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(self.mps / "gpu-0" / "pipe")}
        done = subprocess.run([str(program)], env=env, input=b"get_server_list\n", timeout=30, check=False)
        return done.returncode == 0

    def close(self) -> None:
        super().close()
        for cgroup in (*self.containers, self.gpu_cgroup()):
            cgroup.kill_all(30)
            cgroup.remove()


@pytest.fixture
def node(apiserver, sim_node, start_daemon) -> Iterator[Node]:
    n = Node(apiserver, sim_node, start_daemon)
    yield n
    n.close()


def test_the_mps_daemon_outlives_tandems_container_and_the_next_one_adopts_it(node: Node) -> None:
    node.start()
    ref = node.claim("a")
    assert node.prepared(ref)
    (daemon,) = node.daemons()
    assert node.gpu_cgroup().pids() == {daemon}  # out of Tandem's container

    node.tear_down_container()
    assert node.daemons() == [daemon]
    assert node.answers()

    node.start()  # a new container; its start-up sync finds the daemon by its record
    assert node.prepared(ref)  # the kubelet prepares again after a restart: idempotent
    assert node.daemons() == [daemon] and node.answers()

    assert node.kubelet.unprepare([ref]) == {ref.uid: ""}
    assert poll(lambda: not node.daemons(), 30), node.daemons()
    assert not any(d.exists() for d in node.gpu_cgroup().dirs)
