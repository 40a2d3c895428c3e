"""A PCI function's PCIe link and AER counters as sysfs shows them: the raw values grey-failure
rules compare (a link trained narrower or slower than both its ends can do, errors that keep
rising while the device still works).

The kernel answers the current-link files from the function's Link Status register at each read,
the maximum ones from its Link Capabilities. Two spellings of a speed are in use: `8 GT/s` and
`Unknown speed` up to kernel 5.6, `8.0 GT/s PCIe` and `Unknown` from 5.7; both are read, unknown
as missing. A link's ceiling is the lower of what its two ends can do, so the port above the
function (a root port or a switch's downstream port, the element before the function in its
device path) is read too; a function on the root bus has no such port. The lane field is six bits
wide, so a config space that reads all ones shows 63 lanes; PCIe has at most 32, and anything
above is taken as unknown.

The AER files (kernel 4.19 and later, on devices with the AER capability) list one
`<name> <count>` per line and then a `TOTAL_ERR_*` line; the kernel prints short names, its
documentation long ones with spaces, so each line is split on its last space and totals are
looked up by name, never by position. An absent file is no proof of health: the kernel hides it
from devices without the capability, and firmware-first error handling keeps errors from Linux
altogether.

sysfs is the kernel's, but a test tree or a kernel bug can put anything there: every value is
read bounded, never through a symlink as the last component and never blocking (a FIFO answers
nothing), from directories whose real path lies under the sysfs root, and decoded as ASCII, so
digits of other scripts (which `int` takes) count as garbage. Nothing here raises for what a file
holds: it is a value or None. The helpers that do this (`read_text`, `parse_decimal`, `real_dir`)
serve the NIC counters' reader (`driver.health.nic.counters`) too.

Cost: these run for every device every grey-failure round, and resolving a directory's real path
takes a system call per path component. So a resolved directory is remembered and only checked
to be a directory still (one `stat`) before it is used again; one that is gone, or became
something else, is resolved anew. A real path names its device (the PCI address, the netdev's
name), so a remembered one that still exists is still the same device's.
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

from driver.discovery.pcie import device_path

_PAGE = 4096  # the most a sysfs attribute holds
_VALUE_LIMIT = 64  # a number or a speed, with room to spare
_MAX_WIDTH = 32  # lanes PCIe defines at most
_MAX_SPEED_GTS = 1024.0  # 64 GT/s is PCIe 6.0; a few generations' headroom
_SPEED = re.compile(r"([0-9]{1,4}(?:\.[0-9]{1,3})?) GT/s(?: PCIe)?")
_AER_TOTALS = ("TOTAL_ERR_COR", "TOTAL_ERR_NONFATAL", "TOTAL_ERR_FATAL")
_U64_MAX = 2**64 - 1  # AER counts are u64


@dataclass(frozen=True)
class PcieLink:
    speed_gts: float | None  # current_link_speed, GT/s
    width: int | None  # current_link_width
    max_speed_gts: float | None  # max_link_speed of this function
    max_width: int | None
    port: str | None  # BDF of the port above it; None on the root bus
    port_max_speed_gts: float | None
    port_max_width: int | None

    def capable_speed(self) -> float | None:
        """The fastest the link can train to: the lower of the maxima known of its two ends."""
        known = [s for s in (self.max_speed_gts, self.port_max_speed_gts) if s is not None]
        return min(known, default=None)

    def capable_width(self) -> int | None:
        """The widest the link can train to: the lower of the maxima known of its two ends."""
        known = [w for w in (self.max_width, self.port_max_width) if w is not None]
        return min(known, default=None)


@dataclass(frozen=True)
class AerCounts:
    correctable: int | None  # TOTAL_ERR_COR
    nonfatal: int | None  # TOTAL_ERR_NONFATAL
    fatal: int | None  # TOTAL_ERR_FATAL


def read_text(path: str, limit: int = _VALUE_LIMIT) -> str | None:
    """A sysfs attribute's ASCII text, stripped; None when it is absent, unreadable (EINVAL: a
    value the kernel will not give now), a symlink, not a regular file, over `limit` bytes or not
    ASCII. Opened non-blocking, so a FIFO returns nothing rather than hanging the reader."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        data = os.read(fd, limit + 1)
    except OSError:
        return None
    finally:
        os.close(fd)
    try:
        return data.decode("ascii").strip() if len(data) <= limit else None
    except UnicodeDecodeError:
        return None


def parse_decimal(text: str, maximum: int) -> int | None:
    """A plain ASCII decimal from 0 to `maximum`; None for anything else (a sign, another script's
    digits, more digits than `maximum` has, which also keeps `int` within its string limit)."""
    if not (text.isascii() and text.isdigit()) or len(text) > len(str(maximum)):
        return None
    value = int(text)
    return value if value <= maximum else None


