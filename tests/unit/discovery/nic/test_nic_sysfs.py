"""NIC discovery from sysfs alone (the simulated node: no netdev exists, no root needed)."""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import shutil
import socket
import stat
import struct
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from driver.backoff import Backoff
from driver.config import NO_EXCLUSIONS, NicExclusions
from driver.discovery.nic import sysfs as nic_sysfs
from driver.discovery.nic.device import RDMA_NETNS_MODE, device_name
from driver.discovery.nic.discover import ABSENT_STATE, NicDiscovery
from driver.discovery.nic.scan import NicDiscoveryError, NicScanner
from driver.discovery.nic.watcher import NicWatcher
from driver.model import NUMA_NODE, PCI_BUS_ID, PCIE_ROOT, Device, DeviceKind
from driver.node import netlink, rtnl
from driver.resource_api import MAX_ATTRIBUTE_VALUES, MAX_ATTRIBUTES_AND_CAPACITIES
from sim import nics as sim_nics
from sim.fstree import pci_device_dir
from sim.nics import render_netdev, render_nic
from sim.profile import NicSpec, h100_node
from sim.sysfs import render_node


def spec(n: int, **kw) -> NicSpec:
    values = dict(
        pci_address=f"0000:{0x8A + n:02x}:00.0",
        pcie_root="pci0000:80",
        numa_node=1,
        ifname=f"ens{n}np0",
        mac=f"b8:3f:d2:00:01:{n:02x}",
        rdma_device=f"mlx5_{n}",
        uverbs_index=n,
        ipv4=[f"10.{n}.0.2/24"],
        ipv6=[f"fd00:{n}::2/64"],
    )
    values.update(kw)
    return NicSpec(**values)


class Node:
    def __init__(self, root: Path) -> None:
        self.sys = root / "sys"
        self.dev = root / "dev"
        self.sys.mkdir(parents=True)
        self.dev.mkdir()
        (self.sys / "class" / "net").mkdir(parents=True)

    def add(self, *specs: NicSpec) -> None:
        for s in specs:
            render_nic(s, self.sys, self.dev)

    def discovery(self, **kw) -> NicDiscovery:
        return NicDiscovery(self.sys, netlink=False, **kw)

    def by_name(self, **kw) -> dict[str, Device]:
        return {d.name: d for d in self.discovery(**kw).discover()}


@pytest.fixture
def node(tmp_path: Path) -> Node:
    return Node(tmp_path)


def test_device_name_is_a_dns_label_from_the_pci_address() -> None:
    assert device_name("0000:8a:00.0") == "pci-0000-8a-00-0"


def test_simulated_node_nics_are_published_with_their_attributes(tmp_path: Path) -> None:
    profile = h100_node()
    render_node(profile, tmp_path / "sys", tmp_path / "dev")
    devices = NicDiscovery(tmp_path / "sys", netlink=False).discover()

    assert [d.name for d in devices] == sorted(device_name(n.pci_address) for n in profile.nics)
    by_pci = {d.nic.pci_address: d for d in devices if d.nic}
    for n in profile.nics:
        d = by_pci[n.pci_address]
        assert d.kind is DeviceKind.NIC
        a = d.attributes
        assert a["type"] == "nic"
        assert a["ifName"] == n.ifname
        assert a["mac"] == n.mac
        assert a["mtu"] == n.mtu
        assert a["speed"] == n.speed_mbps
        assert a["state"] == "up"
        assert a["linkLayer"] == "Ethernet"
        assert a["portState"] == "ACTIVE"
        assert a["rdmaDevice"] == n.rdma_device
        assert (a["pciVendorID"], a["pciDeviceID"]) == ("15b3", "1021")
        assert (a["sriov"], a["isSriovVf"]) == (False, False)
        assert a["ipv4"] == n.ipv4[0]  # scalar form: the first address
        assert a["ipv6"] == str(ipaddress.ip_interface(n.ipv6[0]))  # canonical form
        assert a[PCI_BUS_ID] == n.pci_address
        assert a[PCIE_ROOT] == n.pcie_root
        assert a[NUMA_NODE] == n.numa_node
        assert d.nic is not None
        assert (d.nic.ifname, d.nic.rdma_device, d.nic.mac) == (n.ifname, n.rdma_device, n.mac)
        assert d.nic.uverbs == f"uverbs{n.uverbs_index}"
        assert (d.nic.umad, d.nic.issm) == (f"umad{n.uverbs_index}", f"issm{n.uverbs_index}")
        assert d.nic.present


