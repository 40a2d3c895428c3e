"""The rtnetlink decoder and the link, address and route dumps against the real kernel of this
machine (the daemon's own namespace; no root needed), compared with what iproute2 and sysfs say;
address and route messages also as bytes a kernel sent, for the cases this machine may not have."""

from __future__ import annotations

import ipaddress
import json
import shutil
import socket
import struct
import subprocess
from pathlib import Path

import pytest

from driver.node import netlink, rtnl


def _ip_links() -> dict[int, dict]:
    if shutil.which("ip") is None:
        pytest.skip("needs iproute2's `ip`")
    out = subprocess.run(["ip", "-j", "-d", "link", "show"], capture_output=True, text=True, check=True).stdout
    return {link["ifindex"]: link for link in json.loads(out)}


def test_the_link_dump_decodes_what_ip_link_shows() -> None:
    with netlink.RouteSocket() as rs:
        dumped = {link.index: link for link in rs.links()}
    shown = _ip_links()
    common = dumped.keys() & shown.keys()  # links may come and go between the two reads
    assert 1 in common, "the loopback is always there"
    for index in common:
        ours, ip = dumped[index], shown[index]
        if ours.name != ip["ifname"]:
            continue  # renamed in between
        assert ours.mac == ip.get("address", ""), ip
        assert ours.mtu == ip["mtu"]
        assert ours.operstate == ip["operstate"].lower()
        assert ours.kind == (ip.get("linkinfo") or {}).get("info_kind", "")
        assert (ours.parent_bus, ours.parent) == (ip.get("parentbus", ""), ip.get("parentdev", ""))
    assert dumped[1].loopback and not any(dumped[i].loopback for i in common if i != 1)


def test_get_and_link_states_find_links_by_index_and_name() -> None:
    with netlink.RouteSocket() as rs:
        found = rs.get(index=1)
        assert found is not None and found[0].name == "lo" and found[1].admin_up
        by_name = rs.get(name="lo")
        assert by_name is not None and by_name[0].index == 1
        assert rs.get(name="tandem-none0") is None
        assert rs.get(index=2**31 - 1) is None
    states = netlink.read_link_states(["lo", "tandem-none0"], indexes={"lo": 2**31 - 1})
    assert list(states) == ["lo"], "a stale ifindex falls back to the name"


def test_speed_is_what_sysfs_says() -> None:
    with netlink.RouteSocket() as rs:
        links = [x for x in rs.links() if not x.loopback]
        for link in links:
            try:
                text = Path(f"/sys/class/net/{link.name}/speed").read_text().strip()
            except OSError:  # no such link any more, or EINVAL: the kernel does not know
                text = "-1"
            expected = int(text) if int(text) > 0 else None
            assert rs.speed(link.name) == expected, link.name
        assert rs.speed("lo") is None and rs.speed("tandem-none0") is None


def test_truncated_and_malformed_messages_are_skipped_not_raised() -> None:
    with netlink.RouteSocket() as rs:
        seq = 4242
        request = rtnl.IFINFO.pack(socket.AF_UNSPEC, 0, 1, 0, 0)
        rs.sock.send(rtnl.HEADER.pack(rtnl.HEADER.size + len(request), rtnl.RTM_GETLINK, 1, seq, 0) + request)
        datagram = rs.sock.recv(1 << 16)
    assert [e.state.name for e in rtnl.parse_link_events(datagram)] == ["lo"]
    for cut in range(len(datagram)):
        rtnl.parse_link_events(datagram[:cut])
        for _, _, start, end in rtnl.messages(datagram[:cut]):
            rtnl.peek_link(datagram, start, end)
    garbled = bytearray(datagram)
    struct.pack_into("=H", garbled, rtnl.HEADER.size + rtnl.IFINFO.size, 2)  # attribute length < 4
    (event,) = rtnl.parse_link_events(bytes(garbled))
    assert event.state.index == 1 and event.state.name == ""


def test_address_messages_name_their_link_by_index() -> None:
    payload = struct.pack("=BBBBi", socket.AF_INET, 24, 0, 0, 7)
    message = rtnl.HEADER.pack(rtnl.HEADER.size + len(payload), rtnl.RTM_NEWADDR, 0, 0, 0) + payload
    found = [(kind, rtnl.address_index(message * 2, s, e)) for kind, _, s, e in rtnl.messages(message * 2)]
    assert found == [(rtnl.RTM_NEWADDR, 7), (rtnl.RTM_NEWADDR, 7)]
    assert rtnl.address_index(message, rtnl.HEADER.size, rtnl.HEADER.size + 4) is None
    assert rtnl.parse_link_events(message) == []


