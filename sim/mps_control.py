#!/usr/bin/env python3
"""A stand-in for `nvidia-cuda-mps-control`, the MPS control daemon, at its command-line interface.

Rendered into the simulated driver root as `usr/bin/nvidia-cuda-mps-control` (`sim.driver_files`),
so the driver starts and stops it exactly as it would NVIDIA's (NVIDIA's MPS documentation,
'Appendix: Tools and Interface Reference'); it is stdlib-only and self-contained for that reason.

* `nvidia-cuda-mps-control -d`: starts the control daemon in the background and returns;
  `nvidia-cuda-mps-control -f`: runs it in the foreground (the process is the daemon). The
  daemon takes its pipe directory from `CUDA_MPS_PIPE_DIRECTORY` (default `/tmp/nvidia-mps`) and
  its log directory from `CUDA_MPS_LOG_DIRECTORY` (default `/var/log/nvidia-mps`), writes its PID
  to `<pipe dir>/nvidia-cuda-mps-control.pid`, listens on `<pipe dir>/control` and logs to
  `<log dir>/control.log` in MPS's `[time Control pid] message` format. A second daemon on a pipe
  directory whose daemon is alive refuses to start, exit code 1, as the real one does.
* `nvidia-cuda-mps-control` (no option): the management front end: reads commands from stdin,
  one a line, sends each to the daemon of `CUDA_MPS_PIPE_DIRECTORY` and prints its answer. No
  daemon: exit code 1 with a message on stderr.

Commands: `quit` (the daemon exits, removing its control socket and PID file),
`get_server_list` (PIDs of MPS servers: none, as no CUDA client ever connects here),
`set_default_active_thread_percentage <p>` / `get_default_active_thread_percentage`,
`set_default_device_pinned_mem_limit <dev> <value>` / `get_default_device_pinned_mem_limit <dev>`.
Anything else is answered with an error line, as the real daemon answers an unknown command.
`TANDEM_SIM_MPS_CVD` names a file the daemon writes its `CUDA_VISIBLE_DEVICES` to, for tests.

It is as careless with its pipe directory as a closed binary running as root may be, for the
tests to show that Tandem never starts it in one a tenant has had: it opens its PID file there by
name, to read whether a daemon is alive and to write its own PID, so a symlink there is followed
(the PID written into whatever it leads to) and a FIFO there blocks it.

Crash tests stop it at a step, as the fake NVML stops a call (`sim.nvml.hung_at`): when
`<TANDEM_SIM_NVML_STATE>.mps-hang` names `before:mps-start` (`-d` or `-f` before it starts the
daemon), `after:mps-start` (the daemon up: with `-d`, before `-d` returns; with `-f`, listening
but answering nothing yet), `before:mps-quit` or `after:mps-quit` (the front end around a
`quit`), it writes the step to `<state>.hung` and waits there until its caller is gone and the
file no longer names the step; then it carries on, as the real program does when the process that
ran it is killed.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import time
from collections.abc import Callable

PID_FILE = "nvidia-cuda-mps-control.pid"
CONTROL = "control"


def _dirs() -> tuple[str, str]:
    return (
        os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or "/tmp/nvidia-mps",
        os.environ.get("CUDA_MPS_LOG_DIRECTORY") or "/var/log/nvidia-mps",
    )


def _hang(step: str) -> None:
    state = os.environ.get("TANDEM_SIM_NVML_STATE", "")

    def wanted() -> bool:
        try:
            with open(state + ".mps-hang") as f:
                return f.read().strip() == step
        except OSError:
            return False

    if not state or not wanted():
        return
    with open(state + ".hung", "w") as f:
        f.write(step)
    caller = os.getppid()
    while os.getppid() == caller or wanted():
        time.sleep(0.02)


def _alive(pipe_dir: str) -> bool:
    try:
        with open(os.path.join(pipe_dir, PID_FILE)) as f:
            pid = int(f.read().strip())
        os.kill(pid, 0)
    except (OSError, ValueError):
        return False
    return True


class _Daemon:
    def __init__(self, pipe_dir: str, log_dir: str) -> None:
        self.pipe_dir, self.log_dir = pipe_dir, log_dir
        self.percentage = "100.0"
        self.mem_limits: dict[str, str] = {}

    def log(self, message: str) -> None:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime())
        with open(os.path.join(self.log_dir, "control.log"), "a") as f:
            f.write(f"[{stamp}.000 Control {os.getpid():6d}] {message}\n")

    def answer(self, line: str) -> tuple[str, bool]:
        """(reply, quit) for one command line."""
        words = line.split()
        if not words:
            return "", False
        cmd, args = words[0], words[1:]
        self.log(f"CMD: {line.strip()}")
        if cmd == "quit":
            return "", True
        if cmd == "get_server_list":
            return "", False
        if cmd == "get_default_active_thread_percentage":
            return self.percentage, False
        if cmd == "set_default_active_thread_percentage" and len(args) == 1:
            try:
                value = float(args[0])
            except ValueError:
                value = -1.0
            if not 0 < value <= 100:
                return f"Invalid percentage: {args[0]}", False
            self.percentage = f"{value:.1f}"
            return self.percentage, False
        if cmd == "set_default_device_pinned_mem_limit" and len(args) == 2:
            self.mem_limits[args[0]] = args[1]
            return "", False
        if cmd == "get_default_device_pinned_mem_limit" and len(args) == 1:
            return self.mem_limits.get(args[0], "0M"), False
        return f"Unrecognized command: {line.strip()}", False

    def serve(self, up: Callable[[], None] = lambda: None) -> None:
        """Listens and answers until `quit`; `up` runs once it listens, before the first answer."""
        path = os.path.join(self.pipe_dir, CONTROL)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(path)
        server.listen(8)
        # By name, in place: a symlink there is followed and a FIFO blocks it (module docstring).
        with open(os.path.join(self.pipe_dir, PID_FILE), "w") as f:
            f.write(f"{os.getpid()}\n")
        record = os.environ.get("TANDEM_SIM_MPS_CVD")
        if record:
            with open(record, "w") as f:
                f.write(os.environ.get("CUDA_VISIBLE_DEVICES", ""))
        self.log(f"Starting control daemon using socket {path}")
        self.log(f"To connect CUDA applications to this daemon, set env CUDA_MPS_PIPE_DIRECTORY={self.pipe_dir}")
        try:
            up()
            while True:
                conn, _ = server.accept()
                with conn, conn.makefile("rw") as stream:
                    done = False
                    for line in stream:
                        reply, done = self.answer(line)
                        stream.write(reply + "\n")
                        stream.flush()
                        if done:
                            break
                if done:
                    self.log("Exit")
                    return
        finally:
            server.close()
            for name in (CONTROL, PID_FILE):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(self.pipe_dir, name))


def _daemonize(pipe_dir: str, log_dir: str) -> int:
    if _alive(pipe_dir):
        print("An instance of this daemon is already running", file=sys.stderr)
        return 1
    os.makedirs(pipe_dir, exist_ok=True)
    os.makedirs(log_dir, exist_ok=True)
    _hang("before:mps-start")
    if os.fork() > 0:
        deadline = time.monotonic() + 10  # returns once the daemon is up: its caller finds the PID file
        while not _alive(pipe_dir) and time.monotonic() < deadline:
            time.sleep(0.01)
        _hang("after:mps-start")
        return 0
    os.setsid()
    if os.fork() > 0:
        os._exit(0)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    try:
        _Daemon(pipe_dir, log_dir).serve()
    finally:
        os._exit(0)


def _foreground(pipe_dir: str, log_dir: str) -> int:
    if _alive(pipe_dir):
        print("An instance of this daemon is already running", file=sys.stderr)
        return 1
    os.makedirs(pipe_dir, exist_ok=True)
    os.makedirs(log_dir, exist_ok=True)
    _hang("before:mps-start")
    _Daemon(pipe_dir, log_dir).serve(up=lambda: _hang("after:mps-start"))
    return 0


def _front_end(pipe_dir: str) -> int:
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        client.connect(os.path.join(pipe_dir, CONTROL))
    except OSError:
        print(f"Cannot find MPS control daemon process (pipe directory {pipe_dir})", file=sys.stderr)
        return 1
    with client, client.makefile("rw") as stream:
        for line in sys.stdin:
            if not line.strip():
                continue
            quitting = line.split()[0] == "quit"
            if quitting:
                _hang("before:mps-quit")
            stream.write(line if line.endswith("\n") else line + "\n")
            stream.flush()
            reply = stream.readline()
            if reply.strip():
                print(reply.rstrip("\n"))
            if quitting:
                _hang("after:mps-quit")
                break
    return 0


def main(argv: list[str]) -> int:
    pipe_dir, log_dir = _dirs()
    if argv == ["-d"]:
        return _daemonize(pipe_dir, log_dir)
    if argv == ["-f"]:
        return _foreground(pipe_dir, log_dir)
    if not argv:
        return _front_end(pipe_dir)
    print(f"Usage: nvidia-cuda-mps-control [-d | -f]; got {' '.join(argv)}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
