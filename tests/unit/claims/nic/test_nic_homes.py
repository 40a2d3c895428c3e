"""Exclusive NICs back from their pods, against hostile tenants: the NIC's PCI address decides what
comes home and how `--exclude-nics` sees it, never a name the pod chose; the return makes the host
identity exactly the remembered one; one NIC that cannot come home holds up no other; and
nic-homes.json is versioned (driver/claims/nic/homes.py). Netlink is a fake kernel here whose
rename and address rules are the real one's (tests/integration/test_nic_return.py runs them)."""

from __future__ import annotations

import dataclasses
import errno
import json
from pathlib import Path

import pytest

from driver.claims.nic import homes as homes_module
from driver.claims.nic.homes import FILE, NicHomes, parked_name
from driver.config import NicExclusions
from driver.discovery.nic.device import device_name
from driver.discovery.nic.discover import NicDiscovery
from driver.discovery.nic.scan import NicScanner
from driver.model import Device, DeviceKind, NicInfo
from driver.node.netlink import LinkHome, NetlinkFailure
from driver.node.rtnl import Link
from sim.nics import render_nic
from sim.profile import NicSpec

A, B = "0000:8a:00.0", "0000:8b:00.0"


class FakeKernel:
    """The host's netdevs by name, changed as `netlink.restore_link` and `rename_link` change them."""

    def __init__(self, **links: LinkHome) -> None:
        self.links = dict(links)
        self.refusing: set[str] = set()  # names whose every change the kernel refuses (EPERM)

    def restore_link(self, name: str, home: LinkHome, netns: str | None = None) -> None:
        if name in self.refusing:
            raise NetlinkFailure(errno.EPERM, "netlink: Operation not permitted")
        if name not in self.links:
            raise OSError(errno.ENODEV, f"no netdev {name!r}")
        if home.name != name and home.name in self.links:
            raise NetlinkFailure(errno.EEXIST, f"the name {home.name!r} is taken by another netdev")
        del self.links[name]
        self.links[home.name] = home

    def rename_link(self, name: str, new: str, netns: str | None = None) -> None:
        if new in self.links:
            raise NetlinkFailure(errno.EEXIST, "netlink: File exists")
        self.links[new] = dataclasses.replace(self.links.pop(name), name=new)


@pytest.fixture
def kernel(monkeypatch: pytest.MonkeyPatch) -> FakeKernel:
    k = FakeKernel()
    monkeypatch.setattr(homes_module.netlink, "restore_link", k.restore_link)
    monkeypatch.setattr(homes_module.netlink, "rename_link", k.rename_link)
    return k


def nic(pci: str, ifname: str, *addresses: str, mtu: int = 9000, mac: str = "02:00:00:00:00:0a") -> Device:
    info = NicInfo(pci_address=pci, ifname=ifname, rdma_device="mlx5_0", mac=mac, ipv4=tuple(addresses))
    return Device(name=device_name(pci), kind=DeviceKind.NIC, attributes={"mtu": mtu}, nic=info)


def test_a_remembered_nic_is_written_as_version_1_and_read_back(tmp_path: Path) -> None:
    homes = NicHomes(tmp_path, boot="boot-1")
    homes.remember([nic(A, "ens1np0", "10.0.0.1/24", mac="02:00:00:00:00:aa")])
    record = {
        "ifname": "ens1np0",
        "mtu": 9000,
        "mac": "02:00:00:00:00:aa",
        "addresses": ["10.0.0.1/24"],
        "boot": "boot-1",
    }
    assert json.loads((tmp_path / FILE).read_text()) == {"version": 1, "nics": {A: record}}
    assert NicHomes(tmp_path, boot="boot-1").home_names() == {A: "ens1np0"}
    # A retried prepare, its netdev already in the pod under the pod's name: the home stays.
    homes.remember([nic(A, "net1", "10.9.9.9/24")])
    assert NicHomes(tmp_path, boot="boot-1").home_names() == {A: "ens1np0"}


