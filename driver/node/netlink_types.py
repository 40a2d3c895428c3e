"""What both halves of the netlink door speak (`netlink` reads, `netlink_pyroute2` writes): the
kernel's refusal as an error, and the host state a returning NIC gets back.

A leaf of its own so that the pyroute2 half, imported lazily by `netlink`, needs nothing of
`netlink` itself: the door has no import circle. Callers keep using the names through `netlink`.
"""

from __future__ import annotations

from dataclasses import dataclass

from driver.errors import NodeError

RT_SCOPE_UNIVERSE = 0  # an address's scope: global


class NetlinkFailure(NodeError, OSError):
    """A netlink request the kernel refused, as an OSError carrying the kernel's errno."""


@dataclass(frozen=True)
class LinkHome:
    """What a netdev was on the host before it went into a pod, for `restore_link`."""

    name: str
    mtu: int = 0  # 0: keep the one it has
    mac: str = ""  # "": keep the one it has
    addresses: tuple[str, ...] = ()  # its global addresses (CIDR): exactly these
