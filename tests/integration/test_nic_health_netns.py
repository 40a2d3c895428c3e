"""NIC health against real netlink: veths in a throwaway network namespace, mapped to fake RDMA
PCI functions by a sysfs fixture, watched by the monitor with netns=<test namespace>. Needs root
(`ip netns add`); skipped otherwise.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from nic_fixtures import SysfsFixture, ip, make_netns, nic_spec, veth, wait_for

from driver.discovery.nic.discover import NicDiscovery
from driver.health.nic.monitor import NicHealthMonitor
from driver.inventory.store import Inventory
from driver.model import Device

LINK = "tandem.dev/link-down"
PORT = "tandem.dev/rdma-port-down"
NAME = "pci-0000-8b-00-0"  # nic_spec(1, ...)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Node:
    """One RDMA NIC (`r0`, mapped to mlx5_1) in the test namespace, discovered into an inventory."""

    def __init__(self, root: Path, ns: str) -> None:
        self.ns = ns
        self.fx = SysfsFixture(root)
        veth(ns, "r0", "02:00:00:00:00:01")
        self.fx.map(nic_spec(1, "r0"))
        self.inventory = Inventory()
        self.discovery = NicDiscovery(self.fx.sys, netns=ns)
        self.rediscover()
        self.monitors: list[NicHealthMonitor] = []

    def rediscover(self, keep: set[str] | None = None) -> None:
        self.inventory.replace("nic", self.discovery.discover(keep or set()))

    def monitor(self, start: bool = True, **kw) -> NicHealthMonitor:
        mon = NicHealthMonitor(self.inventory, sysfs_root=self.fx.sys, netns=self.ns, **kw)
        if start:
            mon.start()
            self.monitors.append(mon)
        return mon

    def device(self) -> Device:
        d = self.inventory.get(NAME)
        assert d is not None
        return d

    def taints(self) -> set[tuple[str, str]]:
        return {(t.key, t.value) for t in self.device().taints}

    def has(self, *taints: tuple[str, str]) -> Callable[[], bool]:
        return lambda: self.taints() == set(taints)


@pytest.fixture
def node(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Node]:
    n = Node(tmp_path, make_netns(request, "health"))
    yield n
    for mon in n.monitors:
        mon.stop()


def test_link_down_is_raised_after_the_debounce_and_up_clears_it(node: Node) -> None:
    mon = node.monitor(debounce=0.3, poll_period=60.0)
    mon.poll()  # the link is known to be up before it goes down
    ip(node.ns, "link", "set", "r0", "down")
    wait_for(node.has((LINK, "admin-down")), what="link-down after `ip link set down`")
    assert node.device().health_message.startswith("r0: administratively down since ")
    ip(node.ns, "link", "set", "r0", "up")
    wait_for(node.has(), what="link-down cleared after `ip link set up`")
    ip(node.ns, "link", "set", "r0p", "down")  # the far end goes: r0 loses its carrier
    wait_for(node.has((LINK, "carrier")), what="link-down after carrier loss")
    ip(node.ns, "link", "set", "r0p", "up")
    wait_for(node.has(), what="carrier back")
    assert mon.netlink_events > 0 and mon.condition_changes == 4


def test_fifty_flaps_change_conditions_at_most_twice(node: Node) -> None:
    mon = node.monitor(debounce=1.0, poll_period=60.0)
    mon.poll()
    for _ in range(50):  # one `ip` per change, so the monitor sees them one by one, not as one batch
        ip(node.ns, "link", "set", "r0", "down")
        ip(node.ns, "link", "set", "r0", "up")
    wait_for(lambda: mon.link_transitions >= 100, what="every flap seen through netlink events")
    mon.poll()  # the link's state now, whatever events are still queued
    wait_for(mon.settled, what="debounce settled after the storm")
    assert node.taints() == set()
    assert mon.condition_changes <= 2


def test_rdma_port_down_from_sysfs(node: Node) -> None:
    node.monitor(debounce=0.2, poll_period=0.1)
    state = node.fx.port_file("mlx5_1")
    state.write_text("1: DOWN\n")
    wait_for(node.has((PORT, "port1-down")), what="rdma-port-down")
    assert node.device().health_message.startswith("mlx5_1: RDMA port 1 is DOWN since ")
    state.write_text("4: ACTIVE\n")
    wait_for(node.has(), what="rdma-port-down cleared")


def test_a_renamed_link_is_followed_by_its_ifindex(node: Node) -> None:
    mon = node.monitor(debounce=0.2, poll_period=0.1)
    ip(node.ns, "link", "set", "r0", "down")
    wait_for(node.has((LINK, "admin-down")), what="link-down")
    ip(node.ns, "link", "set", "r0", "name", "r9")  # discovery has not noticed yet
    mon.poll()  # the inventory still says r0: still the same link, still down
    assert node.taints() == {(LINK, "admin-down")}
    ip(node.ns, "link", "set", "r9", "up")
    wait_for(node.has(), what="cleared through the renamed link")


def test_a_nic_moved_into_a_pod_is_not_down(request: pytest.FixtureRequest, node: Node) -> None:
    pod = make_netns(request, "pod")
    node.monitor(debounce=0.2, poll_period=0.1)
    ip(node.ns, "link", "set", "r0", "down")
    wait_for(node.has((LINK, "admin-down")), what="link-down")
    ip(node.ns, "link", "set", "r0", "netns", pod)
    node.rediscover(keep={"0000:8b:00.0"})
    nic = node.device().nic
    assert nic is not None and not nic.present
    wait_for(node.has(), what="condition withdrawn once the link is unobservable")

    # Nothing comes back however long it stays away: stepped with a fake clock, no sleeping.
    clock = FakeClock()
    mon = node.monitor(start=False, debounce=0.2, clock=clock)
    mon.poll()
    clock.now += 10.0
    mon.poll()
    assert node.taints() == set() and mon.condition_changes == 0


def test_present_false_from_the_start_produces_no_condition(node: Node) -> None:
    ip(node.ns, "link", "set", "r0", "down")
    d = node.device()
    assert d.nic is not None
    node.inventory.replace("nic", [dataclasses.replace(d, nic=dataclasses.replace(d.nic, present=False))])
    clock = FakeClock()
    mon = node.monitor(start=False, debounce=0.2, clock=clock)
    mon.poll()
    clock.now += 10.0
    mon.poll()
    assert node.taints() == set() and mon.condition_changes == 0
