"""The bench's processes: the drivers and the stand-in it starts itself, the control plane the
launcher started (known by its pid files), their CPU and memory, and waiting on them."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

CLK_TCK = os.sysconf("SC_CLK_TCK")


@dataclass
class Proc:
    """A process the bench watches. `popen` is None for the launcher's, which run in sessions of
    their own and are not the bench's children."""

    name: str
    pid: int
    started: float
    popen: subprocess.Popen[bytes] | None = None

    def exited(self) -> bool:
        if self.popen is not None:
            return self.popen.poll() is not None
        return not Path(f"/proc/{self.pid}").exists()


def spawn(name: str, args: list[str], log_path: Path, env: dict[str, str] | None = None) -> Proc:
    with open(log_path, "ab") as out:
        p = subprocess.Popen(args, stdout=out, stderr=out, stdin=subprocess.DEVNULL, env=env, start_new_session=True)
    return Proc(name, p.pid, time.monotonic(), p)


def stop(p: subprocess.Popen[bytes] | subprocess.Popen[str], timeout: float = 15) -> None:
    if p.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        p.send_signal(signal.SIGTERM)
    try:
        p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()


def succeeds(fn: Callable[[], object]) -> bool:
    try:
        fn()
        return True
    except Exception:
        return False


def wait_until(
    what: str, timeout: float, pred: Callable[[], bool], procs: dict[str, Proc] | None = None, every: float = 0.2
) -> None:
    """Until `pred()`; fails early when one of `procs` exits, which would never let it come true."""
    deadline = time.monotonic() + timeout
    while not pred():
        for proc in (procs or {}).values():
            if proc.exited():
                raise RuntimeError(f"{proc.name} exited while waiting for {what}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout} s")
        time.sleep(every)


def cpu_s(pid: int) -> float:
    try:
        f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(f[11]) + int(f[12])) / CLK_TCK


def mem_kib(pid: int) -> tuple[int, int]:
    """(RSS, PSS) in KiB: PSS shares the pages many instances map (the interpreter, libraries) fairly."""
    rss = pss = 0
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Rss:"):
                rss = int(line.split()[1])
            elif line.startswith("Pss:"):
                pss = int(line.split()[1])
    return rss, pss
