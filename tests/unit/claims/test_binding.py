"""Binding conditions' pure parts: which published devices carry them, and which claims a
nominated pod names (the pod is a tenant's object: what it names is only ever a claim name in its
own namespace)."""

from __future__ import annotations

from driver.claims.binding_conditions import ConditionTypes, PublishedDevices, with_binding_conditions
from driver.claims.binding_pods import claim_names
from driver.model import Device, DeviceKind, GpuInfo, MigPlacement, NicInfo

PLACEMENT = MigPlacement("GPU-a", profile_id=19, start=3, size=1)
PARTITION = Device(
    "gpu-0-mig-1g-10gb-p3", DeviceKind.GPU, gpu=GpuInfo(0, "", "0000:01:00.0", "GPU-a", placement=PLACEMENT)
)
PLAIN_GPU = Device("gpu-1", DeviceKind.GPU, gpu=GpuInfo(1, "GPU-b", "0000:02:00.0"))
STATIC_MIG = Device("gpu-2-mig-1g-10gb-9-0", DeviceKind.GPU, gpu=GpuInfo(2, "MIG-c", "0000:03:00.0", "GPU-c", 9, 0))
NIC = Device("nic-0", DeviceKind.NIC, nic=NicInfo("0000:04:00.0", "eth0", "mlx5_0"))


def conditions(devices: list[Device]) -> dict[str, tuple[tuple[str, ...], tuple[str, ...]]]:
    return {d.name: (d.binding_conditions, d.binding_failure_conditions) for d in devices}


def test_partitions_carry_the_partition_conditions_and_other_gpus_none() -> None:
    out = conditions(with_binding_conditions([PARTITION, PLAIN_GPU, STATIC_MIG, NIC], "x.dev", mig=True, nic=False))
    assert out == {
        PARTITION.name: (("x.dev/partition-ready",), ("x.dev/partition-failed",)),
        PLAIN_GPU.name: ((), ()),
        STATIC_MIG.name: ((), ()),  # an administrator's MIG device: nothing to make
        NIC.name: ((), ()),
    }


def test_nics_carry_the_nic_conditions_only_when_asked() -> None:
    out = conditions(with_binding_conditions([PARTITION, NIC], "x.dev", mig=False, nic=True))
    assert out == {PARTITION.name: ((), ()), NIC.name: (("x.dev/nic-ready",), ("x.dev/nic-failed",))}


def test_condition_types_live_in_the_drivers_domain() -> None:
    types = ConditionTypes.of("gpu.example.com")
    assert types.for_device(PARTITION) == ("gpu.example.com/partition-ready", "gpu.example.com/partition-failed")
    assert types.for_device(PLAIN_GPU) is None


def test_a_pod_names_its_claims_templates_and_extended_resource_claim_once_each() -> None:
    pod = {
        "spec": {"resourceClaims": [{"name": "a", "resourceClaimName": "shared"}, {"name": "b"}]},
        "status": {
            "resourceClaimStatuses": [
                {"name": "b", "resourceClaimName": "pod-b-x1"},
                {"name": "a", "resourceClaimName": "shared"},
            ],
            "extendedResourceClaimStatus": {"resourceClaimName": "pod-extended-x2"},
        },
    }
    assert claim_names(pod) == ["shared", "pod-b-x1", "pod-extended-x2"]


def test_a_hostile_pod_shape_names_nothing_rather_than_failing() -> None:
    pods = [
        {},
        {"spec": None, "status": None},
        {"spec": {"resourceClaims": [{"resourceClaimName": 7}, {"resourceClaimName": ""}, "x"]}},
        {"status": {"resourceClaimStatuses": [{"resourceClaimName": ["a"]}], "extendedResourceClaimStatus": {}}},
    ]
    for pod in pods[:2] + pods[3:]:
        assert claim_names(pod) == []


def test_the_publisher_gets_the_same_marked_devices_while_the_inventory_is_unchanged() -> None:
    """The publisher tells "nothing changed" by identity: unchanged inventory devices must come
    back as the very same marked copies, and a changed one as a new copy."""
    inventory = [PARTITION, PLAIN_GPU]
    published = PublishedDevices(lambda: list(inventory), "x.dev", mig=True, nic=False)
    first, again = published(), published()
    assert all(a is b for a, b in zip(first, again, strict=True))
    assert first[0].binding_conditions == ("x.dev/partition-ready",) and first[1] is PLAIN_GPU
    inventory[1] = Device("gpu-1", DeviceKind.GPU, gpu=GpuInfo(1, "GPU-b", "0000:02:00.0"), health_message="x")
    changed = published()
    assert changed[1] is inventory[1] and changed[0].binding_conditions == ("x.dev/partition-ready",)
