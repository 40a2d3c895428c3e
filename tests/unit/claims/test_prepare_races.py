"""The Preparer against a fake API: races the kubelet and a rolling update can produce (two
Preparers on one data dir), claims replaced under the same name, many callers on one claim, and
how requests are named in the device metadata.

The API is a fake whose status apply can be held, so the test decides exactly when the other
party acts: what matters is what is left on disk and in the checkpoint afterwards.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest
from prepare_fakes import DRIVER, FakeAPI, Host, make_preparer, render_host
from waiting import wait_for

from driver.claims.checkpoint import Checkpoint
from driver.claims.metadata_format import decode_stream
from driver.claims.unprepare import Unprepared
from driver.claims.vocabulary import PrepareState


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory) -> Host:
    return render_host(tmp_path_factory.mktemp("host"))


@pytest.fixture
def setup(tmp_path: Path, host: Host):
    data, cdi_root = tmp_path / "data", tmp_path / "cdi"
    data.mkdir()
    api = FakeAPI()
    a = make_preparer(data, cdi_root, api, "a", host)
    b = make_preparer(data, cdi_root, api, "b", host)
    yield api, a, b, data, cdi_root
    a.close()
    b.close()


def _files(data: Path, cdi_root: Path) -> list[str]:
    return sorted(p.name for p in cdi_root.glob("*.json")) + sorted(
        p.name for p in (data / "dra-device-metadata").glob("*")
    )


def test_prepare_and_unprepare_fsync_nothing(setup, monkeypatch: pytest.MonkeyPatch):
    """The record and the files of prepared claims are boot-scoped: written atomically, never
    fsynced (driver.fsutil says why), so no prepare waits for a disk flush."""
    api, a, _, _, _ = setup
    synced: list[str] = []
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(os.readlink(f"/proc/self/fd/{fd}")))
    ref = api.add("default", "c", "uid-1")
    assert not a.prepare([ref])[ref.uid].error
    assert a.unprepare([ref]) == {ref.uid: Unprepared()}
    assert synced == []


def test_unprepare_by_the_other_instance_mid_prepare_leaves_nothing(setup):
    api, a, b, data, cdi_root = setup
    ref = api.add("default", "c", "uid-1")
    api.hold.clear()
    result: list = []
    t = threading.Thread(target=lambda: result.append(a.prepare([ref])[ref.uid]))
    t.start()
    assert api.held.wait(10), "instance A never reached the status apply"
    # A writes its files while its apply is held (the two run side by side).
    wait_for("A's CDI spec, metadata spec and metadata directory", lambda: len(_files(data, cdi_root)) == 3, 10)
    assert b.unprepare([ref]) == {ref.uid: Unprepared()}  # the kubelet asks the newer instance
    api.hold.set()
    t.join(10)
    assert "unprepared while being prepared" in result[0].error
    assert Checkpoint(data, "boot").read() == {}
    assert _files(data, cdi_root) == []
    # A's apply landed after B's withdrawal: A withdrew it again, so no Ready outlives the claim.
    assert api.applies[-3:] == [
        ("default", "c", "uid-1", 0),
        ("default", "c", "uid-1", 1),
        ("default", "c", "uid-1", 0),
    ]
    assert api.claims[("default", "c")]["status"]["devices"] == []


def test_a_prepare_the_other_instance_took_over_and_finished_keeps_its_files(setup, host: Host):
    """The kubelet gave up on A's slow call and asked B, which prepared the claim: A's late end
    must not take away the files B's answer promised (they are the same files)."""
    api, a, _, data, cdi_root = setup
    api_b = FakeAPI()  # the same claims, but B's apply is not held
    api_b.claims = api.claims
    b = make_preparer(data, cdi_root, api_b, "b2", host)
    ref = api.add("default", "c", "uid-1")
    api.hold.clear()
    result: list = []
    t = threading.Thread(target=lambda: result.append(a.prepare([ref])[ref.uid]))
    t.start()
    try:
        assert api.held.wait(10), "instance A never reached the status apply"
        wait_for("A's CDI spec, metadata spec and metadata directory", lambda: len(_files(data, cdi_root)) == 3, 10)
        answer = b.prepare([ref])[ref.uid]
    finally:
        api.hold.set()
        t.join(10)
        b.close()
    assert answer.error == "" and answer.devices
    assert "prepared by another instance" in result[0].error
    assert Checkpoint(data, "boot").read()[ref.uid].state == PrepareState.COMPLETED
    assert len(_files(data, cdi_root)) == 3
    assert api.claims[("default", "c")]["status"]["devices"], "the claim keeps its Ready status"


