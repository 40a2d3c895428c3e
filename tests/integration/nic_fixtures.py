"""Helpers for tests against real netlink: a throwaway network namespace with veths, and a sysfs
fixture tree that maps chosen veths to fake RDMA PCI functions. Creating a namespace needs root;
without it the test skips.

The fixture tree is the daemon's sysfs as a real node shows it when the NICs' netdevs live in
another network namespace: the PCI functions and their RDMA devices are there (the shared RDMA
namespace mode), the netdevs are not (no `class/net/<if>`, no `<function>/net/<if>`: the kernel
shows those only to the namespace that mounted sysfs). What ties a veth to its function is what
ties a ConnectX netdev to it on such a node: the RoCE port's default GID entry, which names the
netdev and is derived from its MAC (so a veth must have the MAC of its `NicSpec`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from sim.nics import render_nic
from sim.profile import NicSpec


def make_netns(request: pytest.FixtureRequest, tag: str) -> str:
    """A new network namespace, deleted when the test ends (also when it fails)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to create network namespaces")
    if shutil.which("ip") is None:
        pytest.skip("needs iproute2's `ip`")
    name = f"tandem-{tag}-{uuid.uuid4().hex[:8]}"
    result = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if result.returncode != 0:
        pytest.skip(f"`ip netns add` failed: {result.stderr.strip()}")
    request.addfinalizer(lambda: subprocess.run(["ip", "netns", "del", name], check=False))
    return name


def ip(ns: str, *args: str) -> None:
    subprocess.run(["ip", "-n", ns, *args], check=True, capture_output=True, text=True)


def ip_batch(ns: str, lines: list[str]) -> None:
    subprocess.run(["ip", "-n", ns, "-b", "-"], input="\n".join(lines) + "\n", check=True, text=True)


def veth(ns: str, name: str, mac: str, up: bool = True, mtu: int = 1500) -> None:
    """A veth pair `name`/`name`p; the peer stays unmapped (no PCI function: a link discovery skips)."""
    ip(ns, "link", "add", name, "address", mac, "mtu", str(mtu), "type", "veth", "peer", "name", f"{name}p")
    if up:
        ip(ns, "link", "set", f"{name}p", "up")
        ip(ns, "link", "set", name, "up")


def nic_spec(n: int, ifname: str, **kw) -> NicSpec:
    values = dict(
        pci_address=f"0000:{0x8A + n:02x}:00.0",
        pcie_root="pci0000:80",
        numa_node=0,
        ifname=ifname,
        mac=f"02:00:00:00:00:{n:02x}",
        rdma_device=f"mlx5_{n}",
        uverbs_index=n,
    )
    values.update(kw)
    return NicSpec(**values)


class SysfsFixture:
    """The sysfs and /dev trees a NIC discovery of the test namespace reads."""

    def __init__(self, root: Path) -> None:
        self.sys, self.dev = root / "sys", root / "dev"
        (self.sys / "class/net").mkdir(parents=True)
        self.dev.mkdir()

    def map(self, *specs: NicSpec) -> None:
        for s in specs:
            render_nic(s, self.sys, self.dev)
            if s.ifname:
                self.hide_netdev(s.ifname)

    def hide_netdev(self, ifname: str) -> None:
        """Take a netdev's own sysfs entries away, as the kernel does for one in another namespace."""
        entry = self.sys / "class/net" / ifname
        shutil.rmtree(entry.resolve())
        entry.unlink()

    def port_file(self, rdma_device: str, name: str = "state", port: int = 1) -> Path:
        return self.sys / "class/infiniband" / rdma_device / "ports" / str(port) / name


def wait_for(cond: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not met within {timeout}s")
        time.sleep(0.01)