def test_peek_reads_the_name_and_a_filter_skips_the_rest() -> None:
    seq = 4243
    request = rtnl.IFINFO.pack(socket.AF_UNSPEC, 0, 1, 0, 0)
    with netlink.RouteSocket() as rs:
        rs.sock.send(rtnl.HEADER.pack(rtnl.HEADER.size + len(request), rtnl.RTM_GETLINK, 1, seq, 0) + request)
        datagram = rs.sock.recv(1 << 16)
    ((_, _, start, end),) = list(rtnl.messages(datagram))
    assert rtnl.peek_link(datagram, start, end) == (1, "lo")
    assert rtnl.parse_link_events(datagram, wanted=lambda index, name: name != "lo") == []
    assert [e.state.name for e in rtnl.parse_link_events(datagram, wanted=lambda i, n: i == 1)] == ["lo"]


# Real kernel messages (Linux 6.18), as a RouteSocket dump in a throwaway namespace received them:
#   ip link add t0 type veth peer name t0p                  (t0 is ifindex 3)
#   ip addr add 10.9.0.1 peer 10.9.0.2/32 dev t0
#   ip addr add 192.0.2.2/24 dev t0
#   ip addr add 2001:db8::2/64 dev t0 nodad                 (and the kernel's own fe80:: address)
#   ip link add t1 type veth peer name t1p                  (t1 is ifindex 5)
#   ip route add default metric 100 nexthop via 192.0.2.1 dev t0 nexthop via 198.51.100.1 dev t1
#   ip route add default via 192.0.2.1 dev t0 table 1000
#   ip -6 route add default metric 10 nexthop via 2001:db8::1 dev t0 nexthop via 2001:db8:1::1 dev t1
ADDRESS_PEER = (
    "4c00000014002200010000005f2700000220800003000000080001000a090002080002000a0900010700030074300000"
    "080008008000000014000600ffffffffffffffff3acb24003acb2400"
)
ADDRESS_V4 = (
    "4c00000014002200010000005f270000021880000300000008000100c000020208000200c00002020700030074300000"
    "080008008000000014000600ffffffffffffffff3acb24003acb2400"
)
ADDRESS_V6 = (
    "4800000014002200010000005f2700000a408200030000001400010020010db800000000000000000000000214000600"
    "ffffffffffffffff3acb24003acb24000800080082000000"
)
ADDRESS_LINK_LOCAL = (
    "5000000014002200010000005f2700000a4080fd0300000014000100fe8000000000000068fa32fffe63b08a14000600"
    "ffffffffffffffff3acb24003acb2400080008008000000005000b0003000000"
)
ROUTE_TABLE_1000 = (
    "3400000018002200050000001b26000002000000fc0300010000000008000f00e803000008000500c00002010800040003000000"
)
ROUTE_MULTIPATH_V4 = (
    "5000000018002200050000001b26000002000000fe0300010000000008000f00fe000000080006006400000024000900"
    "100000000300000008000500c0000201100000000500000008000500c6336401"
)
ROUTE_MULTIPATH_V6 = (
    "9400000018002200060000001b2600000a000000fe0300010000000008000f00fe000000080006000a0000003c000900"
    "1c000000030000001400050020010db80000000000000000000000011c000000050000001400050020010db800010000"
    "000000000000000124000c0000000000000000000000000000000000000000000000000000000000000000000500140000000000"
)
# Route events (Linux 6.18), as the NIC watcher's event socket received them in a throwaway
# namespace where t0 (ifindex 3) has 192.0.2.2/24 and 2001:db8::2/64:
#   ip route add 10.244.1.7/32 dev t0                       (what a CNI adds per pod)
#   ip route add default via 192.0.2.1 dev t0               (RTM_NEWROUTE)
#   ip route del default via 192.0.2.1 dev t0               (RTM_DELROUTE)
#   ip route add default via 192.0.2.1 dev t0 table 252     (the header's 252 is the table itself)
#   ip -6 route del default via 2001:db8::1 dev t0          (RTM_DELROUTE; added before)
EVENT_HOST_ROUTE = (
    "34000000180000065c470f6bd951000002200000fe03fd011000000008000f00fe000000080001000af401070800040003000000"
)
EVENT_DEFAULT_ADDED = (
    "34000000180000065c470f6bdc51000002000000fe0300011000000008000f00fe00000008000500c00002010800040003000000"
)
EVENT_DEFAULT_DELETED = (
    "34000000190000005d470f6bdf51000002000000fe0300011000000008000f00fe00000008000500c00002010800040003000000"
)
EVENT_DEFAULT_TABLE_252 = (
    "34000000180000065d470f6be451000002000000fc0300011000000008000f00fc00000008000500c00002010800040003000000"
)
EVENT_DEFAULT_V6_DELETED = (
    "74000000190000005d470f6bec5100000a000000fe0300011000000008000f00fe00000008000600000400001400050020010db8"
    "000000000000000000000001080004000300000024000c00000000000000000000000000000000000000000000000000000000"
    "00000000000500140000000000"
)
ROUTES = (
    ROUTE_TABLE_1000,
    ROUTE_MULTIPATH_V4,
    ROUTE_MULTIPATH_V6,
    EVENT_HOST_ROUTE,
    EVENT_DEFAULT_ADDED,
    EVENT_DEFAULT_DELETED,
    EVENT_DEFAULT_TABLE_252,
    EVENT_DEFAULT_V6_DELETED,
)
CAPTURED = (ADDRESS_PEER, ADDRESS_V4, ADDRESS_V6, ADDRESS_LINK_LOCAL, *ROUTES)


