"""Node-local facts of the data dir shared by the driver's state files: the boot they belong to,
the lock that serialises their writers, and reading the small ones (cordons, releases).

Crash-safe writes of those files come from `cdi.atomic_write`, the one implementation of it.

Which writes are fsynced (`durable`): only state that must survive a reboot, cordons and NVML
releases. The record of prepared claims (`driver.claims.checkpoint`) and each claim's files (its CDI
spec and device metadata, `driver.claims.files`) are written atomically but not durably
(`PREPARED_STATE_DURABLE`): a reader, and `kill -9` of the daemon at any line, still sees the old
file or the new, because the page cache the rename happens in belongs to the kernel. Only a
kernel crash or power loss loses unsynced writes, and that is a reboot, after which none of them
counts: the checkpoint names the boot it was written in and is discarded in the next (one left
unreadable is set aside and rebuilt like a lost one); CDI specs live in `/var/run/cdi`, a tmpfs;
the kubelet prepares the claims of every restarted pod again, which rewrites its files; and
start-up reconciliation removes what no record accounts for. An fsync there would protect nothing
and cost a disk flush per file: 15 per prepare and unprepare.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

PREPARED_STATE_DURABLE = False  # see the module docstring


def boot_id(proc_root: Path = Path("/proc")) -> str:
    """The kernel's boot ID: prepared state from an earlier boot describes devices that were reset."""
    try:
        return (proc_root / "sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


@contextlib.contextmanager
def locked(mutex: threading.Lock, lock_path: Path) -> Iterator[None]:
    """Exclusive across threads (the mutex) and across processes sharing the data dir (flock).

    Two driver instances run side by side during a rolling update; both must see every write.
    """
    with mutex:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing releases the flock


def read_json_state(path: Path, what: str, key: str, kind: type) -> Any:
    """The `key` entry of a small JSON state file (cordons, releases); `kind()` when there is none.

    A file that is not JSON, or not an object whose `key` is a `kind`, is moved aside for
    inspection (`<name>.corrupt-<time>`, logged) and counts as missing: a bad file is never a
    reason for the daemon to crash-loop.
    """
    try:
        raw = json.loads(path.read_bytes())
        if not isinstance(raw, dict) or not isinstance(raw.get(key, kind()), kind):
            raise ValueError(f"top level is not an object with a {key!r} {kind.__name__}")
    except FileNotFoundError:
        return kind()
    except (ValueError, UnicodeDecodeError) as e:
        aside = path.with_name(f"{path.name}.corrupt-{int(time.time())}")
        os.replace(path, aside)
        log.error("%s file %s is unreadable (%s); moved aside to %s, none apply", what, path, e, aside)
        return kind()
    return raw.get(key, kind())
