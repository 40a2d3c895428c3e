"""The vocabulary every part of the driver shares: devices, their attributes, health and taints.

Discovery produces these values, the inventory holds them, and the slice publisher, the prepare
path, the health stream and the CLI read them. They are plain immutable values so that a snapshot
handed to another thread can never change under it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

STANDARD_DOMAIN = "resource.kubernetes.io"
PCI_BUS_ID = f"{STANDARD_DOMAIN}/pciBusID"
PCIE_ROOT = f"{STANDARD_DOMAIN}/pcieRoot"
NUMA_NODE = f"{STANDARD_DOMAIN}/numaNode"


class DeviceKind(enum.StrEnum):
    GPU = "gpu"
    MIG = "mig"
    NIC = "nic"


class Health(enum.StrEnum):
    """Mirrors the kubelet health stream's HealthStatus values."""

    UNKNOWN = "Unknown"
    HEALTHY = "Healthy"
    UNHEALTHY = "Unhealthy"


class TaintEffect(enum.StrEnum):
    NONE = "None"
    NO_SCHEDULE = "NoSchedule"
    NO_EXECUTE = "NoExecute"


@dataclass(frozen=True, order=True)
class Version:
    """A semantic-version attribute value (published as `version`, not `string`)."""

    value: str


# A scalar attribute value, or a list of one scalar type (list-typed attributes, alpha in 1.37).
Scalar = bool | int | str | Version
AttrValue = Scalar | tuple[bool, ...] | tuple[int, ...] | tuple[str, ...] | tuple[Version, ...]


@dataclass(frozen=True)
class Taint:
    """A device taint. `time_added` is owned by the publisher, which keeps the first time it saw it."""

    key: str
    effect: TaintEffect
    value: str = ""


@dataclass(frozen=True)
class Condition:
    """One reason a device is not plainly healthy, as a health source or an SRE reports it.

    The inventory turns conditions into the device's taints (key, value, effect) and its health
    (UNHEALTHY if any condition is `unhealthy`). `message` says why, for the kubelet's health
    stream and `tandemctl`; `value` is the short taint value (a label value: at most 63
    characters of [A-Za-z0-9_.-], starting and ending alphanumeric).
    """

    key: str  # e.g. "tandem.dev/xid"
    effect: TaintEffect
    value: str = ""
    message: str = ""
    unhealthy: bool = True


@dataclass(frozen=True)
class MigPlacement:
    """A GPU instance that prepare creates (dynamic MIG, `driver.claims.gpu.mig`): on which GPU, of
    which GPU instance profile, on which memory slices. NVML allows one GPU instance per memory
    slice, so this names the instance before it exists and finds it again after a crash."""

    parent_uuid: str
    profile_id: int  # nvmlGpuInstanceProfileInfo.id, e.g. 19 for 1g.10gb
    start: int  # first memory slice
    size: int  # memory slices


@dataclass(frozen=True)
class CounterSet:
    """A pool's shared counters (`spec.sharedCounters`), e.g. one GPU's MIG slices."""

    name: str
    counters: tuple[tuple[str, str], ...]  # (counter name, quantity), sorted


@dataclass(frozen=True)
class CounterUse:
    """What a device consumes of one counter set (`consumesCounters`). The set travels with it, so
    the slice builder publishes exactly the sets that published devices draw from."""

    counter_set: CounterSet
    counters: tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class RequestPolicy:
    """How allocations of a multi-allocatable device consume one of its capacities (consumable
    capacity, docs/reference/resource-api.md): a request is rounded up to `min` + n * `step`, must
    not exceed `max`, and one that names no amount consumes `default`. Quantities as strings."""

    default: str
    min: str
    max: str
    step: str


