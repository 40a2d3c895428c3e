"""One PCI function as a published RDMA NIC: its RDMA device and port, char devices, attributes.

One published device per RDMA-capable PCI function, named from its PCI address
(`pci-0000-8a-00-0`) so the name survives interface renames and the netdev moving into a pod.

netdev -> RDMA device: the first entry of `class/net/<if>/device/infiniband/`, else the RDMA device
whose GID table names the netdev (`class/infiniband/*/ports/*/gid_attrs/ndevs/*`, e.g. soft-RoCE
or drivers without the `infiniband/` link). Functions bound to no driver or to vfio-pci/uio/pci-stub,
and functions without an RDMA device, are not NICs here.

Addresses: `ipv4`/`ipv6` hold global addresses in CIDR form, sorted. With list attributes on they
are string lists (at most 8 each, fewer if the device would exceed 48 attribute values); with
list attributes off they hold the first address of the sorted list, so the value is bounded and
the same whatever order the kernel reports addresses in. `NicInfo` always carries all of them.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from driver.discovery.gpudirect import GpuDirect, nic_attributes, read_gpudirect
from driver.discovery.nic.scan import Netdev, representative
from driver.discovery.nic.sysfs import (
    NicError,
    hex_id,
    link_target_name,
    pci_function_dir,
    read_int,
    read_or_empty,
)
from driver.discovery.topology import Topology, topology
from driver.model import AttrValue, Device, DeviceKind, NicInfo, RequestPolicy
from driver.resource_api import MAX_ATTRIBUTE_VALUES, MAX_ATTRIBUTES_AND_CAPACITIES, MAX_VALUE_LENGTH, value_count

log = logging.getLogger(__name__)

SHARES = "shares"
RDMA_NETNS_MODE = "rdmaNetnsMode"
UNUSABLE_DRIVERS = frozenset({"vfio-pci", "uio_pci_generic", "igb_uio", "pci-stub"})
MAX_ADDRESSES_PER_FAMILY = 8


class RdmaNetnsMode(StrEnum):
    """The kernel's RDMA namespace mode (ib_core `netns_mode`), published as `rdmaNetnsMode`."""

    SHARED = "shared"  # every namespace sees every RDMA device (the default)
    EXCLUSIVE = "exclusive"  # an RDMA device belongs to one namespace


_NETNS_MODES = {
    "Y": RdmaNetnsMode.SHARED,
    "1": RdmaNetnsMode.SHARED,
    "N": RdmaNetnsMode.EXCLUSIVE,
    "0": RdmaNetnsMode.EXCLUSIVE,
}


_DEVICE_NAME = re.compile(r"pci-([0-9a-f]{4})-([0-9a-f]{2})-([0-9a-f]{2})-([0-7])")


def device_name(pci_address: str) -> str:
    """`0000:8a:00.0` -> `pci-0000-8a-00-0`: a DNS label that does not change with the netdev."""
    return "pci-" + pci_address.replace(":", "-").replace(".", "-")


def pci_address_of(name: str) -> str | None:
    """`pci-0000-8a-00-0` -> `0000:8a:00.0`, the inverse of `device_name`; None for any other name
    (a GPU's). A prepared NIC's record names its device, and this is its identity without asking
    discovery, which after a restart has not found a NIC that is inside a pod."""
    m = _DEVICE_NAME.fullmatch(name)
    return f"{m[1]}:{m[2]}:{m[3]}.{m[4]}" if m else None


