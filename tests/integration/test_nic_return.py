"""An exclusive NIC back from its pod gets its host name, MTU and addresses back, against real
netlink in a throwaway namespace (root only): the kernel returns a physical netdev under its
pod-side name and without addresses; Tandem remembered what it was (driver/claims/nic/homes.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from nic_fixtures import SysfsFixture, ip, make_netns, nic_spec, veth

from driver.claims.nic.homes import FILE, NicHomes
from driver.discovery.nic.discover import NicDiscovery


@pytest.fixture
def setup(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, SysfsFixture, NicDiscovery]:
    ns = make_netns(request, "ret")
    fx = SysfsFixture(tmp_path)
    veth(ns, "ens9f0np0", "02:00:00:00:00:09", mtu=4200)
    ip(ns, "addr", "add", "10.30.0.9/24", "dev", "ens9f0np0")
    ip(ns, "addr", "add", "fd30::9/64", "dev", "ens9f0np0", "nodad")
    fx.map(nic_spec(9, "ens9f0np0", mac="02:00:00:00:00:09"))
    return ns, fx, NicDiscovery(fx.sys, netns=ns)


def _gid_names(fx: SysfsFixture, name: str) -> None:
    """The RoCE GID entry follows a rename of its netdev, as the kernel's does."""
    for entry in fx.sys.glob("class/infiniband/*/ports/*/gid_attrs/ndevs/0"):
        entry.write_text(f"{name}\n")


def _returned(ns: str, fx: SysfsFixture, name: str) -> None:
    """What the kernel does when the pod's namespace goes: the netdev is back, down, under its pod
    name, without addresses."""
    ip(ns, "link", "set", "ens9f0np0", "down")
    ip(ns, "link", "set", "ens9f0np0", "name", name)
    ip(ns, "addr", "flush", "dev", name)
    _gid_names(fx, name)


def test_a_nic_back_from_its_pod_gets_its_name_and_addresses_back(setup, tmp_path: Path) -> None:
    ns, fx, disc = setup
    homes = NicHomes(tmp_path / "data", ns)
    (tmp_path / "data").mkdir()
    (before,) = disc.discover()
    homes.remember([before])
    _returned(ns, fx, "net1")
    (back,) = disc.discover()
    assert back.nic is not None and back.nic.ifname == "net1" and not back.nic.ipv4
    assert not homes.restore(disc.host_netdevs(), held={back.nic.pci_address})  # a claim still holds it: wait
    assert homes.restore(disc.host_netdevs(), held=set())
    _gid_names(fx, "ens9f0np0")
    (restored,) = disc.discover()
    assert restored.nic is not None and before.nic is not None
    assert (restored.nic.ifname, restored.nic.ipv4, restored.nic.ipv6) == (
        "ens9f0np0",
        ("10.30.0.9/24",),
        ("fd30::9/64",),
    )
    assert restored.attributes["mtu"] == 4200 and restored.attributes["state"] == "up"
    assert json.loads((tmp_path / "data" / FILE).read_text()) == {"version": 1, "nics": {}}  # forgotten


def test_a_nic_still_in_its_pod_is_remembered_across_restarts(setup, tmp_path: Path) -> None:
    ns, _, disc = setup
    (tmp_path / "data").mkdir()
    (before,) = disc.discover()
    NicHomes(tmp_path / "data", ns).remember([before])
    ip(ns, "link", "del", "ens9f0np0")  # in the pod: not on the host
    disc.discover(keep=[before.nic.pci_address])
    assert not NicHomes(tmp_path / "data", ns).restore(disc.host_netdevs(), held=set())
    assert before.nic.pci_address in json.loads((tmp_path / "data" / FILE).read_text())["nics"]


def test_remembering_a_nic_fsyncs_nothing(setup, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Written atomically but not durably: a restart of the daemon keeps it (the page cache), and
    after a reboot, the only thing a missed fsync loses it to, no pod holds the NIC any more."""
    ns, _, disc = setup
    (tmp_path / "data").mkdir()
    (before,) = disc.discover()
    synced: list[int] = []
    monkeypatch.setattr(os, "fsync", synced.append)
    NicHomes(tmp_path / "data", ns).remember([before])
    assert synced == []
    assert (
        before.nic is not None and before.nic.pci_address in json.loads((tmp_path / "data" / FILE).read_text())["nics"]
    )
