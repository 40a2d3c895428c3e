"""PCI topology from sysfs: the standard pciBusID, pcieRoot and numaNode attributes, and the PCIe
switch (`driver.discovery.pcie`).

Derivations follow k8s.io/dynamic-resource-allocation `deviceattribute` (docs/reference/kubelet-plugin.md,
'Standard attributes') so that `matchAttribute: resource.kubernetes.io/pcieRoot` or `.../numaNode` constraints
line up across drivers. Shared by GPU and NIC discovery; every reader takes the sysfs root so tests
and containers can point it elsewhere. Readers fail soft: a device whose topology cannot be read
is still a device, just without these attributes, and the reason is logged.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path

from driver.discovery.pcie import PCIE_PATH, PCIE_SWITCH, pcie_path
from driver.model import NUMA_NODE, PCI_BUS_ID, PCIE_ROOT, AttrValue
from driver.resource_api import MAX_VALUE_LENGTH

log = logging.getLogger(__name__)

_BDF = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-9a-f]$")
# NVML's form: an 8-digit domain, upper case ("00000000:1B:00.0").
_NVML_BDF = re.compile(r"^([0-9a-f]{8}):([0-9a-f]{2}:[0-9a-f]{2}\.[0-9a-f])$")
MAX_NUMA_NODE = 1023
# One part of a sysfs CPU list (`cpulist`): a CPU number, or an inclusive range of them.
_CPU_RANGE = re.compile(r"([0-9]+)(?:-([0-9]+))?")


def is_pci_bus_id(value: str) -> bool:
    """True for the canonical lower-case `dddd:bb:dd.f` form the standard attribute requires."""
    return bool(_BDF.match(value))


def pci_bus_id(raw: str | bytes) -> str:
    """Canonical BDF from sysfs or NVML spellings; ValueError when it is not one.

    NVML writes "00000000:1B:00.0" (8-digit domain, upper case, NUL-padded buffer): the domain is
    shortened to 4 digits when it fits, which it always does on Linux.
    """
    text = raw.decode("ascii", "replace") if isinstance(raw, bytes) else raw
    text = text.strip("\x00").strip().lower()
    m = _NVML_BDF.match(text)
    if m:
        domain = int(m.group(1), 16)
        if domain > 0xFFFF:
            raise ValueError(f"PCI domain of {text!r} does not fit the 4-digit form")
        text = f"{domain:04x}:{m.group(2)}"
    if not _BDF.match(text):
        raise ValueError(f"{text!r} is not a PCI bus ID (dddd:bb:dd.f)")
    return text


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except (OSError, UnicodeDecodeError) as e:
        log.debug("cannot read %s: %s", path, e)
        return None


def numa_node(sysfs_root: Path, bdf: str) -> int | None:
    """The function's NUMA node, or None when the platform reports none (-1) or nonsense."""
    if not is_pci_bus_id(bdf):
        log.warning("numaNode: %r is not a canonical PCI bus ID", bdf)
        return None
    path = sysfs_root / "bus" / "pci" / "devices" / bdf / "numa_node"
    text = _read(path)
    if text is None:
        log.info("numaNode of %s: %s not readable", bdf, path)
        return None
    try:
        node = int(text)
    except ValueError:
        log.warning("numaNode of %s: %s holds %r, not an integer", bdf, path, text[:32])
        return None
    if node == -1:
        log.debug("numaNode of %s: platform reports no NUMA node", bdf)
        return None
    if not 0 <= node <= MAX_NUMA_NODE:
        log.warning("numaNode of %s: %d is outside 0..%d", bdf, node, MAX_NUMA_NODE)
        return None
    return node


def _first_cpu(text: str) -> int | None:
    """The lowest CPU of a cpulist ("8,0-3,10-11" -> 0); None for an empty list (a memory-only
    node). Checked but never expanded: a corrupt "0-4294967295" costs no more than "0-3".
    ValueError naming the part that is neither a CPU number nor an ascending range."""
    first: int | None = None
    for part in filter(None, text.split(",")):
        m = _CPU_RANGE.fullmatch(part)
        if m is None or (m.group(2) is not None and int(m.group(2)) < int(m.group(1))):
            raise ValueError(f"{part[:32]!r} is neither a CPU number nor an ascending range of them")
        first = int(m.group(1)) if first is None else min(first, int(m.group(1)))
    return first


