"""A prepared claim's devices as one transient CDI spec, and the CDI IDs the kubelet gets for them.

Pure apart from the device nodes (`driver.claims.device_nodes`): each is looked up on the host, so the
spec carries its numbers and the runtime need not, and a missing NVIDIA node is made first as
nvidia-modprobe would make it; a required node that can be neither found nor made fails the claim.
Nothing else is written here; the caller writes the spec with `cdi.write_spec`.

Layout (docs/reference/cdi.md, 'Conventions of DRA drivers'; NVIDIA's `k8s.gpu.nvidia.com/claim` pattern): kind `k8s.<driver>/claim`,
file `k8s.<driver>-claim_<claimUID>.json`, one CDI device per prepared device named
`<claimUID>-<device>[-<shareID>]`. Only env, deviceNodes and mounts are used, so the spec needs at
most cdiVersion 0.5.0 (which Debian 12's podman 4.3.1 still loads), except for NICs in exclusive
mode, whose `netDevices` need 1.1.0 and a runtime that has it.

What goes where:

* **Spec-level edits** are applied once to a container that gets any device of the claim. They hold
  what several devices need, so no container ever gets a device node twice: the GPU control nodes
  (`nvidiactl`, `nvidia-uvm`, `nvidia-uvm-tools`, `nvidia-modeset`) and the driver's files when the
  claim has a GPU; any node two CDI devices of the claim would share (the parent `/dev/nvidia<N>` of
  two MIG devices, `rdma_cm` of two NICs, every node of a device allocated twice with different
  share IDs); and the claim-wide NCCL/UCX environment. A container that references only the NIC
  request of a GPU+NIC claim therefore also sees the control nodes and driver files, but no
  `/dev/nvidia<N>`, and so no GPU.
* Host paths are what the runtime resolves on the host: device nodes are the daemon's view of
  `dev_root` (the DaemonSet mounts the host's `/dev` at `/dev`); driver files were re-rooted from
  the daemon's driver root to the host's at discovery (`--nvidia-driver-root-host`,
  `driver.node.driver_root`). `hostPath` is written only when it differs from the container path.
* **Device edits**: the device's own nodes, `netDevices` for an exclusive NIC (with a hook that
  applies its NicConfig addresses, routes and MTU in the pod: `driver.claims.nic.setup`), and
  `TANDEM_DEVICE_<NAME>=<GPU UUID | RDMA device>`, which tells a container which of the claim's
  devices it received and keeps every CDI device non-empty (as CDI requires) even when all its
  nodes moved to the spec level.

GPU isolation is by device node only, as in NVIDIA's DRA driver (docs/reference/drivers.md, 'NVIDIA DRA driver for GPUs'): CUDA and NVML
enumerate just the GPUs whose `/dev/nvidia<N>` (and, for MIG, `nvidia-caps` access nodes) the
container can open. Neither `NVIDIA_VISIBLE_DEVICES` nor `CUDA_VISIBLE_DEVICES` is set: the first
asks the NVIDIA container runtime's legacy hook to inject GPUs on its own (NVIDIA's claims leave it
unset too); the second takes CUDA ordinals or UUIDs and would only repeat, or break, what the nodes
already decide.

RDMA (docs/reference/drivers.md, 'DRANET'): `/dev/infiniband/uverbs<N>` and `rdma_cm`; with `NicConfig.mad` (from a
DeviceClass only, see `driver.claims.opaque_config`) also `umad<N>` and `issm<N>` (management datagrams, for
`ibstat` and subnet tools, not NCCL). A NIC without a uverbs device (ib_uverbs not loaded) fails the
claim: without it there is no RDMA.
`NCCL_IB_HCA==<rdma>,...` (the leading `=` asks NCCL for exact names, so `mlx5_1` does not also
select `mlx5_10`) and `UCX_NET_DEVICES=<rdma>:<port>,...` point the libraries at the claim's NICs,
each at the RDMA port its netdev is on (as discovered; 1 for a ConnectX function, which has one
port). `NCCL_SOCKET_IFNAME` is not set, not even in exclusive mode: it picks NCCL's bootstrap (TCP)
network, which is the cluster's choice, and a variable set by CDI cannot be overridden from the
pod spec.

GPU-NIC pairing, when the GPUs' `GpuConfig.pairNics` is on (the default):
`TANDEM_GPU_NIC_PAIRS=<ordinal>:<rdma>,...`. The ordinal is the GPU's position among the GPUs
ordered by PCI bus ID (then MIG GI/CI), which is CUDA's PCI_BUS_ID order and, for identical GPUs,
also its default order. Each GPU gets the NIC at the smallest PCIe distance (links through their
lowest common ancestor: behind the same switch beats a switch of switches beats the same root
complex), else on the same NUMA node, else any; among equals the NIC serving the fewest GPUs so
far, then the lowest PCI address; so the answer is deterministic and one NIC may serve several
GPUs. `NCCL_IB_HCA` then lists NICs in order of first use by GPU 0, 1, ... Which rule paired each
GPU (`driver.claims.vocabulary.PairRule`) goes into the GPU's device metadata (`pairedBy`, with `pairedRdmaDevice`).

These three variables describe the devices of **all the claims prepared together** (`pod_devices`:
the kubelet sends a pod's unprepared claims of one driver in one NodePrepareResources call), and
every one of those claims' specs carries the same values. A runtime replaces a variable by key, so
per-claim values would leave a container that gets two claims with only one claim's NICs, and a
GPU claim and a NIC claim of one pod unpaired. A container that gets only some of the pod's claims
sees the lists for all of them (NCCL skips, with a warning, an HCA it cannot open). docs/scenarios.md says what this
means for claims shared between pods.

Over 400 lines on purpose: seventy of them are this docstring, the one place that says what
goes where in a claim's spec, kept beside the code that puts it there.
"""

