"""Reset XIDs held until evidence outlive a restart of the daemon (`driver.health.gpu.held`): a new
monitor's conditions over the same data dir hold them again, keyed by the GPU's UUID and PCI
address, of this boot only; no NVML and no thread, so each rule is driven directly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from driver.health.gpu.conditions import GpuConditions
from driver.health.gpu.held import FILE_NAME, HeldResets
from driver.health.gpu.policy import GpuHealthPolicy, index_gpus
from driver.inventory.store import Inventory
from driver.model import Device, DeviceKind, GpuInfo, TaintEffect

SOURCE = "gpu-health"
BOOT = "boot-1"
NOT_REPORTED = None  # a driver without NVML's recovery-action field
XID = "tandem.dev/xid"


def _gpu(minor: int, uuid: str = "", pci: str = "") -> Device:
    info = GpuInfo(minor=minor, uuid=uuid or f"GPU-{minor}", pci_bus_id=pci or f"0000:0{minor}:00.0")
    return Device(f"gpu-{minor}", DeviceKind.GPU, gpu=info)


def _mig(name: str, gi: int) -> Device:
    info = GpuInfo(minor=0, uuid=f"MIG-{name}", pci_bus_id="0000:00:00.0", parent_uuid="GPU-0", mig_gi=gi, mig_ci=0)
    return Device(name, DeviceKind.MIG, gpu=info)


def _daemon(
    data: Path, devices: list[Device], policy: GpuHealthPolicy | None = None, boot: str = BOOT
) -> GpuConditions:
    """The GPU monitor's conditions of a daemon (re)started over `data`, its first probe done."""
    inv = Inventory()
    inv.replace("gpu", devices)
    c = GpuConditions(inv, policy or GpuHealthPolicy(), SOURCE, HeldResets(data, boot))
    c.restore(now=0.0)
    _probe(c)
    return c


def _probe(c: GpuConditions) -> None:
    """What each probe does with the conditions: forget what is gone, then publish."""
    gpus = index_gpus(c.inventory.devices())
    c.forget_gone(gpus)
    c.publish(gpus)


def _hold(c: GpuConditions, subject: str, xid: int) -> None:
    assert c.observe([subject], c.policy.xid(xid, NOT_REPORTED), 0.0, c.policy.needs_reset(xid, NOT_REPORTED))
    c.publish()


def _taints(c: GpuConditions) -> dict[str, set[tuple[str, str, TaintEffect]]]:
    return {d: {(x.key, x.value, x.effect) for x in conds} for d, conds in c.inventory.conditions(SOURCE).items()}


def _entries(data: Path) -> list[dict]:
    doc = json.loads((data / FILE_NAME).read_text())
    assert doc["version"] == 1 and doc["held"]["boot"] == BOOT
    return doc["held"]["entries"]


def test_a_held_reset_xid_is_held_again_after_a_restart_and_clears_on_evidence(tmp_path: Path) -> None:
    gpus = [_gpu(0), _gpu(1)]
    before = _daemon(tmp_path, gpus)
    _hold(before, "GPU-1", 79)
    assert before.observe(["GPU-0"], before.policy.xid(94, NOT_REPORTED), 0.0)  # a quiet period: not kept
    before.publish()
    assert _entries(tmp_path) == [{"gpu": "GPU-1", "pci": "0000:01:00.0", "subject": "GPU-1", "xid": 79}]

    after = _daemon(tmp_path, gpus)
    assert _taints(after) == {"gpu-1": {(XID, "79", TaintEffect.NO_EXECUTE)}}
    after.state.expire(now=1e9)  # no quiet period ends it
    assert after.reset({"GPU-1": "reacquired"})
    after.publish()
    assert _taints(after) == {} and _entries(tmp_path) == []
    assert _taints(_daemon(tmp_path, gpus)) == {}, "the evidence outlives the restart too"


def test_a_mig_devices_hold_is_kept_by_its_own_uuid(tmp_path: Path) -> None:
    devices = [_mig("mig-1", 1), _mig("mig-2", 2)]
    _hold(_daemon(tmp_path, devices), "MIG-mig-2", 48)
    assert _entries(tmp_path) == [{"gpu": "GPU-0", "pci": "0000:00:00.0", "subject": "MIG-mig-2", "xid": 48}]
    assert _taints(_daemon(tmp_path, devices)) == {"mig-2": {(XID, "48", TaintEffect.NO_EXECUTE)}}


