"""A claim allocated again under the same UID while its preparation here outlived it: the prepare
decides against the allocation as it is now, never against the record of the old one."""

from __future__ import annotations

import json
from pathlib import Path

from prepare_fakes import FakeAPI, make_preparer, render_host

from driver.claims.checkpoint import Checkpoint


def _spec_devices(cdi_root: Path) -> set[str]:
    names = set()
    for spec in cdi_root.glob("*.json"):
        names |= {d["name"] for d in json.loads(spec.read_text()).get("devices", [])}
    return names


def test_a_reallocated_claim_is_prepared_for_its_new_devices_and_its_old_preparation_undone(tmp_path: Path) -> None:
    host = render_host(tmp_path / "host")
    api = FakeAPI()
    p = make_preparer(tmp_path / "data", tmp_path / "cdi", api, "a", host)
    try:
        ref = api.add("default", "c", "uid-1", ("gpu", "gpu-0"))
        assert [d.device for d in p.prepare([ref])[ref.uid].devices] == ["gpu-0"]
        api.add("default", "c", "uid-1", ("gpu", "gpu-1"))  # deallocated and allocated again, same UID
        again = p.prepare([ref])[ref.uid]
        assert again.error == ""
        assert [d.device for d in again.devices] == ["gpu-1"]
        record = Checkpoint(tmp_path / "data", "boot").read()[ref.uid]
        assert [d.device for d in record.devices] == ["gpu-1"]
        names = _spec_devices(tmp_path / "cdi")
        assert "uid-1-gpu-1" in names and "uid-1-gpu-0" not in names
    finally:
        p.close()


def test_a_reallocation_onto_a_device_another_claim_holds_is_refused(tmp_path: Path) -> None:
    """The in-use check a completed record would have skipped: the new device is another claim's."""
    host = render_host(tmp_path / "host")
    api = FakeAPI()
    p = make_preparer(tmp_path / "data", tmp_path / "cdi", api, "a", host)
    try:
        mine = api.add("default", "mine", "uid-mine", ("gpu", "gpu-0"))
        theirs = api.add("other", "theirs", "uid-theirs", ("gpu", "gpu-2"))
        assert [r.error for r in p.prepare([mine, theirs]).values()] == ["", ""]
        api.add("default", "mine", "uid-mine", ("gpu", "gpu-2"))
        refused = p.prepare([mine])[mine.uid]
        assert "already prepared for claim other/theirs" in refused.error
        assert [d.device for d in Checkpoint(tmp_path / "data", "boot").read()["uid-theirs"].devices] == ["gpu-2"]
        assert "uid-mine" not in Checkpoint(tmp_path / "data", "boot").read()
    finally:
        p.close()