def test_a_late_unprepare_of_an_old_claim_spares_the_new_claim_of_the_same_name(setup):
    api, a, _, data, cdi_root = setup
    old = api.add("default", "c", "uid-old")
    assert a.prepare([old])[old.uid].error == ""
    assert a.unprepare([old]) == {old.uid: Unprepared()}
    new = api.add("default", "c", "uid-new")
    assert a.prepare([new])[new.uid].error == ""
    before, status = _files(data, cdi_root), api.claims[("default", "c")]["status"]["devices"]
    assert status, "the new claim's prepare applied its status"
    assert a.unprepare([old]) == {old.uid: Unprepared()}  # retried by the kubelet, long after
    assert _files(data, cdi_root) == before
    assert Checkpoint(data, "boot").read()[new.uid].state == PrepareState.COMPLETED
    # The withdrawal names the old UID, which the API server's precondition refuses for the new claim.
    assert api.applies[-1] == ("default", "c", "uid-old", 0)
    assert api.claims[("default", "c")]["status"]["devices"] == status


def _mounted_metadata(cdi_root: Path, uid: str) -> list[Path]:
    """The host files the claim's metadata CDI specs bind-mount into its containers."""
    out = []
    for spec in sorted(cdi_root.glob(f"{DRIVER}_metadata_{uid}_*.json")):
        for device in json.loads(spec.read_text())["devices"]:
            out += [Path(m["hostPath"]) for m in device["containerEdits"]["mounts"]]
    return out


def test_unprepare_of_a_replaced_claim_leaves_the_new_claim_of_the_same_name_whole(setup):
    """A Job deletes and recreates its claim under the same name; the old claim's Unprepare comes
    after the new claim was prepared (here on another GPU). The new claim's containers must still
    find every file their CDI specs name."""
    api, a, _, data, cdi_root = setup
    old = api.add("default", "c", "uid-old", ("gpu", "gpu-0"))
    assert a.prepare([old])[old.uid].error == ""
    new = api.add("default", "c", "uid-new", ("gpu", "gpu-1"))
    assert a.prepare([new])[new.uid].error == ""
    mounted = _mounted_metadata(cdi_root, new.uid)
    assert mounted and all(p.is_file() for p in mounted)

    assert a.unprepare([old]) == {old.uid: Unprepared()}
    assert [p for p in mounted if not p.is_file()] == [], "the old claim's Unprepare removed the new claim's metadata"
    assert all(decode_stream(p.read_bytes())["metadata"]["uid"] == new.uid for p in mounted)
    assert not list(cdi_root.glob(f"*{old.uid}*")), "the old claim's own specs are gone"
    assert not [p for p in data.rglob("metadata.json") if old.uid in p.read_text()]


def test_a_cancelled_call_prepares_nothing(setup):
    api, a, _, data, cdi_root = setup
    ref = api.add("default", "c", "uid-1")
    result = a.prepare([ref], alive=lambda: False)[ref.uid]
    assert "cancelled" in result.error
    assert Checkpoint(data, "boot").read() == {} and _files(data, cdi_root) == []


def test_metadata_names_the_subrequest_and_the_response_its_parent(setup):
    api, a, _, _, cdi_root = setup
    ref = api.add("default", "c", "uid-1", ("gpu/large", "gpu-0"))
    result = a.prepare([ref])[ref.uid]
    assert result.devices[0].request_names == ("gpu",)
    (mounted,) = _mounted_metadata(cdi_root, ref.uid)
    doc, _ = json.JSONDecoder().raw_decode(mounted.read_text())
    assert doc["requests"][0]["name"] == "gpu/large"


def test_calls_about_one_claim_never_overlap_under_contention(setup):
    """Prepare and unprepare of one claim from many threads at once: the per-claim lock must admit
    one call at a time however often the claim is unprepared (and its lock let go) meanwhile."""
    api, a, *_ = setup
    ref = api.add("default", "c", "uid-1")
    errors: list[str] = []

    def worker(i: int) -> None:
        for _ in range(10):
            if i % 2:
                errors.extend(e for e in [a.prepare([ref])[ref.uid].error] if e)
            else:
                errors.extend(e.error for e in a.unprepare([ref]).values() if e.error)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(24)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert api.overlaps == [], f"{len(api.overlaps)} calls ran while another call about the same claim was in flight"
    assert errors == []
    assert a.claim_locks.held() == set(), "every claim lock is released and forgotten"