@dataclass(frozen=True)
class GpuInfo:
    """What the prepare path needs to know about a GPU or MIG device beyond its attributes."""

    minor: int
    uuid: str
    pci_bus_id: str
    parent_uuid: str = ""
    mig_gi: int | None = None
    mig_ci: int | None = None
    # /dev/nvidia-caps/nvidia-cap<N> minors that grant access to a MIG device.
    mig_caps: tuple[int, ...] = ()
    # Dynamic MIG: the GPU instance prepare creates for this device (None: it exists already).
    placement: MigPlacement | None = None


@dataclass(frozen=True)
class NicInfo:
    """Identity of an RDMA NIC function, keyed by PCI address so it survives renames and moves."""

    pci_address: str
    ifname: str
    rdma_device: str
    mac: str = ""
    ipv4: tuple[str, ...] = ()  # CIDR form, e.g. "10.0.0.5/24"
    ipv6: tuple[str, ...] = ()
    port: int = 1  # the RDMA port the netdev is on (UCX_NET_DEVICES names <rdma>:<port>)
    uverbs: str = ""  # e.g. "uverbs0": /dev/infiniband/uverbs0
    umad: str = ""
    issm: str = ""
    present: bool = True  # False while the netdev is not visible on the host (e.g. moved into a pod)


@dataclass(frozen=True)
class Device:
    """One allocatable device as published in the node's ResourceSlice pool.

    Attribute keys without a domain are in the driver's domain; standard ones carry their
    `resource.kubernetes.io/` prefix. Capacities are Kubernetes quantity strings.
    """

    name: str
    kind: DeviceKind
    attributes: dict[str, AttrValue] = field(default_factory=dict)
    capacity: dict[str, str] = field(default_factory=dict)
    taints: tuple[Taint, ...] = ()
    health: Health = Health.HEALTHY
    health_message: str = ""
    gpu: GpuInfo | None = None
    nic: NicInfo | None = None
    # Host bridge, then the PCIe bridges down to the device (`driver.discovery.pcie`): the PCIe
    # distance of GPU-NIC pairing. Not published (only as the list attribute `pciePath`).
    pcie_path: tuple[str, ...] = ()
    # Partitionable devices: the shared counters this device draws from (dynamic MIG).
    consumes_counters: tuple[CounterUse, ...] = ()
    # Consumable capacity: many claims may hold the device at once (allowMultipleAllocations),
    # each consuming of its capacities by these policies (shared NICs).
    allow_multiple_allocations: bool = False
    request_policies: dict[str, RequestPolicy] = field(default_factory=dict)
    # Binding conditions (`driver.claims.binding`): what must be True, or must not, in the
    # claim's status before the scheduler binds the pod; published with `bindsToNode: true`.
    binding_conditions: tuple[str, ...] = ()
    binding_failure_conditions: tuple[str, ...] = ()

    def __hash__(self) -> int:
        return hash((self.name, self.kind))


def attribute_to_api(value: object) -> dict[str, Any]:
    """One attribute value in API form; tuples become list-typed attributes.

    Raises ValueError for values the API cannot carry (empty or mixed-type lists, other types).
    """
    # bool before int: bool is a subclass of int.
    if isinstance(value, bool):
        return {"bool": value}
    if isinstance(value, int):
        return {"int": value}
    if isinstance(value, str):
        return {"string": value}
    if isinstance(value, Version):
        return {"version": value.value}
    if isinstance(value, tuple):
        if not value:
            raise ValueError("list attribute is empty")
        kinds = {next(iter(attribute_to_api(v))) for v in value}
        if len(kinds) != 1 or isinstance(value[0], tuple):
            raise ValueError(f"list attribute mixes value types: {value!r}")
        key = kinds.pop() + "s"
        return {key: [v.value if isinstance(v, Version) else v for v in value]}
    raise ValueError(f"unsupported attribute value {value!r}")


# Why a device could not be made ready before binding (`driver.claims.binding`): the failure
# condition's reason, and the label of `tandem_binding_failures` (`driver.metrics`).
BINDING_FAILURE_REASONS = ("PartitionFailed", "NicNotReady")
