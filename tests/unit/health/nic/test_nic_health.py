"""NIC health: the debounce state machine with a fake clock, and the monitor in sysfs-only mode
against a rendered simulated node (no root, no netlink)."""

from __future__ import annotations

import dataclasses
import logging
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from driver.backoff import Backoff
from driver.discovery.nic.discover import NicDiscovery
from driver.health import parse_taint_effects
from driver.health.faults import Fault
from driver.health.nic import monitor as nic_health
from driver.health.nic.link_sysfs import LinkSysfs
from driver.health.nic.monitor import NicHealthMonitor
from driver.health.nic.signals import Debounced, link_fault, port_fault
from driver.inventory.store import Inventory
from driver.model import Device, Health, TaintEffect
from driver.node.rtnl import LinkEvent, LinkState
from sim.nics import render_nic, unplug_nic
from sim.profile import h100_node
from sim.sysfs import render_node

LINK = "tandem.dev/link-down"
PORT = "tandem.dev/rdma-port-down"
LOST = "tandem.dev/nic-lost"
DOWN = Fault("carrier", "no carrier")
WALL = 1_780_000_000.0  # 2026-05-28T20:26:40Z
LABEL = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9_.-]{0,61}[A-Za-z0-9])?$")


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def wall(self) -> float:
        return WALL + (self.now - 100.0)


