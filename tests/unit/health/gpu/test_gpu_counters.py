"""The GPU monitor's counters: what a reader gets is a copy, and events count by type and XID."""

from __future__ import annotations

from pathlib import Path

from driver.health.gpu.counters import SharedCounters
from driver.health.gpu.monitor import GpuHealthMonitor
from driver.health.gpu.policy import GpuHealthPolicy
from driver.health.monitors import xid_counts
from driver.inventory.store import Inventory


def test_events_count_by_type_and_xids_by_number() -> None:
    c = SharedCounters()
    c.event("xid", 79)
    c.event("xid", 79)
    c.event("double_bit_ecc")
    c.count(errors=2, probes=1)
    got = c.snapshot()
    assert got.events == {"xid": 2, "double_bit_ecc": 1} and got.xids == {79: 2}
    assert (got.errors, got.probes, got.nvml_inits) == (2, 1, 0)


def test_a_snapshot_is_not_changed_by_later_counts() -> None:
    """The metrics endpoint reads on its own thread while the monitor keeps counting."""
    c = SharedCounters()
    c.event("xid", 13)
    before = c.snapshot()
    c.event("xid", 13)
    c.count(probes=1)
    assert before.events == {"xid": 1} and before.xids == {13: 1} and before.probes == 0


def test_xids_reach_metrics_by_known_number_and_the_rest_as_other(tmp_path: Path) -> None:
    """A driver reporting new or garbage XID numbers cannot grow `/metrics` without bound."""
    monitor = GpuHealthMonitor(Inventory(), GpuHealthPolicy(), driver_root=tmp_path)
    for xid in (79, 79, 13, 94, 4242, 99999):
        monitor._counters.event("xid", xid)
    assert xid_counts([monitor]) == {"79": 2, "13": 1, "94": 1, "other": 2}
