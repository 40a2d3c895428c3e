"""PCIe hierarchies of a simulated node: root ports and switches, and their config space.

Pure data, used by `sim.profile` (where the devices sit) and `sim.fstree` (how the kernel shows it).

How the kernel shows a PCIe hierarchy in sysfs: a host bridge is `devices/pci<domain>:<bus>`, and
every function is a directory below the bridge whose secondary bus it sits on, so the real path of
an endpoint spells its upstream path:
`devices/pci0000:15/0000:15:01.0/0000:16:00.0/0000:17:00.0/0000:18:00.0` is root port 15:01.0,
the upstream port 16:00.0 of a switch, its downstream port 17:00.0 and the endpoint 18:00.0. Every
bridge has PCI class 0x0604; which kind of port it is lives only in its config space, in the
Device/Port Type field of the PCI Express capability (`config`, readable in full by root; others
read only the first 64 bytes). A switch is one upstream port with the downstream ports on its
internal bus; the switch a device sits behind is the nearest upstream port above it.

The board (`hgx_board`): an HGX-like layout, two GPUs and one NIC behind each switch, two switches
behind each root complex (one root port each), root complexes alternating between the NUMA nodes'
sockets. More NICs than switches share the switches round-robin.

Links (`Link`): every PCIe function and bridge shows its link in sysfs, the Link Status register's
speed and width (`current_link_speed`, `current_link_width`) beside the Link Capabilities' maxima
(`max_link_speed`, `max_link_width`), speeds spelt as kernels since 5.7 spell them ("32.0 GT/s
PCIe"). A link trains alike at both ends: the function's current link is its port's.

AER statistics (`AER_FILES`): every function and bridge counts the errors it saw, one file per
severity in the format of drivers/pci/pcie/aer.c: a "<name> <count>" line for each error bit that
has a name, in bit order, then the file's "TOTAL_<ERR_...> <count>".
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from dataclasses import dataclass

# PCI Express capability, Device/Port Type (PCIe base spec 7.5.3.2).
PORT_ROOT = 0x4
PORT_UPSTREAM = 0x5
PORT_DOWNSTREAM = 0x6
BRIDGE_CLASS = 0x060400
CONFIG_SIZE = 256
_CAP_PCIE = 0x10
_CAP_OFFSET = 0x40
_STATUS_CAP_LIST = 0x10
_HEADER_TYPE_BRIDGE = 0x01
# Vendors of the bridges: the CPU's root ports, Broadcom (PLX) PEX switches.
ROOT_PORT_VENDOR, ROOT_PORT_DEVICE = 0x8086, 0x352A
SWITCH_VENDOR, SWITCH_DEVICE = 0x1000, 0xC030

# Host bridge buses of the root complexes, in order; each uses 0x20 buses from its own.
_ROOT_BUSES = (0x15, 0x95, 0x35, 0xB5, 0x55, 0xD5, 0x75, 0xF5)
_SWITCHES_PER_ROOT = 2
_BUSES_PER_SWITCH = 8  # upstream port's bus, the internal bus, then up to 6 endpoint buses
GPUS_PER_SWITCH = 2
MAX_NICS_PER_SWITCH = 4

# Transfer rate per lane of each PCIe generation, in GT/s (`pci_speed_string` in drivers/pci/probe.c).
GENERATION_GTS = {1: 2.5, 2: 5.0, 3: 8.0, 4: 16.0, 5: 32.0, 6: 64.0}


def speed_string(gts: float) -> str:
    """How sysfs spells a link speed, e.g. "32.0 GT/s PCIe"; ValueError for no generation's rate."""
    if gts not in GENERATION_GTS.values():
        raise ValueError(f"{gts} GT/s is no PCIe generation's rate ({sorted(GENERATION_GTS.values())})")
    return f"{gts:.1f} GT/s PCIe"


@dataclass(frozen=True)
class Link:
    """A PCIe link as one end sees it: the generation and width it trained to, and the most the
    end can do (its Link Capabilities)."""

    gen: int = 5
    width: int = 16
    max_gen: int = 5
    max_width: int = 16

    def files(self) -> dict[str, str]:
        """The link's sysfs attributes by file name, as the kernel prints them."""
        return {
            "current_link_speed": speed_string(GENERATION_GTS[self.gen]) + "\n",
            "current_link_width": f"{self.width}\n",
            "max_link_speed": speed_string(GENERATION_GTS[self.max_gen]) + "\n",
            "max_link_width": f"{self.max_width}\n",
        }


BOARD_LINK = Link()  # what the board's parts and ports all are: Gen5 x16


def port_type(position: int) -> int:
    """The port type of the bridge at `position` on a path from the root: a root port first, then
    upstream and downstream ports of switches in turn (how PCIe hierarchies are built)."""
    if position == 0:
        return PORT_ROOT
    return PORT_UPSTREAM if position % 2 else PORT_DOWNSTREAM


