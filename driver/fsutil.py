"""Node-local facts of the data dir shared by the driver's state files: the boot they belong to,
the lock that serialises their writers, reading them (their format versions, a bad one set aside),
and the data dir itself being Tandem's alone (`secure_data_dir`).

Crash-safe writes of those files come from `cdi.atomic_write`, the one implementation of it. A
file that is not Tandem's to trust (one a tenant can write, a process's `/proc` entry) is read
only through `read_untrusted`.

Every state file kept across restarts names its format `version` at its top level, and every
reader follows one rule (`parse_state`): no `version` (a file from before formats were versioned)
is version 0; a file of an older version is upgraded step by step (`Upgrade`) as it is read, and
written back at the current one by the next change; a newer version, or one no step leads from,
is refused. A refused file is never a reason to crash-loop: it is moved aside whole for inspection
(`set_aside`: `<name>.newer-<time>` for a newer version, `<name>.corrupt-<time>` otherwise,
logged) and the file counts as missing. So after a downgrade the old release sets aside what it
cannot read instead of misreading it, and loses nothing: the newer release that wrote it can read
it again. The version goes up only for a change that a reader of the previous one would misread;
an added field is no such change (readers ignore fields they do not know, and the checkpoint
keeps them on rewrite). The two instances of a rolling update share these files, so a new version
is read by one release before a later one writes it.

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
and cost a disk flush per file: 15 per prepare and unprepare. Nor does ext4 flush them at the
rename (`cdi.files` says how, and what that flush cost a prepare).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import stat
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

from driver.errors import NodeError

log = logging.getLogger(__name__)

PREPARED_STATE_DURABLE = False  # see the module docstring
DATA_DIR_MODE = 0o750  # Tandem and its group may look in; only Tandem writes
_GROUP_OTHER_WRITE = 0o022
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC

Upgrade = Callable[[dict[str, Any]], dict[str, Any]]
"""Turns a state file's top-level object of one format version into one of the next version."""

_NO_UPGRADES: Mapping[int, Upgrade] = MappingProxyType({})


class StateFileError(NodeError):
    """A state file this release cannot read: not a JSON object, or of a format version it does not know."""


class NewerFormat(StateFileError):
    """A state file of a format version newer than this release reads: written by a newer release
    (a downgrade, or the newer instance of a rolling update)."""


def unchanged(doc: dict[str, Any]) -> dict[str, Any]:
    """The upgrade from a version whose layout the next one kept: only its number went up (the
    step from 0, a file without a version, for a file whose first version added only that)."""
    return doc


def parse_state(data: bytes, version: int, upgrades: Mapping[int, Upgrade]) -> dict[str, Any]:
    """The top-level object of a state file, at format `version` (the module docstring's rule).

    `upgrades[n]` turns a version-n object into a version n+1 one. Raises StateFileError (NewerFormat
    for a newer version), or ValueError for bytes that are not JSON.
    """
    try:
        raw = json.loads(data)
    except RecursionError:  # nested deeper than the parser's recursion: no file Tandem wrote
        raise StateFileError("nested too deeply to be read") from None
    if not isinstance(raw, dict):
        raise StateFileError("top level is not an object")
    doc: dict[str, Any] = raw
    found = doc.get("version", 0)
    if type(found) is not int or found < 0:
        raise StateFileError(f"format version {found!r} is not a whole number")
    if found > version:
        raise NewerFormat(
            f"format version {found} is newer than this release of Tandem reads (up to {version}): a newer release wrote it"
        )
    for step in range(found, version):
        if step not in upgrades:
            raise StateFileError(
                f"format version {found} is older than this release of Tandem reads (no upgrade from version {step})"
            )
        doc = upgrades[step](doc)
    return doc


def set_aside(path: Path, what: str, error: Exception, consequence: str) -> None:
    """Moves an unreadable state file aside whole, for inspection, and logs why and what follows.

    Never over one set aside before (the other instance of a rolling update may have, within the
    same clock tick); the callers hold the file's lock, so no other writer picks the same name.
    """
    kind = "newer" if isinstance(error, NewerFormat) else "corrupt"
    stamp = time.time_ns()
    while (aside := path.with_name(f"{path.name}.{kind}-{stamp}")).exists():
        stamp += 1
    os.replace(path, aside)
    log.error("%s file %s is unreadable (%s); moved aside to %s, %s", what, path, error, aside, consequence)


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


def read_json_state(
    path: Path,
    what: str,
    key: str,
    kind: type,
    *,
    version: int = 0,
    upgrades: Mapping[int, Upgrade] = _NO_UPGRADES,
) -> Any:
    """The `key` entry of a small JSON state file of format `version`; `kind()` when there is none.

    A file `parse_state` refuses, or whose `key` is not a `kind`, is set aside (`set_aside`) and
    counts as missing: none of its entries apply. The defaults describe a file not versioned yet.
    """
    try:
        raw = parse_state(path.read_bytes(), version, upgrades)
        if not isinstance(raw.get(key, kind()), kind):
            raise StateFileError(f"top level has no {key!r} {kind.__name__}")
    except FileNotFoundError:
        return kind()
    except (ValueError, StateFileError) as e:
        set_aside(path, what, e, "none apply")
        return kind()
    return raw.get(key, kind())


