"""rtnetlink messages decoded with `struct`: links, link states, addresses and routes.

pyroute2 decodes a link message into a tree of objects, about 0.3 ms each; a node where the CNI
creates and deletes a veth per pod start sends thousands of link messages a minute, and the NIC
watcher and NIC health monitor look at every one. Here a message costs a few microseconds: the
fixed header, then the top-level attributes, of which only the few below are read
(linux/rtnetlink.h, linux/if_link.h, linux/if_addr.h); `peek_link` stops at the name (the
kernel's first attribute), so a message about a link of no interest costs less still, and
`peek_route` reads a route message's fixed header alone (a CNI adds and deletes a route per pod;
the NIC watcher wants the default route's changes only). Address and route messages are decoded
here too, so that NIC discovery never imports pyroute2 (about 0.17 CPU-s, a quarter of the
daemon's start-up). Pure: bytes in, dataclasses out.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass

ARPHRD_LOOPBACK = 772
IFF_UP = 0x1
IFF_LOOPBACK = 0x8
IFF_LOWER_UP = 0x10000

NLMSG_ERROR = 2
NLMSG_DONE = 3
RTM_NEWLINK = 16
RTM_DELLINK = 17
RTM_GETLINK = 18
RTM_NEWADDR = 20
RTM_DELADDR = 21
RTM_GETADDR = 22
RTM_NEWROUTE = 24
RTM_DELROUTE = 25
RTM_GETROUTE = 26
NLM_F_MULTI = 0x2
NLM_F_DUMP_INTR = 0x10

IFLA_ADDRESS = 1
IFLA_IFNAME = 3
IFLA_MTU = 4
IFLA_LINK = 5
IFLA_MASTER = 10
IFLA_OPERSTATE = 16
IFLA_LINKINFO = 18
IFLA_CARRIER = 33
IFLA_PARENT_DEV_NAME = 56  # Linux 5.14+
IFLA_PARENT_DEV_BUS_NAME = 57
IFLA_INFO_KIND = 1
IFA_ADDRESS = 1  # the address; on a point-to-point link the peer's
IFA_LOCAL = 2  # the link's own address, where it differs from IFA_ADDRESS
RTA_OIF = 4
RTA_PRIORITY = 6  # the metric
RTA_MULTIPATH = 9  # struct rtnexthop entries, each followed by its own attributes
RTA_TABLE = 15  # the table id; the header's byte cannot hold one above 255
NLA_TYPE_MASK = 0x3FFF  # without NLA_F_NESTED and NLA_F_NET_BYTEORDER

# RFC 2863 operational states, spelt as sysfs `operstate` spells them.
OPERSTATES = ("unknown", "notpresent", "down", "lowerlayerdown", "testing", "dormant", "up")

HEADER = struct.Struct("=IHHII")  # nlmsghdr: length, type, flags, sequence, port id
IFINFO = struct.Struct("=BxHiII")  # ifinfomsg: family, type, index, flags, change
IFADDR = struct.Struct("=BBBBi")  # ifaddrmsg: family, prefix length, flags, scope, index
RTMSG = struct.Struct("=BBBBBBBBI")  # rtmsg: family, dst_len, src_len, tos, table, protocol, scope, type, flags
_RTNEXTHOP = struct.Struct("=HBBi")  # rtnexthop: length (with its attributes), flags, hops, ifindex
_ATTR = struct.Struct("=HH")  # rtattr: length, type
_U32 = struct.Struct("=I")


@dataclass(frozen=True)
class Link:
    """What netlink says about one netdev; addresses (global ones, CIDR form, sorted) are filled in
    by `netlink.read_links` for the links discovery asks about."""

    index: int
    name: str
    mac: str
    mtu: int
    operstate: str  # lower case, as sysfs spells it: "up", "down", "unknown", ...
    kind: str  # IFLA_INFO_KIND ("veth", "bridge", ...); "" for a plain device
    master: int  # ifindex of the bridge/bond this link is a port of; 0 when none
    lower: int  # IFLA_LINK: for a stacked link (vlan, macvlan) the link it rides on; 0 when none
    loopback: bool
    # The device the netdev belongs to (IFLA_PARENT_DEV_*, Linux 5.14+): bus "pci" and the PCI
    # address for a NIC, "virtio", "usb", ...; both "" for a virtual link and on older kernels.
    parent_bus: str = ""
    parent: str = ""
    ipv4: tuple[str, ...] = ()
    ipv6: tuple[str, ...] = ()


@dataclass(frozen=True)
class LinkState:
    """Whether a netdev can pass traffic right now, as one RTM_NEWLINK message says it."""

    index: int
    name: str
    operstate: str  # lower case, as sysfs spells it: "up", "down", "lowerlayerdown", "unknown", ...
    admin_up: bool  # IFF_UP: someone ran `ip link set up`
    carrier: bool  # IFLA_CARRIER (IFF_LOWER_UP when the kernel leaves it out)


@dataclass(frozen=True)
class Address:
    """One address of a link, as an RTM_NEWADDR message gives it."""

    index: int
    family: int  # AF_INET, AF_INET6
    prefixlen: int
    scope: int  # RT_SCOPE_UNIVERSE (0) for a global address, RT_SCOPE_LINK (253) for fe80::/64, ...
    # IFA_LOCAL, else IFA_ADDRESS, as `ip` writes it: on a point-to-point link IFA_ADDRESS is the
    # peer's. "" when the message has neither, or one that is no address of its family.
    address: str


@dataclass(frozen=True)
class Route:
    """One route, as an RTM_NEWROUTE message gives it: what a default-route search reads."""

    family: int
    dst_len: int  # the destination's prefix length: 0 for a default route
    table: int  # RTA_TABLE when the message has it, else the header's
    type: int  # RTN_UNICAST, RTN_LOCAL, RTN_BLACKHOLE, ...
    priority: int  # RTA_PRIORITY, the metric; 0 without one
    oif: int  # RTA_OIF, the output link; 0 without one (a multipath route names its links below)
    nexthops: tuple[int, ...] = ()  # the ifindex of each RTA_MULTIPATH nexthop, in its order


@dataclass(frozen=True)
class LinkEvent:
    """One link message from the event socket; `deleted` when the link left this namespace."""

    state: LinkState
    deleted: bool = False


def messages(datagram: bytes) -> Iterator[tuple[int, int, int, int]]:
    """(type, flags, payload start, end) of each whole message of a datagram; stops at a
    truncated or malformed one."""
    offset = 0
    while offset + HEADER.size <= len(datagram):
        length, kind, flags = HEADER.unpack_from(datagram, offset)[:3]
        if length < HEADER.size or offset + length > len(datagram):
            return
        yield kind, flags, offset + HEADER.size, offset + length
        offset += (length + 3) & ~3


def attributes(data: bytes, offset: int, end: int) -> dict[int, bytes]:
    """The attributes between `offset` and `end`, by type; stops at a malformed one."""
    out: dict[int, bytes] = {}
    while offset + _ATTR.size <= end:
        length, kind = _ATTR.unpack_from(data, offset)
        if length < _ATTR.size or offset + length > end:
            break
        out[kind & NLA_TYPE_MASK] = data[offset + _ATTR.size : offset + length]
        offset += (length + 3) & ~3
    return out


def _text(value: bytes | None) -> str:
    return value.split(b"\0", 1)[0].decode(errors="replace") if value else ""


def _u32(value: bytes | None) -> int:
    return _U32.unpack_from(value)[0] if value and len(value) >= _U32.size else 0


def peek_link(data: bytes, start: int, end: int) -> tuple[int, str] | None:
    """(ifindex, name) of an RTM_NEWLINK/RTM_DELLINK payload, reading no further than the name;
    None when it is too short to be one."""
    if start + IFINFO.size > end:
        return None
    index = IFINFO.unpack_from(data, start)[2]
    offset = start + IFINFO.size
    while offset + _ATTR.size <= end:
        length, kind = _ATTR.unpack_from(data, offset)
        if length < _ATTR.size or offset + length > end:
            break
        if kind & NLA_TYPE_MASK == IFLA_IFNAME:
            return index, _text(data[offset + _ATTR.size : offset + length])
        offset += (length + 3) & ~3
    return index, ""


def peek_route(data: bytes, start: int, end: int) -> tuple[int, int] | None:
    """(dst_len, table) of an RTM_NEWROUTE/RTM_DELROUTE payload, from its fixed header alone; None
    when it is too short to be one. The header's table is exact for every table below 256: the
    kernel writes such an id there and RT_TABLE_COMPAT (252) for any above, whose id only RTA_TABLE
    holds (`decode_route` reads it). So a route of the main table (254) always says 254 here, and
    one that says 252 is of table 252 or one above 255, never of the main table."""
    if start + RTMSG.size > end:
        return None
    _, dst_len, _, _, table = RTMSG.unpack_from(data, start)[:5]
    return dst_len, table


def address_index(data: bytes, start: int, end: int) -> int | None:
    """The ifindex an RTM_NEWADDR/RTM_DELADDR payload is about; None when it is too short."""
    return IFADDR.unpack_from(data, start)[4] if start + IFADDR.size <= end else None


def decode_address(data: bytes, start: int, end: int) -> Address | None:
    """One RTM_NEWADDR/RTM_DELADDR payload; None when it is too short to be one."""
    if start + IFADDR.size > end:
        return None
    family, prefixlen, _, scope, index = IFADDR.unpack_from(data, start)
    a = attributes(data, start + IFADDR.size, end)
    raw = a.get(IFA_LOCAL) or a.get(IFA_ADDRESS)
    try:
        address = socket.inet_ntop(family, raw) if raw else ""
    except ValueError:  # a family without addresses of this length (or none inet_ntop knows)
        address = ""
    return Address(index=index, family=family, prefixlen=prefixlen, scope=scope, address=address)


def decode_route(data: bytes, start: int, end: int) -> Route | None:
    """One RTM_NEWROUTE/RTM_DELROUTE payload; None when it is too short to be one."""
    if start + RTMSG.size > end:
        return None
    family, dst_len, _, _, table, _, _, kind, _ = RTMSG.unpack_from(data, start)
    a = attributes(data, start + RTMSG.size, end)
    return Route(
        family=family,
        dst_len=dst_len,
        table=_u32(a[RTA_TABLE]) if RTA_TABLE in a else table,
        type=kind,
        priority=_u32(a.get(RTA_PRIORITY)),
        oif=_u32(a.get(RTA_OIF)),
        nexthops=_nexthops(a.get(RTA_MULTIPATH, b"")),
    )


def _nexthops(multipath: bytes) -> tuple[int, ...]:
    """The ifindex of each rtnexthop of an RTA_MULTIPATH value; stops at a malformed one."""
    out = []
    offset = 0
    while offset + _RTNEXTHOP.size <= len(multipath):
        length, _, _, index = _RTNEXTHOP.unpack_from(multipath, offset)
        if length < _RTNEXTHOP.size or offset + length > len(multipath):
            break
        out.append(index)
        offset += (length + 3) & ~3
    return tuple(out)


def decode_link(data: bytes, start: int, end: int) -> tuple[Link, LinkState] | None:
    """One RTM_NEWLINK/RTM_DELLINK payload; None when it is too short to be one."""
    if start + IFINFO.size > end:
        return None
    _, ifi_type, index, flags, _ = IFINFO.unpack_from(data, start)
    a = attributes(data, start + IFINFO.size, end)
    operstate = a.get(IFLA_OPERSTATE)
    state = OPERSTATES[operstate[0]] if operstate and operstate[0] < len(OPERSTATES) else "unknown"
    info = a.get(IFLA_LINKINFO)
    carrier = a.get(IFLA_CARRIER)
    link = Link(
        index=index,
        name=_text(a.get(IFLA_IFNAME)),
        mac=":".join(f"{b:02x}" for b in a.get(IFLA_ADDRESS, b"")),
        mtu=_u32(a.get(IFLA_MTU)),
        operstate=state,
        kind=_text(attributes(info, 0, len(info)).get(IFLA_INFO_KIND)) if info else "",
        master=_u32(a.get(IFLA_MASTER)),
        lower=_u32(a.get(IFLA_LINK)),
        loopback=ifi_type == ARPHRD_LOOPBACK or bool(flags & IFF_LOOPBACK),
        parent_bus=_text(a.get(IFLA_PARENT_DEV_BUS_NAME)),
        parent=_text(a.get(IFLA_PARENT_DEV_NAME)),
    )
    link_state = LinkState(
        index=index,
        name=link.name,
        operstate=state,
        admin_up=bool(flags & IFF_UP),
        carrier=bool(carrier[0]) if carrier else bool(flags & IFF_LOWER_UP),
    )
    return link, link_state


def parse_link_events(datagram: bytes, wanted: Callable[[int, str], bool] | None = None) -> list[LinkEvent]:
    """The link messages of one datagram from the event socket; other messages (addresses) are
    skipped, and so is a message too short to decode. With `wanted`, only the messages whose
    (ifindex, name) it accepts are decoded."""
    events = []
    for kind, _, start, end in messages(datagram):
        if kind not in (RTM_NEWLINK, RTM_DELLINK):
            continue
        if wanted is not None and ((peeked := peek_link(datagram, start, end)) is None or not wanted(*peeked)):
            continue
        if decoded := decode_link(datagram, start, end):
            events.append(LinkEvent(decoded[1], deleted=kind == RTM_DELLINK))
    return events