def test_list_attributes_publish_address_lists(node: Node) -> None:
    node.add(spec(1, ipv4=["10.0.0.9/24", "10.0.0.2/24"], ipv6=["fd00::2/64"]))
    d = node.by_name(list_attributes=True)["pci-0000-8b-00-0"]
    assert d.attributes["ipv4"] == ("10.0.0.2/24", "10.0.0.9/24")
    assert d.attributes["ipv6"] == ("fd00::2/64",)
    scalar = node.by_name()["pci-0000-8b-00-0"]
    assert scalar.attributes["ipv4"] == "10.0.0.2/24"


def _move_rdma_device_out(node: Node, s: NicSpec) -> None:
    """Move the RDMA device out of the PCI function, as for a device registered elsewhere (rxe):
    only the GID tables then say which netdev it serves."""
    fn = (node.sys / "bus/pci/devices" / s.pci_address).resolve()
    virtual = node.sys / "devices/virtual/infiniband"
    virtual.mkdir(parents=True, exist_ok=True)
    shutil.move(fn / "infiniband" / s.rdma_device, virtual / s.rdma_device)
    (fn / "infiniband").rmdir()
    link = node.sys / "class/infiniband" / s.rdma_device
    link.unlink()
    link.symlink_to(os.path.relpath(virtual / s.rdma_device, link.parent))


def test_gid_table_maps_a_netdev_when_the_function_has_no_infiniband_link(node: Node) -> None:
    s = spec(1)
    node.add(s)
    _move_rdma_device_out(node, s)

    d = node.by_name()["pci-0000-8b-00-0"]
    assert d.attributes["rdmaDevice"] == s.rdma_device
    assert d.attributes["linkLayer"] == "Ethernet"


def test_a_function_without_any_rdma_device_is_skipped(node: Node, caplog) -> None:
    s = spec(1)
    fn = pci_device_dir(node.sys, s.pci_address, s.pcie_root, 0, 0x8086, 0x1592, "ice")
    render_netdev(fn, node.sys, s, s.ifname)
    node.add(spec(2))
    with caplog.at_level(logging.DEBUG, logger="driver.discovery"):
        assert list(node.by_name()) == ["pci-0000-8c-00-0"]
    assert "no RDMA device" in caplog.text


def test_multi_port_function_is_one_device_named_after_its_first_port(node: Node) -> None:
    s = spec(1, ports=2)
    node.add(s)
    fn = (node.sys / "bus/pci/devices" / s.pci_address).resolve()
    render_netdev(fn, node.sys, s, "ens1d1", dev_port=1)
    (fn / "infiniband" / s.rdma_device / "ports/2/gid_attrs/ndevs/0").write_text("ens1d1\n")

    devices = node.by_name()
    assert list(devices) == ["pci-0000-8b-00-0"]
    d = devices["pci-0000-8b-00-0"]
    assert d.attributes["ifName"] == s.ifname
    assert d.nic is not None and d.nic.umad == f"umad{sim_nics.umad_index(s, 1)}"


def test_multi_port_device_reports_the_port_of_the_published_netdev(node: Node) -> None:
    s = spec(1, ports=2)
    node.add(s)
    fn = (node.sys / "bus/pci/devices" / s.pci_address).resolve()
    # Only port 2 carries the netdev (port 1 is unused): its umad and state must be the ones used.
    (fn / "infiniband" / s.rdma_device / "ports/1/gid_attrs/ndevs/0").write_text("other\n")
    (fn / "infiniband" / s.rdma_device / "ports/2/state").write_text("1: DOWN\n")
    d = node.by_name()["pci-0000-8b-00-0"]
    assert d.attributes["portState"] == "DOWN"
    assert d.nic is not None and d.nic.umad == f"umad{sim_nics.umad_index(s, 2)}"


def test_sriov_pf_and_vf(node: Node) -> None:
    pf = spec(1, sriov_totalvfs=8, sriov_numvfs=1)
    vf = spec(2, pci_address="0000:8b:00.2", is_vf=True, physfn=pf.pci_address, device_id=0x101E)
    node.add(pf, vf)
    pf_dir = (node.sys / "bus/pci/devices" / pf.pci_address).resolve()
    assert (pf_dir / "virtfn0").resolve().name == vf.pci_address

    devices = node.by_name()
    p, v = devices["pci-0000-8b-00-0"].attributes, devices["pci-0000-8b-00-2"].attributes
    assert (p["sriov"], p["sriovVfs"], p["isSriovVf"]) == (True, 1, False)
    assert (v["sriov"], v["isSriovVf"], v["pciDeviceID"]) == (False, True, "101e")
    assert "sriovVfs" not in v


