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

from sim.pcie import hgx_board

# NVML constants the profile refers to by value (nvidia-ml-py names in comments).
BRAND_NVIDIA = 14  # NVML_BRAND_NVIDIA
ARCH_AMPERE = 7  # NVML_DEVICE_ARCH_AMPERE
ARCH_HOPPER = 9  # NVML_DEVICE_ARCH_HOPPER


@dataclass
class MigProfileSpec:
    """One GPU instance profile of a MIG-capable GPU, as NVML describes it.

    `enum` is the `NVML_GPU_INSTANCE_PROFILE_*` value passed to
    nvmlDeviceGetGpuInstanceProfileInfo, `id` the profile ID it returns (nvidia-smi's "ID", what
    the placement and creation calls take). A GPU instance of this profile occupies `size`
    consecutive memory slices starting at one of `starts` (nvmlDeviceGetGpuInstancePossiblePlacements)
    and `slices` compute slices; at most `instances` exist at once (nvmlGpuInstanceProfileInfo's
    instanceCount). Engines are the GPU instance's own (the "+me" profiles carry the single OFA).
    """

    name: str  # e.g. "1g.10gb"
    enum: int
    id: int
    slices: int
    instances: int
    starts: list[int]
    size: int
    memory_mb: int
    multiprocessors: int
    copy_engines: int
    decoders: int
    jpeg: int
    ofa: int
    encoders: int = 0


def _mig_table(
    memory_gb: tuple[int, int, int, int], memory_mb: tuple[int, int, int, int, int], sms: tuple[int, ...],
    decoders: tuple[int, ...], jpeg: tuple[int, ...], copy_engines: tuple[int, ...],
) -> list[MigProfileSpec]:  # fmt: skip
    """The seven profiles of an 8-memory-slice, 7-compute-slice GPU (A100, H100, H200): geometry and
    IDs from NVIDIA's MIG user guide ('Supported MIG Profiles'), `nvidia-smi mig -lgip/-lgipp`.

    `memory_gb`: the names' sizes of 1, 2, 4 and 8 memory slices; `memory_mb`: what NVML reports for
    1g, 1g (2 slices), 2g, 3g/4g, 7g; `sms`, `decoders`, `jpeg`, `copy_engines`: per profile in
    table order. The H200's are read from real NVML (driver 580.159.04, nvidia-ml-py): enums, IDs,
    placements, instance counts, engines and memory exactly; the others' memory sizes are close.
    """
    one, two, four, full = memory_gb
    rows = [  # name, enum (NVML_GPU_INSTANCE_PROFILE_*), id, compute slices, instances, starts, size, memory
        (f"1g.{one}gb", 0x0, 19, 1, 7, list(range(7)), 1, memory_mb[0]),  # 1_SLICE
        (f"1g.{one}gb+me", 0x7, 20, 1, 1, list(range(7)), 1, memory_mb[0]),  # 1_SLICE_REV1
        (f"1g.{two}gb", 0x9, 15, 1, 4, [0, 2, 4, 6], 2, memory_mb[1]),  # 1_SLICE_REV2
        (f"2g.{two}gb", 0x1, 14, 2, 3, [0, 2, 4], 2, memory_mb[2]),  # 2_SLICE
        (f"3g.{four}gb", 0x2, 9, 3, 2, [0, 4], 4, memory_mb[3]),  # 3_SLICE
        (f"4g.{four}gb", 0x3, 5, 4, 1, [0], 4, memory_mb[3]),  # 4_SLICE
        (f"7g.{full}gb", 0x4, 0, 7, 1, [0], 8, memory_mb[4]),  # 7_SLICE
    ]
    ofa = (0, 1, 0, 0, 0, 0, 1)  # the one OFA: the media-extension profile's, or the whole GPU's
    return [
        MigProfileSpec(name, enum, pid, g, n, starts, size, mb, sms[i], copy_engines[i], decoders[i], jpeg[i], ofa[i])
        for i, (name, enum, pid, g, n, starts, size, mb) in enumerate(rows)
    ]


_AMPERE_ENGINES = dict(decoders=(0, 1, 1, 1, 2, 2, 5), jpeg=(0, 1, 0, 0, 0, 0, 1), copy_engines=(1, 1, 1, 2, 3, 4, 7))
_HOPPER_ENGINES = dict(decoders=(1, 1, 1, 2, 3, 4, 7), jpeg=(1, 1, 1, 2, 3, 4, 7), copy_engines=(1, 1, 1, 2, 3, 4, 8))
_HOPPER_SMS = (16, 16, 26, 32, 60, 64, 132)
A100_40GB_MIG = _mig_table((5, 10, 20, 40), (4864, 9856, 9856, 19968, 40192), (14, 14, 14, 28, 42, 56, 98),
                           **_AMPERE_ENGINES)  # fmt: skip
A100_80GB_MIG = _mig_table((10, 20, 40, 80), (9856, 19968, 19968, 40192, 80384), (14, 14, 14, 28, 42, 56, 98),
                           **_AMPERE_ENGINES)  # fmt: skip
