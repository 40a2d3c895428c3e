"""The Preparer against a fake API: races the kubelet and a rolling update can produce (two
Preparers on one data dir), and how requests are named in the device metadata.

The API is a fake whose status apply can be held, so the test decides exactly when the other
party acts: what matters is what is left on disk and in the checkpoint afterwards.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest

from driver.checkpoint import STATE_COMPLETED, Checkpoint, InstanceLock
from driver.claims import ClaimRef, PrepareSettings
from driver.discovery.nvidia_files import DriverFiles
from driver.metadata import MetadataWriter
from driver.model import Device, DeviceKind, GpuInfo
from driver.prepare import Preparer

DRIVER, NODE = "tandem.dev", "n1"
GPU = Device("gpu-0", DeviceKind.GPU, {"type": "gpu"}, gpu=GpuInfo(minor=0, uuid="GPU-0", pci_bus_id="0000:16:00.0"))


class FakeAPI:
    def __init__(self) -> None:
        self.claims: dict[tuple[str, str], dict[str, Any]] = {}
        self.hold = threading.Event()
        self.held = threading.Event()
        self.hold.set()
        self.applies: list[tuple[str, str, str, int]] = []

    def add(self, namespace: str, name: str, uid: str) -> ClaimRef:
        results = [{"request": "gpu", "driver": DRIVER, "pool": NODE, "device": "gpu-0"}]
        self.claims[(namespace, name)] = {
            "metadata": {"name": name, "namespace": namespace, "uid": uid},
            "status": {"allocation": {"devices": {"results": results}}},
        }
        return ClaimRef(namespace, name, uid)

    def get_claim(self, namespace: str, name: str) -> dict[str, Any]:
        return self.claims[(namespace, name)]

    def apply_claim_status(self, namespace: str, name: str, devices: list, field_manager: str, uid: str = "") -> None:
        if devices:
            self.held.set()
            self.hold.wait(10)
        self.applies.append((namespace, name, uid, len(devices)))


def _preparer(data: Path, cdi_root: Path, api: FakeAPI, instance: str) -> Preparer:
    (cdi_root / "dev").mkdir(parents=True, exist_ok=True)
    return Preparer(
        api=api,
        checkpoint=Checkpoint(data, "boot"),
        instance=InstanceLock(data, instance),
        settings=PrepareSettings(DRIVER, NODE, cdi_root, cdi_root / "dev"),
        lookup_device={"gpu-0": GPU}.get,
        driver_files=DriverFiles,
        metadata=MetadataWriter(data, cdi_root, DRIVER),
    )


@pytest.fixture
def setup(tmp_path: Path):
    data, cdi_root = tmp_path / "data", tmp_path / "cdi"
    data.mkdir()
    api = FakeAPI()
    a = _preparer(data, cdi_root, api, "a")
    b = _preparer(data, cdi_root, api, "b")
    yield api, a, b, data, cdi_root
    a.close()
    b.close()


def _files(data: Path, cdi_root: Path) -> list[str]:
    return sorted(p.name for p in cdi_root.glob("*.json")) + sorted(
        p.name for p in (data / "dra-device-metadata").glob("*")
    )


def test_unprepare_by_the_other_instance_mid_prepare_leaves_nothing(setup):
    api, a, b, data, cdi_root = setup
    ref = api.add("default", "c", "uid-1")
    api.hold.clear()
    result: list = []
    t = threading.Thread(target=lambda: result.append(a.prepare([ref])[ref.uid]))
    t.start()
    assert api.held.wait(10), "instance A never reached the status apply"
    assert _files(data, cdi_root), "A has written its files before the apply"
    assert b.unprepare([ref]) == {ref.uid: ""}  # the kubelet asks the newer instance
    api.hold.set()
    t.join(10)
    assert "unprepared while being prepared" in result[0].error
    assert Checkpoint(data, "boot").read() == {}
    assert _files(data, cdi_root) == []


def test_a_late_unprepare_of_an_old_claim_spares_the_new_claim_of_the_same_name(setup):
    api, a, _, data, cdi_root = setup
    old = api.add("default", "c", "uid-old")
    assert a.prepare([old])[old.uid].error == ""
    assert a.unprepare([old]) == {old.uid: ""}
    new = api.add("default", "c", "uid-new")
    assert a.prepare([new])[new.uid].error == ""
    before = _files(data, cdi_root)
    assert a.unprepare([old]) == {old.uid: ""}  # retried by the kubelet, long after
    assert _files(data, cdi_root) == before
    assert Checkpoint(data, "boot").read()[new.uid].state == STATE_COMPLETED
    assert api.applies[-1][:3] != ("default", "c", "uid-old"), "no status write for a claim not prepared here"


def test_a_cancelled_call_prepares_nothing(setup):
    api, a, _, data, cdi_root = setup
    ref = api.add("default", "c", "uid-1")
    result = a.prepare([ref], alive=lambda: False)[ref.uid]
    assert "cancelled" in result.error
    assert Checkpoint(data, "boot").read() == {} and _files(data, cdi_root) == []


def test_metadata_names_the_subrequest_and_the_response_its_parent(setup):
    api, a, _, data, _ = setup
    ref = api.add("default", "c", "uid-1")
    api.claims[("default", "c")]["status"]["allocation"]["devices"]["results"][0]["request"] = "gpu/large"
    result = a.prepare([ref])[ref.uid]
    assert result.devices[0].request_names == ("gpu",)
    doc, _ = json.JSONDecoder().raw_decode((data / "dra-device-metadata/default_c/gpu/metadata.json").read_text())
    assert doc["requests"][0]["name"] == "gpu/large"
