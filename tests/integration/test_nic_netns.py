"""NIC discovery and its watcher against real netlink, in a throwaway network namespace.

Netlink is authoritative for the veths (names, MAC, MTU, state, addresses, default route); a sysfs
fixture tree maps chosen veths to fake RDMA PCI functions, the way a ConnectX's netdev maps to
its function on real hardware. Needs root (`ip netns add`); skipped otherwise.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from nic_fixtures import SysfsFixture, ip, ip_batch, make_netns, nic_spec, veth, wait_for

from driver.discovery.nic import ABSENT_STATE, NicDiscovery
from driver.discovery.nic_watcher import NicWatcher
from driver.model import Device
from driver.resource_api import MAX_ATTRIBUTE_VALUES, MAX_ATTRIBUTES_AND_CAPACITIES
from sim.nics import render_netdev
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
        return NicDiscovery(self.sys, self.dev, netns=self.ns, **kw)

    def discover(self, keep=(), **kw) -> dict[str, Device]:
        return {d.name: d for d in self.discovery(**kw).discover(keep)}

    def rename(self, old: str, new: str) -> None:
        """What the kernel does to sysfs on a rename (netlink side is done by `ip`)."""
        net = (self.sys / "class/net" / old).resolve()
        net.rename(net.parent / new)
        (self.sys / "class/net" / old).unlink()
        (self.sys / "class/net" / new).symlink_to(os.path.relpath(net.parent / new, self.sys / "class/net"))
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

    devices = fx.discover(list_attributes=True)
    assert list(devices) == ["pci-0000-8b-00-0"]
    d = devices["pci-0000-8b-00-0"]
    a = d.attributes
    assert (a["ifName"], a["mac"], a["mtu"], a["state"]) == ("r0", "02:00:00:00:00:01", 4200, "up")
    assert a["speed"] == 200000  # sysfs
    assert a["rdmaDevice"] == "mlx5_1"
    assert a["ipv4"] == ("10.20.0.1/24", "10.20.0.2/24")
    assert a["ipv6"] == ("fd00:20::2/64",)  # the link-local fe80:: address is not global
    assert d.nic is not None and d.nic.ipv6 == ("fd00:20::2/64",) and d.nic.present
    assert fx.discover()["pci-0000-8b-00-0"].attributes["ipv4"] == "10.20.0.1/24"


def test_both_rdma_mappings_multi_port_and_vfs(fx: Fixture) -> None:
    for i, name in enumerate(["pf0", "gid0", "mp0", "mp1", "vf0"]):
        veth(fx.ns, name, f"02:00:00:00:01:{i:02x}")
    pf = nic(1, "pf0", sriov_totalvfs=4, sriov_numvfs=1)
    vf = nic(2, "vf0", pci_address="0000:8b:00.1", is_vf=True, physfn=pf.pci_address)
    gid = nic(3, "gid0")
    multi = nic(4, "mp0", ports=2)
    fx.map(pf, vf, gid, multi)
    # gid0's function loses its infiniband/ link: only the GID table names the netdev.
    fn = (fx.sys / "bus/pci/devices" / gid.pci_address).resolve()
    moved = fx.sys / "devices/virtual/infiniband/mlx5_3"
    moved.parent.mkdir(parents=True)
    shutil.move(fn / "infiniband/mlx5_3", moved)
    (fn / "infiniband").rmdir()
    (fx.sys / "class/infiniband/mlx5_3").unlink()
    (fx.sys / "class/infiniband/mlx5_3").symlink_to("../../devices/virtual/infiniband/mlx5_3")
    # mp1 is the second port of mp0's function.
    mfn = (fx.sys / "bus/pci/devices" / multi.pci_address).resolve()
    render_netdev(mfn, fx.sys, multi, "mp1", dev_port=1)
    (mfn / "infiniband/mlx5_4/ports/2/gid_attrs/ndevs/0").write_text("mp1\n")

    devices = fx.discover()
    assert set(devices) == {"pci-0000-8b-00-0", "pci-0000-8b-00-1", "pci-0000-8d-00-0", "pci-0000-8e-00-0"}
    p, v = devices["pci-0000-8b-00-0"].attributes, devices["pci-0000-8b-00-1"].attributes
    assert (p["ifName"], p["sriov"], p["sriovVfs"], p["isSriovVf"]) == ("pf0", True, 1, False)
    assert (v["ifName"], v["sriov"], v["isSriovVf"]) == ("vf0", False, True)
    assert devices["pci-0000-8d-00-0"].attributes["rdmaDevice"] == "mlx5_3"
    m = devices["pci-0000-8e-00-0"]
    assert m.attributes["ifName"] == "mp0" and m.attributes["rdmaDevice"] == "mlx5_4"


def test_skip_rules(fx: Fixture, caplog) -> None:
    for i, name in enumerate(["ok0", "nodrv0", "vfio0", "excl0", "up0", "upvf0", "port0"]):
        veth(fx.ns, name, f"02:00:00:00:02:{i:02x}")
    up_pf = nic(5, "up0", sriov_totalvfs=2, sriov_numvfs=1)
    fx.map(
        nic(1, "ok0"),
        nic(2, "nodrv0", driver=""),
        nic(3, "vfio0", driver="vfio-pci"),
        nic(4, "excl0"),
        up_pf,
        nic(6, "upvf0", pci_address="0000:8f:00.1", is_vf=True, physfn=up_pf.pci_address),
        nic(7, "port0"),
    )
    # The loopback, even when sysfs (wrongly) maps it to a function, is never a candidate.
    lo = fx.sys / "devices/virtual/net/lo"
    lo.mkdir(parents=True)
    (lo / "device").symlink_to(os.path.relpath(fx.sys / "bus/pci/devices/0000:8b:00.0", lo))
    (fx.sys / "class/net/lo").symlink_to("../../devices/virtual/net/lo")
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
        devices = fx.discover(exclude_interfaces=["excl0"])
    assert [d.attributes["ifName"] for d in devices.values()] == ["ok0"]
    for reason in (
        "skip lo: loopback",
        "skip 0000:8c:00.0: bound to no driver",
        "skip 0000:8d:00.0: bound to vfio-pci",
        "skip excl0: excluded",
        "skip 0000:8f:00.0: carries",
        "skip 0000:8f:00.1: carries",
        "skip 0000:91:00.0: carries",
    ):
        assert reason in caplog.text

    names = {d.attributes["ifName"] for d in fx.discover(skip_default_route=False).values()}
    assert names == {"ok0", "excl0", "up0", "upvf0", "port0"}


def test_rename_keeps_the_device_name(fx: Fixture) -> None:
    veth(fx.ns, "old0", "02:00:00:00:03:01")
    fx.map(nic(1, "old0"))
    assert fx.discover()["pci-0000-8b-00-0"].attributes["ifName"] == "old0"
    ip(fx.ns, "link", "set", "old0", "down")
    ip(fx.ns, "link", "set", "old0", "name", "new0")
    fx.rename("old0", "new0")
    d = fx.discover()["pci-0000-8b-00-0"]
    assert (d.attributes["ifName"], d.attributes["state"]) == ("new0", "down")


def test_allocated_nic_moved_into_a_pod_is_kept(fx: Fixture, pod_netns: str) -> None:
    veth(fx.ns, "rdma0", "02:00:00:00:04:01")
    veth(fx.ns, "rdma1", "02:00:00:00:04:02")
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
    veth(fx.ns, "many0", "02:00:00:00:05:01")
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
