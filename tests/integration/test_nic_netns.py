"""NIC discovery and its watcher against real netlink, in a throwaway network namespace.

Netlink is authoritative for the veths (names, MAC, MTU, state, speed, addresses, default route);
a sysfs fixture tree maps chosen veths to fake RDMA PCI functions the way a node's sysfs maps the
netdev of a ConnectX in another namespace to its function: only through the RDMA side, the netdev
itself is not in it (nic_fixtures). Needs root (`ip netns add`); skipped otherwise.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from nic_fixtures import SysfsFixture, ip, ip_batch, make_netns, nic_spec, veth, wait_for

from driver.config import NicExclusions
from driver.discovery.nic.discover import ABSENT_STATE, NicDiscovery
from driver.discovery.nic.watcher import NicWatcher
from driver.model import Device
from driver.node import netlink
from driver.resource_api import MAX_ATTRIBUTE_VALUES, MAX_ATTRIBUTES_AND_CAPACITIES
from sim.nics import default_gid, render_nic
from sim.profile import NicSpec


@pytest.fixture
def netns(request: pytest.FixtureRequest) -> str:
    return make_netns(request, "t")


@pytest.fixture
def pod_netns(request: pytest.FixtureRequest) -> str:
    return make_netns(request, "pod")


def nic(n: int, ifname: str, **kw) -> NicSpec:
    return nic_spec(n, ifname, **{"mtu": 9000, **kw})  # sysfs says 9000; netlink's value must win


class Fixture(SysfsFixture):
    """The sysfs/dev fixture tree plus a discovery bound to the test namespace."""

    def __init__(self, root: Path, ns: str) -> None:
        super().__init__(root)
        self.ns = ns

    def discovery(self, **kw) -> NicDiscovery:
        return NicDiscovery(self.sys, netns=self.ns, **kw)

    def discover(self, keep=(), **kw) -> dict[str, Device]:
        return {d.name: d for d in self.discovery(**kw).discover(keep)}

    def rename(self, old: str, new: str) -> None:
        """What the kernel does to the RDMA side of sysfs on a rename (netlink side is done by `ip`)."""
        for ndev in self.sys.glob("class/infiniband/*/ports/*/gid_attrs/ndevs/*"):
            if ndev.read_text().strip() == old:
                ndev.write_text(new + "\n")


@pytest.fixture
def fx(tmp_path: Path, netns: str) -> Fixture:
    return Fixture(tmp_path, netns)


def test_netlink_gives_link_facts_and_sysfs_gives_identity(fx: Fixture) -> None:
    veth(fx.ns, "r0", "02:00:00:00:00:01", mtu=4200)
    ip(fx.ns, "addr", "add", "10.20.0.2/24", "dev", "r0")
    ip(fx.ns, "addr", "add", "10.20.0.1/24", "dev", "r0")
    ip(fx.ns, "-6", "addr", "add", "fd00:20::2/64", "dev", "r0", "nodad")
    veth(fx.ns, "plain0", "02:00:00:00:00:99")  # no PCI function in the fixture
    fx.map(nic(1, "r0", speed_mbps=200000))
    assert not (fx.sys / "class/net/r0").exists() and not list(fx.sys.glob("devices/**/net/r0"))

    devices = fx.discover(list_attributes=True)
    assert list(devices) == ["pci-0000-8b-00-0"]
    d = devices["pci-0000-8b-00-0"]
    a = d.attributes
    assert (a["ifName"], a["mac"], a["mtu"], a["state"]) == ("r0", "02:00:00:00:00:01", 4200, "up")
    assert a["speed"] == 10000  # ethtool's answer for a veth, as on a real node; not sysfs
    assert a["rdmaDevice"] == "mlx5_1"
    assert a["ipv4"] == ("10.20.0.1/24", "10.20.0.2/24")
    assert a["ipv6"] == ("fd00:20::2/64",)  # the link-local fe80:: address is not global
    assert d.nic is not None and d.nic.ipv6 == ("fd00:20::2/64",) and d.nic.present
    assert fx.discover()["pci-0000-8b-00-0"].attributes["ipv4"] == "10.20.0.1/24"


def _veths(fx: Fixture, *specs: NicSpec) -> None:
    """One veth per NIC, with the NIC's MAC: its default GID is what names the veth's function."""
    for spec in specs:
        veth(fx.ns, spec.ifname, spec.mac)


def test_vfs_and_multi_port_functions(fx: Fixture) -> None:
    pf = nic(1, "pf0", sriov_totalvfs=4, sriov_numvfs=1)
    vf = nic(2, "vf0", pci_address="0000:8b:00.1", is_vf=True, physfn=pf.pci_address)
    multi = nic(4, "mp0", ports=2)
    _veths(fx, pf, vf, multi)
    veth(fx.ns, "mp1", "02:00:00:00:01:04")
    fx.map(pf, vf, multi)
    # mp1 is the second port of mp0's function: port 2's default GID names it.
    mfn = (fx.sys / "bus/pci/devices" / multi.pci_address).resolve()
    (mfn / "infiniband/mlx5_4/ports/2/gid_attrs/ndevs/0").write_text("mp1\n")
    (mfn / "infiniband/mlx5_4/ports/2/gids/0").write_text(default_gid("02:00:00:00:01:04") + "\n")

    devices = fx.discover()
    assert set(devices) == {"pci-0000-8b-00-0", "pci-0000-8b-00-1", "pci-0000-8e-00-0"}
    p, v = devices["pci-0000-8b-00-0"].attributes, devices["pci-0000-8b-00-1"].attributes
    assert (p["ifName"], p["sriov"], p["sriovVfs"], p["isSriovVf"]) == ("pf0", True, 1, False)
    assert (v["ifName"], v["sriov"], v["isSriovVf"]) == ("vf0", False, True)
    m = devices["pci-0000-8e-00-0"]
    assert m.attributes["ifName"] == "mp0" and m.attributes["rdmaDevice"] == "mlx5_4"


def test_a_netdev_is_its_ports_only_by_name_and_mac(fx: Fixture, caplog) -> None:
    """The daemon's own namespace has a netdev `r0` too (in sysfs, on another function, whose
    GID names it); the test namespace's `r0` is the one whose MAC its port's GID carries."""
    ours = nic(1, "r0")
    theirs = nic(2, "r0", mac="02:00:00:00:0f:02", rdma_device="mlx5_0")  # sorts first
    veth(fx.ns, "r0", ours.mac)
    veth(fx.ns, "spoof0", "02:00:00:00:0f:03")
    fx.map(ours)
    render_nic(theirs, fx.sys, fx.dev)  # left in sysfs: the daemon's own namespace's netdev
    render_nic(nic(3, "spoof0"), fx.sys, fx.dev)  # names spoof0, but with another MAC
    fx.hide_netdev("spoof0")
    with caplog.at_level(logging.DEBUG, logger="driver.discovery"):
        devices = fx.discover()
    assert list(devices) == ["pci-0000-8b-00-0"]
    assert devices["pci-0000-8b-00-0"].attributes["ifName"] == "r0"
    assert "skip spoof0: an RDMA port names a netdev of this name, but not this one" in caplog.text


def test_skip_rules(fx: Fixture, caplog) -> None:
    up_pf = nic(5, "up0", sriov_totalvfs=2, sriov_numvfs=1)
    specs = [
        nic(1, "ok0"),
        nic(2, "nodrv0", driver=""),
        nic(3, "vfio0", driver="vfio-pci"),
        nic(4, "excl0"),
        up_pf,
        nic(6, "upvf0", pci_address="0000:8f:00.1", is_vf=True, physfn=up_pf.pci_address),
        nic(7, "port0"),
    ]
    _veths(fx, *specs)
    fx.map(*specs)
    # Two default routes: IPv4 through up0, IPv6 through a bridge whose port is port0.
    ip(fx.ns, "link", "set", "lo", "up")
    ip(fx.ns, "addr", "add", "192.0.2.2/24", "dev", "up0")
    ip(fx.ns, "route", "add", "default", "via", "192.0.2.1", "dev", "up0")
    ip(fx.ns, "link", "add", "br0", "type", "bridge")
    ip(fx.ns, "link", "set", "port0", "master", "br0")
    ip(fx.ns, "link", "set", "br0", "up")
    ip(fx.ns, "-6", "addr", "add", "2001:db8::2/64", "dev", "br0", "nodad")
    ip(fx.ns, "-6", "route", "add", "default", "via", "2001:db8::1", "dev", "br0")

    with caplog.at_level(logging.DEBUG, logger="driver.discovery"):
        devices = fx.discover(exclude=NicExclusions.parse("excl*"))
    assert [d.attributes["ifName"] for d in devices.values()] == ["ok0"]
    for reason in (
        "skip lo: loopback",
        "skip 0000:8c:00.0: bound to no driver",
        "skip 0000:8d:00.0: bound to vfio-pci",
        "skip 0000:8e:00.0 (excl0): excluded by 'excl*'",
        "skip 0000:8f:00.0: carries",
        "skip 0000:8f:00.1: carries",
        "skip 0000:91:00.0: carries",
    ):
        assert reason in caplog.text

    names = {d.attributes["ifName"] for d in fx.discover(skip_default_route=False).values()}
    assert names == {"ok0", "excl0", "up0", "upvf0", "port0"}


def test_rename_keeps_the_device_name(fx: Fixture) -> None:
    veth(fx.ns, "old0", "02:00:00:00:00:01")
    fx.map(nic(1, "old0"))
    assert fx.discover()["pci-0000-8b-00-0"].attributes["ifName"] == "old0"
    ip(fx.ns, "link", "set", "old0", "down")
    ip(fx.ns, "link", "set", "old0", "name", "new0")
    fx.rename("old0", "new0")
    d = fx.discover()["pci-0000-8b-00-0"]
    assert (d.attributes["ifName"], d.attributes["state"]) == ("new0", "down")


def test_allocated_nic_moved_into_a_pod_is_kept(fx: Fixture, pod_netns: str) -> None:
    veth(fx.ns, "rdma0", "02:00:00:00:00:01")
    veth(fx.ns, "rdma1", "02:00:00:00:00:02")
    ip(fx.ns, "addr", "add", "10.30.0.2/24", "dev", "rdma0")
    fx.map(nic(1, "rdma0"), nic(2, "rdma1"))
    disc = fx.discovery()
    before = {d.name: d for d in disc.discover()}
    assert set(before) == {"pci-0000-8b-00-0", "pci-0000-8c-00-0"}

    ip(fx.ns, "link", "set", "rdma0", "netns", pod_netns)
    assert {d.name for d in disc.discover()} == {"pci-0000-8c-00-0"}
    kept = {d.name: d for d in disc.discover(keep={"0000:8b:00.0"})}
    d = kept["pci-0000-8b-00-0"]
    assert d.nic is not None and not d.nic.present and d.nic.ifname == "rdma0"
    assert d.attributes["state"] == ABSENT_STATE
    assert d.attributes["ipv4"] == before["pci-0000-8b-00-0"].attributes["ipv4"]
    assert kept["pci-0000-8c-00-0"].nic.present  # type: ignore[union-attr]

    ip(pod_netns, "link", "set", "rdma0", "netns", fx.ns)
    back = {d.name: d for d in disc.discover(keep={"0000:8b:00.0"})}["pci-0000-8b-00-0"]
    assert back.nic is not None and back.nic.present and back.attributes["state"] != ABSENT_STATE


def test_many_addresses_stay_within_limits(fx: Fixture) -> None:
    veth(fx.ns, "many0", "02:00:00:00:00:01")
    lines = [f"addr add 10.40.{i}.2/24 dev many0" for i in range(40)]
    lines += [f"addr add fd00:{i:x}::2/64 dev many0 nodad" for i in range(40)]
    ip_batch(fx.ns, lines)
    fx.map(nic(1, "many0"))
    for list_form in (True, False):
        d = fx.discover(list_attributes=list_form)["pci-0000-8b-00-0"]
        assert len(d.attributes) + len(d.capacity) <= MAX_ATTRIBUTES_AND_CAPACITIES
        assert sum(len(v) if isinstance(v, tuple) else 1 for v in d.attributes.values()) <= MAX_ATTRIBUTE_VALUES
        assert d.nic is not None and len(d.nic.ipv4) == 40 and len(d.nic.ipv6) == 40


@pytest.fixture
def watcher(netns: str) -> Iterator[tuple[NicWatcher, list[float]]]:
    calls: list[float] = []
    w = NicWatcher(lambda: calls.append(time.monotonic()), netns=netns, resync_period=3600, quiet=0.1)
    w.start()
    yield w, calls
    w.stop()


def test_watcher_calls_back_on_each_kind_of_change(netns: str, watcher) -> None:
    w, calls = watcher
    changes: list[tuple[str, list[str]]] = [
        ("new NIC", ["link", "add", "ev0", "type", "veth", "peer", "name", "ev0p"]),
        ("carrier", ["link", "set", "ev0", "up"]),
        ("address", ["addr", "add", "10.50.0.2/24", "dev", "ev0"]),
        ("rename", ["link", "set", "ev0", "down"]),
        ("rename", ["link", "set", "ev0", "name", "ev1"]),
        ("removed NIC", ["link", "del", "ev1"]),
    ]
    for what, args in changes:
        wait_for(lambda: w.idle, what="watcher idle")
        before = len(calls)
        ip(netns, *args)
        wait_for(lambda b=before: len(calls) > b, what=f"callback after {what}")


def test_watcher_coalesces_a_burst_of_address_changes(netns: str, watcher) -> None:
    w, calls = watcher
    ip(netns, "link", "add", "burst0", "type", "veth", "peer", "name", "burst0p")
    wait_for(lambda: len(calls) >= 1 and w.idle, what="first callback")
    before_calls, before_events = len(calls), w.events
    ip_batch(netns, [f"addr add 10.60.{i // 250}.{i % 250 + 1}/16 dev burst0" for i in range(100)])
    wait_for(lambda: w.events >= before_events + 100 and w.idle and len(calls) > before_calls)
    assert len(calls) - before_calls <= 5


def test_watcher_calls_back_on_default_route_changes_only(netns: str, watcher) -> None:
    """Discovery leaves out the NICs that carry the default route, so a default route of the main
    table coming or going is an event; the routes a CNI adds per pod, and a default route of another
    table, are dropped."""
    w, calls = watcher
    ip(netns, "link", "add", "rt0", "type", "veth", "peer", "name", "rt0p")
    ip(netns, "link", "set", "rt0", "up")  # its peer stays down: no carrier, no address arriving late
    ip(netns, "addr", "add", "192.0.2.2/24", "dev", "rt0")
    ip(netns, "-6", "addr", "add", "2001:db8::2/64", "dev", "rt0", "nodad")
    wait_for(lambda: len(calls) >= 1 and w.idle, what="callback after the link and its addresses")
    calls_before, events_before, ignored_before = len(calls), w.events, w.ignored
    ip(netns, "route", "add", "10.244.1.7/32", "dev", "rt0")
    ip(netns, "-6", "route", "add", "2001:db8:5::7/128", "dev", "rt0")
    ip(netns, "route", "add", "default", "via", "192.0.2.1", "dev", "rt0", "table", "1000")
    ip(netns, "route", "add", "default", "via", "192.0.2.1", "dev", "rt0")  # the one that counts, last
    wait_for(lambda: len(calls) > calls_before and w.idle, what="callback after the default route")
    assert (w.events - events_before, w.ignored - ignored_before) == (4, 3), "each route but the default dropped"
    changes = [
        ("deleted", ["route", "del", "default", "via", "192.0.2.1", "dev", "rt0"]),
        ("IPv6 added", ["-6", "route", "add", "default", "via", "2001:db8::1", "dev", "rt0"]),
        ("IPv6 deleted", ["-6", "route", "del", "default", "via", "2001:db8::1", "dev", "rt0"]),
    ]
    for what, args in changes:
        wait_for(lambda: w.idle, what="watcher idle")
        calls_before, events_before = len(calls), w.events
        ip(netns, *args)
        wait_for(lambda b=calls_before: len(calls) > b, what=f"callback after the default route {what}")
        assert w.events == events_before + 1  # its own message called back, nothing else


def test_watcher_ignores_links_that_can_never_be_nics(fx: Fixture) -> None:
    """Veth churn next to a NIC: no callback, and no per-link table that keeps what left."""
    veth(fx.ns, "r0", "02:00:00:00:00:01", up=False)  # down: no IPv6 link-local address arriving late
    fx.map(nic(1, "r0"))
    calls: list[float] = []
    disc = fx.discovery()
    w = NicWatcher(lambda: calls.append(1), netns=fx.ns, resync_period=3600, quiet=0.05, may_be_nic=disc.may_be_nic)
    w.start()
    try:
        assert [d.name for d in disc.discover()] == ["pci-0000-8b-00-0"]
        lines = [f"link add c{i} type veth peer name c{i}p" for i in range(100)]
        lines += [f"link set c{i} up" for i in range(100)] + [f"link set c{i}p up" for i in range(100)]
        lines += [f"addr add 10.80.{i}.1/24 dev c{i}" for i in range(100)]
        lines += [f"link del c{i}" for i in range(100)]
        ip_batch(fx.ns, lines)
        ip(fx.ns, "addr", "add", "192.0.2.1/24", "dev", "r0")  # the NIC's change, last
        wait_for(lambda: len(calls) >= 1 and w.idle, what="the NIC's change")
        assert len(calls) == 1, "only the NIC's address change calls back"
        assert w.ignored >= 600, w.ignored  # creations, state changes, addresses, deletions
        with netlink.RouteSocket(fx.ns) as rs:
            live = len(rs.links())
        links, names = w.tracked
        assert links <= live and names <= 1, (w.tracked, live)  # nothing kept of what left
        assert w.link_events("c7") == 0
        assert disc.discover()[0].attributes["ipv4"] == "192.0.2.1/24"
    finally:
        w.stop()
