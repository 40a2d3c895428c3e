"""Crash-safe file writes: a reader sees the old content or the new, never a torn file."""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path


def atomic_write(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Write to a hidden temporary file in the same directory, fsync, rename, fsync the directory.

    The temporary name starts with a dot so that directory scanners (CDI runtimes, our own
    reconciliation) never pick up a half-written file.
    """
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fchmod(f.fileno(), mode)
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