def test_a_record_of_an_earlier_boot_is_dropped_and_never_forced_on_the_nic(tmp_path: Path, kernel: FakeKernel) -> None:
    """After a reboot the kernel brought the NIC up under its own name and the host configured it:
    the record of the boot before must not take away the addresses the host gave it."""
    NicHomes(tmp_path, boot="boot-1").remember([nic(A, "ens1np0", "10.0.0.1/24")])
    kernel.links["ens1np0"] = LinkHome("ens1np0", 9000, "02:00:00:00:00:0a", ("10.7.7.7/24",))
    after = NicHomes(tmp_path, boot="boot-2")
    assert not after.restore({A: "ens1np0"}, held=set())
    assert kernel.links["ens1np0"].addresses == ("10.7.7.7/24",)
    assert json.loads((tmp_path / FILE).read_text())["nics"] == {}
    assert after.home_names() == {}


def test_records_0_1_0_wrote_beside_nics_are_read_and_given_back(tmp_path: Path, kernel: FakeKernel) -> None:
    """0.1.0 reads a versioned file as its own format and writes it back with its records at the
    top level, beside `version` and `nics` (an upgrade's overlap, a downgrade): those NICs must
    still come home with their addresses."""
    (tmp_path / FILE).write_text(json.dumps({
        "version": 1, "nics": {},
        A: {"ifname": "ens1np0", "mtu": 4200, "addresses": ["10.0.0.1/24"]},
    }))  # fmt: skip
    homes = NicHomes(tmp_path)
    assert homes.home_names() == {A: "ens1np0"}
    kernel.links["net1"] = LinkHome("net1")
    assert homes.restore({A: "net1"}, held=())
    assert kernel.links == {"ens1np0": LinkHome("ens1np0", 4200, "", ("10.0.0.1/24",))}


def test_a_file_of_the_first_format_is_read_and_given_back(tmp_path: Path, kernel: FakeKernel) -> None:
    """Written before formats had versions: the PCI -> record object alone, without a MAC."""
    (tmp_path / FILE).write_text(json.dumps({A: {"ifname": "ens1np0", "mtu": 4200, "addresses": ["10.0.0.1/24"]}}))
    homes = NicHomes(tmp_path)
    assert homes.home_names() == {A: "ens1np0"}
    kernel.links["net1"] = LinkHome("net1")
    assert homes.restore({A: "net1"}, held=())
    assert kernel.links == {"ens1np0": LinkHome("ens1np0", 4200, "", ("10.0.0.1/24",))}
    assert json.loads((tmp_path / FILE).read_text()) == {"version": 1, "nics": {}}


def test_a_file_of_a_newer_format_is_set_aside_not_misread(tmp_path: Path, kernel: FakeKernel) -> None:
    newer = json.dumps({"version": 2, "homes": [{"pci": A}]})
    (tmp_path / FILE).write_text(newer)
    assert NicHomes(tmp_path).home_names() == {}
    (aside,) = tmp_path.glob(f"{FILE}.newer-*")
    assert aside.read_text() == newer  # the release that wrote it can read it again


def test_the_return_makes_the_host_identity_exactly_the_remembered_one(tmp_path: Path, kernel: FakeKernel) -> None:
    """Whatever the pod did (renamed, readdressed, another MTU and MAC), the host gets back what it
    had: the record is all restore_link is told, so nothing of the tenant's survives."""
    homes = NicHomes(tmp_path)
    homes.remember([nic(A, "ens1np0", "10.0.0.1/24", mtu=4200)])
    kernel.links["eth0"] = LinkHome("eth0", 1400, "02:66:66:66:66:66", ("192.0.2.66/24",))
    assert not homes.restore({A: "eth0"}, held={A})  # a prepared claim still holds it: wait
    assert "eth0" in kernel.links
    assert not homes.restore({}, held=())  # not on the host (still in its pod): wait
    assert homes.restore({A: "eth0"}, held=())
    assert kernel.links == {"ens1np0": LinkHome("ens1np0", 4200, "02:00:00:00:00:0a", ("10.0.0.1/24",))}
    assert homes.home_names() == {}  # forgotten once given back


