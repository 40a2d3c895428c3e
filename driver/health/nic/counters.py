"""A NIC's error and congestion counters as sysfs shows them: the raw values grey-failure rules
turn into rates (a link that keeps retraining, a fabric that keeps losing packets).

Three kinds of counter, and each stops telling in its own way. The IBTA port counters
(`ports/<p>/counters/`) are narrow and saturate: at all ones they stay put, which reads as "no
new errors" (`COUNTER_LIMITS` holds where each stops). The vendor counters (`ports/<p>/hw_counters/`)
wrap instead: mlx5 reads its queue counters as 32-bit values and its congestion counters as 64-bit
ones; they also start again at 0 when the driver reloads. Which of them a port has depends on the
kernel and on what the firmware offers, so only the counters present and readable are reported; an
old kernel prints `N/A (no PMA)` where its query failed, a newer one fails the read, and both are
left out. The netdev's `carrier_changes` counts each carrier up and each down and starts again
with a new netdev; its `speed` cannot be read while the interface is down, and an unknown speed
prints as -1; that, 0, and -1 in 16 or 32 unsigned bits (65535, 4294967295) are None here.

Values are read as `driver.health.pcie_sysfs` reads them (bounded, ASCII, from real directories
under the sysfs root); a value above what its counter can hold is garbage, not a count. Port
numbers come from listing `ports/`, of which only the first few entries are read: a device has
one or two ports.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

from driver.health.pcie_sysfs import parse_decimal, read_text, real_dir

PORT_ERROR_COUNTERS: tuple[str, ...] = (
    "symbol_error",
    "link_error_recovery",
    "link_downed",
    "port_rcv_errors",
    "local_link_integrity_errors",
    "excessive_buffer_overrun_errors",
)
TRANSPORT_ERROR_COUNTERS: tuple[str, ...] = (
    "out_of_sequence",
    "packet_seq_err",
    "local_ack_timeout_err",
    "req_transport_retries_exceeded",
)
CONGESTION_COUNTERS: tuple[str, ...] = ("np_ecn_marked_roce_packets", "np_cnp_sent", "rp_cnp_handled", "rp_cnp_ignored")

# Where each counter stops: the value an IBTA port counter saturates at (its width's all ones), or
# the modulus a vendor counter wraps at.
COUNTER_LIMITS: Mapping[str, int] = MappingProxyType(
    {
        "symbol_error": 2**16 - 1,
        "link_error_recovery": 2**8 - 1,
        "link_downed": 2**8 - 1,
        "port_rcv_errors": 2**16 - 1,
        "local_link_integrity_errors": 2**4 - 1,
        "excessive_buffer_overrun_errors": 2**4 - 1,
        **dict.fromkeys(TRANSPORT_ERROR_COUNTERS, 2**32),
        **dict.fromkeys(CONGESTION_COUNTERS, 2**64),
    }
)

_GROUPS = (("counters", PORT_ERROR_COUNTERS), ("hw_counters", TRANSPORT_ERROR_COUNTERS + CONGESTION_COUNTERS))
_MAX_PORT_ENTRIES = 16  # entries of `ports/` looked at
_MAX_PORT = 255  # port numbers are 8 bits
_MAX_SPEED = 2**31 - 1  # printed signed: the all-ones "unknown" shows as -1
_UNKNOWN_SPEEDS = frozenset({0, 65535})  # 65535: -1 in 16 bits; 4294967295 is above _MAX_SPEED
_FW_VER_LIMIT = 128


@dataclass(frozen=True)
class NicCounters:
    carrier_changes: int | None  # class/net/<ifname>/carrier_changes
    speed_mbps: int | None  # class/net/<ifname>/speed; None when unknown or unreadable
    fw_ver: str  # class/infiniband/<dev>/fw_ver, "" when absent
    ports: Mapping[int, Mapping[str, int]]  # port -> counter -> value, the counters present and readable


def _device_dir(sysfs_root: Path, kind: str, name: str) -> str | None:
    """`class/<kind>/<name>` as a real directory under sysfs; None for a name that is no single
    path component ("", ".", "..", one with a slash) or a device sysfs does not show."""
    if name in ("", ".", "..") or "/" in name:
        return None
    return real_dir(sysfs_root, f"class/{kind}/{name}")


def _number(directory: str | None, name: str, maximum: int) -> int | None:
    text = None if directory is None else read_text(f"{directory}/{name}")
    return None if text is None else parse_decimal(text, maximum)


def _port_numbers(ports: str) -> list[int]:
    """The decimal port directories among the first entries of `ports/`, none when it cannot be listed."""
    try:
        with os.scandir(ports) as entries:
            names = [e.name for e in itertools.islice(entries, _MAX_PORT_ENTRIES) if e.is_dir(follow_symlinks=False)]
    except OSError:
        return []
    return sorted(n for n in (parse_decimal(name, _MAX_PORT) for name in names) if n is not None)


def _port_counters(sysfs_root: Path, port: str) -> Mapping[str, int]:
    counters: dict[str, int] = {}
    for group, names in _GROUPS:
        directory = real_dir(sysfs_root, f"{port}/{group}")
        for name in names:
            limit = COUNTER_LIMITS[name]
            value = _number(directory, name, limit if name in PORT_ERROR_COUNTERS else limit - 1)
            if value is not None:
                counters[name] = value
    return MappingProxyType(counters)


def _ports(sysfs_root: Path, rdma_device: str) -> Mapping[int, Mapping[str, int]]:
    ports = f"class/infiniband/{rdma_device}/ports"
    listing = real_dir(sysfs_root, ports)
    numbers = [] if listing is None else _port_numbers(listing)
    return MappingProxyType({number: _port_counters(sysfs_root, f"{ports}/{number}") for number in numbers})


def read_nic_counters(sysfs_root: Path, ifname: str, rdma_device: str) -> NicCounters:
    """The netdev's carrier and speed, the RDMA device's firmware and per-port counters; an empty
    `ifname` or `rdma_device` leaves its part None or empty."""
    net = _device_dir(sysfs_root, "net", ifname)
    speed = _number(net, "speed", _MAX_SPEED)
    rdma = _device_dir(sysfs_root, "infiniband", rdma_device)
    fw_ver = None if rdma is None else read_text(f"{rdma}/fw_ver", _FW_VER_LIMIT)
    return NicCounters(
        carrier_changes=_number(net, "carrier_changes", 2**32 - 1),
        speed_mbps=None if speed in _UNKNOWN_SPEEDS else speed,
        fw_ver=fw_ver if fw_ver is not None and fw_ver.isprintable() else "",
        ports=MappingProxyType({}) if rdma is None else _ports(sysfs_root, rdma_device),
    )
