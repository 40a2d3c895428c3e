"""The driver's one door to rtnetlink: chosen links with their addresses and whether they carry
the default route, and an event socket for link and address changes.

Netlink is read, never written. A snapshot is taken in one short-lived `IPRoute` per call so that
no pyroute2 state (it runs its own event loop) is shared between threads; the event socket is a
plain `AF_NETLINK` datagram socket, because the watcher only needs to know *that* something
changed, and a raw socket can be `select`ed together with a wake-up pipe.
"""

from __future__ import annotations

import errno
import ipaddress
import socket
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from pyroute2 import IPRoute
from pyroute2 import netns as pyroute2_netns
from pyroute2.netlink.exceptions import NetlinkError
from pyroute2.netlink.rtnl.ifinfmsg import ifinfmsg

ARPHRD_LOOPBACK = 772
IFF_LOOPBACK = 0x8
RT_SCOPE_UNIVERSE = 0
RT_TABLE_MAIN = 254
RTN_UNICAST = 1

# Multicast group bitmasks (the legacy RTMGRP_* values accepted by bind()).
RTMGRP_LINK = 0x1
RTMGRP_IPV4_IFADDR = 0x10
RTMGRP_IPV6_IFADDR = 0x100
NIC_EVENT_GROUPS = RTMGRP_LINK | RTMGRP_IPV4_IFADDR | RTMGRP_IPV6_IFADDR

# Link kinds whose IFLA_LINK names the device they ride on (a default route over a VLAN uses the
# physical NIC below it). A veth's IFLA_LINK is its peer, which is not "below" it.
_STACKED_KINDS = frozenset({"vlan", "macvlan", "macvtap", "ipvlan", "ipvtap"})

_NLMSG_HEADER = struct.Struct("=IHHII")


@dataclass(frozen=True)
class Link:
    """What netlink says about one netdev; addresses are global ones in CIDR form, sorted."""

    index: int
    name: str
    mac: str
    mtu: int
    operstate: str  # lower case, as sysfs spells it: "up", "down", "unknown", ...
    kind: str  # IFLA_INFO_KIND ("veth", "bridge", ...); "" for a plain device
    master: int  # ifindex of the bridge/bond this link is a port of; 0 when none
    lower: int  # IFLA_LINK: for a stacked link (vlan, macvlan) the link it rides on; 0 when none
    loopback: bool
    ipv4: tuple[str, ...] = ()
    ipv6: tuple[str, ...] = ()


@dataclass(frozen=True)
class Snapshot:
    links: dict[str, Link]  # the requested netdevs that exist, by name
    # Those of them that carry the default route or are built into what does: the lowest-metric
    # default route of each family in the main table (every nexthop of a multipath route, every
    # route of an equal-metric tie), the devices under it when it is a stacked link (vlan, ...),
    # and the bridge/bond ports of any of these, recursively. Moving one would cut the node off.
    uplinks: frozenset[str]


def _link(m: Any) -> Link:
    return Link(
        index=int(m.get("index")),
        name=m.get("ifname") or "",
        mac=(m.get("address") or "").lower(),
        mtu=int(m.get("mtu") or 0),
        operstate=str(m.get("operstate") or "unknown").lower(),
        kind=m.get(("linkinfo", "kind")) or "",
        master=int(m.get("master") or 0),
        lower=int(m.get("link") or 0),
        loopback=m.get("ifi_type") == ARPHRD_LOOPBACK or bool(m.get("flags", 0) & IFF_LOOPBACK),
    )


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
    """One short-lived IPRoute; links fetched one by one (by name or index) and remembered."""

    def __init__(self, ipr: IPRoute) -> None:
        self.ipr = ipr
        self.by_index: dict[int, Link] = {}

    def get(self, **key: Any) -> Link | None:
        if "index" in key and key["index"] in self.by_index:
            return self.by_index[key["index"]]
        try:
            link = _link(self.ipr.link("get", **key)[0])
        except NetlinkError as e:
            if e.code == errno.ENODEV:
                return None
            raise
        self.by_index[link.index] = link
        return link

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
            link = self.get(index=todo.pop())
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
            current = self.get(index=current.master)
        return current is not None


def read_links(names: Iterable[str], netns: str | None = None) -> Snapshot:
    """Netlink's view of the named netdevs of `netns` (a name under /var/run/netns, or the caller's
    own namespace when None; never created). Names netlink does not know are left out.

    Only the named links are asked for (plus the few on the default route's path): decoding a full
    link dump costs pyroute2 about 0.3 ms per netdev, and a node with a thousand veths has only a
    handful of PCI functions worth knowing about.
    """
    ipr = IPRoute(netns=netns, flags=0, strict_check=True) if netns else IPRoute(strict_check=True)
    try:
        reader = _Reader(ipr)
        links = {}
        for name in names:
            link = reader.get(ifname=name)
            if link is not None:
                links[name] = reader.with_addresses(link)
        carrying = reader.carrying_default_route()
        uplinks = frozenset(name for name, link in links.items() if reader.is_part_of(link, carrying))
    finally:
        ipr.close()
    return Snapshot(links=links, uplinks=uplinks)


