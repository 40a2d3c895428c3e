"""A day of a healthy node taints nothing; a day with one grey failure of each kind finds each,
within the hold (states) or a few reads (rates and counts), and clears each after recovery
(`hack/grey_replay.py` plays them through the daemon's own rules in simulated time)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from driver.health.thresholds import GreyThresholds

REPO = Path(__file__).resolve().parents[3]


def _load() -> ModuleType:
    """By its path: hack/ is no package (see test_hack_checked)."""
    spec = importlib.util.spec_from_file_location("grey_replay", REPO / "hack" / "grey_replay.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["grey_replay"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


grey_replay = _load()
T = GreyThresholds()


@pytest.fixture(scope="module")
def day() -> object:
    return grey_replay.run(seed=1, hours=24)


def test_a_healthy_day_taints_nothing(day) -> None:
    assert day.healthy_taints == []


@pytest.mark.parametrize("seed", [2, 3])
def test_other_healthy_days_taint_nothing(seed: int) -> None:
    seen = grey_replay.replay(grey_replay.Node(seed, 24, ()), T)
    assert seen == {}


def test_every_injected_fault_is_found_and_cleared_and_nothing_else_is(day) -> None:
    assert day.other_taints == []
    for row in day.faults:
        assert row.taints == 1, row
        assert row.time_to_taint_s is not None and row.time_to_taint_s <= T.hold + T.period, row
        assert row.time_to_clear_s is not None and row.time_to_clear_s <= T.window + T.recovery + T.period, row


def test_states_wait_out_the_hold_and_counts_taint_at_the_first_read(day) -> None:
    by_fault = {row.fault: row for row in day.faults}
    assert by_fault["GPU PCIe link x8"].time_to_taint_s == T.hold
    assert by_fault["GPU PCIe link x8"].time_to_clear_s == T.recovery
    assert by_fault["NIC link integrity error"].time_to_taint_s == 0
    assert by_fault["GPU PCIe replays"].time_to_taint_s == (T.rising_reads - 1) * T.period
