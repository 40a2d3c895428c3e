"""Grey failures on a running simulated node: the hardware going bad while the daemon watches.

A grey failure leaves a device working, worse than it should: a PCIe link trained down, AER errors,
a NIC whose link flaps, InfiniBand error counters climbing, a GPU slowed down or with NVLinks down.
The kernel and NVML show such things only as states and counters, so a test (or the real-cluster
test, from outside the daemon) makes them happen by changing those: in the rendered sysfs
(`sim.sysfs`, `sim.nics`) and in the fake NVML's state file (`sim.nvml`). Counters change as the
hardware's do: they only rise, and stop at their width or wrap around as the real ones do.

Devices are found the kernel's way (`bus/pci/devices/<bdf>`, `class/net/<ifname>`,
`class/infiniband/<dev>`), so a helper works on whatever tree the node was rendered to. Every file
is replaced in one step: a daemon reading it meanwhile sees the old value or the new one. A change
to several files (both ends of a link, a flap's three counters) is not one step, as it is not in
the kernel either.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import os
import re
from collections.abc import Iterator
from pathlib import Path

from sim.fstree import replace
from sim.nics import HW_COUNTERS, PORT_COUNTERS, rate_string
from sim.nvml import read_state, write_state
from sim.pcie import AER_FILES, aer_text, speed_string
from sim.profile import GpuSpec

_BDF = re.compile(r"[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]")


def _pci_function(sysfs_root: Path, bdf: str) -> Path:
    listed = Path(sysfs_root) / "bus" / "pci" / "devices" / bdf
    if not listed.exists():
        raise LookupError(f"no PCI function {bdf} under {sysfs_root}")
    return listed.resolve()


def _class_device(sysfs_root: Path, cls: str, name: str) -> Path:
    listed = Path(sysfs_root) / "class" / cls / name
    if not listed.exists():
        raise LookupError(f"no {cls} device {name} under {sysfs_root}")
    return listed.resolve()


def _read_int(path: Path) -> int:
    return int(path.read_text())


def _check_count(n: int) -> None:
    if n < 0:
        raise ValueError(f"counters only rise: cannot add {n}")


def set_pcie_link(sysfs_root: Path, bdf: str, *, speed_gts: float | None = None, width: int | None = None) -> None:
    """The link of the function `bdf` retrained, to `speed_gts` (GT/s: 2.5, 5.0, 8.0, 16.0, 32.0,
    64.0) and `width` lanes; unchanged where None. Both ends of a link train alike, so the port above
    the function (the bridge whose bus it sits on) changes with it. ValueError for a link that either
    end could not train to (faster or wider than its maximum)."""
    function = _pci_function(sysfs_root, bdf)
    ends = [function, *([function.parent] if _BDF.fullmatch(function.parent.name) else [])]
    changes = {}
    if speed_gts is not None:
        text = speed_string(speed_gts)
        if any(speed_gts > float((end / "max_link_speed").read_text().split()[0]) for end in ends):
            raise ValueError(f"{bdf}: {speed_gts} GT/s is faster than an end of its link can go")
        changes["current_link_speed"] = text + "\n"
    if width is not None:
        if not all(0 < width <= _read_int(end / "max_link_width") for end in ends):
            raise ValueError(f"{bdf}: x{width} is no width an end of its link can train to")
        changes["current_link_width"] = f"{width}\n"
    for end in ends:
        for name, text in changes.items():
            replace(end / name, text)


def add_aer(sysfs_root: Path, bdf: str, severity: str, name: str, n: int = 1) -> None:
    """`n` AER errors of the kind `name` (e.g. "BadTLP", "CmpltTO") and `severity` ("correctable",
    "nonfatal", "fatal") seen by the function or bridge `bdf`: its line and its file's TOTAL line
    rise by `n`, one error message per error, as the kernel counts."""
    if severity not in AER_FILES:
        raise ValueError(f"no AER severity {severity!r}: one of {sorted(AER_FILES)}")
    file, errors, total = AER_FILES[severity]
    if name not in errors:
        raise ValueError(f"no {severity} AER error {name!r}: one of {errors}")
    _check_count(n)
    path = _pci_function(sysfs_root, bdf) / file
    counts = {key: int(value) for key, value in (line.rsplit(" ", 1) for line in path.read_text().splitlines())}
    counts[name] += n
    counts[total] += n
    replace(path, aer_text(counts))


def flap(sysfs_root: Path, ifname: str, times: int = 1) -> None:
    """The link of the netdev `ifname` lost and found again, `times` times: each flap takes the
    carrier down and up, so the down and up counts rise by one and the changes by two, and the
    carrier ends up. Only a link that is up can flap (ValueError otherwise)."""
    _check_count(times)
    net = _class_device(sysfs_root, "net", ifname)
    if (net / "operstate").read_text().strip() != "up":
        raise ValueError(f"{ifname} is not up: its link cannot flap")
    for name, rise in (("carrier_down_count", times), ("carrier_up_count", times), ("carrier_changes", 2 * times)):
        replace(net / name, f"{_read_int(net / name) + rise}\n")
    replace(net / "carrier", "1\n")


def add_port_counter(sysfs_root: Path, rdma_device: str, port: int, name: str, n: int) -> None:
    """`n` more of the counter `name` of a port of `rdma_device`: a PMA counter (`counters/`, e.g.
    "symbol_error") stops at the largest value of its IBTA width and stays there, an mlx5 hardware
    counter (`hw_counters/`, e.g. "out_of_sequence") wraps around at its width (32 bits; 64 for the
    congestion counters np_* and rp_*)."""
    _check_count(n)
    port_dir = _class_device(sysfs_root, "infiniband", rdma_device) / "ports" / str(port)
    if not port_dir.is_dir():
        raise LookupError(f"{rdma_device} has no port {port}")
    if name in PORT_COUNTERS:
        path = port_dir / "counters" / name
        value = min(_read_int(path) + n, 2 ** PORT_COUNTERS[name] - 1)
    elif name in HW_COUNTERS:
        path = port_dir / "hw_counters" / name
        value = (_read_int(path) + n) % 2 ** HW_COUNTERS[name]
    else:
        raise ValueError(f"no port counter {name!r}: one of {[*PORT_COUNTERS, *HW_COUNTERS]}")
    replace(path, f"{value}\n")


def set_netdev_speed(sysfs_root: Path, ifname: str, mbps: int) -> None:
    """The link of the netdev `ifname` renegotiated to `mbps` (e.g. 200000 after a lane failed):
    its `speed`, and the `rate` of every RDMA port whose netdev it is."""
    net = _class_device(sysfs_root, "net", ifname)
    replace(net / "speed", f"{mbps}\n")
    for port_dir in (net / "device").glob("infiniband/*/ports/*"):
        ndev = port_dir / "gid_attrs" / "ndevs" / "0"
        if ndev.is_file() and ndev.read_text().strip() == ifname:
            replace(port_dir / "rate", rate_string(mbps))


@contextlib.contextmanager
def _state_locked(state_path: Path) -> Iterator[None]:
    """The fake NVML's own lock on its state file, which it holds while it changes the file (a MIG
    change): a test's change made meanwhile would otherwise undo the daemon's, or the daemon's it."""
    fd = os.open(f"{state_path}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def set_gpu_signals(state_path: Path, uuid: str, **fields: object) -> None:
    """The GPU `uuid` as NVML will report it from its next call: the named `GpuSpec` fields set
    (e.g. `pcie_link_gen=3`, `clocks_event_reasons=0x40`, `nvlink_down=[2]`). ValueError for a
    name GpuSpec has no field of, before anything changes."""
    unknown = sorted(set(fields) - {f.name for f in dataclasses.fields(GpuSpec)})
    if unknown:
        raise ValueError(f"GpuSpec has no field {', '.join(unknown)}")
    with _state_locked(state_path):
        profile = read_state(state_path)
        gpu = next((g for g in profile.gpus if g.uuid == uuid), None)
        if gpu is None:
            raise LookupError(f"no GPU {uuid} in {state_path}")
        for name, value in fields.items():
            setattr(gpu, name, value)
        write_state(profile, state_path)
