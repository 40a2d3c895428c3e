"""rtnetlink messages decoded with `struct`: links, link states, and the ifindex of address messages.

pyroute2 decodes a link message into a tree of objects, about 0.3 ms each; a node where the CNI
creates and deletes a veth per pod start sends thousands of link messages a minute, and the NIC
watcher and NIC health monitor look at every one. Here a message costs a few microseconds: the
fixed header, then the top-level attributes, of which only the few below are read
(linux/rtnetlink.h, linux/if_link.h, linux/if_addr.h); `peek_link` stops at the name (the
kernel's first attribute), so a message about a link of no interest costs less still. Pure:
bytes in, dataclasses out.
"""

from __future__ import annotations

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
NLA_TYPE_MASK = 0x3FFF  # without NLA_F_NESTED and NLA_F_NET_BYTEORDER

# RFC 2863 operational states, spelt as sysfs `operstate` spells them.
OPERSTATES = ("unknown", "notpresent", "down", "lowerlayerdown", "testing", "dormant", "up")

HEADER = struct.Struct("=IHHII")  # nlmsghdr: length, type, flags, sequence, port id
IFINFO = struct.Struct("=BxHiII")  # ifinfomsg: family, type, index, flags, change
_IFADDR = struct.Struct("=BBBBi")  # ifaddrmsg: family, prefix length, flags, scope, index
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


def address_index(data: bytes, start: int, end: int) -> int | None:
    """The ifindex an RTM_NEWADDR/RTM_DELADDR payload is about; None when it is too short."""
    return _IFADDR.unpack_from(data, start)[4] if start + _IFADDR.size <= end else None


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
