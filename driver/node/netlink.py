"""The driver's one door to rtnetlink: the links of a namespace, their addresses, speed and
whether they carry the default route, and an event socket for link and address changes.

Netlink is read, and written in one case only: an exclusive NIC that came back from a pod gets
its host name, MTU, MAC and addresses again (`restore_link`, and `rename_link` to move one out of
another's way, for `driver.claims.nic.homes`). Links come from
one dump per pass, decoded by `rtnl` (cheap:
a node may have a thousand veths); addresses and routes of the few links discovery asks about
through a short-lived pyroute2 `IPRoute` per call, so that no pyroute2 state (it runs its own
event loop) is shared between threads. The event socket is a plain `AF_NETLINK` datagram socket,
because the watchers only need to know *that* something changed, and a raw socket can be
`select`ed together with a wake-up pipe.

pyroute2's own `NetlinkError` never leaves this module: every public call turns it into
`NetlinkFailure`, an `OSError` (with the kernel's errno) that is also a Tandem `NodeError`, so callers
catch `OSError` alone and never import pyroute2 (an import-linter contract).

A socket "in" a namespace is made by pyroute2 (a forked child enters the namespace, opens it and
passes it back); the kernel then answers it for that namespace, whatever the caller's own.
"""

from __future__ import annotations

import array
import errno
import fcntl
import ipaddress
import itertools
import os
import socket
import struct
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any, ParamSpec, TypeVar

from pyroute2 import IPRoute
from pyroute2 import netns as pyroute2_netns
from pyroute2.netlink.exceptions import NetlinkError

from driver.errors import NodeError, translating
from driver.node import rtnl
from driver.node.rtnl import Link, LinkState

RT_SCOPE_UNIVERSE = 0
RT_TABLE_MAIN = 254
RTN_UNICAST = 1
NLM_F_REQUEST = 0x1
NLM_F_DUMP = 0x300
SIOCETHTOOL = 0x8946
ETHTOOL_GSET = 0x1
SPEED_UNKNOWN = 0xFFFFFFFF
DUMP_TRIES = 3  # a dump interrupted by a concurrent change (NLM_F_DUMP_INTR) is repeated

# Multicast group bitmasks (the legacy RTMGRP_* values accepted by bind()).
RTMGRP_LINK = 0x1
RTMGRP_IPV4_IFADDR = 0x10
RTMGRP_IPV6_IFADDR = 0x100
NIC_EVENT_GROUPS = RTMGRP_LINK | RTMGRP_IPV4_IFADDR | RTMGRP_IPV6_IFADDR

# Link kinds whose IFLA_LINK names the device they ride on (a default route over a VLAN uses the
# physical NIC below it). A veth's IFLA_LINK is its peer, which is not "below" it.
_STACKED_KINDS = frozenset({"vlan", "macvlan", "macvtap", "ipvlan", "ipvtap"})

# struct ethtool_cmd (ETHTOOL_GSET): speed is the u16 at offset 12 plus speed_hi at offset 28.
_ETHTOOL_CMD_SIZE = 44
_IFREQ = struct.Struct("@16sP")  # struct ifreq: name, then the ethtool_cmd pointer
_sequence = itertools.count(1)

P = ParamSpec("P")
R = TypeVar("R")


class NetlinkFailure(NodeError, OSError):
    """A netlink request the kernel refused, as an OSError carrying the kernel's errno."""


def _door(call: Callable[P, R]) -> Callable[P, R]:
    """pyroute2's NetlinkError out of `call` becomes a NetlinkFailure with the same errno."""
    return translating(call, NetlinkError, lambda e: NetlinkFailure(e.code, f"netlink: {e}"))


@dataclass(frozen=True)
class Snapshot:
    links: dict[str, Link]  # the requested netdevs, by name, with addresses and speed
    # Those of them that carry the default route or are built into what does: the lowest-metric
    # default route of each family in the main table (every nexthop of a multipath route, every
    # route of an equal-metric tie), the devices under it when it is a stacked link (vlan, ...),
    # and the bridge/bond ports of any of these, recursively. Moving one would cut the node off.
    uplinks: frozenset[str]


