"""A prepared claim's devices as one transient CDI spec, and the CDI IDs the kubelet gets for them.

Pure apart from `os.stat` of the device nodes (the spec carries their numbers so the runtime need
not look them up): nothing is written here; the caller writes the spec with `cdi.write_spec`.

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
* Host paths (`hostPath` of nodes, driver file mounts) are the daemon's view of `dev_root` and
  the driver root; the runtime resolves them on the host, so the DaemonSet mounts both at their
  host paths. `hostPath` is written only when it differs from the container path.
* **Device edits**: the device's own nodes, `netDevices` for an exclusive NIC, and
  `TANDEM_DEVICE_<NAME>=<GPU UUID | RDMA device>`, which tells a container which of the claim's
  devices it received and keeps every CDI device non-empty (as CDI requires) even when all its
  nodes moved to the spec level.

GPU isolation is by device node only, as in NVIDIA's DRA driver (docs/reference/drivers.md, 'NVIDIA DRA driver for GPUs'): CUDA and NVML
enumerate just the GPUs whose `/dev/nvidia<N>` (and, for MIG, `nvidia-caps` access nodes) the
container can open. Neither `NVIDIA_VISIBLE_DEVICES` nor `CUDA_VISIBLE_DEVICES` is set: the first
asks the NVIDIA container runtime's legacy hook to inject GPUs on its own (NVIDIA's claims leave it
unset too); the second takes CUDA ordinals or UUIDs and would only repeat, or break, what the nodes
already decide.

RDMA (docs/reference/drivers.md, 'DRANET'): `/dev/infiniband/uverbs<N>` and `rdma_cm`; with `NicConfig.mad` also
`umad<N>` and `issm<N>` (management datagrams, for `ibstat` and subnet tools, not NCCL).
`NCCL_IB_HCA==<rdma>,...` (the leading `=` asks NCCL for exact names, so `mlx5_1` does not also
select `mlx5_10`) and `UCX_NET_DEVICES=<rdma>:1,...` point the libraries at the claim's NICs (port 1:
one PCI function of a ConnectX is one port). `NCCL_SOCKET_IFNAME` is not set, not even in
exclusive mode: it picks NCCL's bootstrap (TCP) network, which is the cluster's choice, and an
appended CDI variable cannot be overridden from the pod spec.

GPU-NIC pairing, when the claim has both and the GPU's `GpuConfig.pairNics` is on (the default):
`TANDEM_GPU_NIC_PAIRS=<ordinal>:<rdma>,...`. The ordinal is the GPU's position in the claim's GPUs
ordered by PCI bus ID (then MIG GI/CI), which is CUDA's PCI_BUS_ID order and, for identical GPUs,
also its default order. Each GPU gets the NIC on the same PCIe root, else on the same NUMA node,
else any; among equals the NIC serving the fewest GPUs so far, then the lowest PCI address; so
the answer is deterministic and one NIC may serve several GPUs. `NCCL_IB_HCA` then lists NICs in
order of first use by GPU 0, 1, ...
"""

from __future__ import annotations

import logging
import os
import re
import stat
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import cdi
from driver.config_api import RequestConfig
from driver.discovery.nvidia_files import DriverFiles
from driver.model import NUMA_NODE, PCIE_ROOT, Device, DeviceKind

log = logging.getLogger(__name__)

CLAIM_CLASS = "claim"
DEVICE_NODE_PERMISSIONS = "rw"
DRIVER_FILE_OPTIONS = ("ro", "nosuid", "nodev", "bind")
GPU_CONTROL_NODES = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset")
RDMA_CM = "infiniband/rdma_cm"
DEVICE_ENV_PREFIX = "TANDEM_DEVICE_"
PAIRS_ENV = "TANDEM_GPU_NIC_PAIRS"
UCX_PORT = 1

_GPU_KINDS = (DeviceKind.GPU, DeviceKind.MIG)
_ENV_UNSAFE = re.compile(r"[^A-Z0-9_]")


class ClaimSpecError(ValueError):
    """The claim's devices cannot be described as one consistent CDI spec; fails the claim."""


@dataclass(frozen=True)
class PlannedDevice:
    device: Device  # from the inventory (attributes, gpu/nic info)
    request_names: tuple[str, ...]
    config: RequestConfig
    share_id: str | None = None


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