def read_untrusted(path: Path, limit: int) -> bytes:
    """The bytes of a file someone else can write (a tenant's, a process's `/proc` entry), read
    so that no such file can hang, flood or redirect the reader: OSError unless it is a regular
    file of at most `limit` bytes.

    Opened first as a bare reference (`O_PATH`, `O_NOFOLLOW`): a symlink (to `/dev/zero`, to a
    file of the host) is refused as one, and neither a FIFO (whose open blocks) nor a device node
    (whose open can act) is ever opened for reading; only once `fstat` shows a regular file is it
    reopened, through that reference, to read (`O_NONBLOCK`, `O_NOCTTY`), at most `limit` + 1
    bytes. Only the last component is not followed: the directories above it must be the
    reader's own.
    """
    ref = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        mode = os.fstat(ref).st_mode
        if not stat.S_ISREG(mode):
            raise OSError(errno.EINVAL, f"not a regular file ({stat.filemode(mode)})", str(path))
        fd = os.open(f"/proc/self/fd/{ref}", os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    finally:
        os.close(ref)
    try:
        chunks: list[bytes] = []
        left = limit + 1
        while left > 0 and (chunk := os.read(fd, left)):
            chunks.append(chunk)
            left -= len(chunk)
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > limit:
        raise OSError(errno.EFBIG, f"larger than {limit} bytes", str(path))
    return data


def secure_data_dir(path: Path) -> None:
    """Makes the data dir if it is missing, and checks it as it is: Tandem's safety rests on no one
    else writing there (docs/security.md), and `mkdir`'s mode applies only to a directory it
    makes. The kubelet's `hostPath: DirectoryOrCreate` makes it 0755 before Tandem starts; an
    administrator or another tool may have made it otherwise.

    The data dir and the directories in it and in those (`instances/`, `mps/<gpu>/`,
    `dra-device-metadata/<claim>/`: where Tandem keeps state; what `mps/<gpu>/` holds, the MPS
    pipe directories and their link among it, is the tenants' side, never trusted where it is
    used) must be real directories owned by Tandem's user, and no entry of the data dir or of a
    directory in it a symlink (Tandem makes none there): otherwise NodeError, saying what to do, and Tandem does not start. A directory
    that group or others can write becomes theirs no more: the data dir is set to
    `DATA_DIR_MODE`, one beneath it loses the group and other write bits (the device-metadata
    directories stay readable, as the runtime mounts them).

    Each directory is opened with `O_NOFOLLOW | O_DIRECTORY`, beneath the data dir relative to its
    parent's descriptor, and judged and changed through that descriptor (`fstat`, `fchmod`), so a
    name swapped in between redirects nothing. Nothing is moved, removed or chowned: the other
    instance of a rolling update keeps its state and sockets here and may run this check at the
    same moment; each only ever narrows a mode.
    """
    with contextlib.suppress(FileExistsError):  # whatever is there is judged below, a dangling link too
        path.mkdir(parents=True, mode=DATA_DIR_MODE)
    _secure_tree(path, None, DATA_DIR_MODE, depth=2)


def _secure_tree(path: Path, parent_fd: int | None, mode: int | None, depth: int) -> None:
    """`path` checked (`secure_data_dir`) and set to `mode` (None: less group and other write),
    then its directories `depth` levels down. Opened relative to `parent_fd` when there is one."""
    try:
        fd = os.open(path if parent_fd is None else path.name, _DIR_FLAGS, dir_fd=parent_fd)
    except FileNotFoundError:
        if parent_fd is None:
            raise
        return  # removed meanwhile (the other instance of a rolling update, a claim unprepared)
    except OSError as e:
        if e.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise
        raise NodeError(_refusal(path, parent_fd)) from e
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            raise NodeError(
                f"{path} belongs to user {st.st_uid}, not to Tandem's ({os.geteuid()}): whoever owns it can "
                f"change Tandem's state there. If it is Tandem's, give it to Tandem's user (chown {os.geteuid()} "
                f"{path}) and start Tandem again; if not, move it away and Tandem makes its own"
            )
        was = stat.S_IMODE(st.st_mode)
        wanted = was & ~_GROUP_OTHER_WRITE if mode is None else mode
        if wanted != was:
            os.fchmod(fd, wanted)
            if was & _GROUP_OTHER_WRITE:
                log.warning(
                    "state directory %s was writable by group or others (mode %04o), now %04o: what it holds "
                    "may not all be Tandem's",
                    path,
                    was,
                    wanted,
                )
            else:
                log.info("state directory %s was mode %04o, now %04o", path, was, wanted)
        if depth:
            for entry in os.scandir(fd):
                if entry.is_symlink() or entry.is_dir(follow_symlinks=False):
                    _secure_tree(path / entry.name, fd, None, depth - 1)
    finally:
        os.close(fd)


def _refusal(path: Path, parent_fd: int | None) -> str:
    """Why `path`, which did not open as a directory without following a link, is refused."""
    try:
        target = os.readlink(path if parent_fd is None else path.name, dir_fd=parent_fd)
    except OSError:
        return f"{path} is not a directory: Tandem keeps its state only in directories of its own. Move it away"
    return (
        f"{path} is a symlink (to {target}), not a directory: whoever can change the link decides where Tandem "
        f"keeps its state. Replace it with the directory it leads to (or remove it: Tandem makes its own) and "
        f"start Tandem again"
    )