def test_skip_rules_with_reasons(node: Node, caplog) -> None:
    good = spec(1)
    unbound = spec(2, driver="")
    vfio = spec(3, driver="vfio-pci")
    by_name = spec(4)
    by_pci = spec(5)
    node.add(good, unbound, vfio, by_name, by_pci)
    # Loopback, even if something maps it to a PCI function, and a virtual link without one.
    lo = node.sys / "devices/virtual/net/lo"
    lo.mkdir(parents=True)
    for f, v in (("address", "00:00:00:00:00:00"), ("mtu", "65536"), ("operstate", "unknown"), ("type", "772")):
        (lo / f).write_text(v + "\n")
    (lo / "device").symlink_to(os.path.relpath(node.sys / "bus/pci/devices" / good.pci_address, lo))
    (node.sys / "class/net/lo").symlink_to("../../devices/virtual/net/lo")
    veth = node.sys / "devices/virtual/net/veth0"
    veth.mkdir(parents=True)
    for f, v in (("address", "02:00:00:00:00:01"), ("mtu", "1500"), ("operstate", "up"), ("type", "1")):
        (veth / f).write_text(v + "\n")
    (node.sys / "class/net/veth0").symlink_to("../../devices/virtual/net/veth0")

    with caplog.at_level(logging.DEBUG, logger="driver.discovery"):
        devices = node.by_name(exclude=NicExclusions.parse(f"{by_name.ifname},{by_pci.pci_address.upper()}"))
    assert list(devices) == [device_name(good.pci_address)]
    assert devices[device_name(good.pci_address)].attributes["ifName"] == good.ifname
    text = caplog.text
    assert "skip lo: loopback" in text
    assert "skip veth0: no PCI device" in text
    assert f"skip {unbound.pci_address}: bound to no driver" in text
    assert f"skip {vfio.pci_address}: bound to vfio-pci" in text
    assert f"skip {by_name.pci_address} ({by_name.ifname}): excluded by {by_name.ifname!r}" in text
    assert f"skip {by_pci.pci_address} ({by_pci.ifname}): excluded by {by_pci.pci_address!r}" in text


def test_exclusions_take_globs_and_keep_the_whole_function_out(node: Node) -> None:
    storage = spec(1, ifname="stor0np0")
    ib = spec(2, ifname="ib0", link_layer="InfiniBand")
    vfs = [spec(3, pci_address="0000:3b:00.2"), spec(4, pci_address="0000:3b:00.3")]
    kept = spec(5)
    node.add(storage, ib, *vfs, kept)
    devices = node.by_name(exclude=NicExclusions.parse("stor*,ib0,0000:3b:00.*"))
    # An excluded IPoIB netdev does not turn its function into an "InfiniBand function without a
    # netdev": the function is out, whatever of it is visible.
    assert list(devices) == [device_name(kept.pci_address)]


def test_an_allocated_nic_that_is_excluded_is_not_kept(node: Node) -> None:
    by_name, by_pci = spec(1), spec(2)
    node.add(by_name, by_pci)
    keep = {by_name.pci_address, by_pci.pci_address}
    assert len(node.discovery().discover(keep)) == 2
    # A restart with a new list: a fresh discovery that never saw the NICs published.
    exclusions = NicExclusions.parse(f"{by_name.ifname},{by_pci.pci_address}")
    assert node.discovery(exclude=exclusions).discover(keep) == []
    # Its netdev gone (moved into a pod in exclusive mode) at the restart: the PCI address still
    # names it (a netdev name cannot: no netdev of that name is left to see).
    shutil.rmtree((node.sys / "class/net" / by_pci.ifname).resolve())
    (node.sys / "class/net" / by_pci.ifname).unlink()
    assert [d.name for d in node.discovery().discover(keep)] == [device_name(x.pci_address) for x in (by_name, by_pci)]
    assert [d.name for d in node.discovery(exclude=exclusions).discover(keep)] == []


def test_infiniband_function_without_netdev_is_published_roce_is_not(node: Node) -> None:
    ib = spec(1, ifname="", link_layer="InfiniBand", mac="")
    roce = spec(2, ifname="")
    node.add(ib, roce)
    devices = node.by_name()
    assert list(devices) == [device_name(ib.pci_address)]
    a = devices[device_name(ib.pci_address)].attributes
    assert a["linkLayer"] == "InfiniBand"
    assert a["rdmaDevice"] == ib.rdma_device
    assert "ifName" not in a and "state" not in a


