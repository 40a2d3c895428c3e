"""MPS control daemons on the node: one per GPU that claims share through MPS, supervised.

MPS (NVIDIA's Multi-Process Service) lets the CUDA processes of several pods run on one GPU at
once, each held to the limits its container's environment sets (`driver.claims.gpu.sharing`). Its
control daemon, `nvidia-cuda-mps-control -f` from the NVIDIA driver root (in the foreground, as
NVIDIA's DRA driver runs it), is started here with `CUDA_VISIBLE_DEVICES` naming the one GPU and
its pipe and log directories under Tandem's own state directory (`<data dir>/mps/<device>/`),
which the claims' CDI specs mount into the containers. The layout of the pipe directory (`control`, `nvidia-cuda-mps-control.pid`) and the management front
end (`nvidia-cuda-mps-control` reading commands on stdin) are NVIDIA's ('MPS', Appendix: Tools
and Interface Reference).

What is the tenants' and what is Tandem's: the pipe directory and the private `/dev/shm` are
mounted read-write into every container of the GPU's MPS claims, so a daemon is known only by
Tandem's record of it (`driver.claims.gpu.mps_identity`), and none is started into a directory a
tenant has had: each start gets a new pipe directory (`driver.claims.gpu.mps_pipes`). Tandem talks
to a daemon through its control socket only when that is a socket: a symlink there could lead to
another GPU's daemon, a FIFO would stall the front end.

Starting, crash-safely: the daemon is started behind a gate, `sh` waiting for a line on its stdin
before it execs the daemon (which keeps its PID and start time). Tandem records the gate's
identity, then releases it. A kill -9 before the record leaves a gate that reads end-of-file and
exits: no daemon; after it, the record names the daemon. No daemon runs unrecorded, so a
restarted Tandem, or the other instance of a rolling update (one `sync` at a time across both:
the `mps.lock` flock), finds every one. It is up once it answers its front end (`get_server_list`).

Which GPUs need a daemon is never kept here: it is what the checkpoint's records say
(`needed`, device name -> GPU UUID), so `sync` is the whole state machine, run at start-up, after
every unprepare, and every `period` seconds by the `mps-supervisor` thread (a prepare starts only
its own claim's GPUs' daemons: another GPU's trouble neither fails nor delays it):

* a needed GPU whose daemon is not running gets one (a daemon that died is restarted);
* a running daemon is found again by its record, so a restarted Tandem adopts it instead of
  starting a second one; a daemon a release before this one started (`-d`, no record) is adopted
  once by its PID file, read as untrusted (`driver.claims.gpu.mps_identity.legacy_daemon`);
* a daemon no record needs any more is told `quit` (killed if it does not go), and its directories
  are removed; but only while the records are `complete`: after the checkpoint was lost, a daemon
  no record names may serve a running pod until start-up has rebuilt its record;
* a needed GPU the inventory lacks now (its UUID unknown: NVML unanswered) keeps the daemon it
  has, and gets one once it is back.

A daemon outlives Tandem, as the claims using it do, and Tandem's container too: it runs in a
session of its own, and the gate is moved into a cgroup of the GPU's own outside the container's
before it execs the daemon (`driver.node.cgroups`, which says why that is what a container's end
spares; a node where it cannot be moved logs so, and its daemons stop with the container). A kill
-9 of Tandem at any step leaves either a record without a daemon (started by the next `sync`) or a
daemon without a claim record (stopped by it), never a duplicate or a daemon no one knows; whatever
else is in a GPU's cgroup (the servers a killed daemon left, a daemon no record names) is killed
before a daemon starts there and when it stops. While Tandem runs, the daemons it started are its
children, reaped as they end; those of an earlier instance are no one's to reap but the node's.

Each daemon has a private `/dev/shm`, which its claims' containers share with it
(`driver.claims.gpu.mps_shm`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import subprocess
import threading
import time
from collections.abc import Callable, Collection, Mapping
from pathlib import Path

from driver.claims.gpu.mps_identity import CONTROL_PROGRAM, RECORD, Recorded, legacy_daemon, read_record, write_record
from driver.claims.gpu.mps_pipes import LINK, fresh, remove_tree, settle
from driver.claims.gpu.mps_shm import release_shm, with_private_shm
from driver.errors import DeviceError
from driver.fsutil import locked
from driver.node.cgroups import Cgroup, hierarchies, owner_name
from driver.node.driver_root import BINARY_DIRS, driver_program
from driver.node.processes import alive, identify, kill, wait_gone

log = logging.getLogger(__name__)

CONTROL_SOCKET = "control"
_START_TIMEOUT = 10.0
_QUIT_TIMEOUT = 10.0
_KILL_TIMEOUT = 5.0
# The daemon is held here until Tandem has recorded it (module docstring): no line, no daemon.
_GATE = ("sh", "-c", 'read -r _ && exec "$@" </dev/null', "sh")


class MpsError(DeviceError):
    """An MPS control daemon could not be started; the message says which GPU and why."""


class MpsDaemons:
    """`root`: `<data dir>/mps`. `needed`: the GPUs (device name -> UUID, None when unknown now)
    whose claims use MPS now. `complete`: whether the records name every prepared claim.
    `sysfs_root`: where the node's cgroup hierarchies are mounted (`fs/cgroup` below it); None
    keeps the daemons in Tandem's own cgroup (tests of everything else)."""

    def __init__(
        self,
        root: Path,
        driver_root: Path,
        needed: Callable[[], Mapping[str, str | None]],
        period: float = 10.0,
        complete: Callable[[], bool] = lambda: True,
        sysfs_root: Path | None = None,
    ) -> None:
        self.root = root
        self._sysfs_root = sysfs_root
        self._driver_root = driver_root
        self._needed = needed
        self._complete = complete
        self._period = period
        # One sync at a time, in this process and on the node: during a rolling update two
        # instances supervise the same daemons, and one must not start (or clear the pipe
        # directory of) a daemon the other is starting.
        self._lock = threading.Lock()
        self._lock_path = root.parent / "mps.lock"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._children: dict[int, subprocess.Popen[bytes]] = {}  # daemons this process started, to reap
        # Device -> the inode of the control socket its daemon bound, as first seen by this instance
        # (`_control_kept`).
        self._sockets: dict[str, int] = {}

    def pipe_dir(self, device: str) -> Path:
        """What the claims' containers mount: Tandem's link to the current daemon's pipe directory."""
        return self.root / device / LINK

    def log_dir(self, device: str) -> Path:
        return self.root / device / "log"

    def shm_dir(self, device: str) -> Path:
        return self.root / device / "shm"

    def cgroup(self, device: str) -> Cgroup | None:
        """The cgroup the device's daemon runs in, out of Tandem's container (module docstring)."""
        if self._sysfs_root is None:
            return None
        return Cgroup(hierarchies(self._sysfs_root), owner_name(self.root.parent), device)

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

    def sync(self, devices: Collection[str] | None = None) -> None:
        """Daemons for exactly the needed GPUs (module docstring). `devices`: only these GPUs'
        daemons started and nothing stopped (a prepare's own GPUs). Raises MpsError naming every
        GPU whose daemon could not be started; the others are done regardless."""
        self._lock_path.parent.mkdir(parents=True, exist_ok=True)
        with locked(self._lock, self._lock_path):
            needed = dict(self._needed())
            present = {p.name for p in self.root.iterdir() if p.is_dir()} if self.root.is_dir() else set()
            if devices is None and self._complete():  # read after `needed`, which reads the records
                for device in sorted(present - set(needed)):
                    self._stop_daemon(device)
            failed = []
            for device, uuid in sorted(needed.items()):
                if uuid is None or (devices is not None and device not in devices):
                    continue
                try:
                    self._ensure(device, uuid)
                except MpsError as e:
                    failed.append(str(e))
            if failed:
                raise MpsError("; ".join(failed))

    def running(self, device: str) -> int | None:
        """The PID of the device's control daemon, if the one on record runs."""
        self._reap()
        daemon = read_record(self._record(device))
        return daemon.process.pid if daemon is not None and alive(daemon.process) else None

    # --- identity: Tandem's record, never the pipe directory ----------------------------------

    def _record(self, device: str) -> Path:
        return self.root / device / RECORD

    def _pipe(self, device: str, daemon: Recorded) -> Path:
        return self.root / device / daemon.pipe

    def _daemon(self, device: str) -> Recorded | None:
        """The device's running daemon: the one on record, or one an earlier release started (in
        the previous layout's pipe directory)."""
        daemon = None
        if self._record(device).exists():
            daemon = read_record(self._record(device))
        elif (process := legacy_daemon(self.pipe_dir(device))) is not None:
            log.info(
                "adopting the MPS control daemon of %s an earlier release started (PID %d)",
                device,
                process.pid,
                extra={"device": device},
            )
            daemon = Recorded(process, LINK)
            write_record(self._record(device), daemon)
        return daemon if daemon is not None and alive(daemon.process) else None

    def _reap(self) -> None:
        for pid, child in list(self._children.items()):
            if child.poll() is not None:
                self._children.pop(pid, None)

    # --- starting -----------------------------------------------------------------------------

    def _program(self) -> Path:
        program = driver_program(self._driver_root, CONTROL_PROGRAM)
        if program is None:
            raise MpsError(
                f"{CONTROL_PROGRAM} is not in {', '.join(BINARY_DIRS)} of the NVIDIA driver root {self._driver_root}"
            )
        return program

    def _env(self, device: str, uuid: str, pipe: Path) -> dict[str, str]:
        return {
            **os.environ,
            "CUDA_VISIBLE_DEVICES": uuid,
            "CUDA_MPS_PIPE_DIRECTORY": str(pipe),
            "CUDA_MPS_LOG_DIRECTORY": str(self.log_dir(device)),
        }

    def _ensure(self, device: str, uuid: str) -> None:
        daemon = self._daemon(device)
        if daemon is not None and self._control_kept(device, self._pipe(device, daemon)):
            self._settle(device, daemon.pipe)
            return
        if daemon is not None:
            log.warning(
                "the MPS control daemon of %s lost its control socket (another daemon bound it, or it "
                "was removed): no client reaches it; restarting it",
                device,
                extra={"device": device},
            )
            if not kill(daemon.process, _KILL_TIMEOUT):
                raise MpsError(f"{device}: the MPS control daemon (PID {daemon.process.pid}) outlived SIGKILL")
        self._sockets.pop(device, None)
        program = self._program()
        cgroup = self.cgroup(device)
        if cgroup is not None and not cgroup.kill_all(_KILL_TIMEOUT):  # what no record names: module docstring
            log.warning(
                "processes in the cgroup of the MPS control daemon of %s outlived SIGKILL",
                device,
                extra={"device": device},
            )
        output = self.root / device / "daemon.out"  # its stdout and stderr, for the error
        try:
            for d in (self.log_dir(device), self.shm_dir(device)):
                d.mkdir(parents=True, exist_ok=True)
            pipe = fresh(self.root / device)  # never one a tenant has had (`mps_pipes`)
            out = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as e:
            raise MpsError(f"{device}: preparing the MPS directories failed: {e}") from e
        log.info("starting the MPS control daemon of %s (%s)", device, uuid, extra={"device": device})
        try:
            command = with_private_shm(device, self.shm_dir(device), [str(program), "-f"])
            gate = subprocess.Popen(
                [*_GATE, *command],
                env=self._env(device, uuid, pipe),
                stdin=subprocess.PIPE,
                stdout=out,
                stderr=out,
                start_new_session=True,
            )
        except OSError as e:
            raise MpsError(f"{device}: {CONTROL_PROGRAM} -f failed: {e}") from e
        finally:
            os.close(out)
        self._children[gate.pid] = gate
        try:
            process = identify(gate.pid)
            if process is None:
                raise OSError(f"it exited at once ({gate.wait()})")
            write_record(self._record(device), Recorded(process, pipe.name))
            self._escape(device, cgroup, gate.pid)
            assert gate.stdin is not None
            gate.stdin.write(b"\n")  # recorded: let it exec the daemon
            gate.stdin.close()
        except OSError as e:
            gate.kill()  # still the gate, never the daemon: nothing runs unrecorded
            with contextlib.suppress(subprocess.TimeoutExpired):
                gate.wait(_QUIT_TIMEOUT)  # gone and reaped before the failure is told (SIGKILL is not instant)
            raise MpsError(f"{device}: starting {CONTROL_PROGRAM} failed: {e}") from e
        self._wait_up(device, gate, output, pipe)
        self._control_kept(device, pipe)  # the socket it bound, from now on
        self._settle(device, pipe.name)  # only now may a container mount it: the daemon has made its files

    def _settle(self, device: str, pipe: str) -> None:
        try:
            settle(self.root / device, pipe)
        except OSError as e:
            raise MpsError(f"{device}: pointing the claims' pipe directory at the daemon's failed: {e}") from e

    def _control_kept(self, device: str, pipe: Path) -> bool:
        """Whether the control socket is still the one the daemon bound. Another daemon binding the
        same path (an older release's during an upgrade's overlap, which cannot see ours from its
        own PID namespace) leaves ours running but unreachable: it must then be restarted."""
        try:
            found = os.lstat(pipe / CONTROL_SOCKET)
        except OSError:
            return False
        return stat.S_ISSOCK(found.st_mode) and self._sockets.setdefault(device, found.st_ino) == found.st_ino

    def _escape(self, device: str, cgroup: Cgroup | None, pid: int) -> None:
        """The gate, and so the daemon it becomes and the servers that daemon starts, into the GPU's
        cgroup, out of Tandem's container; where that fails it stays, and stops with the container."""
        if cgroup is None:
            return
        try:
            cgroup.enter(pid, _START_TIMEOUT)
        except OSError as e:
            log.warning(
                "the MPS control daemon of %s stays in Tandem's cgroup, so it stops with Tandem's "
                "container: moving it out failed: %s",
                device,
                e,
                extra={"device": device},
            )

    def _wait_up(self, device: str, gate: subprocess.Popen[bytes], output: Path, pipe: Path) -> None:
        deadline = time.monotonic() + _START_TIMEOUT
        while (left := deadline - time.monotonic()) > 0:
            if gate.poll() is not None:
                with open(output, "rb") as f:  # Tandem's own file, beside the pipe directory
                    why = f.read()[-300:].decode(errors="replace").strip()
                raise MpsError(f"{device}: {CONTROL_PROGRAM} -f exited with {gate.returncode}: {why}")
            if self._tell(pipe, "get_server_list", left):
                return
            time.sleep(0.02)
        raise MpsError(f"{device}: the MPS control daemon did not answer within {_START_TIMEOUT:.0f}s")

    def _tell(self, pipe: Path, command: str, timeout: float) -> bool:
        """Whether the front end delivered `command` to the daemon: only through a control socket
        that is a socket (module docstring), and never for longer than `timeout`."""
        try:
            if not stat.S_ISSOCK(os.lstat(pipe / CONTROL_SOCKET).st_mode):
                return False
            done = subprocess.run(
                [str(self._program())],
                env={**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(pipe)},
                input=f"{command}\n".encode(),
                capture_output=True,
                timeout=timeout,
                check=False,
            )
        except (OSError, MpsError, subprocess.TimeoutExpired):
            return False
        return done.returncode == 0

    # --- stopping -----------------------------------------------------------------------------

    def _stop_daemon(self, device: str) -> None:
        self._sockets.pop(device, None)
        daemon = self._daemon(device)
        if daemon is not None:
            process = daemon.process
            log.info("stopping the MPS control daemon of %s: no claim uses it", device, extra={"device": device})
            if not (
                self._tell(self._pipe(device, daemon), "quit", _QUIT_TIMEOUT) and wait_gone(process, _QUIT_TIMEOUT)
            ):
                log.warning(
                    "the MPS control daemon of %s did not quit (its control socket gone, not a socket or "
                    "unanswered); killing it",
                    device,
                    extra={"device": device},
                )
                if not kill(process, _KILL_TIMEOUT):
                    log.error(
                        "the MPS control daemon of %s (PID %d) outlived SIGKILL; kept on record, retried next round",
                        device,
                        process.pid,
                        extra={"device": device},
                    )
                    return
        self._reap()
        cgroup = self.cgroup(device)
        if cgroup is not None and not (cgroup.kill_all(_KILL_TIMEOUT) and cgroup.remove()):
            log.error(
                "the cgroup of the MPS control daemon of %s holds processes that outlived SIGKILL; retried next round",
                device,
                extra={"device": device},
            )
            return
        release_shm(self.shm_dir(device))
        remove_tree(self.root, device)  # its pipe directories are the tenants': nothing in them followed
