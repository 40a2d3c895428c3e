"""Crash-safe file replacement: a reader sees the old content or the new, never a torn file.

CDI runtimes rescan their spec directories whenever they change, so a spec must appear in one
step; the driver's own state files (checkpoint, cordons, device metadata) need the same promise
across `kill -9` and power loss. This is the one implementation of it: it lives in the CDI
library because the library must stay standalone, and the driver imports it from here.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

TEMP_SUFFIX = ".tmp"


def atomic_write(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Write to a hidden temporary file in the same directory, fsync, rename, fsync the directory.

    The temporary name starts with a dot and ends in ``.tmp`` so that directory scanners (CDI
    runtimes, the driver's reconciliation) never pick up a half-written file; after a crash the
    file is either the old one or the complete new one.
    """
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=TEMP_SUFFIX)
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
    """Make a rename or removal in `directory` durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
