"""The building blocks of a rendered node: files, relative links, character devices, PCI functions.

Shared by the GPU side (`sim.sysfs`) and the NIC side (`sim.nics`) of the node, so that both lay
out PCI functions the one way the kernel does (see `sim.sysfs` for the layout).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence
from pathlib import Path

from sim.pcie import BRIDGE_CLASS, bridge_config, bridge_ids, port_type

_PCI_CLASS_BY_VENDOR = {0x10DE: 0x030200, 0x15B3: 0x020000}  # 3D controller, Ethernet controller


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


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
) -> Path:
    """Create a PCI function's sysfs directory and its links; return the real directory.

    `pci_class` defaults to a 3D controller for NVIDIA and an Ethernet controller otherwise.
    `bridges`: the PCIe bridges between the host bridge and the function, root port first, each
    rendered with its config space (`sim.pcie`); without them a function off the root bus gets a
    root port of its own.
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
        symlink(sysfs_root / "bus" / "pci" / "devices" / bridge, parent)
    real = parent / bdf
    cls = pci_class if pci_class is not None else _PCI_CLASS_BY_VENDOR.get(vendor, 0x020000)
    write(real / "numa_node", f"{numa_node}\n")
    write(real / "vendor", f"0x{vendor:04x}\n")
    write(real / "device", f"0x{device:04x}\n")
    write(real / "class", f"0x{cls:06x}\n")
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