from __future__ import annotations

import functools
import logging
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import cdi
from driver.claims.device_nodes import DeviceNodeError, DeviceNodes
from driver.claims.nic.setup import needs_setup, setup_hook
from driver.claims.planned import PlannedDevice
from driver.claims.vocabulary import PairRule
from driver.discovery.pcie import PCIE_SWITCH, shared_nodes
from driver.discovery.pcie import distance as pcie_distance
from driver.errors import InvalidInput
from driver.model import NUMA_NODE, PCIE_ROOT, Device, DeviceKind, attribute_to_api
from driver.node.driver_root import DriverFiles

log = logging.getLogger(__name__)

CLAIM_CLASS = "claim"
DRIVER_FILE_OPTIONS = ("ro", "nosuid", "nodev", "bind")
GPU_CONTROL_NODES = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset")
RDMA_CM = "infiniband/rdma_cm"
DEVICE_ENV_PREFIX = "TANDEM_DEVICE_"
PAIRS_ENV = "TANDEM_GPU_NIC_PAIRS"
PAIRED_NIC = "pairedRdmaDevice"
PAIRED_BY = "pairedBy"

_GPU_KINDS = (DeviceKind.GPU, DeviceKind.MIG)
_ENV_UNSAFE = re.compile(r"[^A-Z0-9_]")


class ClaimSpecError(InvalidInput):
    """The claim's devices cannot be described as one consistent CDI spec; fails the claim."""


def claim_vendor(driver_name: str) -> str:
    return f"k8s.{driver_name}"


def claim_kind(driver_name: str) -> str:
    return f"{claim_vendor(driver_name)}/{CLAIM_CLASS}"


def claim_spec_filename(driver_name: str, claim_uid: str) -> str:
    return cdi.spec_filename(claim_vendor(driver_name), CLAIM_CLASS, claim_uid)


def cdi_device_name(claim_uid: str, device_name: str, share_id: str | None = None) -> str:
    """`<claimUID>-<device>[-<shareID>]`: unique per claim, so a runtime never mixes up two claims."""
    return f"{claim_uid}-{device_name}" + (f"-{share_id}" if share_id else "")


# -- device nodes ---------------------------------------------------------------------------------