def _remove_netdev(node: Node, s: NicSpec) -> None:
    """What the host sees when the netdev moves into a pod: its sysfs entries go away."""
    fn = (node.sys / "bus/pci/devices" / s.pci_address).resolve()
    (node.sys / "class/net" / s.ifname).unlink()
    shutil.rmtree(fn / "net" / s.ifname)


def test_allocated_nic_whose_netdev_vanished_is_kept_absent(node: Node) -> None:
    s = spec(1)
    node.add(s, spec(2))
    disc = node.discovery()
    before = {d.name: d for d in disc.discover()}["pci-0000-8b-00-0"]
    _remove_netdev(node, s)

    assert "pci-0000-8b-00-0" not in {d.name for d in disc.discover()}
    kept = {d.name: d for d in disc.discover(keep={s.pci_address.upper()})}
    d = kept["pci-0000-8b-00-0"]
    assert d.nic is not None and not d.nic.present
    assert d.attributes["state"] == ABSENT_STATE
    assert {k: v for k, v in d.attributes.items() if k != "state"} == {
        k: v for k, v in before.attributes.items() if k != "state"
    }
    assert d.nic.ifname == s.ifname  # the last known identity
    callable_keep = {d.name for d in disc.discover(keep=lambda: [s.pci_address])}
    assert callable_keep == {"pci-0000-8b-00-0", "pci-0000-8c-00-0"}

    # Netdev back: present again.
    node.add(s)
    back = {d.name: d for d in disc.discover(keep={s.pci_address})}["pci-0000-8b-00-0"]
    assert back.nic is not None and back.nic.present and back.attributes["state"] == "up"


def test_kept_nic_never_seen_is_rebuilt_from_sysfs(node: Node) -> None:
    s = spec(1)
    node.add(s)
    _remove_netdev(node, s)
    d = {d.name: d for d in node.discovery().discover(keep={s.pci_address})}["pci-0000-8b-00-0"]
    assert d.nic is not None and not d.nic.present
    assert d.attributes["rdmaDevice"] == s.rdma_device
    assert d.attributes["state"] == ABSENT_STATE
    assert d.attributes[PCI_BUS_ID] == s.pci_address
    assert node.discovery().discover(keep={"0000:ff:00.0"}) == []  # nothing known: not invented


def test_malformed_sysfs_skips_that_nic_only(node: Node, caplog) -> None:
    bad_mtu, bad_vendor, good = spec(1), spec(2), spec(3)
    node.add(bad_mtu, bad_vendor, good)
    (node.sys / "class/net" / bad_mtu.ifname / "mtu").write_text("lots\n")
    (node.sys / "bus/pci/devices" / bad_vendor.pci_address / "vendor").write_text("0xnvidia\n")
    with caplog.at_level(logging.WARNING):
        devices = node.by_name()
    assert list(devices) == [device_name(good.pci_address)]
    assert "not a number" in caplog.text and "not a PCI ID" in caplog.text


def _port_file(node: Node, s: NicSpec, name: str) -> Path:
    return node.sys / "class/infiniband" / s.rdma_device / "ports/1" / name


def test_a_file_that_is_not_utf8_reads_as_unreadable_and_costs_no_nic(node: Node, caplog) -> None:
    """Any file can be garbled, and a netdev name may be any bytes: the tenant of an exclusive NIC
    can rename its netdev, and the RDMA side shows that name in `gid_attrs/ndevs/*`. Such a file
    reads as an absent one, with a warning naming it, wherever a pass reads it: in the RDMA
    namespace mode (read once per pass), the InfiniBand-only check and the GID tables (read for
    every RDMA device), and a kept NIC's own files."""
    moved, gid_mapped, good = spec(1), spec(2), spec(3)
    node.add(moved, gid_mapped, good)
    _remove_netdev(node, moved)  # in its pod, allocated
    _move_rdma_device_out(node, gid_mapped)
    garbled = [
        _port_file(node, moved, "gid_attrs/ndevs/0"),
        _port_file(node, moved, "link_layer"),
        node.sys / "module/ib_core/parameters/netns_mode",
    ]
    for path in garbled:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"net\xff1\n")
    with caplog.at_level(logging.WARNING, logger="driver.discovery"):
        devices = {d.name: d for d in node.discovery().discover(keep={moved.pci_address})}
    assert list(devices) == [device_name(s.pci_address) for s in (moved, gid_mapped, good)]
    kept = devices[device_name(moved.pci_address)]
    assert kept.nic is not None and not kept.nic.present and "linkLayer" not in kept.attributes
    assert devices[device_name(gid_mapped.pci_address)].attributes["rdmaDevice"] == gid_mapped.rdma_device
    assert all(RDMA_NETNS_MODE not in d.attributes for d in devices.values())
    for path in garbled:
        assert f"{path}: not UTF-8" in caplog.text


