"""MPS control daemons on the node: one per GPU that claims share through MPS, supervised.

MPS (NVIDIA's Multi-Process Service) lets the CUDA processes of several pods run on one GPU at
once, each held to the limits its container's environment sets (`driver.claims.gpu.sharing`). Its
control daemon, `nvidia-cuda-mps-control -d` from the NVIDIA driver root, is started here with
`CUDA_VISIBLE_DEVICES` naming the one GPU and its pipe and log directories under Tandem's own
state directory (`<data dir>/mps/<device>/{pipe,log}`), which the claims' CDI specs mount into
the containers. The layout of the pipe directory (`nvidia-cuda-mps-control.pid`) and the
management front end (`nvidia-cuda-mps-control` reading commands on stdin) are NVIDIA's ('MPS',
Appendix: Tools and Interface Reference).

Which GPUs need a daemon is never kept here: it is what the checkpoint's records say
(`needed`, device name -> GPU UUID), so `sync` is the whole state machine, run at start-up, after
every prepare and unprepare, and every `period` seconds by the `mps-supervisor` thread:

* a needed GPU whose daemon is not running gets one (a daemon that died is restarted);
* a running daemon is found again by its PID file and `/proc/<pid>/cmdline`, so a restarted
  Tandem adopts it instead of starting a second one;
* a daemon no record needs any more is told `quit` (killed if it does not go), and its directories
  are removed; but only while the records are `complete`: after the checkpoint was lost, a daemon
  no record names may serve a running pod until start-up has rebuilt its record;
* a needed GPU the inventory lacks now (its UUID unknown: NVML unanswered) keeps the daemon it
  has, and gets one once it is back.

A daemon outlives Tandem (`-d` detaches it), as the claims using it do; a kill -9 of Tandem at any
step leaves either a record without a daemon (started by the next `sync`) or a daemon without a
record (stopped by it), never a duplicate.

Shared memory: an MPS server and its clients exchange work through POSIX shared memory in
`/dev/shm`, so they must see the same one. As NVIDIA's DRA driver does, each daemon gets a
private one: a tmpfs at `<data dir>/mps/<device>/shm` (half the node's memory at most, as a
container's default), bound over `/dev/shm` in a mount namespace of the daemon's own (`unshare`),
so the servers it starts inherit it; the claims' CDI specs mount the same tmpfs at the
containers' `/dev/shm`. Then no pod sees the host's `/dev/shm` or another GPU's clients, and the
host's is not filled by them. It takes CAP_SYS_ADMIN (the DaemonSet's Tandem is privileged, and
the data dir is mounted `Bidirectional` so the runtime sees the tmpfs); without it (tests run
unprivileged) the daemon keeps the host's `/dev/shm` and says so in the log.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from driver.fsutil import locked
from driver.node.driver_root import BINARY_DIRS, driver_program

log = logging.getLogger(__name__)

CONTROL_PROGRAM = "nvidia-cuda-mps-control"
PID_FILE = "nvidia-cuda-mps-control.pid"
_START_TIMEOUT = 10.0
_QUIT_TIMEOUT = 10.0


class MpsError(Exception):
    """An MPS control daemon could not be started; the message says which GPU and why."""


class MpsDaemons:
    """`root`: `<data dir>/mps`. `needed`: the GPUs (device name -> UUID, None when unknown now)
    whose claims use MPS now. `complete`: whether the records name every prepared claim."""

    def __init__(
        self,
        root: Path,
        driver_root: Path,
        needed: Callable[[], Mapping[str, str | None]],
        period: float = 10.0,
        complete: Callable[[], bool] = lambda: True,
    ) -> None:
        self.root = root
        self._driver_root = driver_root
        self._needed = needed
        self._complete = complete
        self._period = period
        # One sync at a time, in this process and on the node: during a rolling update two
        # instances supervise the same daemons, and one must not start (or remove the PID file
        # of) a daemon the other is starting.
        self._lock = threading.Lock()
        self._lock_path = root.parent / "mps.lock"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def pipe_dir(self, device: str) -> Path:
        return self.root / device / "pipe"

    def log_dir(self, device: str) -> Path:
        return self.root / device / "log"

    def shm_dir(self, device: str) -> Path:
        return self.root / device / "shm"

    # --- the thread ---------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="mps-supervisor", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stops supervising; the daemons stay, for the claims that still use them."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self._period):
            try:
                self.sync()
            except Exception:  # the next round retries; one bad GPU must not end supervision
                log.exception("MPS supervision round failed")

    # --- the state machine --------------------------------------------------------------------

    def sync(self) -> None:
        """Daemons for exactly the needed GPUs (module docstring). Raises MpsError naming every
        GPU whose daemon could not be started; the others are done regardless."""
        self._lock_path.parent.mkdir(parents=True, exist_ok=True)
        with locked(self._lock, self._lock_path):
            needed = dict(self._needed())
            present = {p.name for p in self.root.iterdir() if p.is_dir()} if self.root.is_dir() else set()
            if self._complete():  # read after `needed`, which reads the records
                for device in sorted(present - set(needed)):
                    self._stop_daemon(device)
            failed = []
            for device, uuid in sorted(needed.items()):
                if uuid is None:
                    continue
                try:
                    self._ensure(device, uuid)
                except MpsError as e:
                    failed.append(str(e))
            if failed:
                raise MpsError("; ".join(failed))

    def running(self, device: str) -> int | None:
        """The PID of the device's control daemon, if one is running."""
        try:
            pid = int((self.pipe_dir(device) / PID_FILE).read_text().strip())
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, ValueError, IndexError):
            return None
        return pid if CONTROL_PROGRAM.encode() in cmdline and state not in ("Z", "X") else None

    def _program(self) -> Path:
        program = driver_program(self._driver_root, CONTROL_PROGRAM)
        if program is None:
            raise MpsError(
                f"{CONTROL_PROGRAM} is not in {', '.join(BINARY_DIRS)} of the NVIDIA driver root {self._driver_root}"
            )
        return program

    def _env(self, device: str, uuid: str) -> dict[str, str]:
        return {
            **os.environ,
            "CUDA_VISIBLE_DEVICES": uuid,
            "CUDA_MPS_PIPE_DIRECTORY": str(self.pipe_dir(device)),
            "CUDA_MPS_LOG_DIRECTORY": str(self.log_dir(device)),
        }

    def _ensure(self, device: str, uuid: str) -> None:
        if self.running(device) is not None:
            return
        program = self._program()
        for d in (self.pipe_dir(device), self.log_dir(device), self.shm_dir(device)):
            d.mkdir(parents=True, exist_ok=True)
        (self.pipe_dir(device) / PID_FILE).unlink(missing_ok=True)  # a dead daemon's
        log.info("starting the MPS control daemon of %s (%s)", device, uuid, extra={"device": device})
        try:
            done = subprocess.run(
                self._private_shm(device, [str(program), "-d"]),
                env=self._env(device, uuid),
                stdin=subprocess.DEVNULL,
                capture_output=True,
                timeout=_START_TIMEOUT,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired) as e:
            raise MpsError(f"{device}: {CONTROL_PROGRAM} -d failed: {e}") from e
        if done.returncode != 0:
            why = (done.stderr or done.stdout).decode(errors="replace").strip()[:300]
            raise MpsError(f"{device}: {CONTROL_PROGRAM} -d exited with {done.returncode}: {why}")
        deadline = time.monotonic() + _START_TIMEOUT
        while self.running(device) is None:
            if time.monotonic() > deadline:
                raise MpsError(f"{device}: the MPS control daemon did not come up within {_START_TIMEOUT:.0f}s")
            time.sleep(0.02)

    def _private_shm(self, device: str, cmd: list[str]) -> list[str]:
        """`cmd` run with the device's tmpfs as its `/dev/shm` (module docstring), mounted first."""
        shm = self.shm_dir(device)
        if os.geteuid() != 0:
            log.warning("MPS control daemon of %s: not root, so it shares the host's /dev/shm", device)
            return cmd
        if not os.path.ismount(shm):
            mounted = subprocess.run(
                ["mount", "-t", "tmpfs", "-o", f"rw,nosuid,nodev,noexec,size={_shm_size()}", "tandem-mps-shm", str(shm)],
                capture_output=True, timeout=_START_TIMEOUT, check=False,
            )  # fmt: skip
            if mounted.returncode != 0:
                raise MpsError(
                    f"{device}: mounting a tmpfs at {shm} failed: {mounted.stderr.decode(errors='replace')[:200]}"
                )
        bind = 'mount --bind "$0" /dev/shm && exec "$@"'
        return ["unshare", "--mount", "--propagation", "private", "sh", "-c", bind, str(shm), *cmd]

    def _stop_daemon(self, device: str) -> None:
        pid = self.running(device)
        if pid is not None:
            log.info("stopping the MPS control daemon of %s: no claim uses it", device, extra={"device": device})
            with contextlib.suppress(MpsError, OSError, subprocess.TimeoutExpired):
                subprocess.run(
                    [str(self._program())],
                    env={**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(self.pipe_dir(device))},
                    input=b"quit\n",
                    capture_output=True,
                    timeout=_QUIT_TIMEOUT,
                    check=False,
                )
            deadline = time.monotonic() + _QUIT_TIMEOUT
            while self.running(device) is not None and time.monotonic() < deadline:
                time.sleep(0.02)
            if self.running(device) is not None:
                log.warning("the MPS control daemon of %s ignored quit; killing it", device)
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
        if os.path.ismount(self.shm_dir(device)):  # lazily: a client that has not gone yet keeps it
            subprocess.run(["umount", "-l", str(self.shm_dir(device))], capture_output=True, timeout=_QUIT_TIMEOUT,
                           check=False)  # fmt: skip
        shutil.rmtree(self.root / device, ignore_errors=True)


def _shm_size() -> str:
    """Half the node's memory, as NVIDIA's driver sizes the MPS tmpfs (and the kernel a tmpfs)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return f"{int(line.split()[1]) // 2}k"
    except (OSError, ValueError, IndexError):
        pass
    return "65536k"