def test_a_nic_that_cannot_come_home_holds_up_no_other(tmp_path: Path, kernel: FakeKernel) -> None:
    warned: list[str] = []
    homes = NicHomes(tmp_path, warn=warned.append)
    homes.remember([nic(A, "ens1np0", "10.0.0.1/24"), nic(B, "ens2np0", "10.0.1.1/24")])
    kernel.links.update(net1=LinkHome("net1"), net2=LinkHome("net2"))
    kernel.refusing.add("net1")
    assert homes.restore({A: "net1", B: "net2"}, held=())  # B came home
    assert not homes.restore({A: "net1"}, held=())  # A failed again: nothing changed
    assert set(kernel.links) == {"net1", "ens2np0"}
    assert homes.home_names() == {A: "ens1np0"}  # kept for the next pass; B forgotten
    assert len(warned) == 1 and A in warned[0] and "Operation not permitted" in warned[0]  # once, not per pass
    kernel.refusing.clear()
    assert homes.restore({A: "net1"}, held=())
    assert set(kernel.links) == {"ens1np0", "ens2np0"} and homes.home_names() == {}


def test_a_record_that_cannot_be_used_fails_only_its_nic(tmp_path: Path, kernel: FakeKernel) -> None:
    (tmp_path / FILE).write_text(
        json.dumps(
            {
                "version": 1,
                "nics": {
                    A: {"ifname": "ens1np0", "mtu": 9000, "addresses": ["not an address"]},
                    B: {"ifname": "ens2np0", "mtu": 9000, "addresses": ["10.0.1.1/24"]},
                },
            }
        )
    )
    warned: list[str] = []
    homes = NicHomes(tmp_path, warn=warned.append)
    kernel.links.update(net1=LinkHome("net1"), net2=LinkHome("net2"))
    assert homes.restore({A: "net1", B: "net2"}, held=())
    assert set(kernel.links) == {"net1", "ens2np0"}
    assert homes.home_names() == {A: "ens1np0"}  # kept as it was, for whoever can mend it
    assert len(warned) == 1 and A in warned[0] and "not an address" in warned[0]


def test_a_home_name_another_netdev_holds_stays_its_own(tmp_path: Path, kernel: FakeKernel) -> None:
    """The NIC keeps the name it came back with, a warning (an event) says why, and it comes home
    once the name is free. The pod's name is shown escaped: it is the tenant's choice."""
    warned: list[str] = []
    homes = NicHomes(tmp_path, warn=warned.append)
    homes.remember([nic(A, "ens1np0", "10.0.0.1/24")])
    tenant_name = "\x1b[2Jnet1"
    kernel.links.update({"ens1np0": LinkHome("ens1np0"), tenant_name: LinkHome(tenant_name)})
    assert not homes.restore({A: tenant_name}, held=())
    assert homes.home_names() == {A: "ens1np0"}
    (note,) = warned
    assert "'ens1np0' is taken by another netdev" in note and "\x1b" not in note and "\\x1b[2Jnet1" in note
    del kernel.links["ens1np0"]
    assert homes.restore({A: tenant_name}, held=())
    assert set(kernel.links) == {"ens1np0"} and homes.home_names() == {}


