"""A hostile tenant's exclusive NIC comes home all the same, against real netlink in throwaway
namespaces (root only). The pod renames the netdev to a name `--exclude-nics` keeps out, gives it
its own address, MTU and MAC, and dies: the NIC is published again under its host name, with its
MTU, MAC and only its own addresses (driver/claims/nic/homes.py, `NicScanner.excluded_by`).

A `pod` namespace stands for the pod's: the runtime moves the netdev there, and when the pod goes
the kernel moves it back to the host's (here the test namespace, with `ip link set netns`, which is
what the kernel does on a namespace's end: the netdev arrives down, under its pod name, with the
pod's MTU and MAC and no addresses). The sysfs fixture is the kernel's RDMA side, which follows a
rename or a MAC change (`_kernel_sees`)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from nic_fixtures import SysfsFixture, ip, make_netns, nic_spec, veth

from driver.claims.nic.homes import NicHomes
from driver.config import NicExclusions
from driver.discovery.nic.discover import NicDiscovery
from driver.model import Device
from sim.nics import default_gid

MAC = "02:00:00:00:00:09"


def _kernel_sees(fx: SysfsFixture, name: str, mac: str, rdma: str = "mlx5_9") -> None:
    """The RoCE port's default GID entry as the kernel keeps it: naming the netdev, from its MAC."""
    fx.port_file(rdma, "gid_attrs/ndevs/0").write_text(f"{name}\n")
    fx.port_file(rdma, "gids/0").write_text(f"{default_gid(mac)}\n")


def _pod_dies(pod: str, host: str, name: str) -> None:
    ip(pod, "link", "set", name, "netns", host)
    subprocess.run(["ip", "netns", "del", pod], check=True)


@pytest.fixture
def node(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, SysfsFixture, NicHomes, NicDiscovery]:
    ns = make_netns(request, "host")
    fx = SysfsFixture(tmp_path)
    veth(ns, "ens9f0np0", MAC, mtu=4200)
    ip(ns, "addr", "add", "10.30.0.9/24", "dev", "ens9f0np0")
    ip(ns, "addr", "add", "fd30::9/64", "dev", "ens9f0np0", "nodad")
    fx.map(nic_spec(9, "ens9f0np0", mac=MAC))
    (tmp_path / "data").mkdir()
    homes = NicHomes(tmp_path / "data", ns)
    exclude = NicExclusions.parse("eth*")
    return ns, fx, homes, NicDiscovery(fx.sys, netns=ns, exclude=exclude, home_names=homes.home_names)


def test_a_netdev_renamed_to_an_excluded_name_readdressed_and_abandoned_comes_home(
    node: tuple[str, SysfsFixture, NicHomes, NicDiscovery], request: pytest.FixtureRequest
) -> None:
    ns, fx, homes, disc = node
    (before,) = disc.discover()
    assert before.nic is not None
    pci = before.nic.pci_address
    homes.remember([before])  # prepare, before the runtime moves it

    pod = make_netns(request, "pod")
    ip(ns, "link", "set", "ens9f0np0", "netns", pod)  # the runtime
    # The tenant: another name (one the operator excludes), address, MTU and MAC.
    ip(pod, "link", "set", "ens9f0np0", "down")
    ip(pod, "link", "set", "ens9f0np0", "name", "eth0", "mtu", "1400", "address", "02:66:66:66:66:66")
    ip(pod, "addr", "add", "192.0.2.66/24", "dev", "eth0")
    ip(pod, "link", "set", "eth0", "up")
    _kernel_sees(fx, "eth0", "02:66:66:66:66:66")
    (away,) = disc.discover(keep=[pci])
    assert away.nic is not None and not away.nic.present
    assert not homes.restore(disc.host_netdevs(), held={pci}) and pci not in disc.host_netdevs()

    _pod_dies(pod, ns, "eth0")
    # The kernel drops a pod's addresses on the move; one the host side has that was never
    # remembered (whoever added it) goes too: the host identity is exactly the remembered one.
    ip(ns, "addr", "add", "198.51.100.7/24", "dev", "eth0")
    (back,) = disc.discover()  # published although `eth*` is excluded: its home name decides
    assert back.nic is not None and (back.nic.ifname, back.attributes["mtu"]) == ("eth0", 1400)
    assert homes.restore(disc.host_netdevs(), held=set())

    _kernel_sees(fx, "ens9f0np0", MAC)
    (home,) = disc.discover()
    assert _identity(home) == ("ens9f0np0", MAC, 4200, ("10.30.0.9/24",), ("fd30::9/64",), "up")
    assert homes.home_names() == {}


