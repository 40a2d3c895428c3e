"""The MPS control daemons Tandem supervises, against the stand-in for `nvidia-cuda-mps-control`
installed in a simulated driver root as NVIDIA's is: started once per needed GPU, restarted when
they die, adopted (never duplicated) by a restarted Tandem, stopped with `quit` when no claim
needs them, and the stand-in itself behaving like the real program at its interface."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from flocks import locked_elsewhere
from mps_fixtures import driver_root_fixture, needed_fixture  # noqa: F401  (fixtures: driver_root, needed)
from waiting import wait_for

from driver.claims.gpu.mps import MpsDaemons, MpsError
from driver.claims.gpu.mps_identity import CONTROL_PROGRAM
from driver.node.processes import identify, wait_gone
from sim.driver_files import BIN_DIR

UUID = "GPU-11111111-2222-3333-4444-555555555555"


@pytest.fixture
def daemons(tmp_path: Path, driver_root: Path, needed: dict[str, str | None]) -> Iterator[MpsDaemons]:
    mps = MpsDaemons(tmp_path / "data" / "mps", driver_root, lambda: needed, period=0.05)
    yield mps
    needed.clear()
    mps.stop()
    mps.sync()


def _control(driver_root: Path, pipe_dir: Path, commands: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(driver_root / BIN_DIR / CONTROL_PROGRAM)],
        env={**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(pipe_dir)},
        input=commands,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


def test_a_needed_gpu_gets_one_daemon_that_sees_only_its_gpu(
    tmp_path: Path, driver_root: Path, daemons: MpsDaemons, needed: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    seen = tmp_path / "cvd"
    monkeypatch.setenv("TANDEM_SIM_MPS_CVD", str(seen))
    needed["gpu-0"] = UUID
    daemons.sync()
    pid = daemons.running("gpu-0")
    assert pid is not None
    assert seen.read_text() == UUID
    assert (daemons.pipe_dir("gpu-0") / "control").exists()
    assert "Starting control daemon" in (daemons.log_dir("gpu-0") / "control.log").read_text()
    daemons.sync()
    assert daemons.running("gpu-0") == pid  # no second daemon
    answer = _control(
        driver_root, daemons.pipe_dir("gpu-0"), "set_default_active_thread_percentage 25\nget_server_list\n"
    )
    assert answer.returncode == 0 and answer.stdout.split() == ["25.0"]


def test_a_restarted_tandem_adopts_the_running_daemon(
    tmp_path: Path, driver_root: Path, daemons: MpsDaemons, needed: dict[str, str]
) -> None:
    needed["gpu-0"] = UUID
    daemons.sync()
    pid = daemons.running("gpu-0")
    again = MpsDaemons(daemons.root, driver_root, lambda: needed)  # what a new process builds
    again.sync()
    assert again.running("gpu-0") == pid


def test_a_daemon_that_dies_is_restarted_by_the_supervisor(daemons: MpsDaemons, needed: dict[str, str]) -> None:
    needed["gpu-0"] = UUID
    daemons.sync()
    pid = daemons.running("gpu-0")
    assert pid is not None
    daemons.start()
    os.kill(pid, signal.SIGKILL)
    restarted = wait_for("a new MPS control daemon", lambda: (p := daemons.running("gpu-0")) != pid and p, timeout=30)
    assert restarted != pid


def test_a_daemon_no_claim_needs_is_told_to_quit(
    driver_root: Path, daemons: MpsDaemons, needed: dict[str, str]
) -> None:
    needed["gpu-0"] = UUID
    daemons.sync()
    pid = daemons.running("gpu-0")
    assert pid is not None
    log = (daemons.log_dir("gpu-0") / "control.log").read_text()
    needed.clear()
    daemons.sync()
    assert daemons.running("gpu-0") is None
    assert not (daemons.root / "gpu-0").exists()
    wait_for("the daemon process to end", lambda: not Path(f"/proc/{pid}").exists() or _zombie(pid), timeout=30)
    assert "Starting control daemon" in log


def test_a_daemon_stays_while_its_gpu_is_unknown_or_the_records_may_be_incomplete(
    driver_root: Path, daemons: MpsDaemons, needed: dict[str, str | None]
) -> None:
    """Neither NVML unanswered for a while (the GPU leaves the inventory, its UUID unknown) nor a
    lost checkpoint (a running pod's record not rebuilt yet) is a reason to stop the daemon that
    pod's containers talk to."""
    needed["gpu-0"] = UUID
    daemons.sync()
    pid = daemons.running("gpu-0")
    assert pid is not None
    needed["gpu-0"] = None
    daemons.sync()
    assert daemons.running("gpu-0") == pid
    needed.clear()
    complete = False
    lost = MpsDaemons(daemons.root, driver_root, lambda: needed, complete=lambda: complete)
    lost.sync()
    assert lost.running("gpu-0") == pid
    complete = True
    lost.sync()
    assert lost.running("gpu-0") is None


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_the_stand_in_refuses_a_second_daemon_and_a_front_end_without_one(driver_root: Path, tmp_path: Path) -> None:
    pipe = tmp_path / "pipe"
    env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(pipe), "CUDA_MPS_LOG_DIRECTORY": str(tmp_path / "log")}
    program = str(driver_root / BIN_DIR / CONTROL_PROGRAM)
    assert _control(driver_root, pipe, "get_server_list\n").returncode == 1  # no daemon yet
    assert subprocess.run([program, "-d"], env=env, timeout=30, check=False).returncode == 0
    wait_for("the control socket", lambda: (pipe / "control").exists(), timeout=30)
    second = subprocess.run([program, "-d"], env=env, capture_output=True, text=True, timeout=30, check=False)
    assert second.returncode == 1 and "already running" in second.stderr
    assert "Unrecognized command" in _control(driver_root, pipe, "frobnicate\n").stdout
    assert _control(driver_root, pipe, "quit\n").returncode == 0
    wait_for("the daemon to remove its socket", lambda: not (pipe / "control").exists(), timeout=30)


