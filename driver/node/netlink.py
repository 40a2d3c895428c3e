"""The driver's one door to rtnetlink: the links of a namespace, their addresses, speed and
whether they carry the default route, and an event socket for link, address and route changes.

Netlink is read, and written in one case only: an exclusive NIC that came back from a pod gets
its host name, MTU, MAC and addresses again (`restore_link`, and `rename_link` to move one out of
another's way, for `driver.claims.nic.homes`). Reads are plain `AF_NETLINK` requests on a
`RouteSocket`, decoded by `rtnl` with `struct`: links in one dump per pass (cheap: a node may have a
thousand veths), the addresses of the few links discovery asks about one link at a time, and the
routes, to find which links carry the default route. The event socket is a raw socket too, because
the watchers only need to know *that* something changed, and a raw socket can be `select`ed
together with a wake-up pipe.

pyroute2 is the door's other half (`netlink_pyroute2`), for the writes and for a socket in a named
network namespace (a forked child enters the namespace, opens the socket and passes it back), and
it is imported at the first such call, never at start-up: importing it costs about 0.17 CPU-s, a
quarter of the daemon's start-up, and a daemon that reads its own namespace (the default) never
needs it. A kernel's refusal comes out of every public call as `NetlinkFailure`, an `OSError` (with
the kernel's errno) that is also a Tandem `NodeError`, whichever half asked: callers catch `OSError`
alone and never import pyroute2 (an import-linter contract).
"""

from __future__ import annotations

import array
import contextlib
import errno
import fcntl
import ipaddress
import itertools
import os
import socket
import struct
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import TypeVar

from driver.node import rtnl
from driver.node.netlink_types import RT_SCOPE_UNIVERSE as RT_SCOPE_UNIVERSE
from driver.node.netlink_types import LinkHome as LinkHome
from driver.node.netlink_types import NetlinkFailure as NetlinkFailure
from driver.node.rtnl import Address, Link, LinkState, Route

RT_TABLE_MAIN = 254
RTN_UNICAST = 1
NLM_F_REQUEST = 0x1
NLM_F_DUMP = 0x300
SOL_NETLINK = 270
NETLINK_GET_STRICT_CHK = 12  # Linux 4.20+: the kernel checks a request's header and filters dumps by it
SIOCETHTOOL = 0x8946
ETHTOOL_GSET = 0x1
SPEED_UNKNOWN = 0xFFFFFFFF
DUMP_TRIES = 3  # a dump interrupted by a concurrent change (NLM_F_DUMP_INTR) is repeated

# Multicast group bitmasks (the legacy RTMGRP_* values accepted by bind()).
RTMGRP_LINK = 0x1
RTMGRP_IPV4_IFADDR = 0x10
RTMGRP_IPV6_IFADDR = 0x100
RTMGRP_IPV4_ROUTE = 0x40
RTMGRP_IPV6_ROUTE = 0x400
# Routes too: a change of the default route changes which NICs are uplinks (`Snapshot.uplinks`).
NIC_EVENT_GROUPS = RTMGRP_LINK | RTMGRP_IPV4_IFADDR | RTMGRP_IPV6_IFADDR | RTMGRP_IPV4_ROUTE | RTMGRP_IPV6_ROUTE

# Link kinds whose IFLA_LINK names the device they ride on (a default route over a VLAN uses the
# physical NIC below it). A veth's IFLA_LINK is its peer, which is not "below" it.
_STACKED_KINDS = frozenset({"vlan", "macvlan", "macvtap", "ipvlan", "ipvtap"})

# struct ethtool_cmd (ETHTOOL_GSET): speed is the u16 at offset 12 plus speed_hi at offset 28.
_ETHTOOL_CMD_SIZE = 44
_IFREQ = struct.Struct("@16sP")  # struct ifreq: name, then the ethtool_cmd pointer
_REQUEST_NAMES = {rtnl.RTM_GETLINK: "RTM_GETLINK", rtnl.RTM_GETADDR: "RTM_GETADDR", rtnl.RTM_GETROUTE: "RTM_GETROUTE"}
_sequence = itertools.count(1)

T = TypeVar("T")


@dataclass(frozen=True)
class Snapshot:
    links: dict[str, Link]  # the requested netdevs, by name, with addresses and speed
    # Those of them that carry the default route or are built into what does: the lowest-metric
    # default route of each family in the main table (every nexthop of a multipath route, every
    # route of an equal-metric tie), the devices under it when it is a stacked link (vlan, ...),
    # and the bridge/bond ports of any of these, recursively. Moving one would cut the node off.
    uplinks: frozenset[str]