def _device_node(dev_root: Path, rel: str) -> cdi.DeviceNode | None:
    """The node `/dev/<rel>`; None (logged) when it does not exist on the host.

    Type and numbers come from the host node so the runtime need not stat it; a plain file (the
    unprivileged simulation) gets neither and is left for the runtime to inspect.
    """
    host = dev_root / rel
    container = f"/dev/{rel}"
    try:
        st = os.stat(host)
    except FileNotFoundError:
        log.info("device node %s does not exist; left out of the CDI spec", host)
        return None
    except OSError as e:
        log.warning("device node %s cannot be inspected (%s); left out of the CDI spec", host, e)
        return None
    host_path = "" if str(host) == container else str(host)
    if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode):
        return cdi.DeviceNode(
            path=container,
            host_path=host_path,
            type="c" if stat.S_ISCHR(st.st_mode) else "b",
            major=os.major(st.st_rdev),
            minor=os.minor(st.st_rdev),
            file_mode=stat.S_IMODE(st.st_mode),
            permissions=DEVICE_NODE_PERMISSIONS,
        )
    return cdi.DeviceNode(path=container, host_path=host_path, permissions=DEVICE_NODE_PERMISSIONS)


def _node_paths(p: PlannedDevice) -> list[str]:
    """The device's own nodes, relative to /dev, in the order the container gets them."""
    d = p.device
    if d.kind in _GPU_KINDS:
        if d.gpu is None:
            raise ClaimSpecError(f"device {d.name!r} has no GPU information")
        if d.kind == DeviceKind.MIG and not d.gpu.mig_caps:
            log.warning("MIG device %s has no nvidia-caps access nodes: CUDA will not see it", d.name)
        return [f"nvidia{d.gpu.minor}", *(f"nvidia-caps/nvidia-cap{c}" for c in d.gpu.mig_caps)]
    if d.kind == DeviceKind.NIC:
        if d.nic is None:
            raise ClaimSpecError(f"device {d.name!r} has no NIC information")
        paths = [f"infiniband/{d.nic.uverbs}"] if d.nic.uverbs else []
        paths.append(RDMA_CM)
        if p.config.nic.mad:
            paths += [f"infiniband/{n}" for n in (d.nic.umad, d.nic.issm) if n]
        return paths
    raise ClaimSpecError(f"device {d.name!r} has unsupported kind {d.kind!r}")


# -- environment ----------------------------------------------------------------------------------


class _Env:
    """Every key once across the whole spec: a runtime appends env lists, so a repeated key would
    leave the process with two values and the winner up to the program reading them."""

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


def _distance(gpu: Device, nic: Device) -> int:
    """0: same PCIe root, 1: same NUMA node, 2: anywhere else on the node."""
    root = gpu.attributes.get(PCIE_ROOT)
    if root is not None and root == nic.attributes.get(PCIE_ROOT):
        return 0
    numa = _numa(gpu)
    if numa is not None and numa == _numa(nic):
        return 1
    return 2


def _gpu_order(d: Device) -> tuple[str, int, int, int]:
    g = d.gpu
    assert g is not None  # checked by _node_paths before
    return (g.pci_bus_id, g.minor, g.mig_gi if g.mig_gi is not None else -1, g.mig_ci if g.mig_ci is not None else -1)


def pair_gpus_with_nics(gpus: Sequence[Device], nics: Sequence[Device]) -> list[tuple[int, Device]]:
    """(GPU ordinal, NIC) for each GPU in `gpus` (already in container order); see the module docstring."""
    ordered_nics = sorted(nics, key=lambda n: n.nic.pci_address if n.nic else n.name)
    load = Counter[str]()
    pairs = []
    for ordinal, gpu in enumerate(gpus):
        if not ordered_nics:
            break
        nic = min(
            ordered_nics,
            key=lambda n, gpu=gpu: (_distance(gpu, n), load[n.name], ordered_nics.index(n)),
        )
        load[nic.name] += 1
        pairs.append((ordinal, nic))
    return pairs


# -- the spec -------------------------------------------------------------------------------------


