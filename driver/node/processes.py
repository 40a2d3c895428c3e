"""A process Tandem started, known by what no one else can forge, and signalled only if it is that one.

A PID alone names nothing for long: once its process is gone the kernel gives the number to the
next one, and a number written into a file a tenant can write names whatever the tenant wants (the
MPS control daemon's own PID file is such a file: `driver.claims.gpu.mps_identity`). So a supervised process
is recorded as a `ProcessId`: the boot, the PID and the process's start time (`/proc/<pid>/stat`
field 22, clock ticks since boot), taken by the process that started it. PID and start time name
one process for the life of a boot: the kernel hands a PID out again only after the whole PID space
has wrapped, which no fork rate achieves within one clock tick; the boot ID makes a record of an
earlier boot name nothing. No tenant can make a process with another's start time.

Signals go through a pidfd opened before the identity is checked (`kill`): a pidfd refers to one
process for its whole life, so the process checked is the process signalled, even if the PID is
reused in between. A zombie (exited, not yet reaped) counts as gone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import select
import signal
from typing import Any

from driver.fsutil import boot_id


@functools.cache
def _boot() -> str:
    return boot_id()


@dataclasses.dataclass(frozen=True)
class ProcessId:
    """One process of one boot: its PID and start time (module docstring)."""

    boot: str
    pid: int
    start: int

    def to_json(self) -> dict[str, Any]:
        return {"boot": self.boot, "pid": self.pid, "start": self.start}

    @staticmethod
    def from_json(raw: Any) -> ProcessId:
        """ValueError for anything but what `to_json` writes."""
        if not isinstance(raw, dict):
            raise ValueError("not an object")
        boot, pid, start = raw.get("boot"), raw.get("pid"), raw.get("start")
        if not isinstance(boot, str) or type(pid) is not int or type(start) is not int or pid <= 0 or start < 0:
            raise ValueError(f"not a process identity: {raw!r:.200}")
        return ProcessId(boot, pid, start)


def identify(pid: int) -> ProcessId | None:
    """The live process that has `pid` now; None when there is none, or only a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            # comm (field 2) is in parentheses and may hold anything, ')' included: split after the last.
            fields = f.read().rsplit(b")", 1)[1].split()
        state, start = fields[0], int(fields[19])  # fields 3 and 22
    except (OSError, IndexError, ValueError):
        return None
    return None if state in (b"Z", b"X", b"x") else ProcessId(_boot(), pid, start)


def alive(process: ProcessId) -> bool:
    """Whether `process` itself still runs (not another one that got its PID)."""
    return identify(process.pid) == process


def kill(process: ProcessId, timeout: float) -> bool:
    """SIGKILL to `process`, if it is still that process; True once it is gone (at once when it
    was gone already or its PID names another process now), False if it outlived `timeout`."""
    try:
        pidfd = os.pidfd_open(process.pid)
    except ProcessLookupError:
        return True
    try:
        if not alive(process):  # checked after the pidfd pins the process: the one checked is the one signalled
            return True
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        return _exited(pidfd, timeout)
    finally:
        os.close(pidfd)


def wait_gone(process: ProcessId, timeout: float) -> bool:
    """Whether `process` is gone within `timeout` seconds (waiting on a pidfd: no polling)."""
    try:
        pidfd = os.pidfd_open(process.pid)
    except ProcessLookupError:
        return True
    try:
        return not alive(process) or _exited(pidfd, timeout)
    finally:
        os.close(pidfd)


def _exited(pidfd: int, timeout: float) -> bool:
    """A pidfd turns readable when its process exits (a zombie included)."""
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    return bool(poller.poll(max(timeout, 0.0) * 1000))