def _node_paths(p: PlannedDevice) -> list[str]:
    """The device's own nodes, relative to /dev, in the order the container gets them."""
    d = p.device
    if d.kind in _GPU_KINDS:
        if d.gpu is None:
            raise ClaimSpecError(f"device {d.name!r} has no GPU information")
        if d.kind == DeviceKind.MIG and not d.gpu.mig_caps:
            raise ClaimSpecError(
                f"MIG device {d.name!r} has no nvidia-caps access minors (its capabilities under "
                "--proc-root could not be read): CUDA would not see it"
            )
        return [f"nvidia{d.gpu.minor}", *(f"nvidia-caps/nvidia-cap{c}" for c in d.gpu.mig_caps)]
    if d.kind == DeviceKind.NIC:
        if d.nic is None:
            raise ClaimSpecError(f"device {d.name!r} has no NIC information")
        if not d.nic.uverbs:
            raise ClaimSpecError(
                f"NIC {d.name!r} ({d.nic.rdma_device}) has no uverbs device in sysfs: the ib_uverbs kernel "
                "module is not loaded, so it offers no RDMA"
            )
        paths = [f"infiniband/{d.nic.uverbs}", RDMA_CM]
        if p.config.nic.mad:
            if not (d.nic.umad and d.nic.issm):
                raise ClaimSpecError(
                    f"NIC {d.name!r} ({d.nic.rdma_device}) has no umad/issm device in sysfs: NicConfig.mad "
                    "needs the ib_umad kernel module"
                )
            paths += [f"infiniband/{d.nic.umad}", f"infiniband/{d.nic.issm}"]
        return paths
    raise ClaimSpecError(f"device {d.name!r} has unsupported kind {d.kind!r}")


# -- environment ----------------------------------------------------------------------------------


class _Env:
    """Every key once across the whole spec: a runtime replaces a variable by key, in the order it
    applies the edits, so a repeated key would silently keep only one of the values."""

    def __init__(self) -> None:
        self._owner: dict[str, str] = {}

    def entry(self, key: str, value: str, owner: str) -> str:
        if key in self._owner:
            raise ClaimSpecError(f"environment variable {key} would be set twice ({self._owner[key]}, {owner})")
        self._owner[key] = owner
        return f"{key}={value}"


def _device_env_key(p: PlannedDevice) -> str:
    suffix = p.device.name + (f"-{p.share_id}" if p.share_id else "")
    return DEVICE_ENV_PREFIX + _ENV_UNSAFE.sub("_", suffix.upper())


def _device_env_value(d: Device) -> str:
    if d.gpu is not None:
        return d.gpu.uuid
    if d.nic is not None:
        return d.nic.rdma_device or d.nic.pci_address
    return d.name


# -- GPU-NIC pairing ------------------------------------------------------------------------------


def _numa(d: Device) -> int | None:
    value = d.attributes.get(NUMA_NODE)
    if isinstance(value, tuple):
        value = value[0] if value else None
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


_FAR = 1 << 16  # a PCIe distance beyond any real one: paths unknown, or below different roots


@dataclass(frozen=True)
class Pair:
    """A GPU (`ordinal`: its CUDA ordinal in PCI bus order) and the NIC it is paired with."""

    ordinal: int
    gpu: Device
    nic: Device
    rule: PairRule


def _proximity(gpu: Device, nic: Device) -> tuple[int, PairRule]:
    """(PCIe distance in links, the rule that names it) of a GPU-NIC pair (`driver.discovery.pcie`).
    Without paths (a device discovered without its sysfs link) equal roots still count."""
    hops = pcie_distance(gpu.pcie_path, nic.pcie_path)
    switch = gpu.attributes.get(PCIE_SWITCH)
    if hops is not None and switch is not None and switch == nic.attributes.get(PCIE_SWITCH):
        return (hops, PairRule.PCIE_SWITCH)
    if hops is not None and shared_nodes(gpu.pcie_path, nic.pcie_path) > 1:
        return (hops, PairRule.PCIE_BRIDGE)
    if hops is not None:
        return (hops, PairRule.PCIE_ROOT)
    root = gpu.attributes.get(PCIE_ROOT)
    if root is not None and root == nic.attributes.get(PCIE_ROOT):
        return (_FAR - 1, PairRule.PCIE_ROOT)
    numa = _numa(gpu)
    return (_FAR, PairRule.NUMA_NODE) if numa is not None and numa == _numa(nic) else (_FAR + 1, PairRule.NONE)


def _gpu_order(d: Device) -> tuple[str, int, int, int]:
    g = d.gpu
    assert g is not None  # checked by _node_paths before
    return (g.pci_bus_id, g.minor, g.mig_gi if g.mig_gi is not None else -1, g.mig_ci if g.mig_ci is not None else -1)


