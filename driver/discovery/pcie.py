"""Where a PCI function sits in the PCIe hierarchy: its upstream path, and the switch it sits behind.

What the kernel shows (docs/reference/drivers.md, 'PCIe topology'): the real sysfs path of a
function spells its upstream path, `devices/pci0000:15/0000:15:01.0/0000:16:00.0/0000:17:00.0/
0000:18:00.0` being host bridge, root port, switch upstream port, switch downstream port, device.
Every bridge has class 0x0604; which kind of port it is is the Device/Port Type field of its PCI
Express capability, in config space (`<bridge>/config`).

**The switch a device sits behind** is the nearest upstream switch port above it (port type 5): a
PCIe switch is one upstream port with its downstream ports on an internal bus, and devices below
one switch reach each other through it without crossing the root complex (nvidia-smi's `PIX`,
what GPUDirect RDMA needs for full bandwidth). Its upstream port's PCI address names it.

Port types come from config space when every bridge on the path can be read that far (root can;
anyone else reads only the first 64 bytes of `config`). Otherwise they follow from the structure,
which is how PCIe hierarchies are built: a bridge on the root bus is a root port, below it
upstream and downstream switch ports alternate. Both agree on every ordinary hierarchy; config
space is preferred because it also recognises a PCIe-to-PCI bridge, which is no switch.

**PCIe distance** (`distance`, for GPU-NIC pairing): the number of links between two functions
through their lowest common ancestor in this tree; None when they hang below different root
complexes (their traffic then crosses the CPU interconnect or at least the host bridge's fabric).
"""

from __future__ import annotations

import logging
import os
import posixpath
import struct
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

# Tandem's attributes (in the driver's domain): the switch's upstream port, and (list form only)
# the whole upstream path.
PCIE_SWITCH = "pcieSwitch"
PCIE_PATH = "pciePath"
PORT_ROOT = 0x4
PORT_UPSTREAM = 0x5
PORT_DOWNSTREAM = 0x6
_CAP_PCIE = 0x10
_CAP_POINTER = 0x34
_STATUS_CAP_LIST = 0x10
_CONFIG_BYTES = 256
_MAX_CAPABILITIES = 48  # a loop in a broken capability list must end


@dataclass(frozen=True)
class PciePath:
    """A function's place in the hierarchy: `nodes` is the host bridge (`pci0000:15`), then the
    bridges root port first; `switch` the upstream port of the nearest switch above, or None."""

    nodes: tuple[str, ...]
    switch: str | None

    @property
    def root(self) -> str:
        return self.nodes[0]


def device_path(sysfs_root: Path, bdf: str) -> tuple[str, ...] | None:
    """(host bridge, bridges..., bdf) from the kernel's `bus/pci/devices/<bdf>` link, or None with
    a logged reason. The link is relative (the kernel makes it so) and is resolved lexically, never
    following further links; it must land in `devices/pci...` and end in the BDF."""
    link = f"{sysfs_root}/bus/pci/devices/{bdf}"  # plain strings: pathlib costs more than the reads
    try:
        target = os.readlink(link)
    except OSError as e:
        log.warning("PCI path of %s: cannot read link %s: %s", bdf, link, e)
        return None
    if posixpath.isabs(target):
        log.warning("PCI path of %s: link target %r is absolute, the kernel makes relative ones", bdf, target)
        return None
    resolved = posixpath.normpath(posixpath.join("bus/pci/devices", target))
    parts = resolved.split("/")
    if not resolved.startswith("devices/pci") or len(parts) < 3 or parts[-1] != bdf:
        log.warning("PCI path of %s: link target %r is not a PCI device path", bdf, target)
        return None
    return tuple(parts[1:])


def port_type(config: bytes) -> int | None:
    """The Device/Port Type of a config space's PCI Express capability; None when it has none or
    the bytes read do not reach it."""
    if len(config) < 0x40 or not struct.unpack_from("<H", config, 0x06)[0] & _STATUS_CAP_LIST:
        return None
    ptr = config[_CAP_POINTER] & 0xFC
    for _ in range(_MAX_CAPABILITIES):
        if ptr < 0x40 or ptr + 4 > len(config):
            return None
        if config[ptr] == _CAP_PCIE:
            return (int(struct.unpack_from("<H", config, ptr + 2)[0]) >> 4) & 0xF
        ptr = config[ptr + 1] & 0xFC
    return None


def _structural_type(position: int) -> int:
    if position == 0:
        return PORT_ROOT
    return PORT_UPSTREAM if position % 2 else PORT_DOWNSTREAM


def _config_types(sysfs_root: Path, nodes: tuple[str, ...]) -> list[int] | None:
    """Port types of the bridges `nodes[1:]` from their config space; None if any cannot be read."""
    types = []
    directory = f"{sysfs_root}/devices/{nodes[0]}"
    for bridge in nodes[1:]:
        directory = f"{directory}/{bridge}"
        try:
            fd = os.open(f"{directory}/config", os.O_RDONLY)
            try:
                config = os.read(fd, _CONFIG_BYTES)
            finally:
                os.close(fd)
        except OSError as e:
            log.debug("config space of %s not readable (%s): port types from the structure", bridge, e)
            return None
        found = port_type(config)
        if found is None:
            log.debug("config space of %s shows no PCIe port type: port types from the structure", bridge)
            return None
        types.append(found)
    return types


def pcie_path(sysfs_root: Path, bdf: str) -> PciePath | None:
    """The function's path and switch (module docstring); None when its link cannot be read."""
    parts = device_path(sysfs_root, bdf)
    if parts is None:
        return None
    nodes = parts[:-1]
    bridges = nodes[1:]
    types = _config_types(sysfs_root, nodes) or [_structural_type(i) for i in range(len(bridges))]
    switch = next((b for b, t in zip(reversed(bridges), reversed(types), strict=True) if t == PORT_UPSTREAM), None)
    return PciePath(nodes=nodes, switch=switch)


def shared_nodes(a: tuple[str, ...], b: tuple[str, ...]) -> int:
    """How many upstream nodes (host bridge first) two paths share: 0 below different host
    bridges, 1 sharing only the host bridge, more when they share a bridge below it."""
    common = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        common += 1
    return common


def distance(a: tuple[str, ...], b: tuple[str, ...]) -> int | None:
    """Links between two functions whose upstream paths (host bridge first) are `a` and `b`, up to
    their lowest common ancestor and down again; None below different host bridges or unknown."""
    common = shared_nodes(a, b)
    if common == 0:
        return None
    return (len(a) - common + 1) + (len(b) - common + 1)
