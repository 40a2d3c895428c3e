"""The GPU monitor's counters: what a reader gets is a copy, and events count by type and XID."""

from __future__ import annotations

from driver.health.gpu_counters import SharedCounters


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