class NicDeviceReader:
    """Reads what sysfs says about one PCI function and builds its `Device` (kind NIC)."""

    def __init__(
        self, sysfs_root: Path, list_attributes: bool, proc_root: Path = Path("/proc"), shares: int = 1
    ) -> None:
        self.sysfs_root = sysfs_root
        self.list_attributes = list_attributes
        self.proc_root = proc_root
        self.shares = shares
        self.gpudirect = GpuDirect(peermem=False, dmabuf=False)
        self.netns_mode: RdmaNetnsMode | None = None  # None: not told (no ib_core)

    def begin_pass(self) -> None:
        """Read what holds for every NIC of the node (GPUDirect RDMA, the RDMA namespace mode),
        once per discovery pass."""
        self.gpudirect = read_gpudirect(self.sysfs_root, self.proc_root)
        mode = read_or_empty(self.sysfs_root / "module/ib_core/parameters/netns_mode")
        self.netns_mode = _NETNS_MODES.get(mode)

    def device(self, bdf: str, netdevs: list[Netdev]) -> Device | None:
        """The function as a published NIC; None (logged at debug level) when it is not one."""
        fn = pci_function_dir(self.sysfs_root, bdf)
        driver = link_target_name(fn / "driver")
        if driver is None:
            log.debug("skip %s: bound to no driver", bdf)
            return None
        if driver in UNUSABLE_DRIVERS:
            log.debug("skip %s: bound to %s", bdf, driver)
            return None
        rep = representative(netdevs)
        rdma = self._rdma_device(fn, rep.name if rep else None)
        if rdma is None:
            log.debug("skip %s (%s): no RDMA device", bdf, rep.name if rep else "-")
            return None
        rdma_dir, port = rdma
        port_dir = rdma_dir / "ports" / str(port)
        link_layer = read_or_empty(port_dir / "link_layer")
        port_state = read_or_empty(port_dir / "state").split(":")[-1].strip()
        uverbs = self._char_device(fn / "infiniband_verbs", "uverbs", rdma_dir.name, None)
        umad = self._char_device(fn / "infiniband_mad", "umad", rdma_dir.name, port)
        issm = self._char_device(fn / "infiniband_mad", "issm", rdma_dir.name, port)
        sriov_total = read_int(fn / "sriov_totalvfs", 0) or 0
        is_vf = (fn / "physfn").is_symlink()

        attrs: dict[str, AttrValue] = {"type": "nic"}
        if rep is not None:
            attrs.update(ifName=rep.name, mac=rep.mac, mtu=rep.mtu)
            if rep.speed:
                attrs["speed"] = rep.speed
            attrs["state"] = rep.operstate
        if link_layer:
            attrs["linkLayer"] = link_layer
        if port_state:
            attrs["portState"] = port_state
        attrs["rdmaDevice"] = rdma_dir.name
        attrs["pciVendorID"] = hex_id(fn / "vendor")
        attrs["pciDeviceID"] = hex_id(fn / "device")
        attrs["sriov"] = sriov_total > 0 and not is_vf
        if attrs["sriov"]:
            attrs["sriovVfs"] = read_int(fn / "sriov_numvfs", 0) or 0
        attrs["isSriovVf"] = is_vf
        attrs.update(nic_attributes(self.gpudirect, driver))
        if self.netns_mode is not None:
            attrs[RDMA_NETNS_MODE] = self.netns_mode.value
        ipv4 = rep.ipv4 if rep else ()
        ipv6 = rep.ipv6 if rep else ()
        attrs.update(self._address_attributes(ipv4, ipv6))
        topo = Topology({})
        try:
            topo = topology(self.sysfs_root, bdf, self.list_attributes)
        except (OSError, ValueError) as e:
            log.warning("NIC %s: no topology attributes: %s", bdf, e)
        attrs.update(topo.attributes)
        sharing = shared_capacity(self.shares)
        attrs = fit_limits(bdf, attrs, capacities=len(sharing.capacity))

        info = NicInfo(
            pci_address=bdf,
            ifname=rep.name if rep else "",
            rdma_device=rdma_dir.name,
            mac=rep.mac if rep else "",
            ipv4=ipv4,
            ipv6=ipv6,
            port=port,
            uverbs=uverbs,
            umad=umad,
            issm=issm,
        )
        return Device(
            name=device_name(bdf),
            kind=DeviceKind.NIC,
            attributes=attrs,
            capacity=sharing.capacity,
            nic=info,
            pcie_path=topo.pcie_path,
            allow_multiple_allocations=sharing.allow_multiple_allocations,
            request_policies=sharing.request_policies,
        )

    def _rdma_device(self, fn: Path, ifname: str | None) -> tuple[Path, int] | None:
        """(RDMA device dir, port) of a function: `infiniband/` first, then the GID tables."""
        direct = sorted((fn / "infiniband").glob("*"))
        if direct:
            dev = direct[0]
            return dev, self._port_of(dev, ifname)
        if ifname is None:
            return None
        for dev in sorted((self.sysfs_root / "class/infiniband").glob("*")):
            for port_dir in sorted((dev / "ports").glob("*")):
                if self._gid_names(port_dir, ifname):
                    return dev.resolve(), int(port_dir.name)
        return None

    def _port_of(self, dev: Path, ifname: str | None) -> int:
        """The port whose GID table names the netdev; the lowest port otherwise."""
        ports = sorted(int(p.name) for p in (dev / "ports").glob("*") if p.name.isdigit())
        if ifname is not None:
            for port in ports:
                if self._gid_names(dev / "ports" / str(port), ifname):
                    return port
        return ports[0] if ports else 1

    @staticmethod
    def _gid_names(port_dir: Path, ifname: str) -> bool:
        # The kernel answers EINVAL for empty GID slots, read as "".
        return any(read_or_empty(entry) == ifname for entry in (port_dir / "gid_attrs/ndevs").glob("*"))

    @staticmethod
    def _char_device(class_dir: Path, prefix: str, rdma_name: str, port: int | None) -> str:
        """`uverbs3`-style name of the char device of this RDMA device (and port) as sysfs lists it;
        entries that say which device/port they belong to must match. "" when the module that
        provides it (ib_uverbs, ib_umad) is not loaded. Whether its node exists under /dev is for
        prepare to check (`driver.claims.device_nodes`): nodes come and go, a claim must fail naming one."""
        for entry in sorted(class_dir.glob(f"{prefix}*")):
            ibdev = read_or_empty(entry / "ibdev")
            if ibdev and ibdev != rdma_name:
                continue
            if port is not None and read_int(entry / "port", port) != port:
                continue
            return entry.name
        return ""

    def _address_attributes(self, ipv4: tuple[str, ...], ipv6: tuple[str, ...]) -> dict[str, AttrValue]:
        out: dict[str, AttrValue] = {}
        for key, addrs in (("ipv4", ipv4), ("ipv6", ipv6)):
            if not addrs:
                continue
            out[key] = tuple(addrs[:MAX_ADDRESSES_PER_FAMILY]) if self.list_attributes else addrs[0]
        return out


