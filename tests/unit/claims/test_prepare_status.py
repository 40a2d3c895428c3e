"""The claim status the driver applies: a Ready condition whose lastTransitionTime says when the
device became ready, not when the driver last wrote the status; and the API the status goes through."""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path

import pytest
from prepare_fakes import NODE, FakeAPI, Host, make_preparer, nic_name, render_host

from driver.claims.allocation import ClaimAPI, PrepareSettings
from driver.claims.checkpoint import Checkpoint
from driver.claims.metadata import MetadataWriter
from driver.claims.nic.network_data import NetworkDataRefresh
from driver.claims.unprepare import Unprepared
from driver.claims.vocabulary import PrepareState
from driver.kube.api import KubeAPI

LONG_AGO = "2020-01-02T03:04:05Z"


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory) -> Host:
    return render_host(tmp_path_factory.mktemp("host"))


def _ready_times(api: FakeAPI, name: str) -> list[str]:
    devices = api.claims[("default", name)]["status"].get("devices") or []
    return [c["lastTransitionTime"] for d in devices for c in d["conditions"] if c["type"] == "Ready"]


def _age_ready_conditions(api: FakeAPI, name: str) -> None:
    """As if the status had been applied long ago."""
    for d in api.claims[("default", name)]["status"]["devices"]:
        for c in d["conditions"]:
            c["lastTransitionTime"] = LONG_AGO


def test_a_resumed_prepare_keeps_the_ready_transition_time(tmp_path: Path, host: Host):
    api = FakeAPI()
    p = make_preparer(tmp_path / "data", tmp_path / "cdi", api, "a", host)
    ref = api.add("default", "c", "uid-1", ("gpu", "gpu-0"), ("nic", nic_name(host, "mlx5_0")))
    assert p.prepare([ref])[ref.uid].error == ""
    _age_ready_conditions(api, "c")
    # Interrupted after the status apply, before the record was completed: the next call redoes it.
    with Checkpoint(tmp_path / "data", "boot").transaction() as claims:
        claims[ref.uid] = dataclasses.replace(claims[ref.uid], state=PrepareState.STARTED, owner="a")
    assert p.prepare([ref])[ref.uid].error == ""
    assert len(api.applies) == 2
    assert _ready_times(api, "c") == [LONG_AGO, LONG_AGO]

    # Unprepared and prepared again: the condition is new, and so is its time.
    assert p.unprepare([ref]) == {ref.uid: Unprepared()}
    assert p.prepare([ref])[ref.uid].error == ""
    assert LONG_AGO not in _ready_times(api, "c")
    p.close()


def test_an_unprepare_without_a_record_still_withdraws_the_status(tmp_path: Path, host: Host):
    """kill -9 after the apply and before PrepareCompleted: start-up rolls the record back, so the
    kubelet's Unprepare finds none, yet the claim shows Ready until the withdrawal."""
    api = FakeAPI()
    p = make_preparer(tmp_path / "data", tmp_path / "cdi", api, "a", host)
    ref = api.add("default", "c", "uid-1")
    assert p.prepare([ref])[ref.uid].error == ""
    assert api.claims[("default", "c")]["status"]["devices"]
    with Checkpoint(tmp_path / "data", "boot").transaction() as claims:
        del claims[ref.uid]  # what the rollback leaves
    assert p.unprepare([ref]) == {ref.uid: Unprepared()}
    assert api.claims[("default", "c")]["status"]["devices"] == []
    p.close()


def test_an_apply_sent_before_a_failing_file_write_is_answered_before_the_call_returns(
    tmp_path: Path, host: Host, monkeypatch: pytest.MonkeyPatch
):
    """The apply goes out before the files are written. When a file write fails, the call must
    still read the apply's answer before it returns: an apply left in flight could land after the
    Unprepare that follows and leave a Ready status on an unprepared claim. (The fake server
    carries out an apply when its answer is read.)"""
    api = FakeAPI()
    p = make_preparer(tmp_path / "data", tmp_path / "cdi", api, "a", host)
    ref = api.add("default", "c", "uid-1", ("gpu", "gpu-0"))

    def disk_full(*_args: object) -> bool:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(p._files, "write_spec", disk_full)
    assert "No space left on device" in p.prepare([ref])[ref.uid].error
    assert api.applies == [("default", "c", "uid-1", 1)], "the apply's answer was not read before the call returned"
    p.close()


def test_a_nic_address_change_keeps_the_ready_transition_time(tmp_path: Path, host: Host):
    api = FakeAPI()
    devices = dict(host.devices)
    p = make_preparer(tmp_path / "data", tmp_path / "cdi", api, "a", dataclasses.replace(host, devices=devices))
    nic = nic_name(host, "mlx5_0")
    ref = api.add("default", "c", "uid-1", ("nic", nic))
    assert p.prepare([ref])[ref.uid].error == ""
    _age_ready_conditions(api, "c")

    old = devices[nic]
    assert old.nic is not None
    devices[nic] = dataclasses.replace(old, nic=dataclasses.replace(old.nic, ipv4=("10.9.9.9/24",)))
    refresh = NetworkDataRefresh(
        api,
        Checkpoint(tmp_path / "data", "boot"),
        PrepareSettings("tandem.dev", NODE, tmp_path / "cdi", host.dev),
        devices.get,
        MetadataWriter(tmp_path / "data", tmp_path / "cdi", "tandem.dev"),
        p.claim_locks,
    )
    assert refresh.run() == 1
    status = api.claims[("default", "c")]["status"]["devices"]
    assert status[0]["networkData"]["ips"][0] == "10.9.9.9/24"
    assert _ready_times(api, "c") == [LONG_AGO]
    p.close()


@pytest.mark.parametrize("method", ["apply_claim_status", "send_claim_status"])
@pytest.mark.parametrize("api", [ClaimAPI, KubeAPI])
def test_the_claim_status_apply_requires_the_claim_uid(api: type, method: str) -> None:
    """Without the UID the server cannot refuse an apply to a claim recreated under the same name."""
    uid = inspect.signature(getattr(api, method)).parameters["uid"]
    assert uid.kind == inspect.Parameter.KEYWORD_ONLY
    assert uid.default is inspect.Parameter.empty
