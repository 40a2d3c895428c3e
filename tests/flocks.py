"""Whether another holder has a file's flock: what a node-wide lock looks like to the other
instance of a rolling update (a second open file description, as another process has)."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path


def locked_elsewhere(path: Path) -> bool:
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False
