"""Counter windows, latches and thresholds: the time rules every grey-failure signal is judged by."""

from __future__ import annotations

import pytest

from driver.health.faults import Fault
from driver.health.grey import allowed_link_errors
from driver.health.thresholds import GreyThresholds, parse_thresholds
from driver.health.windows import CounterWindow, Latch

SICK = Fault("sick", "sick")


def test_window_counts_the_rise_within_it_from_the_read_before_it() -> None:
    w = CounterWindow(window=100)
    for t, v in [(0, 10), (50, 20), (100, 20), (150, 25)]:
        inc = w.add(v, t)
    # kept: the read at 50 (the last at or before 150-100) as baseline, then 100 and 150
    assert (inc.total, inc.rising_reads, inc.seconds) == (5, 1, 100)


def test_window_before_it_fills_counts_from_the_first_read() -> None:
    w = CounterWindow(window=300)
    w.add(0, 0)
    inc = w.add(30, 30)
    assert (inc.total, inc.rising_reads, inc.per_second()) == (30, 1, 1.0)


def test_a_counter_that_goes_back_is_a_reset_not_a_negative_or_huge_rise() -> None:
    w = CounterWindow(window=300)
    w.add(4_000_000_000, 0)
    inc = w.add(3, 30)  # cleared, recreated or wrapped
    assert (inc.total, inc.rising_reads) == (0, 0)
    assert w.add(5, 60).total == 2


def test_a_counter_at_its_ceiling_is_saturated() -> None:
    w = CounterWindow(window=300, saturation=15)
    w.add(14, 0)
    assert not w.saturated
    w.add(15, 30)
    assert w.saturated


def test_latch_reports_after_hold_and_clears_after_recovery_of_good_reads() -> None:
    latch = Latch(hold=60, recovery=120)
    assert not latch.observe(SICK, 0, 1000)
    assert not latch.observe(SICK, 59, 1059)
    assert latch.observe(SICK, 60, 1060)
    assert latch.since_wall == 1000  # when it began to be seen, not when it was reported
    assert not latch.observe(None, 100, 1100)
    assert not latch.observe(None, 219, 1219)
    assert latch.observe(None, 220, 1220)
    assert latch.reported is None


def test_a_good_read_restarts_both_clocks() -> None:
    latch = Latch(hold=60, recovery=120)
    latch.observe(SICK, 0, 0)
    latch.observe(None, 30, 30)
    assert not latch.observe(SICK, 70, 70)  # held 0 s since the good read, not 70
    assert latch.observe(SICK, 130, 130)
    latch.observe(None, 140, 140)
    latch.observe(SICK, 200, 200)  # sick again before recovery: the 120 s of good start over
    assert not latch.observe(None, 210, 210)
    assert not latch.observe(None, 329, 329)
    assert latch.observe(None, 330, 330)


def test_latch_keeps_its_first_words_while_the_taint_value_is_the_same() -> None:
    latch = Latch(hold=0, recovery=10)
    latch.observe(Fault("v", "12 errors"), 0, 0)
    assert not latch.observe(Fault("v", "13 errors"), 30, 30)
    assert latch.reported == Fault("v", "12 errors")
    assert latch.observe(Fault("w", "other"), 60, 60)


def test_dcgm_replay_budget_of_a_gen5_x16_link() -> None:
    # 32 GT/s x 16 lanes x 1e-12 x 60 s = 30.72 -> 31 a minute
    assert allowed_link_errors(32.0, 16, 1e-12) * 60 == pytest.approx(31)
    assert allowed_link_errors(16.0, 16, 1e-12) * 60 == pytest.approx(16)  # Gen4 x16, as DCGM allows


def test_thresholds_parse_names_and_numbers() -> None:
    t = parse_thresholds(["window=600", "flaps=5", "pcie-ber=1e-13", "nic-speed-mbps=400000"])
    assert (t.window, t.flaps, t.pcie_ber, t.nic_speed_mbps, t.period) == (600, 5, 1e-13, 400000, 30)


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("windw=600", "unknown name 'windw'"),
        ("window", "not NAME=VALUE"),
        ("flaps=2.5", "not a whole number"),
        ("window=abc", "not a number"),
        ("flaps=0", "at least 1"),
        ("period=nan", "above zero"),
        ("recovery=-1", "above zero"),
        ("nic-speed-mbps=-1", "zero or more"),
        ("pcie-ber=2", "ratio below 1"),
        ("window=40", "at least twice period"),
        ("rising-reads=11", "no rate could ever be reported"),
    ],
)
def test_thresholds_refuse_what_could_not_work(spec: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        parse_thresholds([spec])


def test_default_thresholds_are_valid() -> None:
    assert GreyThresholds().window / GreyThresholds().period >= GreyThresholds().rising_reads