def _decoded(message: str, decode):
    data = bytes.fromhex(message)
    ((_, _, start, end),) = list(rtnl.messages(data))
    return decode(data, start, end)


def test_address_messages_decode_as_the_kernel_sent_them() -> None:
    assert _decoded(ADDRESS_V4, rtnl.decode_address) == rtnl.Address(3, socket.AF_INET, 24, 0, "192.0.2.2")
    # A point-to-point address: IFA_ADDRESS is the peer (10.9.0.2), IFA_LOCAL the link's own.
    assert _decoded(ADDRESS_PEER, rtnl.decode_address) == rtnl.Address(3, socket.AF_INET, 32, 0, "10.9.0.1")
    # IPv6 messages carry IFA_ADDRESS alone.
    assert _decoded(ADDRESS_V6, rtnl.decode_address) == rtnl.Address(3, socket.AF_INET6, 64, 0, "2001:db8::2")
    link_local = _decoded(ADDRESS_LINK_LOCAL, rtnl.decode_address)
    assert (link_local.scope, link_local.address) == (253, "fe80::68fa:32ff:fe63:b08a")  # RT_SCOPE_LINK


def test_route_messages_decode_as_the_kernel_sent_them() -> None:
    assert _decoded(ROUTE_MULTIPATH_V4, rtnl.decode_route) == rtnl.Route(
        family=socket.AF_INET, dst_len=0, table=254, type=1, priority=100, oif=0, nexthops=(3, 5)
    )
    assert _decoded(ROUTE_MULTIPATH_V6, rtnl.decode_route) == rtnl.Route(
        family=socket.AF_INET6, dst_len=0, table=254, type=1, priority=10, oif=0, nexthops=(3, 5)
    )
    # A table above 255: the header's byte says RT_TABLE_COMPAT (252), RTA_TABLE the table.
    assert bytes.fromhex(ROUTE_TABLE_1000)[rtnl.HEADER.size + 4] == 252
    assert _decoded(ROUTE_TABLE_1000, rtnl.decode_route) == rtnl.Route(
        family=socket.AF_INET, dst_len=0, table=1000, type=1, priority=0, oif=3
    )


def test_peek_route_reads_the_header_alone_and_agrees_with_the_decoder() -> None:
    """The NIC watcher's filter: it keeps a route message when the header says a default route of
    the main table, which must be what the whole message says (RTA_TABLE included) for every
    message a kernel sent; the header's 252 is never the main table, whichever table it stands for."""
    main = netlink.RT_TABLE_MAIN
    peeked = {message: _decoded(message, rtnl.peek_route) for message in ROUTES}
    for message, (dst_len, table) in peeked.items():
        route = _decoded(message, rtnl.decode_route)
        assert ((dst_len, table) == (0, main)) == (route.dst_len == 0 and route.table == main), route
    default_main = {m for m, p in peeked.items() if p == (0, main)}
    assert default_main == {
        ROUTE_MULTIPATH_V4,
        ROUTE_MULTIPATH_V6,
        EVENT_DEFAULT_ADDED,
        EVENT_DEFAULT_DELETED,
        EVENT_DEFAULT_V6_DELETED,
    }
    assert peeked[EVENT_HOST_ROUTE] == (32, main)
    assert peeked[ROUTE_TABLE_1000] == peeked[EVENT_DEFAULT_TABLE_252] == (0, 252)
    kinds = [next(rtnl.messages(bytes.fromhex(m)))[0] for m in (EVENT_DEFAULT_ADDED, EVENT_DEFAULT_DELETED)]
    assert kinds == [rtnl.RTM_NEWROUTE, rtnl.RTM_DELROUTE]
    assert rtnl.peek_route(bytes(11), 0, 11) is None