def test_the_watchers_filter_reads_a_file_that_is_not_utf8_as_unreadable(node: Node) -> None:
    """`may_be_nic` reads `dev_port` (own namespace) and the GID tables (named namespace) outside
    any NIC's pass: a garbled file there answers as an absent one, for the NIC watcher."""
    s, renamed = spec(1), spec(2)
    node.add(s, renamed)
    (node.sys / "class/net" / s.ifname / "dev_port").write_bytes(b"\xff\n")
    _port_file(node, renamed, "gid_attrs/ndevs/0").write_bytes(b"net\xff1\n")
    link = rtnl.Link(7, s.ifname, s.mac, 1500, "up", "", 0, 0, loopback=False)
    for netns in (None, "tenant"):
        scanner = NicScanner(node.sys, netlink=True, netns=netns, skip_default_route=False, exclude=NO_EXCLUSIONS)
        assert scanner.may_be_nic(link), netns


def test_read_takes_a_whole_file_and_fails_as_read_text_does(tmp_path: Path) -> None:
    """Discovery and NIC health read every sysfs file through `read`: to the end (a file of a
    test tree may be longer than an attribute's page), stripped, and failing as `Path.read_text`
    fails, naming the file, so every caller's handling of a broken entry still holds."""
    long = tmp_path / "long"
    long.write_text(" " + "x" * 10_000 + "\n")
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    garbled = tmp_path / "garbled"
    garbled.write_bytes(b"\xff\xfe4: ACTIVE\n")
    assert nic_sysfs.read(long) == "x" * 10_000 and nic_sysfs.read(str(long)) == "x" * 10_000
    assert nic_sysfs.read(empty) == ""
    for broken in (tmp_path / "absent", tmp_path, garbled):
        with pytest.raises(Exception) as ours:
            nic_sysfs.read(broken)
        with pytest.raises(Exception) as theirs:
            broken.read_text()
        assert type(ours.value) is type(theirs.value) and str(ours.value) == str(theirs.value)
    assert isinstance(ours.value, nic_sysfs.BROKEN)


SIM_ADDRESSES = sim_nics.SIM_ADDRESSES_FILE


def test_bad_sim_address_file_is_a_clear_error(node: Node, caplog) -> None:
    s = spec(1)
    node.add(s)
    (node.sys / "class/net" / s.ifname / SIM_ADDRESSES).write_text("10.0.0.300/24\n")
    with caplog.at_level(logging.WARNING):
        assert node.by_name() == {}
    assert SIM_ADDRESSES in caplog.text


def test_many_addresses_stay_within_attribute_limits(node: Node) -> None:
    s = spec(1, ipv4=[f"10.1.{i}.2/24" for i in range(40)], ipv6=[f"fd00:{i:x}::2/64" for i in range(40)])
    node.add(s)
    for list_form in (True, False):
        d = node.by_name(list_attributes=list_form)["pci-0000-8b-00-0"]
        values = sum(len(v) if isinstance(v, tuple) else 1 for v in d.attributes.values())
        assert len(d.attributes) + len(d.capacity) <= MAX_ATTRIBUTES_AND_CAPACITIES
        assert values <= MAX_ATTRIBUTE_VALUES
        for v in d.attributes.values():
            for item in v if isinstance(v, tuple) else (v,):
                assert not isinstance(item, str) or len(item) <= 64
        assert d.nic is not None and len(d.nic.ipv4) == 40  # NicInfo keeps them all
    listed = node.by_name(list_attributes=True)["pci-0000-8b-00-0"].attributes["ipv4"]
    assert isinstance(listed, tuple) and listed[0] == "10.1.0.2/24"


