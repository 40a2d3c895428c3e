"""The one rule for reading a state file's format version, setting aside one that cannot be read,
and the data dir being Tandem's alone whoever made it."""

from __future__ import annotations

import json
import os
import stat
import time
from pathlib import Path
from typing import Any

import pytest

from driver.errors import NodeError
from driver.fsutil import (
    NewerFormat,
    StateFileError,
    parse_state,
    read_json_state,
    secure_data_dir,
    set_aside,
    unchanged,
)


def _doc(**top: Any) -> bytes:
    return json.dumps(top).encode()


def test_the_current_version_is_read_as_it_is() -> None:
    assert parse_state(_doc(version=2, items=[1]), 2, {}) == {"version": 2, "items": [1]}


def test_an_older_version_is_upgraded_step_by_step_and_no_version_is_version_0() -> None:
    steps: list[int] = []

    def step(n: int) -> Any:
        def up(doc: dict[str, Any]) -> dict[str, Any]:
            steps.append(n)
            return {**doc, "seen": [*doc.get("seen", []), n]}

        return up

    upgrades = {0: step(0), 1: step(1), 2: step(2)}
    assert parse_state(_doc(items={}), 3, upgrades)["seen"] == [0, 1, 2]
    assert parse_state(_doc(version=2), 3, upgrades)["seen"] == [2]
    assert steps == [0, 1, 2, 2]
    assert parse_state(_doc(cordons={"gpu-0": {}}), 1, {0: unchanged}) == {"cordons": {"gpu-0": {}}}


def test_a_newer_version_is_refused_naming_both_versions() -> None:
    with pytest.raises(NewerFormat, match=r"format version 2 is newer than this release of Tandem reads \(up to 1\)"):
        parse_state(_doc(version=2), 1, {0: unchanged})


def test_a_version_no_step_leads_from_is_refused() -> None:
    with pytest.raises(StateFileError, match="format version 0 is older than this release") as e:
        parse_state(_doc(), 2, {1: unchanged})
    assert not isinstance(e.value, NewerFormat)


@pytest.mark.parametrize("version", ["1", True, -1, 1.0, None])
def test_a_version_that_is_no_whole_number_is_refused(version: object) -> None:
    with pytest.raises(StateFileError, match="is not a whole number"):
        parse_state(_doc(version=version), 1, {0: unchanged})


def test_json_that_is_no_object_is_refused() -> None:
    with pytest.raises(StateFileError, match="not an object"):
        parse_state(b'["a list"]', 1, {})


def test_a_file_of_a_newer_version_is_set_aside_whole_and_counts_as_missing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A downgrade must not crash-loop the daemon, misread the file or lose it: the release that
    wrote it can still read it."""
    path = tmp_path / "state.json"
    content = _doc(version=2, things={"a": 1})
    path.write_bytes(content)
    assert read_json_state(path, "thing", "things", dict, version=1, upgrades={0: unchanged}) == {}
    assert not path.exists()
    [aside] = tmp_path.glob("state.json.newer-*")
    assert aside.read_bytes() == content
    assert "format version 2 is newer" in caplog.text and str(aside) in caplog.text


def test_a_file_of_an_older_version_is_read_upgraded(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    path.write_bytes(json.dumps({"a": {"x": 1}}).encode())  # version 0: the whole object was the mapping
    things = read_json_state(path, "thing", "things", dict, version=1, upgrades={0: lambda doc: {"things": doc}})
    assert things == {"a": {"x": 1}}
    assert path.exists()  # read, not set aside


def test_files_set_aside_within_one_clock_tick_are_all_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two instances of a rolling update may each set the file aside within one tick of the clock:
    the second must not replace the first."""
    monkeypatch.setattr(time, "time_ns", lambda: 1_700_000_000_000_000_000)
    path = tmp_path / "state.json"
    for content in (b"{one", b"{two"):
        path.write_bytes(content)
        set_aside(path, "thing", ValueError("bad"), "none apply")
    assert sorted(p.read_bytes() for p in tmp_path.glob("state.json.corrupt-*")) == [b"{one", b"{two"]


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def test_a_missing_data_dir_is_made_0750(tmp_path: Path) -> None:
    data = tmp_path / "plugins" / "tandem.dev"
    secure_data_dir(data)
    assert _mode(data) == 0o750


