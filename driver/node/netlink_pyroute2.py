"""The netlink door's pyroute2 half: what still goes through pyroute2, the writes (an exclusive NIC
that came back from a pod gets its host name, MTU, MAC and addresses again: `restore_link`, and
`rename_link` to move one out of another's way) and a socket in a named network namespace
(`socket_in`: a forked child enters the namespace, opens the socket and passes it back; the kernel
then answers it for that namespace, whatever the caller's own).

Only `driver.node.netlink` imports this module, and only at the first call that needs it: importing
pyroute2 costs about 0.17 CPU-s, a quarter of the daemon's start-up, and a daemon that reads the
netlink of its own namespace (the default) never needs it. Each write opens a short-lived `IPRoute`,
so that no pyroute2 state (it runs its own event loop) is shared between threads.

pyroute2's own `NetlinkError` never leaves this module: every public call turns it into
`NetlinkFailure`, an `OSError` (with the kernel's errno) that is also a Tandem `NodeError`, so callers
catch `OSError` alone and never import pyroute2 (an import-linter contract).
"""

from __future__ import annotations

import errno
import ipaddress
import socket
from collections.abc import Callable
from typing import ParamSpec, TypeVar

from pyroute2 import IPRoute
from pyroute2 import netns as pyroute2_netns
from pyroute2.netlink.exceptions import NetlinkError

from driver.errors import translating
from driver.node.netlink_types import RT_SCOPE_UNIVERSE, LinkHome, NetlinkFailure

IFA_F_NODAD = 0x2  # an IPv6 address usable at once, without duplicate address detection

P = ParamSpec("P")
R = TypeVar("R")


def _door(call: Callable[P, R]) -> Callable[P, R]:
    """pyroute2's NetlinkError out of `call` becomes a NetlinkFailure with the same errno."""
    return translating(call, NetlinkError, lambda e: NetlinkFailure(e.code, f"netlink: {e}"))


@_door
def socket_in(netns: str) -> socket.socket:
    """A raw rtnetlink socket in the named network namespace `netns` (never created here)."""
    sock: socket.socket = pyroute2_netns.create_socket(
        netns, socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_ROUTE, flags=0
    )
    return sock


@_door
def restore_link(name: str, home: LinkHome, netns: str | None) -> None:
    """`netlink.restore_link`: the netdev `name` of `netns` made what `home` says."""
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
            flags = {"IFA_FLAGS": IFA_F_NODAD} if address.version == 6 else {}
            ipr.addr("add", index=index, address=str(address.ip), prefixlen=address.network.prefixlen, **flags)
    finally:
        ipr.close()


@_door
def rename_link(name: str, new: str, netns: str | None) -> None:
    """`netlink.rename_link`: the netdev `name` of `netns` set down and renamed `new`."""
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