def _unique_devices(planned: Sequence[PlannedDevice], kinds: tuple[DeviceKind, ...]) -> list[PlannedDevice]:
    """One entry per physical device: two shares of one GPU are still one GPU to the container."""
    seen: dict[str, PlannedDevice] = {}
    for p in planned:
        if p.device.kind in kinds:
            seen.setdefault(p.device.name, p)
    return list(seen.values())


def _network_env(planned: Sequence[PlannedDevice], env: _Env) -> list[str]:
    gpus = sorted(_unique_devices(planned, _GPU_KINDS), key=lambda p: _gpu_order(p.device))
    nics = [p.device for p in _unique_devices(planned, (DeviceKind.NIC,)) if p.device.nic and p.device.nic.rdma_device]
    if not nics:
        return []
    out = []
    order = sorted(nics, key=lambda n: n.nic.pci_address if n.nic else n.name)
    pairing = [(i, p.device) for i, p in enumerate(gpus) if p.config.gpu.pair_nics]
    if pairing:
        chosen = pair_gpus_with_nics([d for _, d in pairing], nics)
        # ordinals of the paired GPUs among all the claim's GPUs, not among the paired ones
        pairs = [(pairing[i][0], nic) for i, nic in chosen]
        out.append(env.entry(PAIRS_ENV, ",".join(f"{i}:{_rdma(n)}" for i, n in pairs), "GPU-NIC pairing"))
        first_use = list(dict.fromkeys(n.name for _, n in pairs))
        order.sort(key=lambda n: first_use.index(n.name) if n.name in first_use else len(first_use))
    out.append(env.entry("NCCL_IB_HCA", "=" + ",".join(_rdma(n) for n in order), "claim NICs"))
    out.append(env.entry("UCX_NET_DEVICES", ",".join(f"{_rdma(n)}:{UCX_PORT}" for n in order), "claim NICs"))
    return out


def _rdma(d: Device) -> str:
    assert d.nic is not None
    return d.nic.rdma_device


def _net_devices(planned: Sequence[PlannedDevice]) -> dict[int, cdi.NetDevice]:
    """Exclusive NICs: the netdev moves into the container under its configured name."""
    out: dict[int, cdi.NetDevice] = {}
    hosts: dict[str, str] = {}
    names: dict[str, str] = {}
    for i, p in enumerate(planned):
        nic = p.device.nic
        if p.device.kind != DeviceKind.NIC or nic is None or p.config.nic.mode != "exclusive":
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


def claim_spec(
    driver_name: str,
    claim_uid: str,
    planned: Sequence[PlannedDevice],
    dev_root: Path,
    driver_files: DriverFiles,
) -> tuple[cdi.Spec | None, dict[str, list[str]]]:
    """The claim's CDI spec and, per device name, its CDI IDs (None and {} for no devices).

    A device planned several times (different share IDs) gets one CDI device and one ID per entry,
    all listed under its name in planned order. Raises `ClaimSpecError` for devices that cannot be
    given to one container together, `cdi.SpecError` for names CDI cannot carry.
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
                nodes[rel] = _device_node(dev_root, rel)
        return [n for rel in paths if (n := nodes[rel]) is not None]

    devices: list[cdi.Device] = []
    ids: dict[str, list[str]] = {}
    for i, p in enumerate(planned):
        name = cdi_device_name(claim_uid, p.device.name, p.share_id)
        own = [rel for rel in node_paths[i] if uses[rel] == 1]
        edits = cdi.ContainerEdits(
            env=(env.entry(_device_env_key(p), _device_env_value(p.device), name),),
            device_nodes=tuple(node_list(own)),
            net_devices=(net_devices[i],) if i in net_devices else (),
        )
        devices.append(cdi.Device(name=name, container_edits=edits))
        ids.setdefault(p.device.name, []).append(cdi.qualified_name(vendor, CLAIM_CLASS, name))

    mounts = []
    if has_gpu:
        mounts = [
            cdi.Mount(host_path=host, container_path=container, options=DRIVER_FILE_OPTIONS)
            for container, host in {c: h for h, c in driver_files.mounts}.items()
        ]
    spec_edits = cdi.ContainerEdits(
        env=tuple(_network_env(planned, env)),
        device_nodes=tuple(node_list(spec_paths)),
        mounts=tuple(mounts),
    )
    return cdi.make_spec(claim_kind(driver_name), devices, container_edits=spec_edits), ids
