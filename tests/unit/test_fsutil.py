"""The one rule for reading a state file's format version, and setting aside one that cannot be read."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from driver.fsutil import NewerFormat, StateFileError, parse_state, read_json_state, set_aside, unchanged


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