def pair_gpus_with_nics(gpus: Sequence[Device], nics: Sequence[Device]) -> list[Pair]:
    """A pair for each GPU in `gpus` (already in container order; the ordinal is the position):
    the NIC at the smallest PCIe distance, then on the GPU's NUMA node, then the one serving the
    fewest GPUs so far, then the lowest PCI address (module docstring)."""
    ordered_nics = sorted(nics, key=lambda n: n.nic.pci_address if n.nic else n.name)
    load = Counter[str]()
    pairs = []
    for ordinal, gpu in enumerate(gpus):
        if not ordered_nics:
            break
        ranked = [(_proximity(gpu, n), n) for n in ordered_nics]
        (_, rule), nic = min(ranked, key=lambda r: (r[0][0], load[r[1].name], ordered_nics.index(r[1])))
        load[nic.name] += 1
        pairs.append(Pair(ordinal, gpu, nic, rule))
    return pairs


def pod_pairs(planned: Sequence[PlannedDevice]) -> list[Pair]:
    """The GPU-NIC pairing of devices prepared together: every GPU whose `GpuConfig.pairNics` is
    on, with its ordinal among all the GPUs, paired among all the NICs."""
    gpus = [p for p in _unique_devices(planned, _GPU_KINDS) if p.device.gpu is not None]
    gpus.sort(key=lambda p: _gpu_order(p.device))
    nics = [p.device for p in _unique_devices(planned, (DeviceKind.NIC,)) if p.device.nic and p.device.nic.rdma_device]
    paired = [(i, p.device) for i, p in enumerate(gpus) if p.config.gpu.pair_nics]
    chosen = pair_gpus_with_nics([d for _, d in paired], nics)
    # ordinals of the paired GPUs among all the GPUs, not among the paired ones
    return [Pair(paired[pair.ordinal][0], pair.gpu, pair.nic, pair.rule) for pair in chosen]


def pairing_metadata(pairs: Sequence[Pair]) -> dict[str, dict[str, dict[str, Any]]]:
    """GPU device name -> what its device metadata says of its pairing, in attribute form:
    `pairedRdmaDevice` (the NIC of `TANDEM_GPU_NIC_PAIRS`) and `pairedBy` (the rule that chose it)."""
    return {
        p.gpu.name: {PAIRED_NIC: attribute_to_api(_rdma(p.nic)), PAIRED_BY: attribute_to_api(p.rule)} for p in pairs
    }


# -- the spec -------------------------------------------------------------------------------------


def _unique_devices(planned: Sequence[PlannedDevice], kinds: tuple[DeviceKind, ...]) -> list[PlannedDevice]:
    """One entry per physical device: two shares of one GPU are still one GPU to the container."""
    seen: dict[str, PlannedDevice] = {}
    for p in planned:
        if p.device.kind in kinds:
            seen.setdefault(p.device.name, p)
    return list(seen.values())


def _network_env(planned: Sequence[PlannedDevice], env: _Env) -> list[str]:
    """Pairing and NIC lists for the devices of every claim prepared together (module docstring)."""
    nics = [p.device for p in _unique_devices(planned, (DeviceKind.NIC,)) if p.device.nic and p.device.nic.rdma_device]
    if not nics:
        return []
    out = []
    order = sorted(nics, key=lambda n: n.nic.pci_address if n.nic else n.name)
    pairs = pod_pairs(planned)
    if pairs:
        out.append(env.entry(PAIRS_ENV, ",".join(f"{p.ordinal}:{_rdma(p.nic)}" for p in pairs), "GPU-NIC pairing"))
        first_use = list(dict.fromkeys(p.nic.name for p in pairs))
        order.sort(key=lambda n: first_use.index(n.name) if n.name in first_use else len(first_use))
    out.append(env.entry("NCCL_IB_HCA", "=" + ",".join(_rdma(n) for n in order), "NICs"))
    out.append(env.entry("UCX_NET_DEVICES", ",".join(f"{_rdma(n)}:{_port(n)}" for n in order), "NICs"))
    return out


def _rdma(d: Device) -> str:
    assert d.nic is not None
    return d.nic.rdma_device


def _port(d: Device) -> int:
    assert d.nic is not None
    return d.nic.port


