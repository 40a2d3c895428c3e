"""Node-local facts of the data dir shared by the driver's state files: the boot they belong to,
and the lock that serialises their writers.

Crash-safe writes of those files come from `cdi.atomic_write`, the one implementation of it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
from collections.abc import Iterator
from pathlib import Path


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
