"""What a watched NIC's settled faults look like as conditions: keys, effects and messages."""

from __future__ import annotations

import pytest

from driver.health.faults import Fault
from driver.health.nic.conditions import NicConditions, NicView, WatchedNic
from driver.health.nic.signals import FUNCTION_GONE, Debounced
from driver.model import TaintEffect

WALL = 1_780_000_000.0  # 2026-05-28T20:26:40Z


def _settled(fault: Fault) -> Debounced:
    d = Debounced(0.0, now=0.0)
    d.observe(fault, 0.0)
    d.settle(0.0, WALL)
    return d


def _watched() -> WatchedNic:
    return WatchedNic(NicView("nic-0", "0000:3b:00.0", "ens1f0", "mlx5_0", present=True), link_ifname="ens1f0")


def test_each_settled_fault_is_a_condition_that_says_where_and_since_when() -> None:
    w = _watched()
    w.link = _settled(Fault("carrier", "no carrier"))
    w.lost = _settled(FUNCTION_GONE)
    w.ports = {1: _settled(Fault("port1-down", "RDMA port 1 is DOWN")), 2: Debounced(0.0, now=0.0)}
    got = {(c.key, c.effect, c.value, c.message) for c in NicConditions("tandem.dev").of(w)}
    assert got == {
        ("tandem.dev/link-down", TaintEffect.NO_SCHEDULE, "carrier", "ens1f0: no carrier since 2026-05-28T20:26:40Z"),
        (
            "tandem.dev/nic-lost",
            TaintEffect.NO_EXECUTE,
            "",
            "0000:3b:00.0: PCI function gone from the bus since 2026-05-28T20:26:40Z",
        ),
        (
            "tandem.dev/rdma-port-down",
            TaintEffect.NO_SCHEDULE,
            "port1-down",
            "mlx5_0: RDMA port 1 is DOWN since 2026-05-28T20:26:40Z",
        ),
    }
    assert len(w.signals()) == 4  # the link, the PCI function and both ports: the debounce waits on each


def test_an_unobserved_nic_has_no_signals_and_no_conditions() -> None:
    w = _watched()
    assert w.signals() == [] and NicConditions("tandem.dev").of(w) == frozenset()


def test_effects_are_overridden_per_full_key_and_an_unknown_key_is_refused() -> None:
    w = _watched()
    w.lost = _settled(FUNCTION_GONE)
    conds = NicConditions("example.com", {"example.com/nic-lost": TaintEffect.NO_SCHEDULE}).of(w)
    assert {(c.key, c.effect) for c in conds} == {("example.com/nic-lost", TaintEffect.NO_SCHEDULE)}
    with pytest.raises(ValueError, match=r"unknown NIC health condition 'tandem\.dev/link-down'"):
        NicConditions("example.com", {"tandem.dev/link-down": TaintEffect.NO_EXECUTE})
