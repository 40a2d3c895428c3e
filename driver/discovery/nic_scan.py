"""Which netdevs and PCI functions a node has: the first step of NIC discovery.

Where link facts come from (`netlink=`):

* `True` (a real node, and the netns tests): netlink of the driver's network namespace (or the
  named `netns`) is the only source of which netdevs exist, their MAC, MTU, operstate and global
  addresses, and of the default route. Sysfs under `sysfs_root` only maps a netdev name to its PCI
  function and RDMA device, so a test can map veths to fake PCI functions.
* `False` (the simulated node: its NICs exist only in a sysfs tree, no netdev exists anywhere):
  `class/net/*` lists the netdevs and `address`, `mtu`, `operstate`, `type`, `dev_port` give their
  facts, as on a real kernel. Addresses have no sysfs file on Linux, so the simulation writes them
  to `class/net/<if>/tandem-sim-addresses` (one CIDR per line), a name no kernel uses, read only
  in this mode. There are no routes, so `skip_default_route` has nothing to skip.

Skipped here (each logged at debug level with the reason): loopback, links without a PCI function
(veth, bridge, ...), `exclude` (netdev names), and with `skip_default_route` the default-route
links, their bridge/bond ports and lower devices, the PCI functions under them and those
functions' VFs (those are marked in `Scan.uplink_functions` for the caller to skip).
InfiniBand functions with no netdev at all (IPoIB not loaded) are listed too, from
`class/infiniband/*`, with no netdevs.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from pyroute2.netlink.exceptions import NetlinkError

from driver.discovery import netlink
from driver.discovery.nic_sysfs import BDF, BROKEN, NicError, pci_function_dir, read, read_int, read_or_empty

log = logging.getLogger(__name__)

SIM_ADDRESSES_FILE = "tandem-sim-addresses"


class NicDiscoveryError(RuntimeError):
    """Discovery as a whole cannot run (netlink unreadable, namespace gone); nothing is published."""


@dataclass(frozen=True)
class Netdev:
    name: str
    mac: str
    mtu: int
    operstate: str
    ipv4: tuple[str, ...] = ()
    ipv6: tuple[str, ...] = ()
    dev_port: int = 0


@dataclass
class Scan:
    """Netdevs grouped by PCI function, plus the functions the default-route rule rules out."""

    functions: dict[str, list[Netdev]] = field(default_factory=dict)
    uplink_functions: set[str] = field(default_factory=set)


class NicScanner:
    """Lists netdevs (from netlink or sysfs) and groups them by the PCI function they belong to."""

    def __init__(
        self,
        sysfs_root: Path,
        *,
        netlink: bool,
        netns: str | None,
        skip_default_route: bool,
        exclude: frozenset[str],
    ) -> None:
        self.sysfs_root = sysfs_root
        self.use_netlink = netlink
        self.netns = netns
        self.skip_default_route = skip_default_route
        self.exclude = exclude

    def scan(self) -> Scan:
        if self.use_netlink:
            netdevs, uplinks = self._netlink_netdevs()
        else:
            netdevs, uplinks = self._sysfs_netdevs(), frozenset()

        scan = Scan()
        for nd in netdevs:
            if nd.name in self.exclude:
                log.debug("skip %s: excluded by configuration", nd.name)
                continue
            try:
                bdf = self._pci_function_of(nd.name)
                if bdf is None:
                    continue
                if nd.name in uplinks:
                    scan.uplink_functions.add(bdf)
                    scan.uplink_functions.update(self._virtfns(bdf))
            except BROKEN as e:
                log.warning("skip netdev %s: unreadable sysfs entry: %s", nd.name, e)
                continue
            scan.functions.setdefault(bdf, []).append(nd)
        for bdf in self._infiniband_only_functions(scan.functions.keys()):
            scan.functions[bdf] = []
        return scan

    def _netlink_netdevs(self) -> tuple[list[Netdev], frozenset[str]]:
        """Netdevs that sysfs ties to a device, as netlink sees them; those carrying the default
        route. Netdevs without a `device` link in sysfs have no PCI function and are not asked for.
        """
        names = [e.name for e in sorted((self.sysfs_root / "class/net").glob("*")) if (e / "device").is_symlink()]
        try:
            snapshot = netlink.read_links(names, self.netns)
        except (OSError, NetlinkError) as e:
            raise NicDiscoveryError(f"cannot read netlink of {netlink.namespace_name(self.netns)}: {e}") from e
        out = []
        for name in names:
            link = snapshot.links.get(name)
            if link is None:
                log.debug("skip %s: in sysfs but unknown to netlink (moved to another namespace?)", name)
                continue
            if link.loopback:
                log.debug("skip %s: loopback", name)
                continue
            try:
                dev_port = read_int(self.sysfs_root / "class/net" / name / "dev_port", 0) or 0
            except NicError as e:
                log.warning("skip netdev %s: unreadable sysfs entry: %s", name, e)
                continue
            out.append(Netdev(name, link.mac, link.mtu, link.operstate, link.ipv4, link.ipv6, dev_port))
        return out, snapshot.uplinks if self.skip_default_route else frozenset()

    def _sysfs_netdevs(self) -> list[Netdev]:
        out = []
        for entry in sorted((self.sysfs_root / "class/net").glob("*")):
            name = entry.name
            try:
                if name == "lo" or read_int(entry / "type") == netlink.ARPHRD_LOOPBACK:
                    log.debug("skip %s: loopback", name)
                    continue
                addresses = self._sim_addresses(entry / SIM_ADDRESSES_FILE)
                out.append(
                    Netdev(
                        name=name,
                        mac=read(entry / "address").lower(),
                        mtu=read_int(entry / "mtu") or 0,
                        operstate=read(entry / "operstate").lower(),
                        ipv4=tuple(a for a in addresses if ":" not in a),
                        ipv6=tuple(a for a in addresses if ":" in a),
                        dev_port=read_int(entry / "dev_port", 0) or 0,
                    )
                )
            except BROKEN as e:
                log.warning("skip netdev %s: unreadable sysfs entry: %s", name, e)
        return out

    @staticmethod
    def _sim_addresses(path: Path) -> list[str]:
        try:
            lines = path.read_text().split()
        except FileNotFoundError:
            return []
        try:
            parsed = sorted({ipaddress.ip_interface(x) for x in lines}, key=lambda a: (a.version, a.ip))
        except ValueError as e:
            raise NicError(f"{path}: {e}") from e
        return [str(a) for a in parsed]

    def _pci_function_of(self, ifname: str) -> str | None:
        link = self.sysfs_root / "class/net" / ifname / "device"
        if not link.is_symlink():
            log.debug("skip %s: no PCI device (virtual link)", ifname)
            return None
        bdf = link.resolve().name.lower()
        if not BDF.match(bdf):
            log.debug("skip %s: device %r is not a PCI function", ifname, bdf)
            return None
        return bdf

    def _virtfns(self, bdf: str) -> set[str]:
        try:
            fn = pci_function_dir(self.sysfs_root, bdf)
        except NicError:
            return set()
        return {p.resolve().name for p in fn.glob("virtfn*")}

    def _infiniband_only_functions(self, known: Iterable[str]) -> list[str]:
        """PCI functions with an InfiniBand RDMA device and no netdev (IPoIB not loaded)."""
        known = set(known)
        out = []
        for dev in sorted((self.sysfs_root / "class/infiniband").glob("*")):
            try:
                bdf = (dev / "device").resolve().name.lower() if (dev / "device").is_symlink() else ""
            except BROKEN as e:
                log.warning("skip RDMA device %s: %s", dev.name, e)
                continue
            if not BDF.match(bdf) or bdf in known or bdf in out:
                continue
            layers = {read_or_empty(p / "link_layer") for p in (dev / "ports").glob("*")}
            if layers == {"InfiniBand"}:
                out.append(bdf)
            else:
                log.debug("skip %s (%s): RoCE function without a visible netdev", bdf, dev.name)
        return out