def test_two_nics_whose_pod_swapped_their_names_both_come_home(tmp_path: Path, kernel: FakeKernel) -> None:
    """Each holds the other's home name: one steps aside to a name of its own PCI address first."""
    homes = NicHomes(tmp_path)
    homes.remember([nic(A, "ens1np0", "10.0.0.1/24"), nic(B, "ens2np0", "10.0.1.1/24")])
    kernel.links.update(ens2np0=LinkHome("ens2np0"), ens1np0=LinkHome("ens1np0"))  # A as ens2np0, B as ens1np0
    assert homes.restore({A: "ens2np0", B: "ens1np0"}, held=())
    assert kernel.links == {
        "ens1np0": LinkHome("ens1np0", 9000, "02:00:00:00:00:0a", ("10.0.0.1/24",)),
        "ens2np0": LinkHome("ens2np0", 9000, "02:00:00:00:00:0a", ("10.0.1.1/24",)),
    }
    assert homes.home_names() == {}
    assert parked_name(B) == "tdm00008b000" and len(parked_name("10000:8b:00.0")) <= 15


def test_an_unreadable_file_costs_the_pass_not_the_nic_discovery(tmp_path: Path, kernel: FakeKernel) -> None:
    """restore and home_names run in every NIC discovery pass: they never raise for the file."""
    (tmp_path / FILE).mkdir()  # read_bytes: IsADirectoryError, an OSError
    homes = NicHomes(tmp_path)
    assert homes.home_names() == {}
    assert not homes.restore({A: "net1"}, held=())


# -- discovery: exclusion by the home name, and the NICs back from pods it finds -----------------


def _render(root: Path, ifname: str, n: int) -> str:
    pci = f"0000:{0x8A + n:02x}:00.0"
    spec = NicSpec(pci, "pci0000:80", 0, ifname, f"02:00:00:00:00:{n:02x}", f"mlx5_{n}", n)
    render_nic(spec, root / "sys", root / "dev")
    return pci


@pytest.fixture
def returned(tmp_path: Path) -> tuple[Path, str, str]:
    """A node whose NIC `back` came home from its pod as `eth0` (its home name `ens1np0`), and
    whose NIC `own` has been `eth1` on the host all along."""
    (tmp_path / "sys/class/net").mkdir(parents=True)
    (tmp_path / "dev").mkdir()
    back, own = _render(tmp_path, "eth0", 0), _render(tmp_path, "eth1", 1)
    (tmp_path / "data").mkdir()
    NicHomes(tmp_path / "data").remember([nic(back, "ens1np0")])
    return tmp_path, back, own


def _published(root: Path, exclude: str) -> tuple[list[str], dict[str, str]]:
    disc = NicDiscovery(
        root / "sys", netlink=False, exclude=NicExclusions.parse(exclude), home_names=NicHomes(root / "data").home_names
    )
    return [d.nic.pci_address for d in disc.discover() if d.nic], disc.host_netdevs()


def test_a_name_pattern_sees_a_returning_nic_by_its_home_name(returned: tuple[Path, str, str]) -> None:
    root, back, own = returned
    # `eth*` cannot hide the NIC coming home (it would never be given back), and still keeps out
    # the NIC whose host name is eth1.
    assert _published(root, "eth*") == ([back], {back: "eth0", own: "eth1"})
    # A pattern of its home name keeps it out as before it went into the pod; restore still finds it.
    assert _published(root, "ens1*") == ([own], {back: "eth0", own: "eth1"})
    assert _published(root, back) == ([own], {back: "eth0", own: "eth1"})  # by PCI address: always


def test_the_nic_watcher_sees_a_returning_nic_by_its_home_name(returned: tuple[Path, str, str]) -> None:
    """Its filter decides which link events rediscover: the return must not be ignored."""
    root, _, _ = returned
    scanner = NicScanner(
        root / "sys",
        netlink=True,
        netns=None,
        skip_default_route=False,
        exclude=NicExclusions.parse("eth*"),
        home_names=NicHomes(root / "data").home_names,
    )
    link = Link(7, "eth0", "02:00:00:00:00:00", 1500, "down", "", 0, 0, loopback=False)
    assert scanner.may_be_nic(link)
    assert not scanner.may_be_nic(dataclasses.replace(link, index=8, name="eth1", mac="02:00:00:00:00:01"))
