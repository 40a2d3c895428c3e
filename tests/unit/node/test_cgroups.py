"""The cgroup of Tandem's own that its MPS control daemons run in, out of its container: found in
every hierarchy (v1 and v2 layouts), a process and its children moved there in each, everything in
it killed, and removed with the parents it leaves empty. The moves run against the node's real
cgroup tree (root only), under a name of this test's own."""

from __future__ import annotations

import os
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from waiting import wait_for

from driver.node.cgroups import PARENT, Cgroup, hierarchies, owner_name
from driver.node.processes import identify

SYS = Path("/sys")


def test_the_hierarchies_of_cgroup_v1_v2_and_neither(tmp_path: Path) -> None:
    v1 = tmp_path / "v1" / "fs" / "cgroup"
    for name in ("cpu,cpuacct", "memory", "systemd", "unified"):
        (v1 / name).mkdir(parents=True)
        (v1 / name / "cgroup.procs").touch()
    (v1 / "cpu").symlink_to("cpu,cpuacct")  # the same hierarchy a second time
    (v1 / "not-a-hierarchy").mkdir()
    assert hierarchies(tmp_path / "v1") == [v1 / n for n in ("cpu,cpuacct", "memory", "systemd", "unified")]
    v2 = tmp_path / "v2" / "fs" / "cgroup"
    (v2 / "kubepods").mkdir(parents=True)
    (v2 / "cgroup.procs").touch()
    (v2 / "kubepods" / "cgroup.procs").touch()
    assert hierarchies(tmp_path / "v2") == [v2]
    assert hierarchies(tmp_path / "none") == []


def test_the_owner_is_named_after_its_data_directory() -> None:
    assert owner_name(Path("/var/lib/kubelet/plugins/tandem.dev")) == "var-lib-kubelet-plugins-tandem.dev"


def test_nowhere_to_move_to_is_an_error() -> None:
    with pytest.raises(OSError, match="no cgroup hierarchy"):
        Cgroup([], "owner", "gpu-0").enter(os.getpid(), 10)


@pytest.fixture
def cgroup() -> Iterator[Cgroup]:
    if os.geteuid() != 0 or not hierarchies(SYS):
        pytest.skip("moving a process between cgroups needs root and a mounted cgroup tree")
    made = Cgroup(hierarchies(SYS), f"test-{uuid.uuid4().hex[:12]}", "gpu-0")
    yield made
    made.kill_all(10)
    made.remove()


def test_a_process_moved_in_leaves_its_cgroup_in_every_hierarchy_and_its_children_follow(cgroup: Cgroup) -> None:
    """What takes a process out of its container's reach (driver/node/cgroups.py): moved before it
    forks, in every hierarchy, then killed with whatever it started, and the cgroup removed."""
    # The shell never ends by itself (its last `sleep` is exec'd), so that its end can only be the
    # kill, even when the kill reaches its child first and its `wait` returns.
    parent = subprocess.Popen(["sh", "-c", "read -r _; sleep 300 & wait; exec sleep 300"], stdin=subprocess.PIPE)
    try:
        cgroup.enter(parent.pid, 10)
        assert parent.stdin is not None
        parent.stdin.write(b"\n")
        parent.stdin.close()
        lines = Path(f"/proc/{parent.pid}/cgroup").read_text().splitlines()
        assert len(lines) == len(cgroup.dirs) and all(
            line.endswith(f"/{PARENT}/{cgroup.dirs[0].parent.name}/gpu-0") for line in lines
        )
        child = _wait_two(cgroup) - {parent.pid}
        assert cgroup.remove() is False  # not while a process is in it
        assert cgroup.kill_all(10)
        assert parent.wait(timeout=10) < 0 and all(identify(c) is None for c in child)
        assert cgroup.remove() and not any(d.parent.exists() for d in cgroup.dirs)  # its empty parents too
    finally:
        parent.kill()
        parent.wait()


def test_killing_all_spares_a_process_outside_it(cgroup: Cgroup) -> None:
    inside = subprocess.Popen(["sleep", "300"])
    outside = subprocess.Popen(["sleep", "300"])
    try:
        cgroup.enter(inside.pid, 10)
        assert cgroup.pids() == {inside.pid}
        assert cgroup.kill_all(10)
        assert inside.wait(timeout=10) < 0 and outside.poll() is None
    finally:
        for p in (inside, outside):
            p.kill()
            p.wait()


def _wait_two(cgroup: Cgroup) -> set[int]:
    return wait_for("the shell and its child in the cgroup", lambda: p if len(p := cgroup.pids()) == 2 else None)
