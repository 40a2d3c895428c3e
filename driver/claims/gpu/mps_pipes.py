"""A fresh pipe directory for every start of a GPU's MPS control daemon, and the old ones removed
without following anything in them.

Why: the pipe directory is mounted read-write into the containers of the GPU's MPS claims, so a
container's root can leave anything there (a symlink to a host file, a FIFO) and it stays after
the daemon dies. NVIDIA's control daemon runs as root and its code is closed: what it opens,
follows or creates in its pipe directory cannot be proved, so a root daemon started into a
directory a tenant has had could be led to write as root wherever the tenant points. Therefore no
daemon is ever started into one: each start gets `<device>/pipe-<16 hex digits>`, made by
`mkdir` (which fails for a name that exists, so it is empty and new), and Tandem's record of the
daemon names it (`driver.claims.gpu.mps_identity`), so a restarted Tandem adopts the daemon with
its directory without reading anything a tenant can write.

How the containers find it: the claims' CDI specs mount `<device>/pipe` (`LINK`), a symlink of
Tandem's to the current daemon's directory. It lives in `<device>/`, which is mounted into no
container, so no tenant can change it, and it is replaced atomically (a new link renamed over it)
once a new daemon has answered: no container has its directory before the daemon made its PID
file and socket there (after that, sharing it is what MPS is). The runtime resolves the link when
it creates a container: a container made after the start, a restarted container of a claim prepared before included, mounts the new directory,
and no claim's CDI spec has to be rewritten. The specs of the previous layout, in which `pipe` was
the directory itself, name the same path and so follow the link too; that directory, the previous
release's daemon's, is moved aside (`pipe-retired-<time>`) when a daemon of this release replaces
it. A container made before the start keeps the directory it mounted: its MPS server died with
the old daemon, so its CUDA processes have failed already, and new ones there find no daemon
until the container restarts, which mounts the new one.

Removing the old ones (`settle`): a pipe directory that neither the record nor the link names
is removed entry by entry through file descriptors (`remove_tree`). An entry is unlinked by name,
which never follows a symlink or opens a FIFO; a directory is opened with `O_DIRECTORY |
O_NOFOLLOW | O_NONBLOCK` (a symlink or FIFO swapped in meanwhile fails to open, nothing blocks),
its files unlinked and its own directories moved up into the directory being removed, so that
however deep a tenant nests, no more than two directories are open and no recursion grows. A
container made before may still have the directory mounted and keep filling it: one pass does at
most `_PASS_ENTRIES` entries, and the next sync goes on where it stopped.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import re
import secrets
import time
from pathlib import Path

log = logging.getLogger(__name__)

LINK = "pipe"  # what CDI specs mount; the previous layout's pipe directory itself
_FRESH = re.compile(r"pipe-[0-9a-f]{16}")
_OLD_PREFIXES = (
    "pipe-",
    ".pipe-",
    "stale-",
)  # pipe dirs, a link a crash left half made, the previous release's set-asides
_PASS_ENTRIES = 10_000
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def recordable(name: str) -> bool:
    """Whether `name` can be a daemon's pipe directory in a record: a fresh one, or the previous layout's."""
    return name == LINK or _FRESH.fullmatch(name) is not None


def fresh(device_dir: Path) -> Path:
    """A new, empty pipe directory in `device_dir` that no container has ever mounted."""
    device_dir.mkdir(parents=True, exist_ok=True)
    while True:
        path = device_dir / f"pipe-{secrets.token_hex(8)}"
        with contextlib.suppress(FileExistsError):
            path.mkdir()
            return path


def point(device_dir: Path, name: str) -> None:
    """`<device>/pipe` made to lead to `name`, atomically for every reader (a new link renamed over
    the old one). The previous layout's directory in its place is moved aside first, to be removed
    as an old one: a link cannot be renamed over a directory."""
    link = device_dir / LINK
    try:
        if os.readlink(link) == name:
            return
    except FileNotFoundError:
        pass
    except OSError:  # not a link: the previous layout's directory
        os.rename(link, device_dir / f"pipe-retired-{time.time_ns()}")
    temp = device_dir / f".pipe-{secrets.token_hex(8)}"
    os.symlink(name, temp)
    os.replace(temp, link)


def settle(device_dir: Path, pipe: str) -> None:
    """The link leading to `pipe`, the recorded daemon's directory (a kill -9 may have come between
    the record and the link), and every older directory removed but the one the link leads to
    (the one containers get now). OSError when the link cannot be made; a removal that fails is
    logged, and the next sync goes on."""
    if pipe != LINK:  # else a daemon of the previous layout, in `pipe` itself: left as it is
        point(device_dir, pipe)
    kept = {LINK, pipe}
    with contextlib.suppress(OSError):
        kept.add(os.readlink(device_dir / LINK))
    with contextlib.suppress(FileNotFoundError):
        for name in sorted(os.listdir(device_dir)):  # Tandem's own directory: a handful of names
            if name not in kept and name.startswith(_OLD_PREFIXES):
                remove_tree(device_dir, name)


def remove_tree(parent: Path, name: str) -> None:
    """Removes `parent/name` and everything beneath it, following and opening nothing a tenant
    may have put there (module docstring). `parent` is Tandem's own. What is left (a container
    that has the directory adds to it, or a failure) is logged, and the next sync goes on."""
    try:
        if not _remove_tree(parent, name):
            log.info("%s is still filled (a container that has it adds to it): the next round goes on", parent / name)
    except OSError as e:
        log.warning("removing %s failed: %s", parent / name, e)


def _remove_tree(parent: Path, name: str) -> bool:
    parent_fd = os.open(parent, _DIR_FLAGS)
    try:
        try:
            os.unlink(name, dir_fd=parent_fd)
            return True
        except FileNotFoundError:
            return True
        except IsADirectoryError:
            pass
        top = os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
        try:
            _empty(top)
        finally:
            os.close(top)
        try:
            os.rmdir(name, dir_fd=parent_fd)
        except FileNotFoundError:
            pass
        except OSError:  # refilled by a container that still has it, or the pass ran out: the next sync goes on
            return False
        return True
    finally:
        os.close(parent_fd)


def _empty(top: int) -> None:
    """Empties the directory open as `top`, one level at a time (module docstring), in at most
    `_PASS_ENTRIES` steps. A step that fails (an entry swapped or refilled meanwhile) is left to
    the next pass."""
    left = _PASS_ENTRIES
    while left > 0:
        names = _names(top, left)
        if not names:
            return
        for name in names:
            left -= 1
            try:
                os.unlink(name, dir_fd=top)
            except IsADirectoryError:
                left -= _lift(top, name, left)
            except OSError:
                continue


def _lift(top: int, name: str, left: int) -> int:
    """Empties `top`'s subdirectory `name` into `top` (files unlinked, directories moved up) and
    removes it; how many of its entries it handled."""
    try:
        sub = os.open(name, _DIR_FLAGS, dir_fd=top)
    except OSError:
        return 0
    try:
        names = _names(sub, max(left, 1))
        for inner in names:
            try:
                os.unlink(inner, dir_fd=sub)
            except IsADirectoryError:
                with contextlib.suppress(OSError):
                    os.rename(inner, f".up-{secrets.token_hex(8)}", src_dir_fd=sub, dst_dir_fd=top)
            except OSError:
                continue
    finally:
        os.close(sub)
    with contextlib.suppress(OSError):
        os.rmdir(name, dir_fd=top)
    return len(names)


def _names(fd: int, limit: int) -> list[str]:
    """At most `limit` names in the directory open as `fd` (a tenant may have made millions)."""
    with os.scandir(fd) as entries:
        return [e.name for e in itertools.islice(entries, limit)]
