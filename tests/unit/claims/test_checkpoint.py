"""The checkpoint survives upgrades, corruption and reboots without crash-looping the daemon."""

from __future__ import annotations

import dataclasses
import fcntl
import json
import multiprocessing
import os
from pathlib import Path

import pytest

from driver.claims.checkpoint import Checkpoint, ClaimRecord, DeviceRecord, InstanceLock
from driver.claims.vocabulary import PrepareState, Sharing, TimeSliceInterval


def _record(uid: str = "u1") -> ClaimRecord:
    return ClaimRecord(
        namespace="ns", name="c", uid=uid, state=PrepareState.COMPLETED,
        devices=(DeviceRecord(request_names=("gpu",), pool="node", device="gpu-0", share_id="s1"),),
    )  # fmt: skip


def test_round_trip(tmp_path: Path):
    cp = Checkpoint(tmp_path, "boot-1")
    with cp.transaction() as claims:
        claims["u1"] = _record()
    assert Checkpoint(tmp_path, "boot-1").read() == {"u1": _record()}
    doc = json.loads((tmp_path / "checkpoint.json").read_text())
    assert doc["version"] == 1 and doc["bootID"] == "boot-1"
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")], "temporary file left behind"


def test_fields_a_newer_release_added_are_kept_on_rewrite(tmp_path: Path):
    """An added field is no reason to raise the format version (`driver.fsutil`): this release
    reads the file and loses none of it."""
    (tmp_path / "checkpoint.json").write_text(json.dumps({
        "version": 1, "bootID": "b", "futureTop": 1,
        "claims": {"u1": {"namespace": "ns", "name": "c", "state": PrepareState.COMPLETED, "devices": [],
                          "futureField": {"x": 1}}},
    }))  # fmt: skip
    cp = Checkpoint(tmp_path, "b")
    with cp.transaction() as claims:
        claims["u2"] = _record("u2")
    raw = json.loads((tmp_path / "checkpoint.json").read_text())
    assert raw["claims"]["u1"]["futureField"] == {"x": 1}
    assert set(raw["claims"]) == {"u1", "u2"}


def test_the_pods_a_claim_was_prepared_for_are_kept_and_an_older_record_reads_with_none(tmp_path: Path):
    """`pods` is an added field (no format version bump): written when set, absent from a record
    an older release wrote, which reads back with no pods."""
    (tmp_path / "checkpoint.json").write_text(json.dumps({
        "version": 1, "bootID": "b",
        "claims": {"old": {"namespace": "ns", "name": "c", "state": PrepareState.COMPLETED, "devices": []}},
    }))  # fmt: skip
    cp = Checkpoint(tmp_path, "b")
    assert cp.read()["old"].pods == ()
    with cp.transaction() as claims:
        claims["u1"] = dataclasses.replace(_record(), pods=("train-0", "train-1"))
    raw = json.loads((tmp_path / "checkpoint.json").read_text())
    assert raw["claims"]["u1"]["pods"] == ["train-0", "train-1"]
    assert "pods" not in raw["claims"]["old"]
    assert Checkpoint(tmp_path, "b").read()["u1"].pods == ("train-0", "train-1")


def test_a_checkpoint_without_a_version_is_read_and_rewritten_at_the_current_one(tmp_path: Path):
    """An upgrade from a release that wrote no version: its file is version 0, read as version 1."""
    doc = {"bootID": "b", "claims": {"u1": _record().to_json()}}
    (tmp_path / "checkpoint.json").write_text(json.dumps(doc))
    cp = Checkpoint(tmp_path, "b")
    assert cp.read() == {"u1": _record()} and not cp.incomplete
    with cp.transaction() as claims:
        claims["u2"] = _record("u2")
    raw = json.loads((tmp_path / "checkpoint.json").read_text())
    assert raw["version"] == 1 and set(raw["claims"]) == {"u1", "u2"}


def test_a_checkpoint_of_a_newer_format_is_set_aside_whole_and_rebuilt(tmp_path: Path, caplog):
    """A downgrade: this release must neither misread nor overwrite what a newer one wrote, nor
    crash-loop. The file is kept aside, and the checkpoint is `incomplete`, as for a lost one."""
    content = json.dumps({"version": 2, "bootID": "b", "claims": {"u1": {"renamed": "ns/c"}}})
    (tmp_path / "checkpoint.json").write_text(content)
    cp = Checkpoint(tmp_path, "b")
    assert cp.read() == {} and cp.incomplete
    [aside] = tmp_path.glob("checkpoint.json.newer-*")
    assert aside.read_text() == content
    assert "format version 2 is newer than this release of Tandem reads (up to 1)" in caplog.text
    with cp.transaction() as claims:
        claims["u2"] = _record("u2")
    raw = json.loads((tmp_path / "checkpoint.json").read_text())
    assert raw["version"] == 1 and raw["incomplete"] is True and set(raw["claims"]) == {"u2"}
    assert aside.read_text() == content