def _net_devices(planned: Sequence[PlannedDevice]) -> dict[int, cdi.NetDevice]:
    """Exclusive NICs: the netdev moves into the container under its configured name."""
    out: dict[int, cdi.NetDevice] = {}
    hosts: dict[str, str] = {}
    names: dict[str, str] = {}
    for i, p in enumerate(planned):
        nic = p.device.nic
        if p.device.kind != DeviceKind.NIC or nic is None or not p.config.nic.exclusive:
            continue
        if not nic.ifname or not nic.present:
            raise ClaimSpecError(f"NIC {p.device.name!r} has no network interface on the host to move into the pod")
        name = p.config.nic.interface_name
        if not name:
            raise ClaimSpecError(f"NIC {p.device.name!r}: exclusive mode needs NicConfig.interfaceName")
        for seen, key, what in ((hosts, nic.ifname, "host interface"), (names, name, "interface name")):
            if key in seen:
                raise ClaimSpecError(f"NICs {seen[key]!r} and {p.device.name!r} both use {what} {key!r}")
            seen[key] = p.device.name
        out[i] = cdi.NetDevice(host_interface_name=nic.ifname, name=name)
    return out


@functools.lru_cache(maxsize=2)
def _driver_mounts(driver_files: DriverFiles) -> tuple[cdi.Mount, ...]:
    """The NVIDIA driver files every GPU claim's spec mounts (one per container path). The same
    for every claim until the files change (a driver upgrade gives a new, unequal `DriverFiles`),
    so they are made once, not for each prepare: dozens of mounts were most of a spec's cost."""
    return tuple(
        cdi.Mount(host_path=host, container_path=container, options=DRIVER_FILE_OPTIONS)
        for container, host in {c: h for h, c in driver_files.mounts}.items()
    )


def claim_spec(
    driver_name: str,
    claim_uid: str,
    planned: Sequence[PlannedDevice],
    device_nodes: DeviceNodes,
    driver_files: DriverFiles,
    pod_devices: Sequence[PlannedDevice] | None = None,
) -> tuple[cdi.Spec | None, dict[str, list[str]]]:
    """The claim's CDI spec and, per device name, its CDI IDs (None and {} for no devices).

    `pod_devices` are the devices of every claim prepared together with this one, its own
    included; the pairing and NIC variables describe them (module docstring). None: this claim's.

    A device planned several times (different share IDs) gets one CDI device and one ID per entry,
    all listed under its name in planned order. Raises `ClaimSpecError` for devices that cannot be
    given to one container together or whose device nodes cannot be had, `cdi.SpecError` for names
    CDI cannot carry.
    """
    if not planned:
        return None, {}
    vendor = claim_vendor(driver_name)
    env = _Env()
    node_paths = [_node_paths(p) for p in planned]
    net_devices = _net_devices(planned)
    uses = Counter(rel for paths in node_paths for rel in dict.fromkeys(paths))
    has_gpu = any(p.device.kind in _GPU_KINDS for p in planned)
    shared = [rel for rel in dict.fromkeys(r for paths in node_paths for r in paths) if uses[rel] > 1]
    spec_paths = [*(GPU_CONTROL_NODES if has_gpu else ()), *shared]
    nodes: dict[str, cdi.DeviceNode | None] = {}

    def node_list(paths: Sequence[str]) -> list[cdi.DeviceNode]:
        for rel in paths:
            if rel not in nodes:
                try:
                    nodes[rel] = device_nodes.node(rel)
                except DeviceNodeError as e:
                    raise ClaimSpecError(str(e)) from e
        return [n for rel in paths if (n := nodes[rel]) is not None]

    devices: list[cdi.Device] = []
    ids: dict[str, list[str]] = {}
    for i, p in enumerate(planned):
        name = cdi_device_name(claim_uid, p.device.name, p.share_id)
        own = [rel for rel in node_paths[i] if uses[rel] == 1]
        edits = cdi.ContainerEdits(
            env=(
                env.entry(_device_env_key(p), _device_env_value(p.device), name),
                *(env.entry(key, value, name) for key, value in p.share_env),
            ),
            device_nodes=tuple(node_list(own)),
            mounts=p.share_mounts,
            net_devices=(net_devices[i],) if i in net_devices else (),
            hooks=(setup_hook(p.config.nic),) if i in net_devices and needs_setup(p.config.nic) else (),
        )
        devices.append(cdi.Device(name=name, container_edits=edits))
        ids.setdefault(p.device.name, []).append(cdi.qualified_name(vendor, CLAIM_CLASS, name))

    spec_edits = cdi.ContainerEdits(
        env=tuple(_network_env(planned if pod_devices is None else pod_devices, env)),
        device_nodes=tuple(node_list(spec_paths)),
        mounts=_driver_mounts(driver_files) if has_gpu else (),
    )
    return cdi.make_spec(claim_kind(driver_name), devices, container_edits=spec_edits), ids
