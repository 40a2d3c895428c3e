"""Which netdevs and PCI functions a node has: the first step of NIC discovery.

Where link facts come from (`netlink=`):

* `True` (a real node, and the netns tests): netlink of the driver's network namespace (or the
  named `netns`) is the only source of which netdevs exist, their MAC, MTU, operstate, speed
  (ethtool) and global addresses, and of the default route.
* `False` (the simulated node: its NICs exist only in a sysfs tree, no netdev exists anywhere):
  `class/net/*` lists the netdevs and `address`, `mtu`, `operstate`, `speed`, `type`, `dev_port`
  give their facts, as on a real kernel. Addresses have no sysfs file on Linux, so the simulation
  writes them to `class/net/<if>/tandem-sim-addresses` (one CIDR per line), a name no kernel
  uses, read only in this mode. There are no routes, so `skip_default_route` has nothing to skip.

Which PCI function a netdev of netlink belongs to (`function_of`), first answer wins:

1. Netlink's parent device (IFLA_PARENT_DEV_BUS_NAME/NAME, Linux 5.14+): bus `pci` names the
   function; any other bus (virtio, usb) is no RDMA NIC. The same in every namespace.
2. No parent (a virtual link, or an older kernel), in the daemon's own namespace: sysfs
   `class/net/<if>/device`, as the kernel links it.
3. No parent, in a named namespace: the daemon's sysfs shows the netdevs of the namespace that
   mounted it, never the named one's (the kernel filters `class/net` and `<function>/net/` by
   namespace), so sysfs cannot say. The RDMA side can: in the shared RDMA namespace mode (the
   kernel's default) every RDMA device is visible, and the default GID of a RoCE port (index 0)
   names its netdev in `ports/<p>/gid_attrs/ndevs/0`, in whatever namespace it is. A netdev is
   that port's when the name matches and the GID is the one the kernel derives from its MAC
   (fe80::EUI-64), so a same-named netdev of another namespace is not taken for it. (Mounting a
   sysfs of the named namespace would need a forked helper in a private mount namespace per pass,
   and would show nothing netlink and the RDMA sysfs do not.) IPoIB netdevs have no GID entry:
   in a named namespace on a kernel before 5.14 their function is listed InfiniBand-only.

Skipped here (each logged at debug level with the reason, but for the links of no PCI function, of
which a node with a CNI has thousands): loopback, links of no PCI function (veth, bridge, ...),
NICs `exclude` matches (the whole function, by its PCI address or any of its
netdevs' names; for a NIC Tandem is bringing home from a pod, by its home name instead of the
names it has: `excluded_by`), and with `skip_default_route` the default-route links, their bridge/bond ports
and lower devices, the PCI functions under them and those functions' VFs (marked in
`Scan.uplink_functions` for the caller to skip). InfiniBand functions with no netdev at all (IPoIB
not loaded) are listed too, from `class/infiniband/*`, with no netdevs.
"""

from __future__ import annotations

import ipaddress
import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from driver.config import NicExclusions
from driver.discovery.nic.sysfs import BDF, BROKEN, NicError, pci_function_dir, read, read_int, read_or_empty
from driver.errors import NodeError
from driver.node import netlink
from driver.node.rtnl import ARPHRD_LOOPBACK, Link

log = logging.getLogger(__name__)

SIM_ADDRESSES_FILE = "tandem-sim-addresses"
GID_REREAD_SECONDS = 5.0
_VIRTUAL = "no PCI device (a virtual link)"


class NicDiscoveryError(NodeError):
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
    speed: int | None = None  # Mb/s; None when the kernel does not know (link down)


@dataclass
class Scan:
    """Netdevs grouped by PCI function, plus the functions the default-route rule rules out and
    those the exclusions leave out."""

    functions: dict[str, list[Netdev]] = field(default_factory=dict)
    uplink_functions: set[str] = field(default_factory=set)
    excluded: dict[str, list[Netdev]] = field(default_factory=dict)  # left out by `exclude`
    nic_indexes: frozenset[int] = frozenset()  # ifindexes of the netdevs in `functions` (netlink)


@dataclass(frozen=True)
class _Function:
    """The PCI function a netdev belongs to, and which of its ports the netdev is (`dev_port`)."""

    pci_address: str
    dev_port: int = 0


@dataclass(frozen=True)
class _GidEntry:
    """A RoCE port's default GID entry: the netdev it names, seen from the RDMA side."""

    pci_address: str
    port: int
    gid: str