def test_char_devices_are_named_from_sysfs_whether_or_not_their_node_exists(node: Node) -> None:
    """A missing node is prepare's to report (the claim fails naming it: test_cdi_spec), not
    discovery's to hide."""
    s = spec(1)
    node.add(s)
    (node.dev / "infiniband" / f"uverbs{s.uverbs_index}").unlink()
    d = node.by_name()["pci-0000-8b-00-0"]
    assert d.nic is not None and d.nic.uverbs == f"uverbs{s.uverbs_index}" and d.nic.umad == f"umad{s.uverbs_index}"


def test_dev_nodes_are_char_devices_as_root_and_files_otherwise(node: Node, monkeypatch) -> None:
    s = spec(1, ports=2)
    node.add(s)
    ib = node.dev / "infiniband"
    if os.geteuid() == 0 and stat.S_ISCHR((ib / "rdma_cm").stat().st_mode):
        expected = {"uverbs1": (231, 193), "umad1": (231, 1), "issm1": (231, 65), "umad33": (231, 33)}
        expected["rdma_cm"] = (sim_nics.MISC_MAJOR, sim_nics.RDMA_CM_MINOR)
        for name, (major, minor) in expected.items():
            st = (ib / name).stat()
            assert stat.S_ISCHR(st.st_mode), name
            assert (os.major(st.st_rdev), os.minor(st.st_rdev)) == (major, minor), name
    monkeypatch.setattr(sim_nics.os, "geteuid", lambda: 1000)
    other = Node(node.sys.parent / "unprivileged")
    other.add(s)
    assert (other.dev / "infiniband/uverbs1").is_file()


def test_messages_reads_netlink_headers() -> None:
    one = (20).to_bytes(4, "little") + bytes(16)
    assert len(list(rtnl.messages(one + one + b"\x00" * 3))) == 2
    assert list(rtnl.messages(b"")) == []
    assert list(rtnl.messages((0).to_bytes(4, "little") + bytes(16))) == []


