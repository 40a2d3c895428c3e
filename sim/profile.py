"""Hardware description of a simulated node: GPUs (with MIG), RDMA NICs, NUMA nodes, PCIe roots.

A profile is pure data. Renderers turn it into what the real discovery code reads: a sysfs tree
and device nodes (`sim.sysfs`), the fake `pynvml` module's state (`sim.nvml`) and
NIC sysfs entries (`sim.nics`). The profile is JSON-serialisable so that a daemon running
as a separate process can be given the same node (see `NodeProfile.to_json`).

Like all of `sim`, this module imports nothing of `driver`: the simulation stands in for the
outside world and must not share the driver's own assumptions.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

# NVML constants the profile refers to by value (nvidia-ml-py names in comments).
BRAND_NVIDIA = 14  # NVML_BRAND_NVIDIA
ARCH_AMPERE = 7  # NVML_DEVICE_ARCH_AMPERE
ARCH_HOPPER = 9  # NVML_DEVICE_ARCH_HOPPER


@dataclass
class MigDeviceSpec:
    """An existing MIG device (a GPU instance with one compute instance) on a GPU in MIG mode."""

    profile: str  # e.g. "1g.10gb"
    gi_id: int  # GPU instance ID
    ci_id: int  # compute instance ID
    placement_start: int
    placement_size: int
    memory_bytes: int
    multiprocessors: int
    uuid: str
    # engines of the GPU instance
    copy_engines: int = 1
    decoders: int = 1
    encoders: int = 0
    jpeg: int = 1
    ofa: int = 0


@dataclass
class GpuSpec:
    index: int  # NVML index
    minor: int  # /dev/nvidia<minor>
    uuid: str
    name: str  # product name, e.g. "NVIDIA H100 80GB HBM3"
    pci_bus_id: str  # canonical lower-case BDF, e.g. "0000:1b:00.0"
    pcie_root: str  # e.g. "pci0000:15"
    numa_node: int  # -1 when the platform does not report one
    memory_bytes: int
    architecture: int = ARCH_HOPPER
    brand: int = BRAND_NVIDIA
    cuda_compute_capability: tuple[int, int] = (9, 0)
    pci_vendor_id: int = 0x10DE
    pci_device_id: int = 0x2330
    multiprocessors: int = 132
    mig_capable: bool = False
    mig_mode: bool = False
    mig_devices: list[MigDeviceSpec] = field(default_factory=list)
    # Supported MIG profile names of a MIG-capable GPU (published as a list attribute).
    mig_profiles: list[str] = field(default_factory=list)
    # Failure injection: an NVML call on this GPU raises these error codes (NVML_ERROR_* values),
    # keyed by the pynvml function name, e.g. {"nvmlDeviceGetUUID": 3}.
    nvml_errors: dict[str, int] = field(default_factory=dict)
    lost: bool = False  # fallen off the bus: every call raises NVML_ERROR_GPU_IS_LOST
    # Memory health as NVML reports it. The fake adds every ECC event raised on the GPU to the
    # matching ECC counter (nvmlDeviceGetTotalEccErrors), as the driver counts what it reports.
    ecc_enabled: bool = True
    ecc_corrected_volatile: int = 0
    ecc_uncorrected_volatile: int = 0
    ecc_corrected_aggregate: int = 0
    ecc_uncorrected_aggregate: int = 0
    # nvmlDeviceGetRemappedRows (Ampere and later): rows remapped, a remap waiting for a GPU reset,
    # a remap that failed (the GPU needs service).
    remapped_rows_correctable: int = 0
    remapped_rows_uncorrectable: int = 0
    remapped_rows_pending: bool = False
    remapped_rows_failure: bool = False
    # nvmlDeviceGetRetiredPagesPendingStatus (before Ampere): a page retirement waits for a reset.
    retired_pages_pending: bool = False
    # NVML_FI_DEV_GET_GPU_RECOVERY_ACTION (an NVML_GPU_RECOVERY_ACTION_* value: 0 none, 1 GPU
    # reset, 2 node reboot, 3 drain P2P, 4 drain and reset, ...); None: a driver without the field.
    recovery_action: int | None = 0


@dataclass
class NicSpec:
    """One RDMA-capable PCI function (a PF or a VF) with its netdev and RDMA device."""

    pci_address: str  # e.g. "0000:8a:00.0"
    pcie_root: str  # e.g. "pci0000:80"
    numa_node: int
    ifname: str  # e.g. "ens1f0np0"
    mac: str
    rdma_device: str  # e.g. "mlx5_0"
    uverbs_index: int  # /dev/infiniband/uverbs<N>
    mtu: int = 9000
    speed_mbps: int = 400000
    link_layer: str = "Ethernet"  # or "InfiniBand"
    port_state: str = "4: ACTIVE"
    ports: int = 1
    vendor_id: int = 0x15B3
    device_id: int = 0x1021  # ConnectX-7
    driver: str = "mlx5_core"
    is_vf: bool = False
    physfn: str = ""  # PCI address of the PF when is_vf
    sriov_totalvfs: int = 0
    sriov_numvfs: int = 0
    operstate: str = "up"
    ipv4: list[str] = field(default_factory=list)  # CIDR, e.g. "192.168.10.2/24"
    ipv6: list[str] = field(default_factory=list)


@dataclass
class NodeProfile:
    name: str
    numa_nodes: int = 2
    # ACPI SLIT distance matrix (`/sys/devices/system/node/node<N>/distance`); defaults to 10/20.
    numa_distances: list[list[int]] = field(default_factory=list)
    # CPU socket of each NUMA node (`/sys/devices/system/node/node<N>/cpulist` -> physical_package_id).
    numa_sockets: list[int] = field(default_factory=list)
    gpus: list[GpuSpec] = field(default_factory=list)
    nics: list[NicSpec] = field(default_factory=list)
    driver_version: str = "580.95.05"
    cuda_driver_version: int = 13000  # nvmlSystemGetCudaDriverVersion: 1000*major + 10*minor

    def distances(self) -> list[list[int]]:
        if self.numa_distances:
            return self.numa_distances
        n = self.numa_nodes
        return [[10 if i == j else 20 for j in range(n)] for i in range(n)]

    def sockets(self) -> list[int]:
        return self.numa_sockets or list(range(self.numa_nodes))

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> NodeProfile:
        return cls.from_dict(json.loads(text))

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> NodeProfile:
        gpus = []
        for g in raw.get("gpus", []):
            g = dict(g)
            g["mig_devices"] = [MigDeviceSpec(**m) for m in g.get("mig_devices", [])]
            g["cuda_compute_capability"] = tuple(g.get("cuda_compute_capability", (9, 0)))
            gpus.append(GpuSpec(**g))
        nics = [NicSpec(**n) for n in raw.get("nics", [])]
        rest = {k: v for k, v in raw.items() if k not in ("gpus", "nics")}
        return cls(gpus=gpus, nics=nics, **rest)


_GIB = 1024**3


def _uuid(prefix: str, n: int) -> str:
    return f"{prefix}-{n:08x}-0000-4000-8000-{n:012x}"


def h100_node(name: str = "node-1", gpus: int = 8, nics: int = 4) -> NodeProfile:
    """An HGX H100 node: GPUs split over 2 NUMA nodes, one ConnectX-7 RoCE NIC per PCIe root pair.

    GPU i sits on PCIe root `pci0000:<root>`; NIC j shares the root of GPU 2j, so a claim for a
    GPU and a NIC on the same root has a real answer on this node.
    """
    roots = ["15", "26", "37", "48", "95", "a6", "b7", "c8"]
    gpu_specs = []
    for i in range(gpus):
        root = roots[i % len(roots)]
        bus = int(root, 16) + 1
        gpu_specs.append(
            GpuSpec(
                index=i,
                minor=i,
                uuid=_uuid("GPU", i + 1),
                name="NVIDIA H100 80GB HBM3",
                pci_bus_id=f"0000:{bus:02x}:00.0",
                pcie_root=f"pci0000:{root}",
                numa_node=0 if i < gpus / 2 else 1,
                memory_bytes=80 * _GIB,
            )
        )
    nic_specs = []
    for j in range(nics):
        root = roots[(2 * j) % len(roots)]
        bus = int(root, 16) + 2
        nic_specs.append(
            NicSpec(
                pci_address=f"0000:{bus:02x}:00.0",
                pcie_root=f"pci0000:{root}",
                numa_node=0 if 2 * j < gpus / 2 else 1,
                ifname=f"ens{j + 1}f0np0",
                mac=f"b8:3f:d2:00:00:{j + 1:02x}",
                rdma_device=f"mlx5_{j}",
                uverbs_index=j,
                ipv4=[f"10.{j}.0.{10 + j}/24"],
                ipv6=[f"fd00:{j}::{10 + j}/64"],
            )
        )
    return NodeProfile(name=name, gpus=gpu_specs, nics=nic_specs)


_A100_MIG_PROFILES = ["1g.5gb", "1g.10gb", "2g.10gb", "3g.20gb", "4g.20gb", "7g.40gb"]


def a100_mig_node(name: str = "node-mig", gpus: int = 8, per_gpu: int = 7) -> NodeProfile:
    """An A100 40GB node with every GPU in MIG mode, carved into `per_gpu` 1g.5gb devices."""
    gpu_specs = []
    for i in range(gpus):
        bus = 0x07 + 0x10 * i
        migs = [
            MigDeviceSpec(
                profile="1g.5gb",
                gi_id=7 + k,
                ci_id=0,
                placement_start=k,
                placement_size=1,
                memory_bytes=5 * _GIB - 256 * 1024**2,
                multiprocessors=14,
                uuid=_uuid("MIG", 100 * (i + 1) + k),
            )
            for k in range(per_gpu)
        ]
        gpu_specs.append(
            GpuSpec(
                index=i,
                minor=i,
                uuid=_uuid("GPU", 0xA100 + i),
                name="NVIDIA A100-SXM4-40GB",
                pci_bus_id=f"0000:{bus:02x}:00.0",
                pcie_root=f"pci0000:{bus - 1:02x}",
                numa_node=0 if i < gpus / 2 else 1,
                memory_bytes=40 * _GIB,
                architecture=ARCH_AMPERE,
                cuda_compute_capability=(8, 0),
                pci_device_id=0x20B0,
                multiprocessors=108,
                mig_capable=True,
                mig_mode=True,
                mig_devices=migs,
                mig_profiles=list(_A100_MIG_PROFILES),
            )
        )
    return NodeProfile(name=name, gpus=gpu_specs)
