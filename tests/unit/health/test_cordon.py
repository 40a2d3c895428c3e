"""Manual cordons: persisted before they apply, survive restarts, tolerate a corrupt file."""

from __future__ import annotations

import datetime
import json
import os
from pathlib import Path

import pytest

from driver.health import cordon as cordon_mod
from driver.health.cordon import CordonError, CordonStore, UnknownDevice
from driver.inventory.store import Inventory
from driver.model import Condition, Device, DeviceKind, Health, Taint, TaintEffect

KEY = "tandem.dev/cordoned"
CORDON_TAINT = Taint(KEY, TaintEffect.NO_SCHEDULE, "manual")


def _devices(*names: str) -> list[Device]:
    return [Device(name=n, kind=DeviceKind.NIC if n.startswith("nic") else DeviceKind.GPU) for n in names]


def _inventory(*names: str) -> Inventory:
    inv = Inventory()
    inv.replace("gpu", [d for d in _devices(*names) if d.kind == DeviceKind.GPU])
    inv.replace("nic", [d for d in _devices(*names) if d.kind == DeviceKind.NIC])
    return inv


def _device(inv: Inventory, name: str) -> Device:
    dev = inv.get(name)
    assert dev is not None, name
    return dev


def test_cordon_taints_one_device_without_making_it_unhealthy(tmp_path: Path) -> None:
    inv = _inventory("gpu-0", "gpu-1", "nic-0")
    store = CordonStore(tmp_path, inv)
    c = store.cordon("gpu-0", "  replacing fan  ", by="alice")

    assert (c.device, c.reason, c.by) == ("gpu-0", "replacing fan", "alice")
    assert datetime.datetime.fromisoformat(c.since).tzinfo is not None
    [cond] = inv.conditions("cordon")["gpu-0"]
    assert cond == Condition(KEY, TaintEffect.NO_SCHEDULE, "manual", message=cond.message, unhealthy=False)
    assert "replacing fan" in cond.message and "alice" in cond.message and c.since in cond.message
    gpu0 = _device(inv, "gpu-0")
    assert gpu0.taints == (CORDON_TAINT,)
    assert gpu0.health == Health.HEALTHY
    assert _device(inv, "gpu-1").taints == () and _device(inv, "nic-0").taints == ()


def test_cordon_survives_restart(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[int] = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd)))
    CordonStore(tmp_path, _inventory("gpu-0", "nic-0")).cordon("nic-0", "flapping link", by="bob")
    assert len(synced) == 2  # durable, unlike prepared claims' state: the file and its rename survive a reboot

    inv = _inventory("gpu-0", "nic-0")  # a new daemon: fresh inventory, same data dir
    store = CordonStore(tmp_path, inv)
    assert _device(inv, "nic-0").taints == ()
    [loaded] = store.load()
    assert (loaded.device, loaded.reason, loaded.by) == ("nic-0", "flapping link", "bob")
    assert _device(inv, "nic-0").taints == (CORDON_TAINT,)
    assert store.list() == [loaded]


def test_domain_and_source_are_configurable(tmp_path: Path) -> None:
    inv = _inventory("gpu-0")
    CordonStore(tmp_path, inv, domain="gpu.example.com", source="manual").cordon("gpu-0", "x")
    assert set(inv.conditions("manual")) == {"gpu-0"}
    assert _device(inv, "gpu-0").taints == (Taint("gpu.example.com/cordoned", TaintEffect.NO_SCHEDULE, "manual"),)


def test_uncordon_lifts_and_persists(tmp_path: Path) -> None:
    inv = _inventory("gpu-0")
    store = CordonStore(tmp_path, inv)
    store.cordon("gpu-0", "x")
    assert store.uncordon("gpu-0") is True
    assert _device(inv, "gpu-0").taints == ()
    assert store.uncordon("gpu-0") is False

    inv2 = _inventory("gpu-0")
    assert CordonStore(tmp_path, inv2).load() == []
    assert _device(inv2, "gpu-0").taints == ()


def test_unknown_device_is_refused_with_close_names(tmp_path: Path) -> None:
    inv = _inventory("gpu-0", "gpu-1", "nic-0")
    store = CordonStore(tmp_path, inv)
    with pytest.raises(UnknownDevice, match="gpu-0") as err:
        store.cordon("gpu0", "x")
    assert "nic-0" not in str(err.value)
    with pytest.raises(UnknownDevice, match="known devices: gpu-0, gpu-1, nic-0"):
        store.cordon("zzzzzz", "x")
    assert not store.path.exists()
    assert inv.conditions("cordon") == {}


@pytest.mark.parametrize("reason", ["", "   ", "x" * 257, "two\nlines", "bell\x07"])
def test_bad_reason_is_refused(tmp_path: Path, reason: str) -> None:
    store = CordonStore(tmp_path, _inventory("gpu-0"))
    with pytest.raises(CordonError, match="reason"):
        store.cordon("gpu-0", reason)
    assert not store.path.exists()


def test_reason_at_the_limit_is_accepted(tmp_path: Path) -> None:
    store = CordonStore(tmp_path, _inventory("gpu-0"))
    assert store.cordon("gpu-0", "x" * 256).reason == "x" * 256