@dataclass(frozen=True)
class Sharing:
    """What makes a NIC shareable: its `shares` capacity and the policy of consuming it."""

    capacity: dict[str, str]
    allow_multiple_allocations: bool
    request_policies: dict[str, RequestPolicy]


def shared_capacity(shares: int) -> Sharing:
    """A NIC `shares` claims may hold at once (`--nic-shares`; docs/scenarios.md, 'Shared RoCE
    NICs'): capacity `shares`, whole shares from 1 to all; a request that names no amount takes
    all of them, the whole NIC, as before sharing existed. One share: an ordinary device."""
    if shares <= 1:
        return Sharing({}, False, {})
    total = str(shares)
    return Sharing({SHARES: total}, True, {SHARES: RequestPolicy(default=total, min="1", max=total, step="1")})


def fit_limits(bdf: str, attrs: dict[str, AttrValue], capacities: int = 0) -> dict[str, AttrValue]:
    """Keep a device within the API's limits: strings of at most 64 characters (a longer one came
    from a broken sysfs file and is dropped), at most 48 values (address lists are shortened), at
    most 32 attributes and capacities (else NicError: the function cannot be published)."""
    out: dict[str, AttrValue] = {}
    for key, value in attrs.items():
        items = value if isinstance(value, tuple) else (value,)
        if any(isinstance(v, str) and len(v) > MAX_VALUE_LENGTH for v in items):
            log.warning("NIC %s: attribute %s is longer than %d characters, dropped", bdf, key, MAX_VALUE_LENGTH)
            continue
        out[key] = value

    while value_count(out) > MAX_ATTRIBUTE_VALUES:
        lists = [(len(v), k) for k in ("ipv4", "ipv6") if isinstance(v := out.get(k), tuple) and len(v) > 1]
        if not lists:
            break
        key = max(lists)[1]
        out[key] = out[key][:-1]  # type: ignore[index]
    if len(out) + capacities > MAX_ATTRIBUTES_AND_CAPACITIES:
        raise NicError(f"{len(out)} attributes and {capacities} capacities, more than {MAX_ATTRIBUTES_AND_CAPACITIES}")
    return out