def _default_route_links(routes: list) -> frozenset[int]:
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


def namespace_name(netns: str | None) -> str:
    """The namespace in words, for error messages: `network namespace 'x'` or the driver's own."""
    return f"network namespace {netns!r}" if netns else "the driver's network namespace"


def open_event_socket(netns: str | None = None, groups: int = NIC_EVENT_GROUPS) -> socket.socket:
    """A non-blocking rtnetlink socket subscribed to `groups` in `netns` (never created here)."""
    if netns:
        sock = pyroute2_netns.create_socket(netns, socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_ROUTE, flags=0)
    else:
        sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_ROUTE)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
        sock.bind((0, groups))  # port id 0: the kernel assigns one
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


def count_messages(datagram: bytes) -> int:
    """Number of netlink messages in one datagram (the kernel may batch several)."""
    count, offset = 0, 0
    while offset + _NLMSG_HEADER.size <= len(datagram):
        length = _NLMSG_HEADER.unpack_from(datagram, offset)[0]
        if length < _NLMSG_HEADER.size:
            break
        count += 1
        offset += (length + 3) & ~3
    return count


# Link-state reading for health monitoring: whether a netdev can carry traffic, not what it is.

IFF_UP = 0x1
IFF_LOWER_UP = 0x10000
RTM_NEWLINK = 16
RTM_DELLINK = 17


@dataclass(frozen=True)
class LinkState:
    """Whether a netdev can pass traffic right now, as one RTM_NEWLINK message says it."""

    index: int
    name: str
    operstate: str  # lower case, as sysfs spells it: "up", "down", "lowerlayerdown", "unknown", ...
    admin_up: bool  # IFF_UP: someone ran `ip link set up`
    carrier: bool  # IFLA_CARRIER (IFF_LOWER_UP when the kernel leaves it out)


@dataclass(frozen=True)
class LinkEvent:
    """One link message from the event socket; `deleted` when the link left this namespace."""

    state: LinkState
    deleted: bool = False


def _link_state(m: Any) -> LinkState:
    flags = int(m.get("flags") or 0)
    carrier = m.get("carrier")
    return LinkState(
        index=int(m.get("index")),
        name=m.get("ifname") or "",
        operstate=str(m.get("operstate") or "unknown").lower(),
        admin_up=bool(flags & IFF_UP),
        carrier=bool(flags & IFF_LOWER_UP) if carrier is None else bool(carrier),
    )


def read_link_states(
    names: Iterable[str], netns: str | None = None, indexes: Mapping[str, int] | None = None
) -> dict[str, LinkState]:
    """The link state of each named netdev of `netns` that exists there, keyed by the name asked
    for. A name with a known ifindex in `indexes` is looked up by that index first, so a netdev
    renamed since its name was learnt is still found; by name when the index is gone. One
    short-lived `IPRoute`, one request per link (see `read_links` for why not a dump)."""
    ipr = IPRoute(netns=netns, flags=0, strict_check=True) if netns else IPRoute(strict_check=True)
    out: dict[str, LinkState] = {}

    def get(**key: Any) -> LinkState | None:
        try:
            return _link_state(ipr.link("get", **key)[0])
        except NetlinkError as e:
            if e.code != errno.ENODEV:
                raise
            return None

    try:
        for name in names:
            index = (indexes or {}).get(name, 0)
            state = (get(index=index) if index else None) or get(ifname=name)
            if state is not None:
                out[name] = state
    finally:
        ipr.close()
    return out


def parse_link_events(datagram: bytes) -> list[LinkEvent]:
    """The RTM_NEWLINK/RTM_DELLINK messages of one datagram from `open_event_socket`; other
    messages (addresses) are skipped, and so is a message too short or malformed to decode."""
    events: list[LinkEvent] = []
    offset = 0
    while offset + _NLMSG_HEADER.size <= len(datagram):
        length, kind = _NLMSG_HEADER.unpack_from(datagram, offset)[:2]
        if length < _NLMSG_HEADER.size or offset + length > len(datagram):
            break
        if kind in (RTM_NEWLINK, RTM_DELLINK):
            msg = ifinfmsg(datagram[offset : offset + length])
            try:
                msg.decode()
                state = _link_state(msg)
            except Exception:  # pyroute2 raises assorted errors on a truncated attribute
                state = None
            if state is not None:
                events.append(LinkEvent(state, deleted=kind == RTM_DELLINK))
        offset += (length + 3) & ~3
    return events
