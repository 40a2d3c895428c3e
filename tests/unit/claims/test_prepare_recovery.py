"""Start-up after the checkpoint was lost: the files of claims still in use are kept and their
records rebuilt; only what the API server shows unused is removed; nothing is removed while the
API server cannot say; and a prepare after an unprepare that failed halfway."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from prepare_fakes import FakeAPI, Host, make_preparer, make_reconciler, nic_name, render_host

from driver.claims.checkpoint import Checkpoint, InstanceLock
from driver.claims.unprepare import Unprepared
from driver.claims.vocabulary import PrepareState


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory) -> Host:
    return render_host(tmp_path_factory.mktemp("host"))


def _files(tmp_path: Path, uid: str) -> list[Path]:
    return sorted(p for p in tmp_path.rglob("*") if p.is_file() and uid in str(p))


def test_an_unreachable_api_server_keeps_every_file_until_it_can_tell(tmp_path: Path, host: Host):
    api = FakeAPI()
    data, cdi_root = tmp_path / "data", tmp_path / "cdi"
    p = make_preparer(data, cdi_root, api, "a", host)
    live = api.add("default", "live", "uid-live", ("gpu", "gpu-0"), ("nic", nic_name(host, "mlx5_0")))
    gone = api.add("default", "gone", "uid-gone", ("gpu", "gpu-1"))
    first = p.prepare([live])[live.uid]
    assert first.error == "" and p.prepare([gone])[gone.uid].error == ""
    before = {path: path.read_bytes() for uid in (live.uid, gone.uid) for path in _files(tmp_path, uid)}
    del api.claims[("default", "gone")]
    (data / "checkpoint.json").write_text("not json")  # lost, as by a disk error

    api.down = True
    make_reconciler(data, cdi_root, api, p, host).run()
    assert {path: path.read_bytes() for path in before} == before, "nothing is removed on a guess"
    checkpoint = Checkpoint(data, "boot")
    assert checkpoint.read() == {} and checkpoint.incomplete

    api.down = False  # the next start
    make_reconciler(data, cdi_root, api, p, host).run()
    assert _files(tmp_path, gone.uid) == []
    assert {path: path.read_bytes() for path in _files(tmp_path, live.uid)} == {
        path: content for path, content in before.items() if live.uid in str(path)
    }
    records = checkpoint.read()
    assert set(records) == {live.uid} and records[live.uid].state == PrepareState.COMPLETED
    assert not checkpoint.incomplete
    assert p.prepare([live])[live.uid] == first, "the kubelet gets the same answer as before"
    p.close()


def test_an_unprepare_removes_the_files_of_a_claim_the_checkpoint_lost(tmp_path: Path, host: Host):
    api = FakeAPI()
    data, cdi_root = tmp_path / "data", tmp_path / "cdi"
    p = make_preparer(data, cdi_root, api, "a", host)
    ref = api.add("default", "c", "uid-1")
    assert p.prepare([ref])[ref.uid].error == ""
    (data / "checkpoint.json").unlink()
    assert p.unprepare([ref]) == {ref.uid: Unprepared()}
    assert _files(tmp_path, ref.uid) == []
    p.close()


def test_names_no_driver_writes_never_stop_start_up(tmp_path: Path, host: Host, caplog: pytest.LogCaptureFixture):
    """The CDI directory is shared with other writers, and the data dir may hold an older layout
    or a damaged checkpoint: reconciliation passes over what is not its own, removes what is, and
    the daemon starts (a raise here would be a crash loop)."""
    api = FakeAPI()
    data, cdi_root = tmp_path / "data", tmp_path / "cdi"
    p = make_preparer(data, cdi_root, api, "a", host)
    ref = api.add("default", "c", "uid-1")
    assert p.prepare([ref])[ref.uid].error == ""
    foreign = cdi_root / "tandem.dev_metadata_.._gpu.json"  # another writer's name in our pattern
    foreign.write_text('{"cdiVersion":"0.5.0","kind":"x.com/y","devices":[]}')
    old_layout = data / "dra-device-metadata" / ("default_" + "c" * 240) / "gpu"  # `<namespace>_<name>`
    old_layout.mkdir(parents=True)
    raw = json.loads((data / "checkpoint.json").read_text())
    raw["claims"]["../escape"] = {**raw["claims"][ref.uid], "state": "PrepareStarted", "owner": "../../victim"}
    (data / "checkpoint.json").write_text(json.dumps(raw))
    victim = tmp_path / "victim.lock"
    victim.write_text("")

    make_reconciler(data, cdi_root, api, p, host).run()
    assert foreign.exists(), "a file no driver instance wrote is left alone"
    assert not old_layout.parent.exists(), "a directory of another layout is removed as an orphan"
    assert set(Checkpoint(data, "boot").read()) == {ref.uid}
    assert victim.exists(), "a record's owner names no file outside the driver's directories"
    assert "not a claim UID" in caplog.text
    assert p.prepare([ref])[ref.uid].error == "", "the claim prepared before is prepared still"
    p.close()


def test_an_owner_that_is_no_instance_id_is_dead_and_names_no_file(tmp_path: Path):
    data = tmp_path / "data"
    data.mkdir()
    instance = InstanceLock(data, "i-1")
    outside = tmp_path / "x.lock"
    outside.write_text("")
    assert instance.is_alive("../../x") is False
    assert outside.exists()
    instance.release()


def test_a_prepare_after_an_unprepare_that_failed_halfway_restores_every_file_and_the_status(
    tmp_path: Path, host: Host, monkeypatch: pytest.MonkeyPatch
):
    """Unprepare removed the files and withdrew the status, then failed to drop the record (the
    disk full): the kubelet's next prepare must answer IDs that resolve, with a Ready status."""
    api = FakeAPI()
    data, cdi_root = tmp_path / "data", tmp_path / "cdi"
    p = make_preparer(data, cdi_root, api, "a", host)
    ref = api.add("default", "c", "uid-1")
    first = p.prepare([ref])[ref.uid]
    assert first.error == ""
    files = {path: path.read_bytes() for path in _files(tmp_path, ref.uid)}

    def full(*_: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(p._checkpoint, "transaction", full)
    failed = p.unprepare([ref])[ref.uid]
    assert "No space left" in failed.error and failed.error_kind == "other", "an OSError is no Tandem error"
    assert _files(tmp_path, ref.uid) == [] and api.claims[("default", "c")]["status"]["devices"] == []
    monkeypatch.undo()

    again = p.prepare([ref])[ref.uid]
    assert again == first
    assert {path: path.read_bytes() for path in _files(tmp_path, ref.uid)} == files
    assert api.claims[("default", "c")]["status"]["devices"]
    assert Checkpoint(data, "boot").read()[ref.uid].state == PrepareState.COMPLETED
    p.close()