def test_a_missing_control_program_is_an_error_naming_it(tmp_path: Path, needed: dict[str, str]) -> None:
    needed["gpu-0"] = UUID
    mps = MpsDaemons(tmp_path / "mps", tmp_path / "empty-root", lambda: needed)
    with pytest.raises(MpsError, match="nvidia-cuda-mps-control is not in"):
        mps.sync()


@pytest.mark.skipif(os.geteuid() != 0, reason="a private /dev/shm is a tmpfs mount in a mount namespace: needs root")
def test_each_daemon_has_a_private_dev_shm_that_its_claims_mount(daemons: MpsDaemons, needed: dict[str, str]) -> None:
    """MPS servers and clients share memory in /dev/shm: the daemon's is a tmpfs of its own (in a
    mount namespace it alone has), the same the claims' specs mount, and gone with the daemon."""
    needed["gpu-0"] = UUID
    daemons.sync()
    pid = daemons.running("gpu-0")
    assert pid is not None
    shm = daemons.shm_dir("gpu-0")
    assert os.path.ismount(shm)
    (shm / "probe").write_text("from the host")
    theirs = {line.split()[4]: line.split() for line in Path(f"/proc/{pid}/mountinfo").read_text().splitlines()}
    assert "/dev/shm" in theirs and "tmpfs" in theirs["/dev/shm"]
    assert Path(f"/proc/{pid}/root/dev/shm/probe").read_text() == "from the host"  # the same tmpfs
    assert not Path("/dev/shm/probe").exists()  # and not the host's
    needed.clear()
    daemons.sync()
    assert not os.path.ismount(shm) and not shm.exists()


def test_a_sync_holds_the_node_wide_lock_the_other_instance_of_a_rolling_update_takes(
    tmp_path: Path, driver_root: Path
) -> None:
    held: list[bool] = []

    def needed() -> dict[str, str | None]:
        held.append(locked_elsewhere(tmp_path / "data" / "mps.lock"))
        return {}

    MpsDaemons(tmp_path / "data" / "mps", driver_root, needed).sync()
    assert held == [True]


@pytest.mark.skipif(os.geteuid() != 0, reason="a private /dev/shm is a tmpfs mount in a mount namespace: needs root")
def test_a_daemon_started_again_gets_a_new_dev_shm(daemons: MpsDaemons, needed: dict[str, str]) -> None:
    """The tenants of a daemon that died may have left anything in its /dev/shm (issue 33): the
    next daemon, root like it, gets a tmpfs no one has had."""
    needed["gpu-0"] = UUID
    daemons.sync()
    pid = daemons.running("gpu-0")
    process = identify(pid) if pid is not None else None
    assert process is not None
    shm = daemons.shm_dir("gpu-0")
    (shm / "planted").symlink_to("/etc/hostname")
    os.kill(process.pid, signal.SIGKILL)
    assert wait_gone(process, 30)
    daemons.sync()
    again = daemons.running("gpu-0")
    assert again not in (None, pid) and os.path.ismount(shm)
    assert not os.path.lexists(shm / "planted") and not os.path.lexists(f"/proc/{again}/root/dev/shm/planted")