def _identity(d: Device) -> tuple[object, ...]:
    assert d.nic is not None
    return d.nic.ifname, d.nic.mac, d.attributes["mtu"], d.nic.ipv4, d.nic.ipv6, d.attributes["state"]


def test_two_nics_whose_pod_swapped_their_names_both_come_home(
    node: tuple[str, SysfsFixture, NicHomes, NicDiscovery], request: pytest.FixtureRequest
) -> None:
    """Each comes back under the other's home name: one is moved aside first (`parked_name`)."""
    ns, fx, homes, disc = node
    veth(ns, "ens8f0np0", "02:00:00:00:00:08", mtu=4200)
    ip(ns, "addr", "add", "10.30.0.8/24", "dev", "ens8f0np0")
    fx.map(nic_spec(8, "ens8f0np0"))
    homes.remember(disc.discover())
    pod = make_netns(request, "pod")
    for name in ("ens9f0np0", "ens8f0np0"):
        ip(ns, "link", "set", name, "netns", pod)
    ip(pod, "link", "set", "ens9f0np0", "name", "swap")
    ip(pod, "link", "set", "ens8f0np0", "name", "ens9f0np0")
    ip(pod, "link", "set", "swap", "name", "ens8f0np0")
    ip(pod, "link", "set", "ens9f0np0", "netns", ns)
    _pod_dies(pod, ns, "ens8f0np0")
    _kernel_sees(fx, "ens8f0np0", MAC)
    _kernel_sees(fx, "ens9f0np0", "02:00:00:00:00:08", rdma="mlx5_8")
    disc.discover()
    assert homes.restore(disc.host_netdevs(), held=set())

    _kernel_sees(fx, "ens9f0np0", MAC)
    _kernel_sees(fx, "ens8f0np0", "02:00:00:00:00:08", rdma="mlx5_8")
    eight, nine = disc.discover()
    assert _identity(nine) == ("ens9f0np0", MAC, 4200, ("10.30.0.9/24",), ("fd30::9/64",), "up")
    assert _identity(eight)[:4] == ("ens8f0np0", "02:00:00:00:00:08", 4200, ("10.30.0.8/24",))
    assert homes.home_names() == {}


def test_a_home_name_another_netdev_took_waits_for_it(
    node: tuple[str, SysfsFixture, NicHomes, NicDiscovery], request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    ns, fx, _, disc = node
    warned: list[str] = []
    homes = NicHomes(tmp_path / "data", ns, warn=warned.append)
    (before,) = disc.discover()
    homes.remember([before])
    pod = make_netns(request, "pod")
    ip(ns, "link", "set", "ens9f0np0", "netns", pod)
    ip(pod, "link", "set", "ens9f0np0", "name", "net1")
    ip(ns, "link", "add", "ens9f0np0", "type", "veth", "peer", "name", "squatter")  # meanwhile, on the host
    _pod_dies(pod, ns, "net1")
    _kernel_sees(fx, "net1", MAC)
    disc.discover()
    assert not homes.restore(disc.host_netdevs(), held=set())
    assert homes.home_names() == {before.nic.pci_address: "ens9f0np0"}
    assert len(warned) == 1 and "'ens9f0np0' is taken by another netdev" in warned[0]

    ip(ns, "link", "del", "ens9f0np0")
    assert homes.restore(disc.host_netdevs(), held=set())
    _kernel_sees(fx, "ens9f0np0", MAC)
    (home,) = disc.discover()
    assert _identity(home) == ("ens9f0np0", MAC, 4200, ("10.30.0.9/24",), ("fd30::9/64",), "up")
