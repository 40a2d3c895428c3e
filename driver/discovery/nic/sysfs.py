"""Reading the RDMA side of sysfs: values, link targets, PCI functions, and what a broken entry is.

NIC discovery reads dozens of small sysfs files per function, and NIC health a few per NIC every
poll (`driver.health.nic.link_sysfs`); a kernel bug, a half-removed device or a test tree can make any
of them absent, garbled or a symlink loop. These readers turn that into `NicError` or the OS's
own error (together `BROKEN`, what callers catch), so that one broken entry costs only the NIC it
describes. The lenient readers
(`read_or_empty`, `read_int`) take a file that is not UTF-8 as unreadable, as they take an absent
one: a netdev name may be any bytes (a tenant can rename the netdev of an exclusive NIC, and
the RDMA side shows that name in `gid_attrs/ndevs/*`), and one such file must not stop a pass.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

from driver.errors import DeviceError

log = logging.getLogger(__name__)

# A PCI function address as sysfs spells it (functions 0-7; SR-IOV VFs get their own bus/device).
BDF = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")


class NicError(DeviceError):
    """Sysfs says something that cannot be true of an RDMA NIC (bad number, broken link, ...)."""


# What a broken sysfs entry raises: what these readers make of it (NicError), I/O errors,
# unparsable values, symlink loops (RuntimeError).
BROKEN = (NicError, OSError, ValueError, RuntimeError)

_CHUNK = 4096  # a sysfs attribute is at most one page


def read(path: str | os.PathLike[str]) -> str:
    """A small file's text, stripped. Fails as `Path.read_text` does: `OSError` naming the file
    when it cannot be read (absent: FileNotFoundError; a directory; EINVAL: a value the kernel
    will not give now), `UnicodeDecodeError` (a ValueError) when it is not UTF-8.

    Straight through the OS (open, read to the end, close) because this runs for every file of
    every discovery pass and health poll: `read_text` builds a buffered text stream per file, which
    costs several times the CPU and nine system calls (a terminal check, seeks, fstats) instead of
    four.
    """
    fd = os.open(path, os.O_RDONLY)  # not inherited (PEP 446)
    try:
        chunks = [os.read(fd, _CHUNK)]
        while chunks[-1]:  # an attribute comes in one read; a file of a test tree may be longer
            chunks.append(os.read(fd, _CHUNK))
    except OSError as e:  # the same subclass (errno), with the file's name
        raise OSError(e.errno, e.strerror, os.fspath(path)) from None
    finally:
        os.close(fd)
    return b"".join(chunks).decode().strip()


def _read_or_none(path: Path) -> str | None:
    """`read`, or None when the file cannot be read (absent; EINVAL, e.g. `speed` of a link that
    is down) or is not UTF-8 (logged, naming the file: nothing else would tell it was there)."""
    try:
        return read(path)
    except OSError:
        return None
    except UnicodeDecodeError as e:
        log.warning("%s: not UTF-8 (%s); taken as unreadable", path, e)
        return None


def read_or_empty(path: Path) -> str:
    return _read_or_none(path) or ""


def read_int(path: Path, default: int | None = None) -> int | None:
    text = _read_or_none(path)
    if text is None:
        return default
    try:
        return int(text, 0)
    except ValueError as e:
        raise NicError(f"{path}: not a number: {text[:40]!r}") from e


def hex_id(path: Path) -> str:
    """`0x15b3` -> `15b3`, the form lspci and device plugin selectors use."""
    text = read(path).lower()
    value = text[2:] if text.startswith("0x") else text
    if not re.fullmatch(r"[0-9a-f]{4}", value):
        raise NicError(f"{path}: not a PCI ID: {text[:40]!r}")
    return value


def link_target_name(path: Path) -> str | None:
    """Basename of a symlink's target (`driver` -> `mlx5_core`), None when there is no link."""
    try:
        return os.path.basename(os.readlink(path))
    except OSError:
        return None


def pci_function_dir(sysfs_root: Path, bdf: str) -> Path:
    """The real directory of a PCI function; NicError when sysfs does not list it."""
    path = sysfs_root / "bus/pci/devices" / bdf
    if not path.exists():
        raise NicError(f"PCI function {bdf} not found under {sysfs_root}/bus/pci/devices")
    return path.resolve()