class NicScanner:
    """Lists netdevs (from netlink or sysfs) and groups them by the PCI function they belong to.

    `home_names`: PCI address -> home name of each NIC Tandem is bringing home from a pod
    (`driver.claims.nic.homes`), for `excluded_by`."""

    def __init__(
        self,
        sysfs_root: Path,
        *,
        netlink: bool,
        netns: str | None,
        skip_default_route: bool,
        exclude: NicExclusions,
        home_names: Callable[[], Mapping[str, str]] = dict,
    ) -> None:
        self.sysfs_root = sysfs_root
        self.use_netlink = netlink
        self.netns = netns
        self.skip_default_route = skip_default_route
        self.exclude = exclude
        self.home_names = home_names
        self._gids: tuple[float, dict[str, list[_GidEntry]]] = (-math.inf, {})  # (read at, entries)

    def scan(self) -> Scan:
        indexes: dict[str, int] = {}
        if self.use_netlink:
            netdevs, uplinks = self._netlink_netdevs(indexes)
        else:
            netdevs, uplinks = self._sysfs_netdevs(), frozenset()

        scan = Scan()
        for bdf, nd in netdevs:
            scan.functions.setdefault(bdf, []).append(nd)
            if nd.name in uplinks:
                scan.uplink_functions.add(bdf)
                scan.uplink_functions.update(self._virtfns(bdf))
        for bdf in self._infiniband_only_functions(scan.functions.keys()):
            scan.functions[bdf] = []
        homes = self.home_names() if self.exclude.patterns else {}
        for bdf, nds in list(scan.functions.items()):
            if pattern := self.excluded_by(bdf, (n.name for n in nds), homes):
                log.debug("skip %s (%s): excluded by %r", bdf, ",".join(n.name for n in nds) or "-", pattern)
                scan.excluded[bdf] = scan.functions.pop(bdf)
        scan.nic_indexes = frozenset(
            indexes[n.name] for nds in scan.functions.values() for n in nds if n.name in indexes
        )
        return scan

    def may_be_nic(self, link: Link) -> bool:
        """Whether a link (from an event) can be a NIC discovery publishes: it belongs to a PCI
        function, and no exclusion names it. Cheap, for the NIC watcher to ignore veth churn
        before any rediscovery: no netlink request, one sysfs look-up in the own namespace; in a
        named one the RoCE GID entries of the last read, read again (at most every
        `GID_REREAD_SECONDS`) when they do not name the link."""
        if self.netns and not link.parent_bus:
            found = self._function_of(link, self._gid_entries(max_age=math.inf))
            if not isinstance(found, _Function):
                found = self._function_of(link, self._gid_entries(max_age=GID_REREAD_SECONDS))
        else:
            found = self._function_of(link, {})
        return isinstance(found, _Function) and self.excluded_by(found.pci_address, (link.name,)) is None

    def excluded_by(self, pci_address: str, names: Iterable[str], homes: Mapping[str, str] | None = None) -> str | None:
        """The `exclude` pattern that keeps this NIC out, or None. A PCI-address pattern always
        applies. A name pattern is matched against the NIC's netdev names (`names`), except for a
        NIC Tandem is bringing home from a pod (`homes`, read now when not given): against its home
        name alone, never against a name the pod gave it, so that no pod can hide a NIC from its
        return (docs/deployment.md, 'Which NICs')."""
        if not self.exclude.patterns:
            return None
        home = (self.home_names() if homes is None else homes).get(pci_address)
        return self.exclude.match(pci_address, (home,) if home else names)

    def _netlink_netdevs(self, indexes: dict[str, int]) -> tuple[list[tuple[str, Netdev]], frozenset[str]]:
        """Netdevs of PCI functions as netlink sees them, with their function; the names of
        those carrying the default route. Fills `indexes` (name -> ifindex) for them."""
        try:
            with netlink.RouteSocket(self.netns) as rs:
                everything = rs.links()
                gids = self._gid_entries(max_age=0.0) if self.netns else {}
                mapped: list[tuple[Link, _Function, int | None]] = []
                for link in everything:
                    found = self._function_of(link, gids)
                    if isinstance(found, _Function):
                        mapped.append((link, found, rs.speed(link.name)))
                    elif found != _VIRTUAL:
                        log.debug("skip %s: %s", link.name, found)
            snapshot = netlink.read_links([m[0] for m in mapped], {x.index: x for x in everything}, self.netns)
        except OSError as e:
            raise NicDiscoveryError(f"cannot read netlink of {netlink.namespace_name(self.netns)}: {e}") from e
        out = []
        for link, fn, speed in mapped:
            full = snapshot.links[link.name]
            indexes[link.name] = link.index
            out.append(
                (
                    fn.pci_address,
                    Netdev(link.name, full.mac, full.mtu, full.operstate, full.ipv4, full.ipv6, fn.dev_port, speed),
                )
            )
        return out, snapshot.uplinks if self.skip_default_route else frozenset()

    def _function_of(self, link: Link, gids: dict[str, list[_GidEntry]]) -> _Function | str:
        """The PCI function of a link (see the module docstring for the order), or why it has none."""
        if link.loopback:
            return "loopback"
        gid = default_gid(link.mac)
        entry = next((e for e in gids.get(link.name, ()) if e.gid == gid), None)
        if link.parent_bus:
            if link.parent_bus != "pci" or not BDF.match(link.parent.lower()):
                return f"its device {link.parent!r} is on the {link.parent_bus} bus, not a PCI function"
            dev_port = entry.port - 1 if entry and entry.pci_address == link.parent.lower() else 0
            return _Function(link.parent.lower(), self._dev_port(link.name, dev_port))
        if self.netns:
            if entry is not None:
                return _Function(entry.pci_address, entry.port - 1)
            if link.name in gids:
                return "an RDMA port names a netdev of this name, but not this one (the MAC differs)"
            return _VIRTUAL
        try:
            bdf = self._pci_function_of(link.name)
        except BROKEN as e:
            return f"unreadable sysfs entry: {e}"
        return _Function(bdf, self._dev_port(link.name, 0)) if bdf else _VIRTUAL

    def _dev_port(self, ifname: str, fallback: int) -> int:
        """sysfs `dev_port` in the daemon's own namespace (where sysfs shows the netdev)."""
        if self.netns:
            return fallback
        try:
            return read_int(self.sysfs_root / "class/net" / ifname / "dev_port", fallback) or 0
        except NicError:
            return fallback

    def _gid_entries(self, max_age: float) -> dict[str, list[_GidEntry]]:
        """netdev name -> the RoCE ports whose default GID names a netdev of that name (netdevs
        of different namespaces may share one), for every RDMA device of a PCI function; read
        afresh when the last read is older than `max_age` seconds. An InfiniBand port's GIDs
        name no netdev: the read fails, the port is skipped."""
        read_at, cached = self._gids  # one reference: a discovery pass may replace it meanwhile
        now = time.monotonic()
        if now - read_at < max_age:
            return cached
        out: dict[str, list[_GidEntry]] = {}
        for dev in sorted((self.sysfs_root / "class/infiniband").glob("*")):
            try:
                bdf = (dev / "device").resolve().name.lower() if (dev / "device").is_symlink() else ""
                ports = sorted((dev / "ports").glob("*")) if BDF.match(bdf) else []
            except BROKEN:
                continue
            for port_dir in ports:
                name = read_or_empty(port_dir / "gid_attrs/ndevs/0")
                if name and port_dir.name.isdigit():
                    gid = read_or_empty(port_dir / "gids/0").lower()
                    out.setdefault(name, []).append(_GidEntry(bdf, int(port_dir.name), gid))
        self._gids = (now, out)
        return out

    def _sysfs_netdevs(self) -> list[tuple[str, Netdev]]:
        out = []
        for entry in sorted((self.sysfs_root / "class/net").glob("*")):
            name = entry.name
            try:
                if name == "lo" or read_int(entry / "type") == ARPHRD_LOOPBACK:
                    log.debug("skip %s: loopback", name)
                    continue
                bdf = self._pci_function_of(name)
                if bdf is None:
                    log.debug("skip %s: %s", name, _VIRTUAL)
                    continue
                addresses = self._sim_addresses(entry / SIM_ADDRESSES_FILE)
                speed = read_int(entry / "speed", -1)
                netdev = Netdev(
                    name=name,
                    mac=read(entry / "address").lower(),
                    mtu=read_int(entry / "mtu") or 0,
                    operstate=read(entry / "operstate").lower(),
                    ipv4=tuple(a for a in addresses if ":" not in a),
                    ipv6=tuple(a for a in addresses if ":" in a),
                    dev_port=read_int(entry / "dev_port", 0) or 0,
                    speed=speed if speed is not None and speed > 0 else None,
                )
            except BROKEN as e:
                log.warning("skip netdev %s: unreadable sysfs entry: %s", name, e)
                continue
            out.append((bdf, netdev))
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
        """The PCI function sysfs links a netdev of the daemon's own namespace to."""
        link = self.sysfs_root / "class/net" / ifname / "device"
        if not link.is_symlink():
            return None
        bdf = link.resolve().name.lower()
        return bdf if BDF.match(bdf) else None

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


def representative(netdevs: Sequence[Netdev]) -> Netdev | None:
    """The netdev that stands for its PCI function (its first port): the one it is published with
    and the one an exclusive claim moves into a pod."""
    return min(netdevs, key=lambda n: (n.dev_port, n.name)) if netdevs else None


def default_gid(mac: str) -> str:
    """The default RoCE GID the kernel gives a netdev (`make_default_gid`): fe80::/64 with the
    modified EUI-64 of its MAC, spelt as sysfs `gids/<i>` spells it. "" for a non-Ethernet MAC."""
    try:
        b = bytes.fromhex(mac.replace(":", ""))
    except ValueError:
        return ""
    if len(b) != 6:
        return ""
    eui = bytes([b[0] ^ 0x02, b[1], b[2], 0xFF, 0xFE, b[3], b[4], b[5]])
    return "fe80:0000:0000:0000:" + ":".join(eui[i : i + 2].hex() for i in range(0, 8, 2))