def test_persisted_before_applied(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A cordon the disk did not take must not be in effect: it would vanish on restart."""
    inv = _inventory("gpu-0")
    store = CordonStore(tmp_path, inv)

    def disk_full(*_args: object, **_kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(cordon_mod, "atomic_write", disk_full)
    with pytest.raises(OSError, match="No space"):
        store.cordon("gpu-0", "x")
    assert _device(inv, "gpu-0").taints == ()


def test_corrupt_file_is_moved_aside(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "cordons.json").write_text("{not json")
    inv = _inventory("gpu-0")
    store = CordonStore(tmp_path, inv)
    assert store.load() == []
    assert not store.path.exists()
    [aside] = tmp_path.glob("cordons.json.corrupt-*")
    assert aside.read_text() == "{not json"
    assert "unreadable" in caplog.text
    store.cordon("gpu-0", "after the mess")
    assert _device(inv, "gpu-0").taints == (CORDON_TAINT,)


@pytest.mark.parametrize("content", ['["a list"]', '{"cordons": []}', b"\xff\xfe"])
def test_wrong_shape_is_corrupt(tmp_path: Path, content: str | bytes) -> None:
    path = tmp_path / "cordons.json"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    assert CordonStore(tmp_path, _inventory("gpu-0")).load() == []
    assert len(list(tmp_path.glob("cordons.json.corrupt-*"))) == 1


def test_a_file_without_a_version_is_read_and_rewritten_at_the_current_one(tmp_path: Path) -> None:
    """An upgrade from a release that wrote no version: its cordons still apply."""
    doc = {"cordons": {"gpu-0": {"reason": "fan", "by": "", "since": ""}}}
    (tmp_path / "cordons.json").write_text(json.dumps(doc))
    inv = _inventory("gpu-0", "gpu-1")
    store = CordonStore(tmp_path, inv)
    assert [c.device for c in store.load()] == ["gpu-0"]
    store.cordon("gpu-1", "psu")
    raw = json.loads(store.path.read_text())
    assert raw["version"] == cordon_mod.FORMAT_VERSION == 1 and sorted(raw["cordons"]) == ["gpu-0", "gpu-1"]


def test_a_file_of_a_newer_format_is_set_aside_whole(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A downgrade: the file is neither misread nor overwritten, and the daemon goes on as for an
    unreadable file (none of its cordons apply); the newer release can read it again."""
    content = json.dumps({"version": 2, "cordons": [{"device": "gpu-0", "reason": "fan"}]})
    (tmp_path / "cordons.json").write_text(content)
    inv = _inventory("gpu-0")
    store = CordonStore(tmp_path, inv)
    assert store.load() == []
    [aside] = tmp_path.glob("cordons.json.newer-*")
    assert aside.read_text() == content
    assert "format version 2 is newer" in caplog.text
    store.cordon("gpu-0", "again")
    assert json.loads(store.path.read_text())["version"] == 1 and aside.read_text() == content


def test_bad_entry_is_skipped_good_ones_apply(tmp_path: Path) -> None:
    doc = {"version": 1, "cordons": {"gpu-0": {"reason": 7}, "gpu-1": {"reason": "ok", "by": "", "since": ""}}}
    (tmp_path / "cordons.json").write_text(json.dumps(doc))
    inv = _inventory("gpu-0", "gpu-1")
    assert [c.device for c in CordonStore(tmp_path, inv).load()] == ["gpu-1"]
    assert _device(inv, "gpu-0").taints == ()
    assert _device(inv, "gpu-1").taints == (CORDON_TAINT,)


def test_cordon_of_absent_device_applies_when_it_returns(tmp_path: Path) -> None:
    CordonStore(tmp_path, _inventory("gpu-0", "gpu-1")).cordon("gpu-1", "drained for RMA")

    inv = _inventory("gpu-0")  # gpu-1 is gone after the restart
    store = CordonStore(tmp_path, inv)
    assert [c.device for c in store.load()] == ["gpu-1"]
    assert inv.get("gpu-1") is None
    assert [c.device for c in store.list()] == ["gpu-1"]  # still on file

    inv.replace("gpu", _devices("gpu-0", "gpu-1"))
    assert _device(inv, "gpu-1").taints == (CORDON_TAINT,)
    assert _device(inv, "gpu-0").taints == ()


def test_uncordon_of_absent_device_cleans_up(tmp_path: Path) -> None:
    CordonStore(tmp_path, _inventory("gpu-0")).cordon("gpu-0", "retired")
    store = CordonStore(tmp_path, _inventory())
    store.load()
    assert store.uncordon("gpu-0") is True
    assert store.list() == []


def test_two_instances_keep_each_others_cordons(tmp_path: Path) -> None:
    """Rolling update: both daemons write the one file; neither may drop the other's cordon."""
    old_inv, new_inv = _inventory("gpu-0", "nic-0"), _inventory("gpu-0", "nic-0")
    old, new = CordonStore(tmp_path, old_inv), CordonStore(tmp_path, new_inv)
    old.cordon("gpu-0", "a")
    new.cordon("nic-0", "b")
    assert [c.device for c in old.list()] == ["gpu-0", "nic-0"]
    assert _device(new_inv, "gpu-0").taints == (CORDON_TAINT,)
    new.uncordon("gpu-0")
    assert old.load()[0].device == "nic-0"
    assert _device(old_inv, "gpu-0").taints == ()