def test_truncated_and_malformed_address_and_route_messages_are_skipped_not_raised() -> None:
    for message in CAPTURED:
        data = bytes.fromhex(message)
        for cut in range(len(data)):
            for decode in (rtnl.decode_address, rtnl.decode_route, rtnl.peek_route):
                decode(data, rtnl.HEADER.size, cut)
    assert rtnl.decode_address(b"\0" * 7, 0, 7) is None
    assert rtnl.decode_route(b"\0" * 11, 0, 11) is None
    # An address of the wrong length for its family is no address.
    garbled = bytearray(bytes.fromhex(ADDRESS_V4))
    garbled[rtnl.HEADER.size] = socket.AF_INET6
    assert _decoded(bytes(garbled).hex(), rtnl.decode_address).address == ""
    # A nexthop whose length runs past the attribute ends the list; those before it stay.
    garbled = bytearray(bytes.fromhex(ROUTE_MULTIPATH_V4))
    second_nexthop = rtnl.HEADER.size + rtnl.RTMSG.size + 8 + 8 + 4 + 16
    struct.pack_into("=H", garbled, second_nexthop, 200)
    assert _decoded(bytes(garbled).hex(), rtnl.decode_route).nexthops == (3,)


SCOPES = {"global": 0, "site": 200, "link": 253, "host": 254}
FAMILIES = {"inet": socket.AF_INET, "inet6": socket.AF_INET6}


def test_the_address_dump_decodes_what_ip_addr_shows() -> None:
    """Each link's addresses, link by link as `read_links` asks, against `ip -j addr show`."""
    if shutil.which("ip") is None:
        pytest.skip("needs iproute2's `ip`")
    out = subprocess.run(["ip", "-j", "addr", "show"], capture_output=True, text=True, check=True).stdout
    seen = set()
    with netlink.RouteSocket() as rs:
        for link in json.loads(out):
            ours = {(a.family, a.address, a.prefixlen, a.scope) for a in rs.addresses(link["ifindex"])}
            shown = {(FAMILIES[a["family"]], a["local"], a["prefixlen"], SCOPES[a["scope"]]) for a in link["addr_info"]}
            assert ours == shown, link["ifname"]
            seen |= ours
    assert (socket.AF_INET, "127.0.0.1", 8, SCOPES["host"]) in seen


ROUTE_TYPES = {"unicast": 1, "local": 2, "broadcast": 3, "anycast": 4, "multicast": 5, "blackhole": 6}
ROUTE_TYPES |= {"unreachable": 7, "prohibit": 8, "throw": 9}
TABLES = {"main": 254, "local": 255, "default": 253}


def _shown_route(route: dict, indexes: dict[str, int]) -> tuple:
    """A route of `ip -j route show table all` as (dst_len, table, type, metric, output links)."""
    dst_len = 0 if route["dst"] == "default" else ipaddress.ip_network(route["dst"], strict=False).prefixlen
    table = route.get("table", "main")
    devs = [nh["dev"] for nh in route["nexthops"]] if "nexthops" in route else [route.get("dev")]
    links = tuple(sorted(indexes[dev] for dev in devs if dev))
    return (
        dst_len,
        TABLES.get(table) or int(table),
        ROUTE_TYPES[route.get("type", "unicast")],
        route.get("metric", 0),
        links,
    )


def test_the_route_dump_decodes_what_ip_route_shows() -> None:
    """Every route of every table, per family, against `ip -j route show table all`."""
    indexes = {link["ifname"]: index for index, link in _ip_links().items()}
    for family, option in ((socket.AF_INET, "-4"), (socket.AF_INET6, "-6")):
        out = subprocess.run(["ip", "-j", option, "route", "show", "table", "all"], capture_output=True, text=True)
        shown = sorted(_shown_route(route, indexes) for route in json.loads(out.stdout))
        with netlink.RouteSocket() as rs:
            routes = rs.routes(family)
        ours = sorted(
            (r.dst_len, r.table, r.type, r.priority, tuple(sorted(r.nexthops or ([r.oif] if r.oif else []))))
            for r in routes
        )
        assert ours == shown
        assert {r.family for r in routes} == {family}
