"""The GPU monitor's conditions: kept by UUID, published per device, and written only on change;
no NVML and no thread, so each rule is driven directly."""

from __future__ import annotations

from collections.abc import Iterable

import pytest

from driver.health.gpu.conditions import GpuConditions
from driver.health.gpu.policy import GpuHealthPolicy, index_gpus
from driver.inventory.store import Inventory
from driver.model import Condition, Device, DeviceKind, GpuInfo

SOURCE = "gpu-health"


class CountingInventory(Inventory):
    """Records each write of a health source; `fail` writes raise before they are recorded."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[tuple[str, frozenset[Condition]]] = []
        self.fail = 0

    def set_conditions(self, source: str, device: str, conditions: Iterable[Condition]) -> bool:
        if self.fail:
            self.fail -= 1
            raise RuntimeError("inventory refused")
        self.writes.append((device, frozenset(conditions)))
        return super().set_conditions(source, device, conditions)


def _mig(name: str, uuid: str, gi: int) -> Device:
    info = GpuInfo(minor=0, uuid=uuid, pci_bus_id="", parent_uuid="GPU-a", mig_gi=gi, mig_ci=0)
    return Device(name, DeviceKind.MIG, gpu=info)


@pytest.fixture
def inv() -> CountingInventory:
    inv = CountingInventory()
    inv.replace("gpu", [_mig("mig-1", "MIG-1", 1), _mig("mig-2", "MIG-2", 2)])
    return inv


def _published(inv: Inventory) -> dict[str, set[str]]:
    return {d: {c.key for c in conds} for d, conds in inv.conditions(SOURCE).items()}


def test_a_device_publishes_its_gpus_conditions_and_its_own_instances(inv: CountingInventory) -> None:
    policy = GpuHealthPolicy()
    c = GpuConditions(inv, policy, SOURCE)
    assert c.observe(["MIG-1"], policy.xid(94), now=0.0)
    c.state.set_hard("GPU-a", [policy.gpu_lost("gone")])
    c.publish()
    assert _published(inv) == {
        "mig-1": {"tandem.dev/xid", "tandem.dev/gpu-lost"},
        "mig-2": {"tandem.dev/gpu-lost"},  # the MIG-1 instance's XID is not its sibling's
    }


def test_only_a_device_whose_conditions_changed_is_written(inv: CountingInventory) -> None:
    policy = GpuHealthPolicy()
    c = GpuConditions(inv, policy, SOURCE)
    c.observe(["MIG-2"], policy.double_bit_ecc(), now=0.0)
    c.publish()
    c.publish(index_gpus(inv.devices()))
    assert [d for d, _ in inv.writes] == ["mig-2"]


def test_a_device_that_left_the_inventory_is_cleared(inv: CountingInventory) -> None:
    policy = GpuHealthPolicy()
    c = GpuConditions(inv, policy, SOURCE)
    c.state.set_hard("GPU-a", [policy.gpu_lost("gone")])
    c.publish()
    inv.replace("gpu", [_mig("mig-1", "MIG-1", 1)])
    c.publish()
    assert inv.writes[-1] == ("mig-2", frozenset())
    assert set(_published(inv)) == {"mig-1"}


def test_a_write_the_inventory_refused_is_made_at_the_next_publish(
    inv: CountingInventory, caplog: pytest.LogCaptureFixture
) -> None:
    policy = GpuHealthPolicy()
    c = GpuConditions(inv, policy, SOURCE)
    c.observe(["MIG-1"], policy.xid(94), now=0.0)
    inv.fail = 1
    c.publish()
    assert "mig-1: cannot publish health conditions" in caplog.text and _published(inv) == {}
    c.publish()
    assert _published(inv) == {"mig-1": {"tandem.dev/xid"}}


def test_an_instance_made_again_does_not_inherit_what_the_old_one_had(inv: CountingInventory) -> None:
    """Same name and GI/CI, new UUID: the old instance's conditions are forgotten, not moved."""
    policy = GpuHealthPolicy()
    c = GpuConditions(inv, policy, SOURCE)
    c.observe(["MIG-1"], policy.xid(94), now=0.0)
    c.publish()
    inv.replace("gpu", [_mig("mig-1", "MIG-1b", 1), _mig("mig-2", "MIG-2", 2)])
    gpus = index_gpus(inv.devices())
    c.forget_gone(gpus)
    c.publish(gpus)
    assert "MIG-1" not in c.state.subjects() and _published(inv) == {}


def test_single_bit_errors_count_toward_the_rate_until_the_gpu_is_gone(inv: CountingInventory) -> None:
    policy = GpuHealthPolicy(single_bit_threshold=3)
    c = GpuConditions(inv, policy, SOURCE)
    gpu = index_gpus(inv.devices())["GPU-a"]
    assert not c.single_bits(gpu, 2, now=0.0)
    c.forget_gone({})  # the GPU left: its rate starts again from nothing if it comes back
    assert not c.single_bits(gpu, 2, now=1.0)
    assert c.single_bits(gpu, 1, now=2.0)
    c.publish()
    assert _published(inv) == {"mig-1": {"tandem.dev/ecc"}, "mig-2": {"tandem.dev/ecc"}}