_RESOLVED: dict[tuple[str, str], str] = {}  # (sysfs root, relative path) -> its real directory
_RESOLVED_LIMIT = 4096  # devices come and go: forget all rather than grow


def real_dir(sysfs_root: Path, relative: str) -> str | None:
    """The real path of a directory under `sysfs_root`, None when it is absent or its links lead
    outside: what is read below it is then read from real directories of sysfs alone. Remembered,
    and checked to be a directory still before it is given again (module docstring)."""
    if "\0" in relative:
        return None
    key = (str(sysfs_root), relative)
    known = _RESOLVED.get(key)
    if known is not None and os.path.isdir(known):
        return known
    _RESOLVED.pop(key, None)
    root = os.path.realpath(sysfs_root)
    real = os.path.realpath(os.path.join(root, relative))
    if not (real.startswith(root + os.sep) and os.path.isdir(real)):
        return None
    if len(_RESOLVED) >= _RESOLVED_LIMIT:
        _RESOLVED.clear()
    _RESOLVED[key] = real
    return real


def parse_link_speed(text: str) -> float | None:
    """GT/s from `8.0 GT/s PCIe` (kernel 5.7 and later) or `8 GT/s` (before); None for
    `Unknown`, `Unknown speed` and anything else."""
    match = _SPEED.fullmatch(text.strip())
    if match is None:
        return None
    speed = float(match.group(1))
    return speed if 0 < speed <= _MAX_SPEED_GTS else None


def parse_aer(text: str) -> dict[str, int]:
    """Name -> count of an `aer_dev_*` file, names as written, lines that end in no count skipped."""
    counts: dict[str, int] = {}
    for line in text.splitlines():
        name, _, count = line.strip().rpartition(" ")
        value = parse_decimal(count, _U64_MAX)
        if name and value is not None:
            counts[name] = value
    return counts


def _function_path(sysfs_root: Path, bdf: str) -> tuple[str, ...] | None:
    """(host bridge, bridges..., bdf), without a word when sysfs does not list the function."""
    if not os.path.lexists(f"{sysfs_root}/bus/pci/devices/{bdf}"):
        return None
    return device_path(sysfs_root, bdf)  # a link it cannot follow is logged there


def _width(directory: str | None, name: str, minimum: int) -> int | None:
    text = None if directory is None else read_text(f"{directory}/{name}")
    value = None if text is None else parse_decimal(text, _MAX_WIDTH)
    return value if value is not None and value >= minimum else None


def _speed(directory: str | None, name: str) -> float | None:
    text = None if directory is None else read_text(f"{directory}/{name}")
    return None if text is None else parse_link_speed(text)


def read_pcie_link(sysfs_root: Path, bdf: str) -> PcieLink | None:
    """The function's link and the maxima of the port above it; None when sysfs does not list the
    function or its directory cannot be reached. A current width of 0 (the link is down) is a
    value; a maximum of 0 is not."""
    parts = _function_path(sysfs_root, bdf)
    if parts is None:
        return None
    function = real_dir(sysfs_root, "devices/" + "/".join(parts))
    if function is None:
        return None
    port = None if parts[-2].startswith("pci") else parts[-2]
    port_dir = None if port is None else real_dir(sysfs_root, "devices/" + "/".join(parts[:-1]))
    return PcieLink(
        speed_gts=_speed(function, "current_link_speed"),
        width=_width(function, "current_link_width", 0),
        max_speed_gts=_speed(function, "max_link_speed"),
        max_width=_width(function, "max_link_width", 1),
        port=port,
        port_max_speed_gts=_speed(port_dir, "max_link_speed"),
        port_max_width=_width(port_dir, "max_link_width", 1),
    )


def port_of(sysfs_root: Path, bdf: str) -> str | None:
    """The PCI address of the port above a function (None on the root bus, or unlisted)."""
    parts = _function_path(sysfs_root, bdf)
    return None if parts is None or parts[-2].startswith("pci") else parts[-2]


def read_aer(sysfs_root: Path, bdf: str) -> AerCounts:
    """The function's AER totals; a field is None where its file, or its total, cannot be read."""
    parts = _function_path(sysfs_root, bdf)
    function = None if parts is None else real_dir(sysfs_root, "devices/" + "/".join(parts))
    totals = []
    for kind, total in zip(("correctable", "nonfatal", "fatal"), _AER_TOTALS, strict=True):
        text = None if function is None else read_text(f"{function}/aer_dev_{kind}", _PAGE)
        totals.append(None if text is None else _total(text, total))
    return AerCounts(*totals)


def _total(text: str, total: str) -> int | None:
    """The count of the `total` line, found from the end (the kernel prints it last): every
    round reads these files, and only their totals."""
    for line in reversed(text.splitlines()):
        name, _, count = line.strip().rpartition(" ")
        if name == total:
            return parse_decimal(count, _U64_MAX)
    return None