def _global_cidrs(addresses: Iterable[Address]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    found: dict[int, set[ipaddress.IPv4Interface | ipaddress.IPv6Interface]] = {
        socket.AF_INET: set(),
        socket.AF_INET6: set(),
    }
    for a in addresses:
        if a.scope == RT_SCOPE_UNIVERSE and a.address and a.family in found:
            found[a.family].add(ipaddress.ip_interface(f"{a.address}/{a.prefixlen}"))

    def ordered(family: int) -> tuple[str, ...]:
        return tuple(str(a) for a in sorted(found[family], key=lambda a: (a.ip, a.network.prefixlen)))

    return ordered(socket.AF_INET), ordered(socket.AF_INET6)


class _Reader:
    """One RouteSocket of a pass, over the namespace's links as one dump found them."""

    def __init__(self, rs: RouteSocket, by_index: Mapping[int, Link]) -> None:
        self.rs = rs
        self.by_index = by_index

    def with_addresses(self, link: Link) -> Link:
        v4, v6 = _global_cidrs(self.rs.addresses(link.index))
        return replace(link, ipv4=v4, ipv6=v6)

    def carrying_default_route(self) -> set[int]:
        routes = [
            r
            for family in (socket.AF_INET, socket.AF_INET6)
            for r in self.rs.routes(family)
            if r.dst_len == 0 and r.table == RT_TABLE_MAIN and r.type == RTN_UNICAST
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
    namespace's links in one dump or one by one, their addresses, the routes, and the links' speed
    (an ethtool ioctl on any socket of a namespace reaches that namespace's netdevs). OSError when
    the namespace cannot be entered."""

    def __init__(self, netns: str | None = None) -> None:
        self.sock = _raw_socket(netns)
        # Strict checking has the kernel filter an address dump by the ifindex asked for; a kernel
        # older than 4.20 refuses the option and dumps every link's (`addresses` filters them).
        with contextlib.suppress(OSError):
            self.sock.setsockopt(SOL_NETLINK, NETLINK_GET_STRICT_CHK, 1)

    def __enter__(self) -> RouteSocket:
        return self

    def __exit__(self, *_: object) -> None:
        self.sock.close()

    def links(self) -> list[Link]:
        """Every link of the namespace (RTM_GETLINK dump), loopback included."""
        request = rtnl.IFINFO.pack(socket.AF_UNSPEC, 0, 0, 0, 0)
        return [link for link, _ in self._dump(rtnl.RTM_GETLINK, request, rtnl.RTM_NEWLINK, rtnl.decode_link)]

    def addresses(self, index: int) -> list[Address]:
        """Every address of the link `index`, of any family and scope (RTM_GETADDR dump). The
        kernel filters the dump by the index under strict checking; it is checked here again for
        kernels that do not."""
        request = rtnl.IFADDR.pack(socket.AF_UNSPEC, 0, 0, 0, index)
        found = self._dump(rtnl.RTM_GETADDR, request, rtnl.RTM_NEWADDR, rtnl.decode_address)
        return [a for a in found if a.index == index]

    def routes(self, family: int) -> list[Route]:
        """Every route of `family` in every table (RTM_GETROUTE dump)."""
        request = rtnl.RTMSG.pack(family, 0, 0, 0, 0, 0, 0, 0, 0)
        found = self._dump(rtnl.RTM_GETROUTE, request, rtnl.RTM_NEWROUTE, rtnl.decode_route)
        # A kernel without the family (IPv6 disabled) answers with every family's routes.
        return [r for r in found if r.family == family]

    def _dump(
        self, request_type: int, request: bytes, answer: int, decode: Callable[[bytes, int, int], T | None]
    ) -> list[T]:
        """The `answer` messages of a dump request, decoded (one too short to decode is left out).
        A dump interrupted by a concurrent change (NLM_F_DUMP_INTR) is repeated, up to DUMP_TRIES
        times: still changing under us then, what we have is as good as a moment later."""
        found: list[T] = []
        for _ in range(DUMP_TRIES):
            found, interrupted = [], False
            for got, flags, data, start, end in self._ask(request_type, NLM_F_DUMP, request):
                interrupted = interrupted or bool(flags & rtnl.NLM_F_DUMP_INTR)
                if got == answer and (decoded := decode(data, start, end)) is not None:
                    found.append(decoded)
            if not interrupted:
                break
        return found

    def get(self, index: int = 0, name: str = "") -> tuple[Link, LinkState] | None:
        """One link by ifindex or name (RTM_GETLINK); None when the namespace has no such link."""
        request = rtnl.IFINFO.pack(socket.AF_UNSPEC, 0, index, 0, 0)
        if name:
            value = name.encode() + b"\0"
            request += struct.pack("=HH", 4 + len(value), rtnl.IFLA_IFNAME) + value + bytes(-len(value) % 4)
        try:
            for kind, _, data, start, end in self._ask(rtnl.RTM_GETLINK, 0, request):
                if kind == rtnl.RTM_NEWLINK:
                    return rtnl.decode_link(data, start, end)
        except OSError as e:
            if e.errno in (errno.ENODEV, errno.ENOENT):
                return None
            raise
        return None

    def _ask(self, request_type: int, flags: int, request: bytes) -> Iterator[tuple[int, int, bytes, int, int]]:
        """Sends one request of `request_type` (RTM_GET*); yields (type, flags, datagram, start,
        end) of each message answering it, up to the end of a dump or the one answer;
        NetlinkFailure for an error answer."""
        seq = next(_sequence)
        header = rtnl.HEADER.pack(rtnl.HEADER.size + len(request), request_type, NLM_F_REQUEST | flags, seq, 0)
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
                    raise NetlinkFailure(code, f"{_REQUEST_NAMES[request_type]}: {os.strerror(code)}")
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


def read_links(chosen: Iterable[Link], everything: Mapping[int, Link], netns: str | None = None) -> Snapshot:
    """The `chosen` links (from a `RouteSocket.links` dump: `everything`, by ifindex) of `netns`
    with their global addresses, and which of them carry the default route.

    Addresses are asked for link by link: a node with a thousand veths has only a handful of NICs.
    """
    with RouteSocket(netns) as rs:
        reader = _Reader(rs, everything)
        links = {link.name: reader.with_addresses(link) for link in chosen}
        carrying = reader.carrying_default_route()
    uplinks = frozenset(name for name, link in links.items() if reader.is_part_of(link, carrying))
    return Snapshot(links=links, uplinks=uplinks)


def _default_route_links(routes: list[Route]) -> frozenset[int]:
    best: dict[int, tuple[int, set[int]]] = {}  # family -> (metric, oifs)
    for r in routes:
        oifs = {r.oif} if r.oif else set()
        oifs |= {index for index in r.nexthops if index}
        current = best.get(r.family)
        if current is None or r.priority < current[0]:
            best[r.family] = (r.priority, oifs)
        elif r.priority == current[0]:
            current[1].update(oifs)
    return frozenset(i for _, oifs in best.values() for i in oifs)


def restore_link(name: str, home: LinkHome, netns: str | None = None) -> None:
    """Make the netdev `name` what the host had before it went into a pod (`home`): its name, MTU
    and MAC, up, and exactly `home.addresses` as its global addresses: any other (a tenant's) is
    removed, link-local ones are the kernel's and stay. A rename and most drivers' MAC change need
    the link down. Raises OSError (a NetlinkFailure where the kernel refused a request): ENODEV
    when there is no netdev `name`, EEXIST when another netdev has the name `home.name`."""
    from driver.node import netlink_pyroute2  # at the first write, not at start-up (module docstring)

    netlink_pyroute2.restore_link(name, home, netns)


def rename_link(name: str, new: str, netns: str | None = None) -> None:
    """Rename the netdev `name` to `new`, setting it down (a rename needs that). Raises OSError as
    `restore_link` does."""
    from driver.node import netlink_pyroute2  # at the first write, not at start-up (module docstring)

    netlink_pyroute2.rename_link(name, new, netns)


def namespace_name(netns: str | None) -> str:
    """The namespace in words, for error messages: `network namespace 'x'` or the driver's own."""
    return f"network namespace {netns!r}" if netns else "the driver's network namespace"


def _raw_socket(netns: str | None) -> socket.socket:
    """An rtnetlink socket in `netns` (never created here), or in the caller's namespace."""
    if netns:
        from driver.node import netlink_pyroute2  # only for another namespace (module docstring)

        return netlink_pyroute2.socket_in(netns)
    return socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_ROUTE)


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
