"""The inventory folds health conditions into taints and tells subscribers only about real changes."""

from __future__ import annotations

from driver.inventory.store import Inventory
from driver.model import Condition, Device, DeviceKind, Health, Taint, TaintEffect

XID = Condition("tandem.dev/xid", TaintEffect.NO_SCHEDULE, "79", "XID 79: GPU fell off the bus")
APP_XID = Condition("tandem.dev/xid", TaintEffect.NONE, "13", "XID 13: application error", unhealthy=False)


def _inv() -> tuple[Inventory, list[int]]:
    inv = Inventory()
    calls: list[int] = []
    inv.subscribe(lambda: calls.append(1))
    inv.replace("gpu", [Device("gpu-1", DeviceKind.GPU), Device("gpu-0", DeviceKind.GPU)])
    return inv, calls


def test_devices_are_sorted_and_a_same_answer_is_no_change():
    inv, calls = _inv()
    assert [d.name for d in inv.devices()] == ["gpu-0", "gpu-1"]
    assert inv.replace("gpu", [Device("gpu-0", DeviceKind.GPU), Device("gpu-1", DeviceKind.GPU)]) is False
    assert calls == [1]


def test_conditions_become_taints_and_health_and_clear_again():
    inv, calls = _inv()
    assert inv.set_conditions("nvml", "gpu-0", [XID, APP_XID])
    d = inv.get("gpu-0")
    assert d is not None and d.health == Health.UNHEALTHY
    assert set(d.taints) == {
        Taint("tandem.dev/xid", TaintEffect.NO_SCHEDULE, "79"),
        Taint("tandem.dev/xid", TaintEffect.NONE, "13"),
    }
    assert "fell off the bus" in d.health_message
    assert inv.set_conditions("nvml", "gpu-0", [XID, APP_XID]) is False  # no change, no notification
    assert inv.set_conditions("nvml", "gpu-0", [])
    d = inv.get("gpu-0")
    assert d is not None and d.taints == () and d.health == Health.HEALTHY
    assert len(calls) == 3


def test_informational_conditions_keep_the_device_healthy():
    inv, _ = _inv()
    inv.set_conditions("nvml", "gpu-1", [APP_XID])
    d = inv.get("gpu-1")
    assert d is not None and d.health == Health.HEALTHY and d.taints


def test_sources_do_not_overwrite_each_other():
    inv, _ = _inv()
    cordon = Condition("tandem.dev/cordoned", TaintEffect.NO_SCHEDULE, "", "maintenance", unhealthy=False)
    inv.set_conditions("nvml", "gpu-0", [XID])
    inv.set_conditions("cordon", "gpu-0", [cordon])
    inv.set_conditions("nvml", "gpu-0", [])
    d = inv.get("gpu-0")
    assert d is not None and [t.key for t in d.taints] == ["tandem.dev/cordoned"]


def test_a_device_name_claimed_by_two_sources_is_kept_by_the_first():
    inv, _ = _inv()
    inv.replace("nic", [Device("gpu-0", DeviceKind.NIC), Device("pci-0000-17-00-0", DeviceKind.NIC)])
    assert inv.get("gpu-0").kind == DeviceKind.GPU  # type: ignore[union-attr]
    assert inv.get("pci-0000-17-00-0") is not None