def test_corrupt_file_is_moved_aside_and_state_starts_empty(tmp_path: Path, caplog):
    (tmp_path / "checkpoint.json").write_text('{"claims": [truncated')
    assert Checkpoint(tmp_path, "b").read() == {}
    aside = list(tmp_path.glob("checkpoint.json.corrupt-*"))
    assert len(aside) == 1 and aside[0].read_text() == '{"claims": [truncated'
    assert "unreadable" in caplog.text


def test_a_reboot_invalidates_prepared_claims(tmp_path: Path):
    with Checkpoint(tmp_path, "boot-1").transaction() as claims:
        claims["u1"] = _record()
    assert Checkpoint(tmp_path, "boot-2").read() == {}


def test_failed_transaction_writes_nothing(tmp_path: Path):
    cp = Checkpoint(tmp_path, "b")
    try:
        with cp.transaction() as claims:
            claims["u1"] = _record()
            raise RuntimeError("crash before commit")
    except RuntimeError:
        pass
    assert cp.read() == {}


def _add(data_dir: str, uid: str) -> None:
    with Checkpoint(Path(data_dir), "b").transaction() as claims:
        claims[uid] = _record(uid)


def test_two_processes_never_lose_each_others_writes(tmp_path: Path):
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_add, args=(str(tmp_path), f"u{i}")) for i in range(8)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert set(Checkpoint(tmp_path, "b").read()) == {f"u{i}" for i in range(8)}


def test_valid_json_of_the_wrong_shape_is_moved_aside_too(tmp_path: Path):
    for shape in (["x"], "ab", {"d1": {"pool": "p", "device": "d"}}):
        (tmp_path / "checkpoint.json").write_text(
            json.dumps({"version": 1, "claims": {"u": {"namespace": "n", "name": "c", "devices": shape}}})
        )
        assert Checkpoint(tmp_path, "").read() == {}
        assert not (tmp_path / "checkpoint.json").exists()


def test_a_rewrite_by_another_instance_is_seen_even_with_the_same_size_and_time(tmp_path: Path):
    """On coarse timestamps two same-size rewrites can share an mtime; the inode must tell them apart."""
    path = tmp_path / "checkpoint.json"
    mine, other = Checkpoint(tmp_path, "b"), Checkpoint(tmp_path, "b")
    with mine.transaction() as claims:
        claims["u1"] = _record("u1")
    first = path.stat()
    with other.transaction() as claims:
        del claims["u1"]
        claims["u2"] = _record("u2")
    assert path.stat().st_size == first.st_size
    os.utime(path, ns=(first.st_atime_ns, first.st_mtime_ns))  # as if written within the same tick
    assert set(mine.read()) == {"u2"}


def test_a_lost_record_stays_marked_incomplete_until_it_is_rebuilt(tmp_path: Path):
    """Claims may still be prepared that no record names: the file says so, for the other instance
    of a rolling update and for the next start, until reconciliation has rebuilt the records."""
    (tmp_path / "checkpoint.json").write_text('{"claims": [truncated')
    mine, other = Checkpoint(tmp_path, "b"), Checkpoint(tmp_path, "b")
    with mine.transaction() as claims:
        claims["u1"] = _record("u1")
    assert mine.incomplete
    assert json.loads((tmp_path / "checkpoint.json").read_text())["incomplete"] is True
    assert set(other.read()) == {"u1"} and other.incomplete
    other.mark_complete()
    assert "incomplete" not in json.loads((tmp_path / "checkpoint.json").read_text())
    assert set(mine.read()) == {"u1"} and not mine.incomplete


def test_a_missing_file_is_incomplete_and_one_of_an_earlier_boot_is_not(tmp_path: Path):
    cp = Checkpoint(tmp_path, "boot-1")
    assert cp.read() == {} and cp.incomplete
    with cp.transaction() as claims:
        claims["u1"] = _record()
    cp.mark_complete()
    after_reboot = Checkpoint(tmp_path, "boot-2")
    assert after_reboot.read() == {} and not after_reboot.incomplete, "nothing of an earlier boot is prepared"


def test_an_instance_whose_lock_file_another_removed_before_it_locked_it_locks_a_new_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """Two instances starting at once: the other's tidy-up finds this one's new file not locked
    yet and removes it. The lock must end up on a file others can find, or this instance looks dead."""
    real = fcntl.flock
    raced: list[int] = []

    def flock(fd: int, op: int) -> None:
        if not raced:  # the other instance's tidy-up, between this one's open and its lock
            raced.append(fd)
            (tmp_path / "instances" / "i-1.lock").unlink()
        real(fd, op)

    monkeypatch.setattr(fcntl, "flock", flock)
    instance = InstanceLock(tmp_path, "i-1")
    monkeypatch.undo()
    other = InstanceLock(tmp_path, "i-2")
    assert raced and other.is_alive("i-1")
    other.release()
    instance.release()