H100_80GB_MIG = _mig_table((10, 20, 40, 80), (9984, 20096, 20096, 40448, 81152), _HOPPER_SMS, **_HOPPER_ENGINES)
# As real NVML reports them on an H200 (driver 580.159.04).
H200_MIG = _mig_table((18, 35, 71, 141), (16384, 33280, 33280, 71424, 143360), _HOPPER_SMS, **_HOPPER_ENGINES)

# Blackwell: the RTX PRO 6000 Blackwell's 4-memory-slice table (96GB), the one with every kind of
# profile suffix NVML names: "+me" (one of each media engine, the OFA among them), "+me.all" (every
# decoder, encoder, JPEG and OFA engine on one slice), "-me" (none), "+gfx" (graphics). Names, IDs,
# SMs, engines, copy engines and instance counts as NVIDIA's MIG user guide ('Supported MIG
# Profiles') and `nvidia-smi mig -lgip` list them; memory from its GiB; the enum each name is
# (nvidia-ml-py's NVML_GPU_INSTANCE_PROFILE_*: REV1 +me, GFX, NO_ME, ALL_ME).
RTX_PRO_6000_MIG = [
    MigProfileSpec(name, enum, pid, g, n, list(range(0, 4, size)), size, mb, sms, g, dec, dec, ofa, encoders=dec)
    for name, enum, pid, g, n, size, mb, sms, dec, ofa in [
        # name, enum, id, compute slices, instances, size, memory MB, SMs, NVDEC/NVENC/NVJPG each, OFA
        ("1g.24gb", 0x0, 14, 1, 4, 1, 24192, 46, 1, 0),  # 1_SLICE
        ("1g.24gb+me", 0x7, 21, 1, 1, 1, 24192, 46, 1, 1),  # 1_SLICE_REV1
        ("1g.24gb+gfx", 0xA, 47, 1, 4, 1, 24192, 46, 1, 0),  # 1_SLICE_GFX
        ("1g.24gb-me", 0xD, 67, 1, 4, 1, 24192, 46, 0, 0),  # 1_SLICE_NO_ME
        ("1g.24gb+me.all", 0xF, 65, 1, 1, 1, 24192, 46, 4, 1),  # 1_SLICE_ALL_ME
        ("2g.48gb", 0x1, 5, 2, 2, 2, 48512, 94, 2, 0),  # 2_SLICE
        ("2g.48gb+gfx", 0xB, 35, 2, 2, 2, 48512, 94, 2, 0),  # 2_SLICE_GFX
        ("2g.48gb-me", 0xE, 66, 2, 2, 2, 48512, 94, 0, 0),  # 2_SLICE_NO_ME
        ("2g.48gb+me.all", 0x10, 64, 2, 1, 2, 48512, 94, 4, 1),  # 2_SLICE_ALL_ME
        ("4g.96gb", 0x3, 0, 4, 1, 4, 97280, 188, 4, 1),  # 4_SLICE
        ("4g.96gb+gfx", 0xC, 32, 4, 1, 4, 97280, 188, 4, 1),  # 4_SLICE_GFX
    ]
]