@pytest.mark.parametrize("before", [0o755, 0o777, 0o1777, 0o700])
def test_a_data_dir_made_before_tandem_ends_0750(tmp_path: Path, before: int, caplog: pytest.LogCaptureFixture) -> None:
    """The kubelet's DirectoryOrCreate makes it 0755 before Tandem starts; mkdir's mode changes
    nothing then. One anybody could write gets a warning: what it holds may not all be Tandem's."""
    data = tmp_path / "tandem.dev"
    data.mkdir()
    os.chmod(data, before)
    (data / "checkpoint.json").write_text("{}")
    secure_data_dir(data)
    assert _mode(data) == 0o750
    assert (data / "checkpoint.json").read_text() == "{}"  # nothing in it moved or lost
    assert ("writable by group or others" in caplog.text) == bool(before & 0o022)


def test_state_directories_in_it_lose_group_and_other_write_and_the_tenants_side_is_left_alone(tmp_path: Path) -> None:
    data = tmp_path / "tandem.dev"
    made = {
        "instances": 0o777,
        "mps": 0o775,
        "mps/gpu-0": 0o777,
        "mps/gpu-0/pipe-1": 0o777,  # the tenants' side of an MPS GPU: not Tandem's state
        "dra-device-metadata": 0o755,
        "dra-device-metadata/0b5e4a7c-1111-4a2b-8c3d-000000000001": 0o757,
    }
    for name, mode in made.items():
        (data / name).mkdir(parents=True)
        os.chmod(data / name, mode)
    (data / "mps/gpu-0/pipe").symlink_to("pipe-1")  # Tandem's link to it (driver/claims/gpu/mps_pipes.py)
    secure_data_dir(data)
    assert {name: _mode(data / name) for name in made} == {
        "instances": 0o755,
        "mps": 0o755,
        "mps/gpu-0": 0o755,
        "mps/gpu-0/pipe-1": 0o777,
        "dra-device-metadata": 0o755,
        "dra-device-metadata/0b5e4a7c-1111-4a2b-8c3d-000000000001": 0o755,
    }


@pytest.mark.parametrize("where", ["", "mps", "mps/gpu-0", "checkpoint.json"])
def test_a_symlink_for_the_data_dir_or_in_it_is_refused_and_nothing_is_changed(tmp_path: Path, where: str) -> None:
    """A link decides where Tandem's state goes, and whoever can change the link decides with it.
    Tandem makes no link there; finding one, it refuses to start, saying what to do, and follows
    none: the directory the link leads to keeps its mode."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o777)
    os.chmod(elsewhere, 0o777)
    data = tmp_path / "tandem.dev"
    link = data / where if where else data
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(elsewhere)
    with pytest.raises(
        NodeError, match=rf"{link} is a symlink \(to {elsewhere}\), not a directory: .* start Tandem again"
    ):
        secure_data_dir(data)
    assert _mode(elsewhere) == 0o777


def test_a_dangling_symlink_for_the_data_dir_is_refused_and_not_made(tmp_path: Path) -> None:
    data = tmp_path / "tandem.dev"
    data.symlink_to(tmp_path / "nowhere")
    with pytest.raises(NodeError, match="is a symlink"):
        secure_data_dir(data)
    assert not (tmp_path / "nowhere").exists()


def test_a_data_dir_of_another_user_is_refused_and_left_as_it_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Owned by another user, it is that user's to change, whatever its mode: refused, saying what
    to do, and not touched. Here Tandem runs as another user instead (a chown needs root:
    the next test and tests/integration/test_deployment.py chown for real)."""
    data = tmp_path / "tandem.dev"
    data.mkdir()
    os.chmod(data, 0o777)
    owner = os.geteuid()
    monkeypatch.setattr(os, "geteuid", lambda: owner + 1)
    with pytest.raises(NodeError, match=rf"{data} belongs to user {owner}, not to Tandem's \({owner + 1}\).*chown"):
        secure_data_dir(data)
    assert _mode(data) == 0o777


@pytest.mark.parametrize("where", ["instances", "mps/gpu-0"])
def test_a_state_dir_of_another_user_in_the_data_dir_is_refused(tmp_path: Path, where: str) -> None:
    if os.geteuid() != 0:
        pytest.skip("giving a directory to another user needs root")
    data = tmp_path / "tandem.dev"
    (data / where).mkdir(parents=True)
    os.chown(data / where, 65534, 65534)
    with pytest.raises(NodeError, match=rf"{data / where} belongs to user 65534, not to Tandem's \(0\)"):
        secure_data_dir(data)
