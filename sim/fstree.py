"""The building blocks of a rendered node: files, relative links, character devices, PCI functions.

Shared by the GPU side (`sim.sysfs`) and the NIC side (`sim.nics`) of the node, so that both lay
out PCI functions the one way the kernel does (see `sim.sysfs` for the layout).

Some files are the running node's, not the profile's: error counters and the state of a link
change while the node runs (`sim.grey` changes them, as the hardware would). Rendering writes
those only where they are missing (`write_once`), so that rendering again, after a hot-plug or a
profile change, keeps what happened since; every other file is rewritten from the profile.
Changes made while a reader may look (`replace`) are atomic: a reader sees the old count or the
new, never a torn or empty file.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence
from pathlib import Path

from cdi import atomic_write
from sim.pcie import AER_FILES, BOARD_LINK, BRIDGE_CLASS, Link, aer_text, bridge_config, bridge_ids, port_type

_PCI_CLASS_BY_VENDOR = {0x10DE: 0x030200, 0x15B3: 0x020000}  # 3D controller, Ethernet controller


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def write_once(path: Path, text: str) -> None:
    """`write`, unless the file is there: it holds what the running node did (module docstring)."""
    if not path.exists():
        write(path, text)


def replace(path: Path, text: str) -> None:
    """Replace an existing file in one step, for a reader that may be reading it now. Not durable:
    a rendered tree means nothing after a reboot."""
    atomic_write(path, text.encode(), durable=False)


def _pcie_state(directory: Path, link: Link) -> None:
    """A PCIe function's or bridge's link and AER statistics, all errors zero (`sim.pcie`)."""
    for name, text in link.files().items():
        write_once(directory / name, text)
    for file, errors, total in AER_FILES.values():
        write_once(directory / file, aer_text(dict.fromkeys([*errors, total], 0)))


def symlink(link: Path, target: Path) -> None:
    """A relative link from `link` to `target`, replacing whatever was there."""
    link.parent.mkdir(parents=True, exist_ok=True)
    rel = os.path.relpath(target, link.parent)
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(rel)


def pci_device_dir(
    sysfs_root: Path,
    bdf: str,
    pcie_root: str,
    numa_node: int,
    vendor: int,
    device: int,
    driver: str | None,
    *,
    pci_class: int | None = None,
    bridges: Sequence[str] = (),
    link: Link = BOARD_LINK,
) -> Path:
    """Create a PCI function's sysfs directory and its links; return the real directory.

    `pci_class` defaults to a 3D controller for NVIDIA and an Ethernet controller otherwise.
    `bridges`: the PCIe bridges between the host bridge and the function, root port first, each
    rendered with its config space (`sim.pcie`); without them a function off the root bus gets a
    root port of its own. `link`: the function's PCIe link; the port above it shows the same one
    (both ends train alike, and the slot was built for the part), the other bridges the board's.
    """
    domain, bus, _ = bdf.split(":", 2)
    root_bus = pcie_root.split(":")[-1]
    parent = sysfs_root / "devices" / pcie_root
    if not bridges and bus != root_bus:
        bridges = (f"{domain}:{root_bus}:01.0",)
    for position, bridge in enumerate(bridges):
        parent = parent / bridge
        port = port_type(position)
        bridge_vendor, bridge_device = bridge_ids(port)
        write(parent / "class", f"0x{BRIDGE_CLASS:06x}\n")
        write(parent / "vendor", f"0x{bridge_vendor:04x}\n")
        write(parent / "device", f"0x{bridge_device:04x}\n")
        (parent / "config").write_bytes(bridge_config(bridge_vendor, bridge_device, port))
        _pcie_state(parent, link if position == len(bridges) - 1 else BOARD_LINK)
        symlink(sysfs_root / "bus" / "pci" / "devices" / bridge, parent)
    real = parent / bdf
    cls = pci_class if pci_class is not None else _PCI_CLASS_BY_VENDOR.get(vendor, 0x020000)
    write(real / "numa_node", f"{numa_node}\n")
    write(real / "vendor", f"0x{vendor:04x}\n")
    write(real / "device", f"0x{device:04x}\n")
    write(real / "class", f"0x{cls:06x}\n")
    _pcie_state(real, link)
    drivers = sysfs_root / "bus" / "pci" / "drivers"
    if driver is not None:
        symlink(real / "driver", drivers / driver)
        symlink(drivers / driver / bdf, real)
    elif (real / "driver").is_symlink():
        (real / "driver").unlink()
    symlink(sysfs_root / "bus" / "pci" / "devices" / bdf, real)
    return real


def char_device(path: Path, major: int, minor: int, use_mknod: bool) -> bool:
    """A character device if we may create one, else an empty file; returns which it made."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists() or path.is_symlink():
        path.unlink()
    if use_mknod:
        try:
            os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(major, minor))
            os.chmod(path, 0o666)  # as the nvidia driver makes them; mknod honours the umask
            return True
        except OSError:
            pass
    path.touch()
    return False
