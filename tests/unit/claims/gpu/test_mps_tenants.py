"""Hostile tenants against the MPS control daemons (issue 22, finding 1). A GPU's pipe directory
is mounted read-write into its MPS claims' containers, so a container's root can put anything
there: a FIFO or a symlink to /dev/zero in place of the daemon's PID file, another GPU's daemon's
PID, a control socket removed or leading to another GPU's daemon. None of it stalls Tandem, gets a
daemon that is not the GPU's own quit or killed, or loses track of the GPU's own; a restarted
Tandem adopts its daemons by its own record. Real daemons of the stand-in control program run."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from mps_fixtures import driver_root_fixture, needed_fixture  # noqa: F401  (fixtures: driver_root, needed)
from waiting import wait_for

from driver.claims.gpu import mps
from driver.claims.gpu.mps import _GATE, MpsDaemons, MpsError
from driver.claims.gpu.mps_identity import CONTROL_PROGRAM, PID_FILE, RECORD
from driver.node.processes import identify, wait_gone
from sim.driver_files import BIN_DIR

UUIDS = {"gpu-0": "GPU-00000000-0000-0000-0000-000000000000", "gpu-1": "GPU-11111111-1111-1111-1111-111111111111"}


@pytest.fixture
def daemons(tmp_path: Path, driver_root: Path, needed: dict[str, str | None]) -> Iterator[MpsDaemons]:
    mps = MpsDaemons(tmp_path / "data" / "mps", driver_root, lambda: needed)
    yield mps
    needed.clear()
    with contextlib.suppress(MpsError):
        mps.sync()  # stopped, their tmpfs unmounted
    for pid in _daemons_under(tmp_path):  # whatever a failure left, so that none outlives the test
        os.kill(pid, signal.SIGKILL)


def _daemons_under(tmp_path: Path) -> list[int]:
    """The live control daemons whose pipe directory is under `tmp_path` (by their environment)."""
    out = []
    for proc in Path("/proc").iterdir():
        try:
            environ = (proc / "environ").read_bytes().split(b"\0")
            cmdline = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        pipe = next((e for e in environ if e.startswith(b"CUDA_MPS_PIPE_DIRECTORY=")), b"")
        if CONTROL_PROGRAM.encode() in cmdline and str(tmp_path).encode() in pipe and identify(int(proc.name)):
            out.append(int(proc.name))
    return out


def _finishes(work: Callable[[], object], fifo: Path | None = None) -> object:
    """`work`'s result; an AssertionError if it is still blocked after a minute (on a FIFO without
    a writer: then a writer opens and closes it, so that the blocked thread can end)."""
    result: list[object] = []
    thread = threading.Thread(target=lambda: result.append(work()), daemon=True)
    thread.start()
    thread.join(60)
    if thread.is_alive() and fifo is not None:
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        thread.join(60)
    assert result, "blocked on what a tenant put into the pipe directory"
    return result[0]


def _kill(pid: int) -> None:
    """The daemon dies (and has died once this returns: a SIGKILL takes effect asynchronously)."""
    process = identify(pid)
    assert process is not None
    os.kill(pid, signal.SIGKILL)
    assert wait_gone(process, 30)


def _plant(path: Path, what: str) -> None:
    """A tenant replaces `path` (root in its container: it may)."""
    if path.is_dir() and not path.is_symlink():
        path.rmdir()
    else:
        path.unlink(missing_ok=True)
    if what == "fifo":
        os.mkfifo(path)
    elif what == "dev-zero":
        path.symlink_to("/dev/zero")
    elif what == "directory":
        path.mkdir()
    else:
        path.write_text(what)


@pytest.mark.parametrize("what", ["fifo", "dev-zero", "directory"])
def test_a_restarted_tandem_adopts_its_daemon_whatever_is_in_place_of_the_pid_file(
    tmp_path: Path, driver_root: Path, daemons: MpsDaemons, needed: dict[str, str | None], what: str
) -> None:
    needed["gpu-0"] = UUIDS["gpu-0"]
    daemons.sync()
    pid = daemons.running("gpu-0")
    assert pid is not None
    pid_file = daemons.pipe_dir("gpu-0") / PID_FILE
    _plant(pid_file, what)
    again = MpsDaemons(daemons.root, driver_root, lambda: needed)  # what a new process builds

    def restart() -> int | None:
        again.sync()
        return again.running("gpu-0")

    assert _finishes(restart, pid_file if what == "fifo" else None) == pid  # adopted: no second daemon
    assert _daemons_under(tmp_path) == [pid]
    needed.clear()
    _finishes(again.sync, pid_file if what == "fifo" else None)
    assert _daemons_under(tmp_path) == [] and not (daemons.root / "gpu-0").exists()


def test_a_daemon_that_died_is_restarted_whatever_a_tenant_left_in_its_names(
    tmp_path: Path, daemons: MpsDaemons, needed: dict[str, str | None]
) -> None:
    """A FIFO at the PID file, a directory at the control socket: the next daemon starts anyway
    (a daemon refuses to start while its PID file names a live process; this one names another
    GPU's daemon, which is left alone)."""
    needed.update(UUIDS)
    daemons.sync()
    pid, other = daemons.running("gpu-0"), daemons.running("gpu-1")
    assert pid is not None and other is not None
    _kill(pid)
    _plant(daemons.pipe_dir("gpu-0") / "control", "directory")
    _plant(daemons.pipe_dir("gpu-0") / PID_FILE, str(other))
    _finishes(daemons.sync)
    again = daemons.running("gpu-0")
    assert again is not None and again != pid
    assert daemons.running("gpu-1") == other
    _plant(daemons.pipe_dir("gpu-0") / PID_FILE, "fifo")
    _kill(again)
    _finishes(daemons.sync, daemons.pipe_dir("gpu-0") / PID_FILE)
    assert daemons.running("gpu-0") not in (None, again)


def test_another_gpus_pid_and_a_removed_control_socket_never_get_that_gpus_daemon_killed(
    tmp_path: Path, daemons: MpsDaemons, needed: dict[str, str | None]
) -> None:
    """The GPU's own daemon, unreachable through its socket, is killed as the process Tandem
    started; the PID the tenant wrote is never signalled."""
    needed.update(UUIDS)
    daemons.sync()
    mine, theirs = daemons.running("gpu-0"), daemons.running("gpu-1")
    assert mine is not None and theirs is not None
    _plant(daemons.pipe_dir("gpu-0") / PID_FILE, str(theirs))
    (daemons.pipe_dir("gpu-0") / "control").unlink()
    del needed["gpu-0"]
    daemons.sync()
    assert identify(mine) is None  # gone, not leaked
    assert daemons.running("gpu-1") == theirs and identify(theirs) is not None
    assert _daemons_under(tmp_path) == [theirs]


def test_a_control_socket_leading_to_another_gpus_daemon_is_not_told_to_quit(
    tmp_path: Path, daemons: MpsDaemons, needed: dict[str, str | None]
) -> None:
    needed.update(UUIDS)
    daemons.sync()
    mine, theirs = daemons.running("gpu-0"), daemons.running("gpu-1")
    control = daemons.pipe_dir("gpu-0") / "control"
    control.unlink()
    control.symlink_to(daemons.pipe_dir("gpu-1") / "control")
    del needed["gpu-0"]
    daemons.sync()
    assert mine is not None and identify(mine) is None
    assert daemons.running("gpu-1") == theirs and _daemons_under(tmp_path) == [theirs]


def test_a_recorded_pid_that_names_another_process_now_is_neither_signalled_nor_adopted(
    tmp_path: Path, daemons: MpsDaemons, needed: dict[str, str | None]
) -> None:
    """The daemon died and its PID went to another process (its start time differs)."""
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        me = identify(stranger.pid)
        assert me is not None
        record = daemons.root / "gpu-0" / RECORD
        record.parent.mkdir(parents=True)
        record.write_text(json.dumps({"version": 1, "daemon": dataclasses.replace(me, start=me.start - 1).to_json()}))
        needed["gpu-0"] = UUIDS["gpu-0"]
        daemons.sync()
        started = daemons.running("gpu-0")
        assert started not in (None, stranger.pid)
        record.write_text(json.dumps({"version": 1, "daemon": dataclasses.replace(me, start=me.start - 1).to_json()}))
        assert started is not None
        _kill(started)
        needed.clear()
        daemons.sync()
        assert stranger.poll() is None and not (daemons.root / "gpu-0").exists()
    finally:
        stranger.kill()
        stranger.wait()


def test_a_daemon_an_earlier_release_started_is_adopted_only_by_its_own_gpu(
    tmp_path: Path, driver_root: Path, daemons: MpsDaemons, needed: dict[str, str | None]
) -> None:
    """A release before this one kept no record: its daemon (`-d`) is found once by the PID file in
    its pipe directory, believed only for a daemon whose environment names that directory; the
    same PID written into another GPU's pipe directory adopts nothing there."""
    pipe = daemons.pipe_dir("gpu-0")
    env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(pipe), "CUDA_MPS_LOG_DIRECTORY": str(daemons.log_dir("gpu-0"))}
    subprocess.run([str(driver_root / BIN_DIR / CONTROL_PROGRAM), "-d"], env=env, check=True, timeout=30)
    legacy = int((pipe / PID_FILE).read_text())
    daemons.pipe_dir("gpu-1").mkdir(parents=True)
    _plant(daemons.pipe_dir("gpu-1") / PID_FILE, str(legacy))
    needed.update(UUIDS)
    daemons.sync()
    assert daemons.running("gpu-1") not in (None, legacy)
    assert daemons.running("gpu-0") == legacy  # adopted, and from now on on record
    assert (daemons.root / "gpu-0" / RECORD).exists()
    needed.clear()
    daemons.sync()
    assert _daemons_under(tmp_path) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="a PID namespace of the tenant's own: needs root")
