"""A cgroup of Tandem's own, in every cgroup hierarchy of the node, for a process that must outlive
Tandem's container: the MPS control daemons (`driver.claims.gpu.mps`), which running pods use.

Why a cgroup: when Tandem's container stops (a crash, a rolling update, an upgrade), what kills its
processes is their cgroup, not their parentage. containerd's runc shim, once the container's init
has exited, runs `runc kill --all` for a container without a PID namespace of its own (hostPID;
`ShouldKillAllOnExit`), which writes `cgroup.kill` in its v2 cgroup (or the unified one of a
hybrid node) or signals every PID of its v1 `devices` cgroup; `runc delete` does the same; and the
kubelet, removing a pod, kills whatever is left in the pod's cgroup of every mounted hierarchy. A
process that has left the kubepods tree in every hierarchy is reached by none of them. (A
container's own PID namespace would kill it anyway, with its init: hence hostPID,
docs/deployment.md.)

Where: `<hierarchy>/tandem-mps/<owner>/<name>` in every hierarchy under `<sysfs root>/fs/cgroup`
(there: the cgroup v2 root itself, or on cgroup v1 each controller's and named hierarchy's mount,
the hybrid's `unified` among them), outside the kubepods tree that the kubelet owns and systemd's
slices. `owner` is the owning data directory as a name (`var-lib-kubelet-plugins-tandem.dev`), so
two installations on one node, or a test beside a cluster, never share one.

Moving a process there: its PID written to each `cgroup.procs` by a writer in the host's cgroup
namespace: on cgroup v2 mounted with `nsdelegate` (systemd's default) a writer in a private cgroup
namespace, which containerd gives every container there, may move a process only within that
namespace. So Tandem writes it itself where it shares PID 1's cgroup namespace (cgroup v1, where
containers get none of their own; a node process; a PID 1 it may not inspect), and otherwise
through `nsenter --cgroup=/proc/1/ns/cgroup` (PID 1 being the host's under hostPID).

What is in it is the supervised process's and its children's, and nobody else's: only Tandem moves
a process there, tenants cannot write the host's cgroup tree, and children stay in their parent's
cgroup. So `kill_all` may stop everything it finds there (the MPS servers a killed control daemon
left, a daemon that no record names); each through a pidfd opened before the PID is checked to be
listed still, so the process signalled is the one listed, never another that got its PID.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import time
from pathlib import Path

PARENT = "tandem-mps"
_PROCS = "cgroup.procs"
_MOVE = ("nsenter", "--cgroup=/proc/1/ns/cgroup", "--", "sh", "-c", 'for f; do echo "$0" >"$f" || exit; done')


def hierarchies(sysfs_root: Path) -> list[Path]:
    """The node's cgroup hierarchies (module docstring); none where nothing is mounted there."""
    root = sysfs_root / "fs" / "cgroup"
    if (root / _PROCS).exists():  # cgroup v2: one hierarchy, mounted right there
        return [root]
    try:  # v1: a directory per hierarchy; links (`cpu` -> `cpu,cpuacct`) name one twice
        return sorted(d for d in root.iterdir() if not d.is_symlink() and (d / _PROCS).exists())
    except OSError:
        return []


def owner_name(data_dir: Path) -> str:
    """The cgroup name of what `data_dir`'s Tandem owns: its path, '/' as '-'."""
    return str(data_dir).strip("/").replace("/", "-")


class Cgroup:
    """`<hierarchy>/tandem-mps/<owner>/<name>` in each of `hierarchies`."""

    def __init__(self, hierarchies: list[Path], owner: str, name: str) -> None:
        self._dirs = [h / PARENT / owner / name for h in hierarchies]

    @property
    def dirs(self) -> list[Path]:
        return list(self._dirs)

    def enter(self, pid: int, timeout: float) -> None:
        """Moves process `pid` (not yet its children: start it before it forks) into this cgroup,
        made first where missing. OSError when it cannot be moved, or there is nowhere to move it."""
        if not self._dirs:
            raise OSError("no cgroup hierarchy is mounted")
        for d in self._dirs:
            for level in (d.parent.parent, d.parent, d):
                _make(level)
        if _in_host_cgroup_namespace():
            for d in self._dirs:
                (d / _PROCS).write_text(str(pid))
            return
        try:
            moved = subprocess.run(
                [*_MOVE, str(pid), *(str(d / _PROCS) for d in self._dirs)],
                capture_output=True,
                timeout=timeout,
                check=False,
            )
        except subprocess.TimeoutExpired as e:
            raise OSError(f"moving it took over {timeout:.0f}s") from e
        if moved.returncode != 0:
            raise OSError(moved.stderr.decode(errors="replace").strip()[:300] or f"exit code {moved.returncode}")

    def pids(self) -> set[int]:
        """The processes in this cgroup, in any hierarchy."""
        found: set[int] = set()
        for d in self._dirs:
            with contextlib.suppress(OSError, ValueError):
                found.update(int(line) for line in (d / _PROCS).read_text().split())
        return found

    def kill_all(self, timeout: float) -> bool:
        """SIGKILL to everything in this cgroup (module docstring); True once it is empty, False if
        something is still there after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while pids := self.pids():
            pidfds = [fd for pid in pids if (fd := self._kill_if_listed(pid)) is not None]
            try:  # a killed process leaves cgroup.procs as it exits, when its pidfd turns readable
                poller = select.poll()
                for fd in pidfds:
                    poller.register(fd, select.POLLIN)
                waiting = set(pidfds)
                while waiting and (left := deadline - time.monotonic()) > 0:
                    for fd, _ in poller.poll(left * 1000):
                        poller.unregister(fd)
                        waiting.discard(fd)
            finally:
                for fd in pidfds:
                    os.close(fd)
            if time.monotonic() > deadline:
                return not self.pids()
        return True

    def _kill_if_listed(self, pid: int) -> int | None:
        """SIGKILL to `pid` if it is listed here still once a pidfd pins it: that pidfd, to wait on."""
        try:
            pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            return None
        if pid not in self.pids():  # checked after the pidfd pins the process: the one listed is the one killed
            os.close(pidfd)
            return None
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        return pidfd

    def remove(self) -> bool:
        """Removes this cgroup where it exists, and the parents it leaves empty; whether it is gone
        (not while a process is in it)."""
        gone = True
        for d in self._dirs:
            try:
                d.rmdir()
            except FileNotFoundError:
                pass
            except OSError:
                gone = False
                continue
            for parent in (d.parent, d.parent.parent):  # `<owner>`, `tandem-mps`: other GPUs' may remain
                with contextlib.suppress(OSError):
                    parent.rmdir()
        return gone


def _make(d: Path) -> None:
    """`d`, below an existing parent; a v1 cpuset cgroup starts with no CPUs and no memory nodes
    and takes no process so, so it gets its parent's (as runc makes a container's)."""
    d.mkdir(exist_ok=True)
    for name in ("cpuset.cpus", "cpuset.mems"):
        with contextlib.suppress(FileNotFoundError):
            if not (d / name).read_text().strip():
                (d / name).write_text((d.parent / name).read_text())


def _in_host_cgroup_namespace() -> bool:
    try:
        own, host = os.stat("/proc/self/ns/cgroup"), os.stat("/proc/1/ns/cgroup")
    except PermissionError:  # a PID 1 this process may not inspect is not a container's own init
        return True
    return (own.st_dev, own.st_ino) == (host.st_dev, host.st_ino)