def _global_cidrs(messages: Iterable[Any], index: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    found: dict[int, set[Any]] = {socket.AF_INET: set(), socket.AF_INET6: set()}
    for a in messages:
        addr = a.get("local") or a.get("address")
        if a.get("index") != index or a.get("scope") != RT_SCOPE_UNIVERSE or not addr:
            continue
        if a.get("family") in found:
            found[a.get("family")].add(ipaddress.ip_interface(f"{addr}/{a.get('prefixlen')}"))

    def ordered(family: int) -> tuple[str, ...]:
        return tuple(str(a) for a in sorted(found[family], key=lambda a: (a.ip, a.network.prefixlen)))

    return ordered(socket.AF_INET), ordered(socket.AF_INET6)


class _Reader:
    """One short-lived IPRoute, over the namespace's links as one dump found them."""

    def __init__(self, ipr: IPRoute, by_index: Mapping[int, Link]) -> None:
        self.ipr = ipr
        self.by_index = by_index

    def with_addresses(self, link: Link) -> Link:
        # With strict checking the kernel filters the dump by index; _global_cidrs checks again
        # for kernels that ignore the filter.
        v4, v6 = _global_cidrs(self.ipr.addr("dump", index=link.index), link.index)
        return replace(link, ipv4=v4, ipv6=v6)

    def carrying_default_route(self) -> set[int]:
        routes = [
            r
            for family in (socket.AF_INET, socket.AF_INET6)
            for r in self.ipr.route("dump", family=family)
            if r.get("dst_len") == 0 and r.get("table") == RT_TABLE_MAIN and r.get("type") == RTN_UNICAST
        ]
        carrying = set(_default_route_links(routes))
        todo = list(carrying)
        while todo:  # down through stacked links: a VLAN uplink rides on its physical NIC
            link = self.by_index.get(todo.pop())
            if link and link.kind in _STACKED_KINDS and link.lower and link.lower not in carrying:
                carrying.add(link.lower)
                todo.append(link.lower)
        return carrying

    def is_part_of(self, link: Link, carrying: set[int]) -> bool:
        """True when the link, or a bridge/bond it is (transitively) a port of, carries the route."""
        seen: set[int] = set()
        current: Link | None = link
        while current is not None and current.index not in carrying:
            if not current.master or current.master in seen:
                return False
            seen.add(current.master)
            current = self.by_index.get(current.master)
        return current is not None


class RouteSocket:
    """A raw rtnetlink socket in `netns` (the caller's own when None) for one pass: the
    namespace's links in one dump or one by one, and their speed (an ethtool ioctl on any socket
    of a namespace reaches that namespace's netdevs). OSError when the namespace cannot be entered."""

    @_door
    def __init__(self, netns: str | None = None) -> None:
        self.sock = _raw_socket(netns)

    def __enter__(self) -> RouteSocket:
        return self

    def __exit__(self, *_: object) -> None:
        self.sock.close()

    def links(self) -> list[Link]:
        """Every link of the namespace (RTM_GETLINK dump), loopback included."""
        for _ in range(DUMP_TRIES):
            links, interrupted = self._dump()
            if not interrupted:
                return links
        return links  # still changing under us: what we have is as good as a moment later

    def _dump(self) -> tuple[list[Link], bool]:
        links: list[Link] = []
        interrupted = False
        for kind, flags, data, start, end in self._ask(NLM_F_DUMP, rtnl.IFINFO.pack(socket.AF_UNSPEC, 0, 0, 0, 0)):
            interrupted = interrupted or bool(flags & rtnl.NLM_F_DUMP_INTR)
            if kind == rtnl.RTM_NEWLINK and (decoded := rtnl.decode_link(data, start, end)):
                links.append(decoded[0])
        return links, interrupted

    def get(self, index: int = 0, name: str = "") -> tuple[Link, LinkState] | None:
        """One link by ifindex or name (RTM_GETLINK); None when the namespace has no such link."""
        request = rtnl.IFINFO.pack(socket.AF_UNSPEC, 0, index, 0, 0)
        if name:
            value = name.encode() + b"\0"
            request += struct.pack("=HH", 4 + len(value), rtnl.IFLA_IFNAME) + value + bytes(-len(value) % 4)
        try:
            for kind, _, data, start, end in self._ask(0, request):
                if kind == rtnl.RTM_NEWLINK:
                    return rtnl.decode_link(data, start, end)
        except OSError as e:
            if e.errno in (errno.ENODEV, errno.ENOENT):
                return None
            raise
        return None

    def _ask(self, flags: int, request: bytes) -> Iterator[tuple[int, int, bytes, int, int]]:
        """Sends one RTM_GETLINK request; yields (type, flags, datagram, start, end) of each message
        answering it, up to the end of a dump or the one answer; OSError for an error answer."""
        seq = next(_sequence)
        header = rtnl.HEADER.pack(rtnl.HEADER.size + len(request), rtnl.RTM_GETLINK, NLM_F_REQUEST | flags, seq, 0)
        self.sock.send(header + request)
        while True:
            data = self.sock.recv(1 << 20)
            for kind, msg_flags, start, end in rtnl.messages(data):
                if rtnl.HEADER.unpack_from(data, start - rtnl.HEADER.size)[3] != seq:
                    continue  # the answer to an earlier request given up on
                if kind == rtnl.NLMSG_DONE:
                    return
                if kind == rtnl.NLMSG_ERROR:
                    code = -struct.unpack_from("=i", data, start)[0]
                    raise OSError(code, f"RTM_GETLINK: {os.strerror(code)}")
                yield kind, msg_flags, data, start, end
                if not msg_flags & rtnl.NLM_F_MULTI:
                    return

    def speed(self, name: str) -> int | None:
        """The link speed in Mb/s, the value `ethtool` and sysfs `speed` show; None when the
        kernel does not know it (link down, a driver without link settings, a vanished link)."""
        cmd = array.array("B", bytes(_ETHTOOL_CMD_SIZE))
        struct.pack_into("=I", cmd, 0, ETHTOOL_GSET)
        try:
            fcntl.ioctl(self.sock.fileno(), SIOCETHTOOL, _IFREQ.pack(name.encode(), cmd.buffer_info()[0]))
        except OSError:
            return None
        speed = struct.unpack_from("=H", cmd, 12)[0] | struct.unpack_from("=H", cmd, 28)[0] << 16
        return None if speed in (0, SPEED_UNKNOWN) else speed


@_door
def read_links(chosen: Iterable[Link], everything: Mapping[int, Link], netns: str | None = None) -> Snapshot:
    """The `chosen` links (from a `RouteSocket.links` dump: `everything`, by ifindex) of `netns`
    with their global addresses, and which of them carry the default route.

    Addresses are asked for link by link: decoding a full address dump costs pyroute2 about
    0.3 ms per message, and a node with a thousand veths has only a handful of NICs.
    """
    ipr = IPRoute(netns=netns, flags=0, strict_check=True) if netns else IPRoute(strict_check=True)
    try:
        reader = _Reader(ipr, everything)
        links = {link.name: reader.with_addresses(link) for link in chosen}
        carrying = reader.carrying_default_route()
        uplinks = frozenset(name for name, link in links.items() if reader.is_part_of(link, carrying))
    finally:
        ipr.close()
    return Snapshot(links=links, uplinks=uplinks)


def _default_route_links(routes: list[Any]) -> frozenset[int]:
    best: dict[int, tuple[int, set[int]]] = {}  # family -> (metric, oifs)
    for r in routes:
        metric = int(r.get("priority") or 0)
        oifs = {int(r.get("oif"))} if r.get("oif") else set()
        oifs |= {int(nh["oif"]) for nh in (r.get("multipath") or []) if nh.get("oif")}
        family = r.get("family")
        current = best.get(family)
        if current is None or metric < current[0]:
            best[family] = (metric, oifs)
        elif metric == current[0]:
            current[1].update(oifs)
    return frozenset(i for _, oifs in best.values() for i in oifs)


@dataclass(frozen=True)
class LinkHome:
    """What a netdev was on the host before it went into a pod, for `restore_link`."""

    name: str
    mtu: int = 0  # 0: keep the one it has
    mac: str = ""  # "": keep the one it has
    addresses: tuple[str, ...] = ()  # its global addresses (CIDR): exactly these


@_door
def restore_link(name: str, home: LinkHome, netns: str | None = None) -> None:
    """Make the netdev `name` what the host had before it went into a pod (`home`): its name, MTU
    and MAC, up, and exactly `home.addresses` as its global addresses: any other (a tenant's) is
    removed, link-local ones are the kernel's and stay. A rename and most drivers' MAC change need
    the link down. Raises OSError (a NetlinkFailure where the kernel refused a request): ENODEV
    when there is no netdev `name`, EEXIST when another netdev has the name `home.name`."""
    ipr = IPRoute(netns=netns, flags=0) if netns else IPRoute()
    try:
        index = _index_of(ipr, name)
        holders = ipr.link_lookup(ifname=home.name)
        if holders and holders != [index]:
            raise NetlinkFailure(errno.EEXIST, f"the name {home.name!r} is taken by another netdev")
        (link,) = ipr.get_links(index)
        new_mac = bool(home.mac) and str(link.get_attr("IFLA_ADDRESS") or "").lower() != home.mac
        if name != home.name or new_mac:
            ipr.link("set", index=index, state="down")
        if name != home.name:
            ipr.link("set", index=index, ifname=home.name)
        if new_mac:
            ipr.link("set", index=index, address=home.mac)
        if home.mtu and link.get_attr("IFLA_MTU") != home.mtu:
            ipr.link("set", index=index, mtu=home.mtu)
        ipr.link("set", index=index, state="up")
        wanted = {ipaddress.ip_interface(a) for a in home.addresses}
        have = {
            ipaddress.ip_interface(f"{a.get_attr('IFA_LOCAL') or a.get_attr('IFA_ADDRESS')}/{a['prefixlen']}")
            for a in ipr.get_addr(index=index)
            if a["scope"] == RT_SCOPE_UNIVERSE
        }
        for address in sorted(have - wanted, key=str):
            ipr.addr("del", index=index, address=str(address.ip), prefixlen=address.network.prefixlen)
        for address in sorted(wanted - have, key=str):
            flags = {"IFA_FLAGS": 0x2} if address.version == 6 else {}  # IFA_F_NODAD: usable at once
            ipr.addr("add", index=index, address=str(address.ip), prefixlen=address.network.prefixlen, **flags)
    finally:
        ipr.close()


@_door
def rename_link(name: str, new: str, netns: str | None = None) -> None:
    """Rename the netdev `name` to `new`, setting it down (a rename needs that). Raises OSError as
    `restore_link` does."""
    ipr = IPRoute(netns=netns, flags=0) if netns else IPRoute()
    try:
        index = _index_of(ipr, name)
        ipr.link("set", index=index, state="down")
        ipr.link("set", index=index, ifname=new)
    finally:
        ipr.close()


def _index_of(ipr: IPRoute, name: str) -> int:
    (index,) = ipr.link_lookup(ifname=name) or [0]
    if not index:
        raise OSError(errno.ENODEV, f"no netdev {name!r}")
    return int(index)


def namespace_name(netns: str | None) -> str:
    """The namespace in words, for error messages: `network namespace 'x'` or the driver's own."""
    return f"network namespace {netns!r}" if netns else "the driver's network namespace"


def _raw_socket(netns: str | None) -> socket.socket:
    """An rtnetlink socket in `netns` (never created here), or in the caller's namespace."""
    if netns:
        sock: socket.socket = pyroute2_netns.create_socket(
            netns, socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_ROUTE, flags=0
        )
        return sock
    return socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_ROUTE)


@_door
def open_event_socket(netns: str | None = None, groups: int = NIC_EVENT_GROUPS) -> socket.socket:
    """A non-blocking rtnetlink socket subscribed to `groups` in `netns` (never created here)."""
    sock = _raw_socket(netns)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
        sock.bind((0, groups))  # port id 0: the kernel assigns one
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


def read_link_states(
    names: Iterable[str], netns: str | None = None, indexes: Mapping[str, int] | None = None
) -> dict[str, LinkState]:
    """The link state of each named netdev of `netns` that exists there, keyed by the name asked
    for: whether it can carry traffic, for health monitoring. A name with a known ifindex in
    `indexes` is looked up by that index first, so a netdev renamed since its name was learnt is
    still found; by name when the index is gone. One request per link, not a dump."""
    out: dict[str, LinkState] = {}
    with RouteSocket(netns) as rs:
        for name in names:
            index = (indexes or {}).get(name, 0)
            found = (rs.get(index=index) if index else None) or rs.get(name=name)
            if found is not None:
                out[name] = found[1]
    return out
