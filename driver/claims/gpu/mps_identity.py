"""Which process is a GPU's MPS control daemon: Tandem's record of it, never the pipe directory.

Kept apart from the daemons' supervision (`driver.claims.gpu.mps`) because it is the one place
that decides whom Tandem may signal, and it has to be read as such. The pipe directory and the
private `/dev/shm` are mounted read-write into every container of the GPU's MPS claims, and a
container's root may put anything there (a FIFO, a symlink to `/dev/zero`, another daemon's PID
in the PID file). So Tandem keeps nothing of its own there and reads nothing from there. A daemon
is known by its `ProcessId` (boot, PID, start time: `driver.node.processes`), recorded in
`<device>/daemon.json` beside those directories and mounted into no container, and is signalled
only as that process. The record names the daemon's pipe directory too (a fresh one for each
start: `driver.claims.gpu.mps_pipes`), in the same object, so a restarted Tandem talks to the
daemon it adopts in the directory it was started in; a record of the release before, which had
one directory for every start, names none, and its daemon's is `<device>/pipe`. The one exception
is a daemon a release before records started: it is adopted once by its PID file, read as
untrusted (`legacy_daemon`).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from cdi import atomic_write
from driver.claims.gpu.mps_pipes import LINK, recordable
from driver.fsutil import read_json_state, read_untrusted
from driver.node.processes import ProcessId, alive, identify

CONTROL_PROGRAM = "nvidia-cuda-mps-control"
PID_FILE = "nvidia-cuda-mps-control.pid"  # the daemon's own, in the pipe directory: never read as Tandem's
RECORD = "daemon.json"  # in `<data dir>/mps/<device>/`, beside the pipe directory
RECORD_VERSION = 1


@dataclasses.dataclass(frozen=True)
class Recorded:
    """A daemon on record: its process, and the name of its pipe directory in `<device>/`."""

    process: ProcessId
    pipe: str


def read_record(record: Path) -> Recorded | None:
    """The daemon `record` names, or None when there is none or it names no process."""
    raw = read_json_state(record, "MPS daemon record", "daemon", dict, version=RECORD_VERSION)
    # An added field, not a new version: the release before ignores it and reaches the same
    # directory through `<device>/pipe`, which leads to the recorded one.
    pipe = raw.get("pipe", LINK)
    try:
        if not isinstance(pipe, str) or not recordable(pipe):
            raise ValueError(f"not a pipe directory of a daemon: {pipe!r:.80}")
        return Recorded(ProcessId.from_json(raw), pipe)
    except ValueError:
        return None


def write_record(record: Path, daemon: Recorded) -> None:
    doc = {"version": RECORD_VERSION, "daemon": {**daemon.process.to_json(), "pipe": daemon.pipe}}
    # Not fsynced: a reboot, the only thing that loses it, ends the daemon and changes the boot.
    atomic_write(record, json.dumps(doc).encode(), 0o600, durable=False)


def legacy_daemon(pipe_dir: Path) -> ProcessId | None:
    """A daemon of a release that kept no record, by the PID file it wrote into `pipe_dir`: a
    tenant may have written it, so it is read as untrusted and believed only for a control daemon
    whose environment names this pipe directory and that runs in Tandem's PID namespace (neither
    another GPU's daemon nor any other process a tenant names is taken over: under hostPID Tandem
    sees the tenants' processes too, which a tenant may give any name and environment, but each in
    a PID namespace of its pod's own)."""
    try:
        process = identify(int(read_untrusted(pipe_dir / PID_FILE, 32)))
        if process is None:
            return None
        cmdline = read_untrusted(Path(f"/proc/{process.pid}/cmdline"), 1 << 16)
        environ = read_untrusted(Path(f"/proc/{process.pid}/environ"), 1 << 20).split(b"\0")
        theirs, own = os.stat(f"/proc/{process.pid}/ns/pid"), os.stat("/proc/self/ns/pid")
    except (OSError, ValueError):
        return None
    ours = (
        (theirs.st_dev, theirs.st_ino) == (own.st_dev, own.st_ino)
        and CONTROL_PROGRAM.encode() in cmdline
        and f"CUDA_MPS_PIPE_DIRECTORY={pipe_dir}".encode() in environ
    )
    return process if ours and alive(process) else None  # still the process whose files were read