def _online_nodes(node_dir: Path) -> list[int]:
    try:
        names = [p.name for p in node_dir.iterdir()]
    except OSError:
        return []
    # isascii: `isdigit` also takes "²", which `int` refuses
    return sorted(int(n[4:]) for n in names if n.startswith("node") and n[4:].isascii() and n[4:].isdigit())


def _socket(sysfs_root: Path, node: int) -> int | None:
    """The CPU package of a NUMA node (None for memory-only nodes or unreadable topology)."""
    path = sysfs_root / "devices" / "system" / "node" / f"node{node}" / "cpulist"
    try:
        cpu = _first_cpu(_read(path) or "")
    except ValueError as e:
        log.warning("socket of NUMA node %d: %s is not a CPU list: %s", node, path, e)
        return None
    if cpu is None:
        return None
    pkg = _read(sysfs_root / "devices" / "system" / "cpu" / f"cpu{cpu}" / "topology" / "physical_package_id")
    try:
        return int(pkg) if pkg is not None else None
    except ValueError:
        return None


def numa_node_list(sysfs_root: Path, node: int) -> list[int]:
    """The node first, then the other nodes of its socket at the minimum SLIT distance from it.

    The `distance` row lists distances to the online nodes in ascending node order. A node whose
    socket cannot be read is never included; on any read failure the list is just `[node]`.
    """
    node_dir = sysfs_root / "devices" / "system" / "node"
    nodes = _online_nodes(node_dir)
    text = _read(node_dir / f"node{node}" / "distance")
    try:
        row = [int(d) for d in (text or "").split()]
    except ValueError:
        row = []
    if not row or len(row) != len(nodes):
        log.info("numaNode list of node %d: distance row %r does not match nodes %s", node, text, nodes)
        return [node]
    own = _socket(sysfs_root, node)
    if own is None:
        return [node]
    peers = {
        other: dist
        for other, dist in zip(nodes, row, strict=True)
        if other != node and _socket(sysfs_root, other) == own
    }
    if not peers:
        return [node]
    nearest = min(peers.values())
    return [node, *sorted(n for n, d in peers.items() if d == nearest)]


@dataclass(frozen=True)
class Topology:
    """A PCI function's topology attributes, and its upstream path for GPU-NIC pairing (host
    bridge first, then the bridges; () when unknown), which is published only in list form."""

    attributes: dict[str, AttrValue]
    pcie_path: tuple[str, ...] = ()


def topology(sysfs_root: Path, bdf: str, list_form: bool) -> Topology:
    """The standard attributes of a PCI function, and Tandem's `pcieSwitch` (the upstream port of
    the switch it sits behind) and, in list form only, `pciePath` (host bridge, then every bridge
    down to it: `driver.discovery.pcie`); any that cannot be derived are left out.

    `list_form` publishes numaNode and pciePath as lists (needs DRAListTypeAttributes on the cluster).
    """
    if not is_pci_bus_id(bdf):
        log.warning("topology: %r is not a canonical PCI bus ID", bdf)
        return Topology({})
    attrs: dict[str, AttrValue] = {PCI_BUS_ID: bdf}
    path = pcie_path(sysfs_root, bdf)
    if path is not None and len(path.root) > MAX_VALUE_LENGTH:
        log.warning("pcieRoot of %s: %r is too long for an attribute", bdf, path.root)
        path = None
    if path is not None:
        attrs[PCIE_ROOT] = path.root
        if path.switch is not None:
            attrs[PCIE_SWITCH] = path.switch
        if list_form:
            attrs[PCIE_PATH] = path.nodes
    node = numa_node(sysfs_root, bdf)
    if node is not None:
        attrs[NUMA_NODE] = tuple(numa_node_list(sysfs_root, node)) if list_form else node
    return Topology(attrs, path.nodes if path is not None else ())