def test_a_tenant_process_named_and_dressed_as_a_daemon_is_never_adopted(
    daemons: MpsDaemons, needed: dict[str, str | None]
) -> None:
    """Under hostPID Tandem sees tenants' processes, and a tenant may exec anything under the name
    `nvidia-cuda-mps-control` with this GPU's pipe directory in its environment, and write its PID
    into the PID file of a pipe directory of an earlier release: it is in its pod's PID namespace,
    not Tandem's, so it is neither adopted nor signalled, and a daemon of Tandem's own starts."""
    pipe = daemons.pipe_dir("gpu-0")
    pipe.mkdir(parents=True)
    dressed = f"import os; os.execve('/bin/sleep', [{CONTROL_PROGRAM!r}, '300'], {{'CUDA_MPS_PIPE_DIRECTORY': {str(pipe)!r}}})"
    pod = subprocess.Popen(["unshare", "--pid", "--fork", "--kill-child", sys.executable, "-c", dressed])
    try:
        children = Path(f"/proc/{pod.pid}/task/{pod.pid}/children")
        tenant = int(wait_for("the tenant's process", lambda: children.read_text().split())[0])
        wait_for("it dressed up", lambda: CONTROL_PROGRAM.encode() in Path(f"/proc/{tenant}/cmdline").read_bytes())
        _plant(pipe / PID_FILE, str(tenant))
        needed.update({"gpu-0": UUIDS["gpu-0"]})
        daemons.sync()
        assert daemons.running("gpu-0") not in (None, tenant)
        assert identify(tenant) is not None  # not signalled
    finally:
        pod.kill()
        pod.wait()


def test_a_daemon_is_never_run_unrecorded(
    tmp_path: Path, daemons: MpsDaemons, needed: dict[str, str | None], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The gate execs the daemon only on a line from Tandem, sent after the record: a Tandem
    killed before that closes the gate's stdin (end of file), and nothing runs."""
    marker = tmp_path / "ran"
    gate = subprocess.Popen([*_GATE, "touch", str(marker)], stdin=subprocess.PIPE)
    assert gate.stdin is not None
    gate.stdin.close()  # as the kernel does for a Tandem killed here
    assert gate.wait(timeout=30) != 0 and not marker.exists()
    released = subprocess.run([*_GATE, "touch", str(marker)], input=b"\n", timeout=30, check=False)
    assert released.returncode == 0 and marker.exists()

    def no_record(*_: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(mps, "write_record", no_record)
    needed["gpu-0"] = UUIDS["gpu-0"]
    with pytest.raises(MpsError, match="gpu-0: starting nvidia-cuda-mps-control failed: disk full"):
        daemons.sync()
    assert _daemons_under(tmp_path) == []
