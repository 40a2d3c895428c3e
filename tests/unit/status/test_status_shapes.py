"""The status socket's documents as TypedDicts (`driver.status.shapes`): `checked` takes in what
fits and says where what does not, and `tandemctl` tells a daemon's odd answer in one line."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from driver.ctl import commands as ctl
from driver.status.shapes import ClaimDoc, DevicesDoc, HealthDoc, ReacquireAnswer, checked

DEVICE: dict[str, Any] = {
    "name": "gpu-0",
    "kind": "gpu",
    "model": "NVIDIA H100 80GB HBM3",
    "uuid": "GPU-aaaa",
    "rdmaDevice": None,
    "numaNode": 0,
    "pcieRoot": "pci0000:15",
    "pciBusID": "0000:1b:00.0",
    "health": "Healthy",
    "healthMessage": "",
    "taints": [{"key": "tandem.dev/xid", "value": "79", "effect": "NoExecute"}],
    "claims": ["ml/train"],
    "pods": ["ml/train-0"],
}
CLAIM: dict[str, Any] = {
    "uid": "u1",
    "namespace": "ml",
    "name": "train",
    "state": "PrepareCompleted",
    "pods": ["ml/train-0"],
    "devices": [{"requestNames": ["nic"], "pool": "node-a", "device": "nic-0", "shareID": "s", "exclusive": True}],
    "status": [{"device": "nic-0", "ready": True, "networkData": {"interfaceName": "net1", "ips": ["10.0.0.2/24"]}}],
    "files": {"cdiSpec": True, "metadataSpecs": False, "metadataDir": False},
    "lastError": None,
}
HEALTH: dict[str, Any] = {
    "status": "degraded",
    "ready": True,
    "reasons": ["1 device(s) not healthy: gpu-1"],
    "devices": {"total": 2, "Healthy": 1, "Unhealthy": 1, "Unknown": 0},
    "unhealthy": [{"device": "gpu-1", "reason": "XID 79"}],
    "cordoned": [{"device": "gpu-0", "reason": "fan", "by": "alice", "since": "2025-01-02T12:00:00Z", "present": True}],
    "released": [],
    "daemon": {"registered": True, "slices": {"published": 1}},
}


def test_a_document_that_fits_is_taken_as_it_is() -> None:
    devices = {"devices": [DEVICE]}
    assert checked(DevicesDoc, devices) is devices
    assert checked(ClaimDoc, CLAIM) is CLAIM
    assert checked(HealthDoc, HEALTH) is HEALTH


def test_keys_not_named_pass_and_not_required_ones_may_be_absent() -> None:
    """A newer daemon's keys, and the checkpoint's own in a record, are no error; a record of
    0.1.0 has no networkData, a device no cdiDeviceIDs."""
    newer = copy.deepcopy(CLAIM) | {"owner": "pod-1", "since": "x"}
    newer["devices"][0].pop("shareID")
    del newer["status"][0]["networkData"]
    assert checked(ClaimDoc, newer) is newer


@pytest.mark.parametrize(
    ("change", "where"),
    [
        (lambda d: d["devices"][0].pop("kind"), "devices[0]: no 'kind'"),
        (lambda d: d["devices"][0].update(taints={}), "devices[0].taints: an object, not a list"),
        (lambda d: d["devices"][0]["taints"][0].pop("effect"), "devices[0].taints[0]: no 'effect'"),
        (
            lambda d: d["devices"][0].update(numaNode={"a": 1}),
            "devices[0].numaNode: an object, not a boolean, an integer, a string, a list or null",
        ),
        (lambda d: d["devices"][0].update(claims=["ml/train", 5]), "devices[0].claims[1]: a number, not a string"),
        (lambda d: d["devices"][0].update(model=["x", {}]), "devices[0].model[1]: an object, not a boolean, an"),
        (lambda d: d.update(devices=None), "devices: null, not a list"),
    ],
)
def test_a_document_that_does_not_fit_says_where(change: Any, where: str) -> None:
    doc = {"devices": [copy.deepcopy(DEVICE)]}
    change(doc)
    with pytest.raises(TypeError) as e:
        checked(DevicesDoc, doc)
    assert str(e.value).startswith(where)


def test_scalars_are_told_apart_as_json_does() -> None:
    """true is no count, 1 no boolean, and a status is one of three words."""
    with pytest.raises(TypeError, match=r"devices\.total: a boolean, not an integer"):
        checked(HealthDoc, HEALTH | {"devices": HEALTH["devices"] | {"total": True}})
    with pytest.raises(TypeError, match="ready: a number, not a boolean"):
        checked(HealthDoc, HEALTH | {"ready": 1})
    with pytest.raises(TypeError, match="status: a string, not 'healthy', 'degraded' or 'unhealthy'"):
        checked(HealthDoc, HEALTH | {"status": "fine"})
    with pytest.raises(TypeError, match="lastError: a string, not an object or null"):
        checked(ClaimDoc, CLAIM | {"lastError": "boom"})
    with pytest.raises(TypeError, match=r"^the document: a list, not an object"):
        checked(ReacquireAnswer, [])


@pytest.mark.parametrize(
    ("argv", "answer", "said"),
    [
        (["devices"], {"devices": [{"name": "gpu-0"}]}, "devices[0]: no 'kind'"),
        (["health"], {"ready": True}, "the document: no 'status'"),
        (["claim", "ml/train"], CLAIM | {"files": []}, "files: a list, not an object"),
        (["uncordon", "gpu-0"], ["ok"], "the document: a list, not an object"),
        (["devices", "-o", "json"], {}, "the document: no 'devices'"),
    ],
)
def test_ctl_tells_an_unexpected_answer_in_one_line(
    argv: list[str],
    answer: object,
    said: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setattr(ctl, "request", lambda *_args: (200, answer))
    assert ctl.main(["--socket", "/nowhere/status.sock", *argv]) == ctl.EXIT_UNREACHABLE
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("tandemctl: the daemon at /nowhere/status.sock answered with an unexpected document: ")
    assert said in err


def test_ctl_tells_a_refusal_without_an_error_by_its_status(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(ctl, "request", lambda *_args: (500, {"message": "?"}))
    assert ctl.main(["--socket", "/nowhere/status.sock", "cordon", "gpu-0", "--reason", "x"]) == ctl.EXIT_DEGRADED
    assert capsys.readouterr().err == "tandemctl: request failed with HTTP 500\n"


def test_readiness_says_an_unexpected_health_document_is_not_ready(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ctl, "request", lambda *_args: (200, {"ready": True}))
    assert ctl.unready_reason(Path("/nowhere/status.sock"), 1) == (
        "the daemon's /health answered an unexpected document: the document: no 'status'"
    )
    monkeypatch.setattr(ctl, "request", lambda *_args: (200, HEALTH))
    assert ctl.unready_reason(Path("/nowhere/status.sock"), 1) is None