def wait_for(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met before the deadline")
        time.sleep(0.01)


def test_watcher_coalesces_triggers_and_resyncs() -> None:
    calls: list[float] = []
    w = NicWatcher(lambda: calls.append(time.monotonic()), netlink=False, resync_period=3600, quiet=0.1)
    w.start()
    try:
        for _ in range(100):
            w.trigger()
        wait_for(lambda: len(calls) >= 1 and w.idle)
        assert len(calls) <= 3
    finally:
        w.stop()

    resyncing = NicWatcher(lambda: calls.append(time.monotonic()), netlink=False, resync_period=0.05)
    before = len(calls)
    resyncing.start()
    try:
        wait_for(lambda: len(calls) >= before + 3)  # no event at all: the resync alone calls back
    finally:
        resyncing.stop()


def test_watcher_without_a_resync_calls_back_on_triggers_only() -> None:
    """The daemon's NIC refresh loop rescans periodically itself; its watcher adds no timer."""
    quiet_calls: list[float] = []
    clock_calls: list[float] = []
    quiet = NicWatcher(lambda: quiet_calls.append(time.monotonic()), netlink=False, resync_period=None, quiet=0.01)
    clock = NicWatcher(lambda: clock_calls.append(time.monotonic()), netlink=False, resync_period=0.05)
    quiet.start()
    clock.start()
    try:
        wait_for(lambda: len(clock_calls) >= 3)  # three resync periods went by
        assert quiet_calls == []
        quiet.trigger()
        wait_for(lambda: len(quiet_calls) == 1 and quiet.idle)
    finally:
        quiet.stop()
        clock.stop()


def test_watcher_survives_a_failing_callback() -> None:
    calls = []

    def callback() -> None:
        calls.append(1)
        raise RuntimeError("consumer broke")

    w = NicWatcher(callback, netlink=False, resync_period=3600, quiet=0.01)
    w.start()
    try:
        w.trigger()
        wait_for(lambda: len(calls) == 1)
        w.trigger()
        wait_for(lambda: len(calls) == 2)
    finally:
        w.stop()


def _newlink(index: int, name: str) -> bytes:
    """An RTM_NEWLINK datagram as the kernel sends it: the link's index and name."""
    value = name.encode() + b"\0"
    attr = struct.pack("=HH", 4 + len(value), rtnl.IFLA_IFNAME) + value + bytes(-len(value) % 4)
    body = rtnl.IFINFO.pack(0, 1, index, 1, 0) + attr
    return rtnl.HEADER.pack(rtnl.HEADER.size + len(body), rtnl.RTM_NEWLINK, 0, 0, 0) + body


@pytest.fixture
def events(monkeypatch) -> Iterator[socket.socket]:
    """The watcher's netlink: its event socket is one end of a socket pair (the test sends link
    messages into the other end), its link dump at start a namespace holding only `lo`."""
    theirs, ours = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    theirs.setblocking(False)
    lo = rtnl.Link(1, "lo", "00:00:00:00:00:00", 65536, "unknown", "", 0, 0, loopback=True)
    monkeypatch.setattr(netlink, "open_event_socket", lambda netns=None: theirs)
    monkeypatch.setattr(netlink, "RouteSocket", lambda netns=None: contextlib.nullcontext(_OneLink(lo)))
    yield ours
    ours.close()


class _OneLink:
    def __init__(self, link: rtnl.Link) -> None:
        self._link = link

    def links(self) -> list[rtnl.Link]:
        return [self._link]


def test_a_link_the_watcher_cannot_judge_counts(events: socket.socket) -> None:
    """`may_be_nic` failing (a sysfs entry of the link that cannot be read) neither fails the
    watcher's start, which judges the links there are, nor stops its thread: the link's messages
    count, so NIC discovery reads it afresh."""

    def may_be_nic(link: rtnl.Link) -> bool:
        raise RuntimeError(f"sysfs entry of {link.name} broken")

    calls: list[float] = []
    w = NicWatcher(lambda: calls.append(time.monotonic()), may_be_nic=may_be_nic, resync_period=None, quiet=0.01)
    w.start()
    try:
        assert w.tracked == (1, 1)  # lo, judged "may be a NIC" for want of a verdict
        events.send(_newlink(9, "ens9np0"))
        wait_for(lambda: len(calls) == 1)
        assert w.link_events("ens9np0") == 1 and w.ignored == 0
        w.trigger()  # and the thread goes on
        wait_for(lambda: len(calls) == 2)
    finally:
        w.stop()


def test_the_watcher_outlives_a_failing_step(events: socket.socket, caplog) -> None:
    """Any failure of the thread is logged and answered with a rescan; the thread goes on."""
    failures = [RuntimeError("is_nic broke")]

    def is_nic(index: int) -> bool:
        if failures:
            raise failures.pop()
        return False

    calls: list[float] = []
    w = NicWatcher(
        lambda: calls.append(time.monotonic()),
        may_be_nic=lambda link: False,
        is_nic=is_nic,
        resync_period=None,
        quiet=0.01,
        backoff=Backoff(initial=0.01, maximum=0.01),
    )
    with caplog.at_level(logging.ERROR, logger="driver.discovery.nic.watcher"):
        w.start()
        try:
            events.send(_newlink(9, "veth9"))  # no NIC: `is_nic` has the last word, and fails
            wait_for(lambda: len(calls) == 1)  # the rescan that covers what the failure lost
            events.send(_newlink(10, "veth10"))
            w.trigger()
            wait_for(lambda: len(calls) == 2 and w.idle)
            assert w.ignored == 1  # veth10, judged as before
        finally:
            w.stop()
    assert "NIC watcher failed; rescanning" in caplog.text


class _FakeRouteSocket(netlink.RouteSocket):
    """A RouteSocket whose dumps answer with the messages given: every link's addresses whatever the
    ifindex asked for, like a kernel that ignores the dump filter, and every family's routes."""

    def __init__(self, addrs: list[rtnl.Address], routes: list[rtnl.Route]) -> None:
        self.sock = SimpleNamespace(close=lambda: None)
        self.answers = {rtnl.RTM_GETADDR: addrs, rtnl.RTM_GETROUTE: routes}

    def _dump(self, request_type, request, answer, decode):
        return list(self.answers[request_type])


def _l(index: int, name: str, kind: str = "", master: int = 0, lower: int = 0) -> rtnl.Link:
    return rtnl.Link(index, name, "aa:00:00:00:00:01", 1500, "up", kind, master, lower, loopback=False)


def _default(family: int, metric: int, oif: int = 0, multipath: tuple[int, ...] = ()) -> rtnl.Route:
    return rtnl.Route(family, dst_len=0, table=254, type=1, priority=metric, oif=oif, nexthops=multipath)


def test_netlink_uplinks_follow_routes_stacked_links_and_masters(monkeypatch) -> None:
    v4, v6 = socket.AF_INET, socket.AF_INET6
    links = [
        _l(2, "eth0"),
        _l(3, "eth0.100", kind="vlan", lower=2),
        _l(4, "bond0", kind="bond"),
        _l(5, "eth5"),
        _l(6, "eth6", master=4),
        _l(9, "eth9"),
        _l(10, "veth0", kind="veth", lower=11),
        _l(11, "veth0p", kind="veth", lower=10),
    ]
    fake = _FakeRouteSocket(
        addrs=[
            rtnl.Address(2, v4, prefixlen=24, scope=0, address="10.0.0.2"),
            rtnl.Address(2, v6, prefixlen=64, scope=253, address="fe80::1"),
            rtnl.Address(5, v4, prefixlen=24, scope=0, address="10.5.0.2"),
        ],
        routes=[
            _default(v4, 100, oif=3),  # over a VLAN: eth0 below it carries it
            _default(v4, 100, oif=10),  # an equal-metric tie
            _default(v4, 200, oif=9),  # a backup route: not the uplink
            _default(v6, 0, multipath=(4, 5)),  # through a bond and eth5
            rtnl.Route(v4, dst_len=24, table=254, type=1, priority=0, oif=11),  # not a default route
        ],
    )
    monkeypatch.setattr(netlink, "RouteSocket", lambda netns=None: fake)
    chosen = [x for x in links if x.name in ("eth0", "eth5", "eth6", "eth9", "veth0p")]
    snap = netlink.read_links(chosen, {x.index: x for x in links})
    assert set(snap.links) == {"eth0", "eth5", "eth6", "eth9", "veth0p"}
    assert snap.uplinks == {"eth0", "eth5", "eth6"}
    eth0 = snap.links["eth0"]
    assert (eth0.ipv4, eth0.ipv6, eth0.mac, eth0.operstate) == (("10.0.0.2/24",), (), "aa:00:00:00:00:01", "up")


def test_unreadable_netlink_is_a_clear_error(node: Node) -> None:
    node.add(spec(1))
    disc = NicDiscovery(node.sys, netns=f"tandem-no-such-ns-{os.getpid()}")
    with pytest.raises(NicDiscoveryError, match="tandem-no-such-ns"):
        disc.discover()
    assert not Path(f"/var/run/netns/tandem-no-such-ns-{os.getpid()}").exists()  # never created


def test_watcher_on_a_missing_namespace_fails_at_start() -> None:
    w = NicWatcher(lambda: None, netns=f"tandem-no-such-ns-{os.getpid()}")
    with pytest.raises(NicDiscoveryError, match="cannot subscribe"):
        w.start()


def test_link_facts_are_published_only_once_they_hold(tmp_path: Path) -> None:
    """A flapping link must not rewrite the slice on every flap; a lasting change gets through."""
    nic = h100_node(gpus=0, nics=1).nics[0]
    sysfs, dev = tmp_path / "sys", tmp_path / "dev"
    render_nic(nic, sysfs, dev)
    now = [0.0]
    disc = NicDiscovery(sysfs, netlink=False, link_hold=2.0, clock=lambda: now[0])
    operstate = sysfs / "class/net" / nic.ifname / "operstate"

    def state() -> object:
        return disc.discover()[0].attributes.get("state")

    assert state() == "up"
    for t in range(10):  # flaps faster than the hold: the published state never moves
        now[0] = t * 0.3
        operstate.write_text("down\n" if t % 2 == 0 else "up\n")
        assert state() == "up"
    operstate.write_text("down\n")
    now[0] = 10.0
    assert state() == "up" and disc.pending_until == 12.0
    now[0] = 12.0
    assert state() == "down" and disc.pending_until is None


def test_flaps_between_two_looks_restart_the_hold(tmp_path: Path) -> None:
    """Discovery samples; netlink's per-link message count tells it the link moved in between."""
    nic = h100_node(gpus=0, nics=1).nics[0]
    sysfs, dev = tmp_path / "sys", tmp_path / "dev"
    render_nic(nic, sysfs, dev)
    now, events = [0.0], [0]
    disc = NicDiscovery(sysfs, netlink=False, link_hold=2.0, clock=lambda: now[0], link_events=lambda _name: events[0])
    assert disc.discover()[0].attributes["state"] == "up"
    (sysfs / "class/net" / nic.ifname / "operstate").write_text("down\n")
    disc.discover()  # candidate "down" from t=0
    now[0], events[0] = 3.0, 4  # up-down-up-down happened unseen: not stable for 2 s after all
    assert disc.discover()[0].attributes["state"] == "up"
    now[0] = 5.0  # quiet since t=3
    assert disc.discover()[0].attributes["state"] == "down"