def wait_for(cond: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not met within {timeout}s")
        time.sleep(0.01)


# ----------------------------------------------------------------------------- state machine


def test_sustained_fault_is_reported_only_after_the_debounce() -> None:
    d = Debounced(2.0, now=0.0)
    assert d.observe(DOWN, 10.0)
    assert not d.settle(11.99, WALL)
    assert d.reported is None and d.due() == 12.0
    assert d.settle(12.0, WALL)
    assert d.reported == DOWN
    assert d.reported_since_wall == WALL - 2.0  # when it went down, not when it was reported
    assert d.due() is None and not d.settle(100.0, WALL)


def test_recovery_is_reported_only_after_the_debounce() -> None:
    d = Debounced(2.0, now=0.0)
    d.observe(DOWN, 0.0)
    d.settle(2.0, WALL)
    assert d.observe(None, 5.0)
    assert not d.settle(6.9, WALL) and d.reported == DOWN
    assert d.settle(7.0, WALL) and d.reported is None


def test_flap_storm_changes_nothing_until_the_link_settles() -> None:
    d = Debounced(2.0, now=0.0)
    changes = transitions = 0
    t = 0.0
    for _ in range(50):  # 50 flaps in 10 s, settled (and maybe reported) every 10 ms
        for fault in (DOWN, None):
            transitions += d.observe(fault, t)
            for _ in range(10):
                t += 0.01
                changes += d.settle(t, WALL)
    assert transitions == 100 and changes == 0 and d.reported is None
    d.observe(DOWN, t)  # ends down: one change, after the debounce
    changes += d.settle(t + 2.0, WALL)
    assert changes == 1 and d.reported == DOWN


def test_a_storm_while_reported_keeps_the_report() -> None:
    d = Debounced(2.0, now=0.0)
    d.observe(DOWN, 0.0)
    d.settle(2.0, WALL)
    t = 2.0
    for i in range(100):
        d.observe(None if i % 2 == 0 else DOWN, t)
        t += 0.1
        assert not d.settle(t, WALL)
    assert d.reported == DOWN


def test_a_different_fault_is_debounced_too() -> None:
    d = Debounced(1.0, now=0.0)
    d.observe(DOWN, 0.0)
    d.settle(1.0, WALL)
    admin = Fault("admin-down", "administratively down")
    d.observe(admin, 1.5)
    assert not d.settle(2.0, WALL) and d.reported == DOWN
    assert d.settle(2.5, WALL) and d.reported == admin


@pytest.mark.parametrize(
    ("state", "value"),
    [
        (LinkState(1, "e0", "down", admin_up=False, carrier=False), "admin-down"),
        (LinkState(1, "e0", "down", admin_up=True, carrier=False), "carrier"),
        (LinkState(1, "e0", "lowerlayerdown", admin_up=True, carrier=True), "operstate-lowerlayerdown"),
        (LinkState(1, "e0", "up", admin_up=True, carrier=True), None),
        (LinkState(1, "e0", "unknown", admin_up=True, carrier=True), None),  # e.g. dummy links
    ],
)
def test_link_fault(state: LinkState, value: str | None) -> None:
    fault = link_fault(state)
    assert (fault.value if fault else None) == value


@pytest.mark.parametrize(
    ("state", "phys", "value"),
    [
        ("ACTIVE", "LinkUp", None),
        ("ACTIVE", None, None),  # no phys_state file: nothing to say about it
        ("ACTIVE_DEFER", "LinkUp", None),
        ("DOWN", "Disabled", "port1-down"),
        ("INIT", "LinkUp", "port1-init"),
        ("ACTIVE", "Port Configuration Training", "port1-phys-port-configuration-training"),
        ("ACTIVE", "x" * 100, "port1-phys-" + "x" * 52),
    ],
)
def test_port_fault_values_are_label_values(state: str, phys: str | None, value: str | None) -> None:
    fault = port_fault(1, state, phys)
    assert (fault.value if fault else None) == value
    if fault is not None:
        assert LABEL.match(fault.value), fault.value


# ----------------------------------------------------------------------------- sysfs-only monitor


class SimNic:
    """The simulated node's NICs in an inventory, with their sysfs files at hand."""

    def __init__(self, root: Path, nics: int = 2) -> None:
        self.sys, self.dev = root / "sys", root / "dev"
        self.profile = h100_node("node-h", gpus=0, nics=nics)
        render_node(self.profile, self.sys, self.dev)
        self.inventory = Inventory()
        self.discovery = NicDiscovery(self.sys, netlink=False)
        self.rediscover()
        self.clock = FakeClock()

    def rediscover(self, keep: set[str] | None = None) -> None:
        self.inventory.replace("nic", self.discovery.discover(keep or set()))

    @property
    def names(self) -> list[str]:
        return [d.name for d in self.inventory.devices()]

    def ifname(self, i: int) -> str:
        return self.profile.nics[i].ifname

    def set_link(self, i: int, up: bool) -> None:
        net = self.sys / "class/net" / self.ifname(i)
        (net / "operstate").write_text("up\n" if up else "down\n")
        (net / "carrier").write_text("1\n" if up else "0\n")

    def port_file(self, i: int, name: str = "state", port: int = 1) -> Path:
        return self.sys / "class/infiniband" / self.profile.nics[i].rdma_device / "ports" / str(port) / name

    def monitor(self, **kw) -> NicHealthMonitor:
        kw.setdefault("clock", self.clock)
        kw.setdefault("wall_clock", self.clock.wall)
        return NicHealthMonitor(self.inventory, sysfs_root=self.sys, netlink=False, **kw)

    def device(self, i: int) -> Device:
        d = self.inventory.get(self.names[i])
        assert d is not None
        return d

    def taints(self, i: int) -> set[tuple[str, str, str]]:
        return {(t.key, t.value, t.effect.value) for t in self.device(i).taints}

    def step(self, mon: NicHealthMonitor, seconds: float) -> None:
        self.clock.now += seconds
        mon.poll()


@pytest.fixture
def node(tmp_path: Path) -> SimNic:
    return SimNic(tmp_path)


def test_link_down_is_raised_after_the_debounce_and_cleared_after_it(node: SimNic) -> None:
    mon = node.monitor(debounce=2.0)
    mon.poll()
    node.set_link(0, up=False)
    node.step(mon, 1.0)  # first seen down; the fake clock takes binary fractions, so sums are exact
    node.step(mon, 1.0)
    node.step(mon, 0.75)
    assert node.taints(0) == set()
    node.step(mon, 0.25)
    assert node.taints(0) == {(LINK, "carrier", "NoSchedule")}
    d = node.device(0)
    assert d.health == Health.UNHEALTHY
    assert d.health_message == f"{node.ifname(0)}: no carrier since 2026-05-28T20:26:41Z"
    assert node.taints(1) == set() and node.device(1).health == Health.HEALTHY

    node.set_link(0, up=True)
    node.step(mon, 1.0)  # first seen up
    node.step(mon, 1.75)
    assert node.taints(0) == {(LINK, "carrier", "NoSchedule")}
    node.step(mon, 0.25)
    assert node.taints(0) == set() and node.device(0).health == Health.HEALTHY
    assert mon.condition_changes == 2 and mon.link_transitions == 2


def test_flapping_link_in_sysfs_mode_changes_conditions_at_most_twice(node: SimNic) -> None:
    mon = node.monitor(debounce=2.0)
    mon.poll()
    for _ in range(50):  # 50 flaps in 10 s, a poll every 100 ms
        for up in (False, True):
            node.set_link(0, up)
            node.step(mon, 0.1)
    node.step(mon, 5.0)
    assert mon.link_transitions == 100
    assert mon.condition_changes <= 2
    assert node.taints(0) == set()


def test_rdma_port_state_and_phys_state(node: SimNic) -> None:
    mon = node.monitor(debounce=1.0)
    mon.poll()
    node.port_file(0).write_text("1: DOWN\n")
    node.port_file(1, "phys_state").write_text("3: Disabled\n")
    mon.poll()
    node.step(mon, 1.0)
    assert node.taints(0) == {(PORT, "port1-down", "NoSchedule")}
    assert node.taints(1) == {(PORT, "port1-phys-disabled", "NoSchedule")}
    assert node.device(0).health_message.startswith(f"{node.profile.nics[0].rdma_device}: RDMA port 1 is DOWN since ")
    node.port_file(0).write_text("4: ACTIVE\n")
    node.port_file(1, "phys_state").write_text("5: LinkUp\n")
    mon.poll()
    node.step(mon, 1.0)
    assert node.taints(0) == node.taints(1) == set()


def test_link_and_port_down_together_and_effect_override(node: SimNic) -> None:
    mon = node.monitor(debounce=0.5, effects={LINK: TaintEffect.NO_EXECUTE})
    node.set_link(0, up=False)
    node.port_file(0).write_text("1: DOWN\n")
    mon.poll()
    node.step(mon, 0.5)
    assert node.taints(0) == {(LINK, "carrier", "NoExecute"), (PORT, "port1-down", "NoSchedule")}


def test_unknown_effect_key_is_refused(node: SimNic) -> None:
    with pytest.raises(ValueError, match="unknown NIC health condition"):
        node.monitor(effects={"tandem.dev/xid": TaintEffect.NO_EXECUTE})


def test_a_nic_moved_into_a_pod_is_unobservable_not_down(node: SimNic) -> None:
    mon = node.monitor(debounce=1.0)
    node.set_link(0, up=False)
    mon.poll()
    node.step(mon, 1.0)
    assert node.taints(0) == {(LINK, "carrier", "NoSchedule")}
    # The netdev leaves the host's view: discovery keeps the allocated NIC with present=False.
    link = node.sys / "class/net" / node.ifname(0)
    shutil.rmtree(link.resolve())
    link.unlink()
    pci = node.profile.nics[0].pci_address
    node.rediscover(keep={pci})
    assert node.device(0).nic is not None and not node.device(0).nic.present
    node.step(mon, 0.1)
    assert node.taints(0) == set() and node.device(0).health == Health.HEALTHY
    node.step(mon, 10.0)
    assert node.taints(0) == set()


def test_present_false_with_a_down_netdev_in_sysfs_says_nothing(node: SimNic) -> None:
    """Even if sysfs still shows a down netdev by that name, a NIC the inventory marks absent is
    not judged by it (the name may belong to something else by now)."""
    d = node.device(0)
    assert d.nic is not None
    node.inventory.replace("nic", [dataclasses.replace(d, nic=dataclasses.replace(d.nic, present=False))])
    node.set_link(0, up=False)
    mon = node.monitor(debounce=0.5)
    mon.poll()
    node.step(mon, 5.0)
    assert node.taints(0) == set() and mon.condition_changes == 0


def test_a_nic_leaving_the_inventory_takes_its_conditions(node: SimNic) -> None:
    mon = node.monitor(debounce=0.5)
    node.set_link(1, up=False)
    mon.poll()
    node.step(mon, 0.5)
    name = node.names[1]
    assert name in node.inventory.conditions("nic-health")
    node.inventory.replace("nic", [node.device(0)])
    node.step(mon, 0.1)
    assert node.inventory.conditions("nic-health") == {}


def test_unreadable_port_state_is_not_judged_and_warned_once(node: SimNic, caplog) -> None:
    mon = node.monitor(debounce=0.5)
    node.port_file(0).write_text("garbage\n")
    with caplog.at_level(logging.WARNING, logger="driver.health.nic.link_sysfs"):
        mon.poll()
        node.step(mon, 1.0)
        node.step(mon, 1.0)
    assert node.taints(0) == set()
    assert caplog.text.count("not a port state") == 1
    assert mon.errors == 3


def test_a_port_state_that_is_not_utf8_is_not_judged_and_costs_no_other_nic(node: SimNic, caplog) -> None:
    """A garbled file reads as an unreadable one (warned once, naming it): that NIC's port is
    not judged, and the round goes on to judge and publish the others."""
    mon = node.monitor(debounce=0.5)
    mon.poll()
    node.set_link(1, up=False)
    node.port_file(0).write_bytes(b"\xff\xfe4: ACTIVE\n")
    with caplog.at_level(logging.WARNING, logger="driver.health.nic.link_sysfs"):
        node.step(mon, 1.0)
        node.step(mon, 1.0)
    assert node.taints(1) == {(LINK, "carrier", "NoSchedule")}
    assert node.taints(0) == set()
    assert caplog.text.count(f"{node.port_file(0)}: not UTF-8") == 1
    assert mon.errors == 2


def test_a_nic_that_cannot_be_read_does_not_stop_the_round(node: SimNic, monkeypatch, caplog) -> None:
    """Whatever a reader did not expect, on one NIC: logged and counted, and every other NIC is
    still judged and published in the same round."""
    broken = node.profile.nics[0].rdma_device
    ports = LinkSysfs.ports

    def failing(self: LinkSysfs, rdma_device: str) -> dict[int, Fault | None]:
        if rdma_device == broken:
            raise RuntimeError("unexpected")
        return ports(self, rdma_device)

    monkeypatch.setattr(LinkSysfs, "ports", failing)
    mon = node.monitor(debounce=0.5)
    node.set_link(1, up=False)
    with caplog.at_level(logging.ERROR, logger="driver.health.nic.monitor"):
        mon.poll()
        node.step(mon, 0.5)
    assert node.taints(1) == {(LINK, "carrier", "NoSchedule")}
    assert mon.errors == 2 and caplog.text.count(f"NIC {node.names[0]}: cannot read its state") == 2


def _unplug(node: SimNic, i: int) -> str:
    """Hot-removes NIC `i` while a claim holds it: discovery keeps it, absent. Its PCI address."""
    nic = node.profile.nics[i]
    unplug_nic(nic, node.sys, node.dev)
    node.rediscover(keep={nic.pci_address})
    return nic.pci_address


def test_a_nic_whose_pci_function_is_gone_is_lost_until_it_is_back(node: SimNic) -> None:
    """Kept published while allocated, as a lost GPU is: NoExecute evicts the pods that hold a
    NIC that no longer exists. Its link and port conditions are gone with it (unobservable)."""
    mon = node.monitor(debounce=1.0)
    node.set_link(0, up=False)
    mon.poll()
    node.step(mon, 1.0)
    assert node.taints(0) == {(LINK, "carrier", "NoSchedule")}
    pci = _unplug(node, 0)
    assert node.device(0).nic is not None and not node.device(0).nic.present
    mon.poll()  # first seen gone
    node.step(mon, 0.75)
    assert node.taints(0) == set()  # not yet: gone for less than the debounce
    node.step(mon, 0.25)
    assert node.taints(0) == {(LOST, "", "NoExecute")}
    d = node.device(0)
    assert d.health == Health.UNHEALTHY
    assert d.health_message == f"{pci}: PCI function gone from the bus since 2026-05-28T20:26:41Z"
    assert node.taints(1) == set()

    # Plugged in again (the same function, rescanned): present, and no longer lost.
    render_nic(node.profile.nics[0], node.sys, node.dev)
    node.set_link(0, up=True)
    node.rediscover()
    mon.poll()  # first seen back
    node.step(mon, 0.75)
    assert node.taints(0) == {(LOST, "", "NoExecute")}
    node.step(mon, 0.25)
    assert node.taints(0) == set() and node.device(0).health == Health.HEALTHY


def test_the_lost_taint_takes_the_effect_configured(node: SimNic) -> None:
    mon = node.monitor(debounce=0.5, effects=parse_taint_effects([f"{LOST}=NoSchedule"]))
    _unplug(node, 1)
    mon.poll()
    node.step(mon, 0.5)
    assert node.taints(1) == {(LOST, "", "NoSchedule")}


def test_netlink_events_follow_the_ifindex_across_a_rename(node: SimNic) -> None:
    """Events as the thread decodes them, driven without a socket (netlink mode, never started)."""
    mon = NicHealthMonitor(node.inventory, sysfs_root=node.sys, clock=node.clock, debounce=1.0)
    name = node.ifname(0)
    mon.observe_events([LinkEvent(LinkState(7, name, "down", admin_up=False, carrier=False))])
    node.clock.now += 0.5
    # Renamed before discovery noticed: the ifindex still says which NIC it is.
    mon.observe_events([LinkEvent(LinkState(7, "renamed0", "down", admin_up=False, carrier=False))])
    node.clock.now += 0.5
    mon.observe_events([LinkEvent(LinkState(99, "unrelated", "down", admin_up=False, carrier=False))])
    # Another link took the old name: it is not this NIC, so its state says nothing about it.
    mon.observe_events([LinkEvent(LinkState(12, name, "up", admin_up=True, carrier=True))])
    node.clock.now += 1.0
    mon.observe_events([])  # settles: the NIC's own link is still down
    assert node.taints(0) == {(LINK, "admin-down", "NoSchedule")}
    assert node.device(0).health_message.startswith(f"{name}: administratively down since ")
    assert mon.netlink_events == 4 and mon.link_transitions == 1
    # The link leaves the namespace (moved into a pod): unobservable, so the condition goes.
    mon.observe_events([LinkEvent(LinkState(7, "renamed0", "down", admin_up=False, carrier=False), deleted=True)])
    assert node.taints(0) == set()


# ----------------------------------------------------------------------------- the thread


def test_thread_raises_and_clears_with_real_time(node: SimNic) -> None:
    mon = NicHealthMonitor(node.inventory, sysfs_root=node.sys, netlink=False, debounce=0.05, poll_period=0.02)
    mon.start()
    try:
        node.set_link(0, up=False)
        wait_for(lambda: node.taints(0) == {(LINK, "carrier", "NoSchedule")}, what="link-down raised")
        node.set_link(0, up=True)
        wait_for(lambda: node.taints(0) == set(), what="link-down cleared")
    finally:
        mon.stop()


def test_thread_survives_a_failing_round(node: SimNic, caplog) -> None:
    class Flaky(Inventory):
        failures = 2

        def devices(self) -> list[Device]:
            if Flaky.failures:
                Flaky.failures -= 1
                raise RuntimeError("boom")
            return super().devices()

    inv = Flaky()
    inv.replace("nic", node.inventory.devices())
    node.set_link(0, up=False)
    mon = NicHealthMonitor(
        inv,
        sysfs_root=node.sys,
        netlink=False,
        debounce=0.05,
        poll_period=0.02,
        backoff=Backoff(initial=0.01, maximum=0.01),
    )
    with caplog.at_level(logging.ERROR, logger="driver.health.nic.monitor"):
        mon.start()
        try:
            wait_for(lambda: any(t.key == LINK for t in inv.get(node.names[0]).taints), what="raised after failures")
        finally:
            mon.stop()
    assert Flaky.failures == 0 and mon.errors >= 2
    assert "NIC health round failed" in caplog.text


def test_event_socket_is_reopened_with_backoff(node: SimNic, monkeypatch, caplog) -> None:
    real = nic_health.netlink.open_event_socket
    calls: list[str | None] = []

    def flaky_open(netns: str | None = None, groups: int = 0):
        calls.append(netns)
        if len(calls) <= 2:
            raise OSError(1, "Operation not permitted")
        return real(netns, groups)

    monkeypatch.setattr(nic_health.netlink, "open_event_socket", flaky_open)
    mon = NicHealthMonitor(
        node.inventory,
        sysfs_root=node.sys,
        debounce=0.05,
        poll_period=60.0,
        backoff=Backoff(initial=0.01, maximum=0.01),
    )
    with caplog.at_level(logging.ERROR, logger="driver.health.nic.monitor"):
        mon.start()
        try:
            wait_for(lambda: len(calls) >= 3, what="third subscription attempt")
        finally:
            mon.stop()
    assert len(calls) == 3  # subscribed on the third try, and then left alone
    assert caplog.text.count("cannot subscribe to link events") == 2