def test_a_reboot_is_evidence(tmp_path: Path) -> None:
    _hold(_daemon(tmp_path, [_gpu(0)]), "GPU-0", 79)
    assert _taints(_daemon(tmp_path, [_gpu(0)], boot="boot-2")) == {}


def test_the_policy_in_force_makes_the_condition_again(tmp_path: Path) -> None:
    _hold(_daemon(tmp_path, [_gpu(0), _gpu(1)]), "GPU-0", 79)
    _hold(_daemon(tmp_path, [_gpu(0), _gpu(1)]), "GPU-1", 48)
    evicting = GpuHealthPolicy(effects={XID: TaintEffect.NO_SCHEDULE}, ignored_xids=frozenset({48}))
    assert _taints(_daemon(tmp_path, [_gpu(0), _gpu(1)], evicting)) == {"gpu-0": {(XID, "79", TaintEffect.NO_SCHEDULE)}}


@pytest.mark.parametrize(
    ("found", "why"),
    [
        (_gpu(1, uuid="GPU-0", pci="0000:07:00.0"), "the same GPU in another slot: it was taken out, serviced"),
        (_gpu(0, uuid="GPU-new"), "another GPU at its address: it was replaced"),
    ],
)
def test_a_moved_or_replaced_gpu_drops_its_hold(tmp_path: Path, found: Device, why: str) -> None:
    _hold(_daemon(tmp_path, [_gpu(0)]), "GPU-0", 79)
    after = _daemon(tmp_path, [found])
    assert _taints(after) == {}, why
    assert _entries(tmp_path) == [], why


def test_a_gpu_not_found_at_start_keeps_its_hold_until_it_is(tmp_path: Path) -> None:
    """NVML may not enumerate a GPU that is off the bus; not found is not evidence."""
    _hold(_daemon(tmp_path, [_gpu(0), _gpu(1)]), "GPU-1", 79)
    after = _daemon(tmp_path, [_gpu(0)])
    assert _taints(after) == {}
    _probe(after)
    assert [e["subject"] for e in _entries(tmp_path)] == ["GPU-1"], "kept while the GPU is away"
    after.inventory.replace("gpu", [_gpu(0), _gpu(1)])
    _probe(after)
    assert _taints(after) == {"gpu-1": {(XID, "79", TaintEffect.NO_EXECUTE)}}


def test_a_gpu_that_leaves_while_the_daemon_runs_starts_clean(tmp_path: Path) -> None:
    c = _daemon(tmp_path, [_gpu(0), _gpu(1)])
    _hold(c, "GPU-1", 79)
    c.inventory.replace("gpu", [_gpu(0)])
    _probe(c)
    assert _entries(tmp_path) == []


@pytest.mark.parametrize(
    "content",
    [
        b"{not json",
        json.dumps({"version": 1, "held": []}).encode(),
        json.dumps({"version": 2, "held": {"boot": BOOT, "entries": []}}).encode(),
    ],
)
def test_a_file_this_release_cannot_read_is_set_aside_and_holds_nothing(tmp_path: Path, content: bytes) -> None:
    (tmp_path / FILE_NAME).write_bytes(content)
    assert _taints(_daemon(tmp_path, [_gpu(0)])) == {}
    assert not (tmp_path / FILE_NAME).exists() and len(list(tmp_path.glob(f"{FILE_NAME}.*-*"))) == 1


def test_a_bad_entry_is_skipped_and_the_others_hold(tmp_path: Path) -> None:
    good = {"gpu": "GPU-0", "pci": "0000:00:00.0", "subject": "GPU-0", "xid": 79}
    bad = [{"gpu": "", "pci": "", "subject": "GPU-0", "xid": 79}, {**good, "xid": "79"}, {**good, "xid": -1}, "x"]
    doc = {"version": 1, "held": {"boot": BOOT, "entries": [*bad, good]}}
    (tmp_path / FILE_NAME).write_text(json.dumps(doc))
    assert _taints(_daemon(tmp_path, [_gpu(0)])) == {"gpu-0": {(XID, "79", TaintEffect.NO_EXECUTE)}}
