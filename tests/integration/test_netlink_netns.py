"""`netlink.read_links` against real netlink in a throwaway network namespace: which links carry the
default route (metrics, multipath, ties, tables, route types, stacked links) and which addresses a
link has. NIC discovery's own tests (test_nic_netns) cover a plain uplink and a bridge port. Needs
root (`ip netns add`); skipped otherwise.
"""

from __future__ import annotations

import subprocess

import pytest
from nic_fixtures import ip, ip_batch, make_netns, veth

from driver.node import netlink


@pytest.fixture
def netns(request: pytest.FixtureRequest) -> str:
    return make_netns(request, "nl")


def _links(ns: str, *names: str) -> None:
    ip(ns, "link", "set", "lo", "up")
    for n, name in enumerate(names, start=1):
        veth(ns, name, f"02:00:00:00:01:{n:02x}")


def _read(ns: str) -> netlink.Snapshot:
    with netlink.RouteSocket(ns) as rs:
        everything = rs.links()
    return netlink.read_links([x for x in everything if not x.loopback], {x.index: x for x in everything}, ns)


def test_every_nexthop_of_a_multipath_default_route_carries_it(netns: str) -> None:
    _links(netns, "a0", "a1", "b0", "b1", "other0")
    ip_batch(
        netns,
        [
            "addr add 192.0.2.2/24 dev a0",
            "addr add 198.51.100.2/24 dev a1",
            "addr add 2001:db8:1::2/64 dev b0 nodad",
            "addr add 2001:db8:2::2/64 dev b1 nodad",
            "route add default metric 100 nexthop via 192.0.2.1 dev a0 nexthop via 198.51.100.1 dev a1",
            "route add ::/0 metric 10 nexthop via 2001:db8:1::1 dev b0 nexthop via 2001:db8:2::1 dev b1",
        ],
    )
    assert _read(netns).uplinks == {"a0", "a1", "b0", "b1"}


def test_the_lowest_metric_wins_and_an_equal_one_unites(netns: str) -> None:
    """Per family, in the main table, unicast routes only: a default route in another table, a
    lower-metric unreachable one and a route that is no default do not count."""
    _links(netns, "slow0", "fast0", "fast1", "table0", "net0", "six0", "six1")
    ip_batch(
        netns,
        [
            "addr add 192.0.2.2/24 dev slow0",
            "addr add 198.51.100.2/24 dev fast0",
            "addr add 203.0.113.2/24 dev fast1",
            "addr add 192.0.2.130/25 dev table0",
            "addr add 10.1.0.2/24 dev net0",
            "addr add 2001:db8:1::2/64 dev six0 nodad",
            "addr add 2001:db8:2::2/64 dev six1 nodad",
            "route add default via 192.0.2.1 dev slow0 metric 300",
            "route add default via 198.51.100.1 dev fast0 metric 100",
            "route append default via 203.0.113.1 dev fast1 metric 100",
            "route add default via 192.0.2.129 dev table0 table 1000",
            "route add unreachable default metric 1",
            "route add 10.0.0.0/8 via 10.1.0.1 dev net0",
            "route add ::/0 via 2001:db8:1::1 dev six0 metric 50",
            "route add ::/0 via 2001:db8:2::1 dev six1 metric 20",
        ],
    )
    assert _read(netns).uplinks == {"fast0", "fast1", "six1"}


def test_the_links_under_a_vlan_uplink_carry_it(netns: str) -> None:
    _links(netns, "phys0", "port0")
    vlan = subprocess.run(
        ["ip", "-n", netns, "link", "add", "link", "phys0", "name", "phys0.10", "type", "vlan", "id", "10"],
        capture_output=True,
        text=True,
    )
    if vlan.returncode != 0:
        pytest.skip(f"this kernel makes no VLAN: {vlan.stderr.strip()}")
    ip_batch(
        netns,
        [
            "link add br0 type bridge",
            "link set phys0.10 master br0",
            "link set phys0.10 up",
            "link set br0 up",
            "addr add 192.0.2.2/24 dev br0",
            "route add default via 192.0.2.1 dev br0",
        ],
    )
    # br0 carries it; its port phys0.10 is part of it, and so is phys0, under the VLAN.
    assert _read(netns).uplinks == {"br0", "phys0.10", "phys0"}


def test_a_link_has_its_own_global_addresses_sorted(netns: str) -> None:
    _links(netns, "r0", "r1")
    ip_batch(
        netns,
        [
            "addr add 10.9.0.1 peer 10.9.0.2/32 dev r0",  # its own is IFA_LOCAL, the peer's IFA_ADDRESS
            "addr add 10.7.0.1/24 dev r0",
            "addr add 10.7.0.1/16 dev r0",
            "addr add 10.8.0.1/24 dev r0 scope link",
            "addr add 10.6.0.1/24 dev r1",
            "addr add fd00:1::1/64 dev r0 nodad",
            "addr add fd00::1/64 dev r0 nodad",
        ],
    )
    links = _read(netns).links
    assert links["r0"].ipv4 == ("10.7.0.1/16", "10.7.0.1/24", "10.9.0.1/32")
    assert links["r0"].ipv6 == ("fd00::1/64", "fd00:1::1/64")  # not fe80::, a link-scope address
    assert (links["r1"].ipv4, links["r1"].ipv6) == (("10.6.0.1/24",), ())