def test_words_are_written_as_their_strings_and_read_back_as_members(tmp_path: Path):
    """The StrEnums of `driver.claims.vocabulary` change nothing on disk: the record's JSON is
    byte for byte what the plain strings made, and reading it gives the members back."""
    record = ClaimRecord(
        "ns", "c", "u1", PrepareState.STARTED, (DeviceRecord(("gpu",), "node", "gpu-0", sharing=Sharing.TIME_SLICING,
                                                             time_slice=TimeSliceInterval.LONG),), owner="i-1",
    )  # fmt: skip
    plain = {"namespace": "ns", "name": "c", "state": "PrepareStarted", "devices": [{
        "requestNames": ["gpu"], "pool": "node", "device": "gpu-0", "sharing": "TimeSlicing", "timeSliceInterval": "Long",
    }], "owner": "i-1"}  # fmt: skip
    assert record.json_text == json.dumps(plain, separators=(",", ":"))
    with Checkpoint(tmp_path, "b").transaction() as claims:
        claims["u1"] = record
    [read] = Checkpoint(tmp_path, "b").read().values()
    assert read == record and read.state is PrepareState.STARTED
    assert read.devices[0].sharing is Sharing.TIME_SLICING and read.devices[0].time_slice is TimeSliceInterval.LONG


@pytest.mark.parametrize(
    ("field", "value", "members"),
    [
        ("state", "PrepareFinished", "['PrepareStarted', 'PrepareCompleted']"),
        ("sharing", "Fractional", "['MPS', 'TimeSlicing']"),
        ("timeSliceInterval", "Eternal", "['Default', 'Short', 'Medium', 'Long']"),
    ],
)
def test_a_word_this_release_does_not_know_sets_the_file_aside_naming_the_field(
    tmp_path: Path, caplog, field: str, value: str, members: str
):
    """A release that adds a word raises the format version (`driver.claims.vocabulary`); a file
    that has one without doing so is refused whole, as a corrupt one is, never read as a string
    no branch expects (an unknown state neither rolled back nor completed)."""
    raw = {"namespace": "ns", "name": "c", "devices": [{"requestNames": ["gpu"], "pool": "node", "device": "gpu-0"}]}
    if field == "state":
        raw["state"] = value
    else:
        raw["devices"][0][field] = value
    content = json.dumps({"version": 1, "bootID": "b", "claims": {"u1": raw}})
    (tmp_path / "checkpoint.json").write_text(content)
    cp = Checkpoint(tmp_path, "b")
    assert cp.read() == {} and cp.incomplete
    [aside] = tmp_path.glob("checkpoint.json.corrupt-*")
    assert aside.read_text() == content
    assert f"{field} must be one of {members}, got {value!r}" in caplog.text


def test_the_checkpoint_0_1_0_wrote_is_read_as_it_is_and_kept_on_rewrite(tmp_path: Path):
    """What 0.1.0 (commit db9db60) wrote in the real cluster while pods held a whole GPU, a GPU+NIC
    pair, an MPS share, a dynamic MIG partition and an exclusive NIC, captured by
    tests/cluster/test_upgrade.py: the same format, so the upgraded driver reads every record as
    it is (unprepare needs all of it) and rewrites none of them differently."""
    original = json.loads((Path(__file__).parent / "checkpoint-0.1.0.json").read_text())
    (tmp_path / "checkpoint.json").write_text(json.dumps(original))
    cp = Checkpoint(tmp_path, original["bootID"])
    claims = cp.read()
    assert set(claims) == set(original["claims"]) and not cp.incomplete
    assert {c.state for c in claims.values()} == {PrepareState.COMPLETED}
    devices = [d for c in claims.values() for d in c.devices]
    (mps,) = [d for d in devices if d.sharing is not None]
    assert mps.sharing == Sharing.MPS and mps.share_id and mps.consumed == {"memory": "20Gi", "computePercent": "25"}
    (mig,) = [d for d in devices if d.mig is not None]
    assert mig.device.startswith("gpu-7-mig-1g-10gb-") and mig.mig.size == 1
    (nic,) = [d for d in devices if d.exclusive]
    assert nic.network_data is not None and nic.network_data["interfaceName"] == "net1"
    assert sorted(len(c.devices) for c in claims.values()) == [1, 1, 1, 1, 2]  # the pair: a GPU and a NIC
    with cp.transaction() as now:
        now["u-new"] = _record("u-new")
    rewritten = json.loads((tmp_path / "checkpoint.json").read_text())
    assert {uid: rewritten["claims"][uid] for uid in original["claims"]} == original["claims"]
