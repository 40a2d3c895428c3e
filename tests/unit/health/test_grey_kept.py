"""Grey verdicts kept across a restart: reported again at once, cleared as any verdict is, of this
boot only, and a file that cannot be trusted costs its entries, never the daemon."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from driver.health.gpu.grey import GpuReading
from driver.health.grey_judge import GreyJudge
from driver.health.grey_kept import FILE_NAME, KeptVerdicts
from driver.health.pcie_sysfs import AerCounts
from driver.health.thresholds import GreyThresholds

T = GreyThresholds()
WELL = GpuReading(gen=5, gen_max=5, width=16, width_max=16, reasons=0, replays=0, aer=AerCounts(0, 0, 0))
NARROW = dataclasses.replace(WELL, width=8)
LINK_INTEGRITY = "tandem.dev/pcie-errors"


def judged(reads: list[GpuReading], judge: GreyJudge | None = None, start: float = 0) -> GreyJudge:
    judge = judge or GreyJudge(T, "tandem.dev", {})
    for i, r in enumerate(reads):
        t = start + i * T.period
        judge.judge({"GPU-1": r}, {}, t, 1_000_000 + t)
    return judge


def test_a_restart_reports_again_what_was_reported_and_clears_it_after_recovery(tmp_path: Path) -> None:
    before = judged([NARROW] * 11)  # held 300 s: reported
    (condition,) = before.conditions("GPU-1")
    KeptVerdicts(tmp_path, "boot-1").save(before.kept())

    after = GreyJudge(T, "tandem.dev", {})
    after.restore(KeptVerdicts(tmp_path, "boot-1").load())
    assert after.conditions("GPU-1") == {condition}  # the same words, the same since
    judged([WELL] * 20, after, start=5000)
    assert after.conditions("GPU-1") == {condition}  # 570 s well
    judged([WELL], after, start=5000 + 20 * T.period)
    assert not after.conditions("GPU-1")


def test_a_count_that_will_not_rise_again_survives_the_restart(tmp_path: Path) -> None:
    uncorrectable = dataclasses.replace(WELL, aer=AerCounts(0, 2, 0))
    before = judged([WELL, uncorrectable])
    KeptVerdicts(tmp_path, "boot-1").save(before.kept())
    after = GreyJudge(T, "tandem.dev", {})
    after.restore(KeptVerdicts(tmp_path, "boot-1").load())
    judged([uncorrectable] * 3, after, start=100)  # the counter stays: its first read is a baseline
    assert {c.key for c in after.conditions("GPU-1")} == {LINK_INTEGRITY}


def test_verdicts_of_an_earlier_boot_are_dropped(tmp_path: Path) -> None:
    KeptVerdicts(tmp_path, "boot-1").save(judged([NARROW] * 11).kept())
    assert KeptVerdicts(tmp_path, "boot-2").load() == {}


def test_the_file_is_written_only_when_the_verdicts_change(tmp_path: Path) -> None:
    kept = KeptVerdicts(tmp_path, "boot-1")
    judge = judged([NARROW] * 11)
    kept.save(judge.kept())
    mtime = (tmp_path / FILE_NAME).stat().st_mtime_ns
    (tmp_path / FILE_NAME).chmod(0o400)  # a second write would now be refused: there must be none
    kept.save(judged([NARROW] * 2, judge, start=400).kept())
    assert (tmp_path / FILE_NAME).stat().st_mtime_ns == mtime


def test_a_bad_entry_is_ignored_and_a_bad_file_set_aside(tmp_path: Path) -> None:
    good = {
        "device": "GPU-1",
        "condition": "pcie-degraded",
        "signal": "link",
        "state": True,
        "value": "x8-of-x16",
        "reason": "PCIe link trained at x8 of x16",
        "since": 1000.0,
    }
    bad = [dict(good, state="yes"), dict(good, since=-1), dict(good, device=""), dict(good, value="x" * 5000), 7]
    doc = {"version": 1, "verdicts": {"boot": "b", "entries": [*bad, good]}}
    (tmp_path / FILE_NAME).write_text(json.dumps(doc))
    loaded = KeptVerdicts(tmp_path, "b").load()
    assert list(loaded) == ["GPU-1"] and len(loaded["GPU-1"]) == 1

    (tmp_path / FILE_NAME).write_text("{" * 100_000)
    assert KeptVerdicts(tmp_path, "b").load() == {}
    assert not (tmp_path / FILE_NAME).exists()  # set aside, under another name
