"""Crash-safe file replacement: a reader sees the old content or the new, never a torn file.

CDI runtimes rescan their spec directories whenever they change, so a spec must appear in one
step; the driver's own state files (checkpoint, cordons, device metadata) need the same promise
across `kill -9`. This is the one implementation of it: it lives in the CDI library because the
library must stay standalone, and the driver imports it from here.

Atomic and durable are two promises. The rename alone makes a write atomic for every reader and
across `kill -9` of the writer: the page cache, where the rename happens, belongs to the kernel and
survives the process. Only a crash of the kernel itself (power loss, panic) can lose what is not
yet on disk, and that is a reboot: so `durable=True` (fsync of the data and of the directory) is
for files that must survive one, and costs a disk flush per write. A file that means nothing after
a reboot (it is on a tmpfs, or is discarded or rebuilt at boot) is written with `durable=False`:
after a power loss it may be the old content, the new, or missing or empty, which its reader must
treat as "not there".

A write that is not durable replaces an existing file by exchanging the two names
(`renameat2(RENAME_EXCHANGE)`) and unlinking the temporary name, which then holds the old content,
rather than by a plain rename over it. Both are atomic for every reader, but ext4 (the usual
filesystem of `/var/lib/kubelet`) treats a plain rename over an existing file as a request for
durability (`auto_da_alloc`) and starts writing the new file out to the disk inside the rename:
0.5 ms per rename at the median, and tens of ms (once 0.9 s) behind another writer's fsyncs
(etcd, containerd, the kubelet), for data that nobody asked to be durable. Exchanged names get no
such flush (0.2 ms; docs/architecture.md, 'The tail of a prepare'). Where the call is missing (not Linux, an old C library) or the filesystem refuses it,
or the target does not exist yet, a plain rename does the job.

A process killed between writing and renaming leaves its temporary file behind, named
``.<target name>.<8 random characters>.tmp``. `remove_temp_files` takes such leftovers away. A
writer holds an exclusive `flock` on its temporary file from creation to rename, so a file that
is still being written (by another process sharing the directory, e.g. the other daemon of a
rolling update) is told apart from one whose writer died: the kernel drops a dead process's locks.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import re
import secrets
import stat
from collections.abc import Callable
from pathlib import Path

TEMP_SUFFIX = ".tmp"
# The random part of a temporary name: 8 characters of [a-z0-9_] (`tempfile.mkstemp`'s, which
# older versions used; `_locked_temp_file` uses 8 hex digits).
_TEMP_NAME = re.compile(r"\.(?P<target>.+)\.[a-z0-9_]{8}" + re.escape(TEMP_SUFFIX))
_AT_FDCWD = -100
_RENAME_EXCHANGE = 2  # linux/fs.h


def _find_renameat2() -> Callable[[int, bytes, int, bytes, int], int] | None:
    try:
        return getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)  # glibc 2.28+, musl 1.2.3+
    except OSError:
        return None


_renameat2 = _find_renameat2()


def atomic_write(path: Path, data: bytes, mode: int = 0o644, *, durable: bool = True) -> None:
    """Write to a hidden temporary file in the same directory and rename it over `path`; with
    `durable`, fsync the data before the rename and the directory after it (module docstring).

    The temporary name starts with a dot and ends in ``.tmp`` so that directory scanners (CDI
    runtimes, the driver's reconciliation) never pick up a half-written file; after `kill -9` the
    file is either the old one or the complete new one, and with `durable` after a power loss too.
    """
    fd, tmp = _locked_temp_file(path)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fchmod(fd, mode)
        if durable:
            os.fsync(fd)  # the data reaches the disk before the rename can
            os.replace(tmp, path)  # still locked: a concurrent `remove_temp_files` leaves it alone
        elif _exchange(tmp, path):
            with contextlib.suppress(FileNotFoundError):  # the old content; a sweep may have taken it
                os.unlink(tmp)
        else:
            os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    finally:
        os.close(fd)
    if durable:
        fsync_dir(path.parent)  # the rename itself survives a power loss


def _exchange(tmp: str, path: Path) -> bool:
    """Swap the names `tmp` and `path` atomically (module docstring); False where that cannot be
    done (no such call, a filesystem without it, no regular file at `path`) and nothing happened.

    Killed right after the swap, the writer leaves the old content under the temporary name, no
    longer locked (the lock is on the new file), which `remove_temp_files` takes away."""
    if _renameat2 is None:
        return False
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):  # a rename over anything else fails, as it should
            return False
    except FileNotFoundError:
        return False
    if _renameat2(_AT_FDCWD, os.fsencode(tmp), _AT_FDCWD, os.fsencode(path), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOENT, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EXDEV):
        return False
    raise OSError(code, os.strerror(code), str(path))


def _locked_temp_file(path: Path) -> tuple[int, str]:
    """A new temporary file for `path`, open and flocked. `remove_temp_files` may take a file away
    between its creation and the lock; then the name no longer leads to our inode, and we start
    again with a new one. (What `tempfile.mkstemp` does, at half its cost.)"""
    while True:
        tmp = f"{path.parent}/.{path.name}.{secrets.token_hex(4)}{TEMP_SUFFIX}"
        try:
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except FileExistsError:
            continue
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            if os.stat(tmp).st_ino == os.fstat(fd).st_ino:
                return fd, tmp
        except FileNotFoundError:
            pass
        os.close(fd)


def remove_temp_files(directory: Path, target_prefix: str = "") -> list[Path]:
    """Remove the temporary files `atomic_write` left in `directory` (not below it) for targets
    whose name starts with `target_prefix`; returns what was removed.

    Only names of our own pattern are touched, and only files no live writer holds locked, so a
    directory shared with other programs (a CDI spec directory) and with another instance of the
    daemon is safe to sweep. A missing directory holds nothing.
    """
    try:
        entries = sorted(directory.iterdir())
    except FileNotFoundError:
        return []
    removed = []
    for path in entries:
        m = _TEMP_NAME.fullmatch(path.name)
        if m is None or not m["target"].startswith(target_prefix):
            continue
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:  # gone meanwhile, or a link or special file: not one of ours
            continue
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                continue
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            path.unlink()  # under our lock: no writer can be using it now
            removed.append(path)
        except (BlockingIOError, FileNotFoundError):
            continue  # a live writer's, or renamed into place meanwhile
        finally:
            os.close(fd)
    # No fsync: a removal a power loss undoes only brings back a leftover the next sweep removes.
    return removed


def fsync_dir(directory: Path) -> None:
    """Make a rename or removal in `directory` durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