@dataclass
class MigDeviceSpec:
    """An existing GPU instance on a GPU in MIG mode, with its compute instance: a MIG device.

    `ci_id` None is a GPU instance without a compute instance (no MIG device yet, as NVML leaves
    one between nvmlDeviceCreateGpuInstance and nvmlGpuInstanceCreateComputeInstance).
    """

    profile: str  # e.g. "1g.10gb"
    gi_id: int  # GPU instance ID
    ci_id: int | None  # compute instance ID
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
    ci_start: int = 0  # the compute instance's first compute slice within the GPU instance
    memory_used_bytes: int = 0  # nvmlDeviceGetMemoryInfo's `used` on the MIG device's handle


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
    # The GPU instance profiles of a MIG-capable GPU (its NVML geometry), e.g. H100_80GB_MIG.
    mig_profiles: list[MigProfileSpec] = field(default_factory=list)
    # Failure injection: an NVML call on this GPU raises these error codes (NVML_ERROR_* values),
    # keyed by the pynvml function name, e.g. {"nvmlDeviceGetUUID": 3}.
    nvml_errors: dict[str, int] = field(default_factory=dict)
    # "before:<function>" or "after:<function>": that NVML call on this GPU blocks before (or after)
    # it acts, and says so in `<state>.hung`, so a test can kill the caller at that exact step.
    nvml_hang: str = ""
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
    # PCIe bridges between the root complex and the GPU, root port first (`sim.pcie`).
    pcie_bridges: list[str] = field(default_factory=list)
    # The compute policy's time slice, 0..3 (Default..Long): `nvidia-smi compute-policy
    # --set-timeslice` sets it (`sim.nvidia_smi`); NVML has no public getter for it.
    time_slice: int = 0
    # What the GPU is doing, for a test to set: nvmlDeviceGetUtilizationRates' `gpu` and `memory`
    # (percent of the last sample period) and nvmlDeviceGetMemoryInfo's `used`.
    utilization_gpu: int = 0
    utilization_memory: int = 0
    memory_used_bytes: int = 0
    # Grey failures: the GPU works, worse than it should. The PCIe link (nvmlDevice*Pcie*): the
    # generation it trains to under load, the most the device and the system allow together
    # (nvmlDeviceGetMaxPcieLinkGeneration) and the device alone, the generation an idle GPU drops
    # to (as NVIDIA GPUs save power), its width and most width, and the link's replays.
    pcie_link_gen: int = 5
    pcie_link_gen_max: int = 5
    pcie_link_gen_gpu_max: int = 5
    pcie_idle_gen: int = 1
    pcie_link_width: int = 16
    pcie_link_width_max: int = 16
    pcie_replay_counter: int = 0
    # nvmlClocksEventReason* bits holding the clocks down besides idleness (which the fake adds):
    # 0x8 HwSlowdown, 0x40 HwThermalSlowdown, 0x80 HwPowerBrakeSlowdown, 0x4 SwPowerCap, ...
    clocks_event_reasons: int = 0
    # NVLink: the GPU's links (0: none, NVML answers NOT_SUPPORTED), those inactive, and the error
    # totals over all links by kind ("replay", "recovery", "crc_flit", "crc_data").
    nvlink_count: int = 0
    nvlink_down: list[int] = field(default_factory=list)
    nvlink_errors: dict[str, int] = field(default_factory=dict)


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
    # PCIe bridges between the root complex and the function, root port first (`sim.pcie`).
    pcie_bridges: list[str] = field(default_factory=list)
    fw_ver: str = "28.39.1002"  # the RDMA device's firmware (`infiniband/<dev>/fw_ver`)


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
    # GPUDirect RDMA (`sim.gpudirect`): the running kernel, whether the NVIDIA kernel modules are
    # the open ones (dma-buf needs them), whether nvidia-peermem is loaded.
    kernel_release: str = "6.8.0-60-generic"
    nvidia_open_modules: bool = True
    nvidia_peermem: bool = False
    # The kernel's RDMA namespace mode (ib_core netns_mode): shared (the default) or exclusive.
    rdma_netns_shared: bool = True

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
            g["mig_profiles"] = [MigProfileSpec(**m) for m in g.get("mig_profiles", [])]
            g["cuda_compute_capability"] = tuple(g.get("cuda_compute_capability", (9, 0)))
            gpus.append(GpuSpec(**g))
        nics = [NicSpec(**n) for n in raw.get("nics", [])]
        rest = {k: v for k, v in raw.items() if k not in ("gpus", "nics")}
        return cls(gpus=gpus, nics=nics, **rest)


_GIB = 1024**3
H100_NVLINKS = 18  # NVLink 4 links of an H100 SXM, all to the board's NVSwitches


def _uuid(prefix: str, n: int) -> str:
    return f"{prefix}-{n:08x}-0000-4000-8000-{n:012x}"


def h100_node(name: str = "node-1", gpus: int = 8, nics: int = 4, *, mig_capable: bool = False) -> NodeProfile:
    """An HGX H100 node: ConnectX-7 RoCE NICs and GPUs behind PCIe switches (`sim.pcie.hgx_board`).

    Two GPUs and one NIC per switch, two switches per root complex, one root complex per NUMA
    node: GPUs 2s and 2s+1 share switch s with NIC s, so a claim for a GPU and a NIC behind the
    same switch (or root, or NUMA node) has a real answer on this node. `mig_capable`: the GPUs
    report MIG support and the H100 80GB profiles (MIG mode still off, as an H100 ships).
    """
    gpu_slots, nic_slots = hgx_board(gpus, nics)
    gpu_specs = [
        GpuSpec(
            index=i,
            minor=i,
            uuid=_uuid("GPU", i + 1),
            name="NVIDIA H100 80GB HBM3",
            pci_bus_id=slot.bdf,
            pcie_root=slot.pcie_root,
            numa_node=slot.numa_node,
            memory_bytes=80 * _GIB,
            pcie_bridges=list(slot.bridges),
            nvlink_count=H100_NVLINKS,
            mig_capable=mig_capable,
            mig_profiles=list(H100_80GB_MIG) if mig_capable else [],
        )
        for i, slot in enumerate(gpu_slots)
    ]
    nic_specs = [
        NicSpec(
            pci_address=slot.bdf,
            pcie_root=slot.pcie_root,
            numa_node=slot.numa_node,
            ifname=f"ens{j + 1}f0np0",
            mac=f"b8:3f:d2:00:00:{j + 1:02x}",
            rdma_device=f"mlx5_{j}",
            uverbs_index=j,
            ipv4=[f"10.{j}.0.{10 + j}/24"],
            ipv6=[f"fd00:{j}::{10 + j}/64"],
            pcie_bridges=list(slot.bridges),
        )
        for j, slot in enumerate(nic_slots)
    ]
    return NodeProfile(name=name, gpus=gpu_specs, nics=nic_specs)


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
                mig_profiles=list(A100_40GB_MIG),
            )
        )
    return NodeProfile(name=name, gpus=gpu_specs)