def bridge_config(vendor: int, device: int, port: int) -> bytes:
    """A bridge's 256-byte config space: type 1 header with a capability list holding the PCI
    Express capability (version 2) of the given port type."""
    cfg = bytearray(CONFIG_SIZE)
    struct.pack_into("<HH", cfg, 0x00, vendor, device)
    struct.pack_into("<H", cfg, 0x06, _STATUS_CAP_LIST)
    cfg[0x09:0x0C] = BRIDGE_CLASS.to_bytes(3, "little")
    cfg[0x0E] = _HEADER_TYPE_BRIDGE
    cfg[0x34] = _CAP_OFFSET
    cfg[_CAP_OFFSET] = _CAP_PCIE
    cfg[_CAP_OFFSET + 1] = 0  # last capability
    struct.pack_into("<H", cfg, _CAP_OFFSET + 2, 0x2 | (port << 4))
    return bytes(cfg)


def bridge_ids(port: int) -> tuple[int, int]:
    """(vendor, device) of a bridge of this port type on the board."""
    return (ROOT_PORT_VENDOR, ROOT_PORT_DEVICE) if port == PORT_ROOT else (SWITCH_VENDOR, SWITCH_DEVICE)


@dataclass(frozen=True)
class Slot:
    """Where one endpoint sits: its address, host bridge, bridges root-first, and NUMA node."""

    bdf: str
    pcie_root: str
    bridges: tuple[str, ...]
    numa_node: int


def hgx_board(gpus: int, nics: int, numa_nodes: int = 2) -> tuple[list[Slot], list[Slot]]:
    """Slots of `gpus` GPUs and `nics` NICs on the HGX-like board (module docstring).

    GPU i sits behind switch i // 2; NIC j behind switch j % switches, after its GPUs. A board with
    few GPUs gets as many switches as its NICs need (at most 4 NICs behind one switch).
    """
    switches = max(-(-gpus // GPUS_PER_SWITCH), -(-nics // MAX_NICS_PER_SWITCH))
    roots = -(-switches // _SWITCHES_PER_ROOT)
    if roots > len(_ROOT_BUSES):
        raise ValueError(f"the board has room for {len(_ROOT_BUSES) * _SWITCHES_PER_ROOT} switches, not {switches}")
    endpoints: list[list[str]] = [[] for _ in range(switches)]
    for i in range(gpus):
        endpoints[i // GPUS_PER_SWITCH].append(f"gpu{i}")
    for j in range(nics):
        endpoints[j % switches].append(f"nic{j}")
    slots: dict[str, Slot] = {}
    for s, names in enumerate(endpoints):
        if len(names) > _BUSES_PER_SWITCH - 2:
            raise ValueError(f"switch {s} would hold {len(names)} endpoints, more than {_BUSES_PER_SWITCH - 2}")
        root, k = divmod(s, _SWITCHES_PER_ROOT)
        base = _ROOT_BUSES[root]
        upstream_bus = base + 1 + _BUSES_PER_SWITCH * k
        root_port = f"0000:{base:02x}:{k + 1:02x}.0"
        upstream = f"0000:{upstream_bus:02x}:00.0"
        numa = root * numa_nodes // roots if numa_nodes > 0 else -1
        for slot, name in enumerate(names):
            downstream = f"0000:{upstream_bus + 1:02x}:{slot:02x}.0"
            slots[name] = Slot(
                bdf=f"0000:{upstream_bus + 2 + slot:02x}:00.0",
                pcie_root=f"pci0000:{base:02x}",
                bridges=(root_port, upstream, downstream),
                numa_node=numa,
            )
    return [slots[f"gpu{i}"] for i in range(gpus)], [slots[f"nic{j}"] for j in range(nics)]


# The AER error bits the kernel names (aer_correctable_error_string, aer_uncorrectable_error_string).
CORRECTABLE_ERRORS = ("RxErr", "BadTLP", "BadDLLP", "Rollover", "Timeout", "NonFatalErr", "CorrIntErr", "HeaderOF")
UNCORRECTABLE_ERRORS = (
    "Undefined",
    "DLP",
    "SDES",
    "TLP",
    "FCP",
    "CmpltTO",
    "CmpltAbrt",
    "UnxCmplt",
    "RxOF",
    "MalfTLP",
    "ECRC",
    "UnsupReq",
    "ACSViol",
    "UncorrIntErr",
    "BlockedTLP",
    "AtomicOpBlocked",
    "TLPBlockedErr",
    "PoisonTLPBlocked",
)
# Severity: its file, its named error bits, its total line.
AER_FILES = {
    "correctable": ("aer_dev_correctable", CORRECTABLE_ERRORS, "TOTAL_ERR_COR"),
    "nonfatal": ("aer_dev_nonfatal", UNCORRECTABLE_ERRORS, "TOTAL_ERR_NONFATAL"),
    "fatal": ("aer_dev_fatal", UNCORRECTABLE_ERRORS, "TOTAL_ERR_FATAL"),
}


def aer_text(counts: Mapping[str, int]) -> str:
    """An AER statistics file with these counts, its lines in the order given."""
    return "".join(f"{name} {n}\n" for name, n in counts.items())
