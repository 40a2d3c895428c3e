"""Render a simulated node into the files the real discovery reads: sysfs, /dev and /proc.

Layout follows the kernel's so that discovery code cannot tell the difference:

* `devices/<pcie_root>/<bridge>.../<bdf>/` is the PCI function (numa_node, vendor, device, class,
  `driver` -> `bus/pci/drivers/<driver>`), and `bus/pci/devices/<bdf>` is a RELATIVE link to it
  (`../../../devices/...`), the way the kernel makes it. The bridges are the device's
  `pcie_bridges` (root port, switch ports: `sim.pcie`), or else a root port on the root bus
  (`<domain>:<root bus>:01.0`); a function on the root bus itself hangs directly off the root.
  Every function and bridge has its link (`{current,max}_link_{speed,width}`) and AER statistics
  (`aer_dev_{correctable,nonfatal,fatal}`), all errors zero (`sim.pcie`). A GPU's link is the one
  it trained to under load (`pcie_link_gen`, `pcie_link_width`): the idle downshift only its NVML
  shows, which is where the driver reads a GPU's link from.
* `module/nvidia`, `module/nvidia_peermem` and `/proc/sys/kernel/osrelease`: what GPUDirect RDMA
  needs (`sim.gpudirect`).
* `devices/system/node/node<N>/{distance,cpulist,cpu<K>}` describe the NUMA nodes and
  `devices/system/cpu/cpu<K>/topology/physical_package_id` their socket (`CPUS_PER_NODE` CPUs
  per node, numbered node by node).
* `/dev/nvidia<minor>`, `nvidiactl`, `nvidia-modeset`, `nvidia-uvm`, `nvidia-uvm-tools` and
  `nvidia-caps/nvidia-cap<N>`: character devices with NVIDIA's numbers when we may `mknod`
  (root), plain empty files otherwise (the demo runs unprivileged).
* Lazily made nodes (`lazy_nodes`): on a real node nobody makes `nvidia-uvm`, `nvidia-uvm-tools`
  and the `nvidia-caps/` nodes until the first CUDA process runs nvidia-modprobe. With
  `lazy_nodes` they stay absent, so whoever hands them out must make them from `/proc` as
  nvidia-modprobe does. Only where character devices can be made: an unprivileged tree gets them
  up front as plain files (an unprivileged daemon could never make them), the state of a node
  where nvidia-modprobe already ran.
* Under `proc_root` (optional): `devices` (the kernel's table of majors, with the dynamic ones of
  nvidia-uvm and nvidia-caps), `driver/nvidia/params` (the device-file mode and owner
  nvidia-modprobe uses), `driver/nvidia-caps/mig-minors` and
  `driver/nvidia/capabilities/gpu<minor>/mig/gi<G>[/ci<C>]/access` (`DeviceFileMinor: <N>`,
  `DeviceFileMode: 292` = 0444), which map MIG devices to `/dev/nvidia-caps/nvidia-cap<N>`.

Rendering is idempotent: it can be re-run over an existing tree after the profile changed (a
removed device's files are not deleted; tests that remove hardware render a fresh tree). It keeps
what the running node changed, error counters and link states (`sim.fstree.write_once`).
"""

from __future__ import annotations

import os
from pathlib import Path

from sim.fstree import char_device, pci_device_dir, symlink, write
from sim.gpudirect import render_kernel_modules
from sim.nics import render_nic
from sim.pcie import Link
from sim.profile import GpuSpec, NodeProfile

CPUS_PER_NODE = 4

NVIDIA_MAJOR = 195  # fixed by the nvidia kernel module
NVIDIACTL_MINOR = 255
NVIDIA_MODESET_MINOR = 254
# nvidia-uvm and nvidia-caps get dynamic majors at module load; these stand in for them and are
# what the rendered /proc/devices lists.
NVIDIA_UVM_MAJOR = 511
NVIDIA_CAPS_MAJOR = 510

# The nvidia driver's static MIG capability table (/proc/driver/nvidia-caps/mig-minors):
# config=1, monitor=2, then per GPU 15 GPU instances, each with an access minor followed by 8
# compute-instance minors.
MIG_CAP_CONFIG = 1
MIG_CAP_MONITOR = 2
_GIS_PER_GPU = 15
_CIS_PER_GI = 8
_MINORS_PER_GI = 1 + _CIS_PER_GI
_MINORS_PER_GPU = _GIS_PER_GPU * _MINORS_PER_GI


def mig_gi_cap_minor(gpu_minor: int, gi: int) -> int:
    return MIG_CAP_MONITOR + 1 + gpu_minor * _MINORS_PER_GPU + gi * _MINORS_PER_GI


def mig_ci_cap_minor(gpu_minor: int, gi: int, ci: int) -> int:
    return mig_gi_cap_minor(gpu_minor, gi) + 1 + ci


def _render_numa(profile: NodeProfile, sysfs_root: Path) -> None:
    nodes = sysfs_root / "devices" / "system" / "node"
    cpus = sysfs_root / "devices" / "system" / "cpu"
    distances = profile.distances()
    sockets = profile.sockets()
    last = profile.numa_nodes - 1
    write(nodes / "online", "0\n" if last == 0 else f"0-{last}\n")
    write(nodes / "possible", "0\n" if last == 0 else f"0-{last}\n")
    for n in range(profile.numa_nodes):
        first = n * CPUS_PER_NODE
        node_dir = nodes / f"node{n}"
        write(node_dir / "distance", " ".join(str(d) for d in distances[n]) + "\n")
        write(node_dir / "cpulist", f"{first}-{first + CPUS_PER_NODE - 1}\n")
        for cpu in range(first, first + CPUS_PER_NODE):
            topo = cpus / f"cpu{cpu}" / "topology"
            write(topo / "physical_package_id", f"{sockets[n]}\n")
            write(topo / "core_id", f"{cpu - first}\n")
            symlink(node_dir / f"cpu{cpu}", cpus / f"cpu{cpu}")
    total = profile.numa_nodes * CPUS_PER_NODE
    write(cpus / "online", f"0-{total - 1}\n")


def _render_gpu_dev_nodes(profile: NodeProfile, dev_root: Path, lazy_nodes: bool) -> None:
    use_mknod = os.geteuid() == 0
    if profile.gpus:
        use_mknod = char_device(dev_root / "nvidiactl", NVIDIA_MAJOR, NVIDIACTL_MINOR, use_mknod)
        char_device(dev_root / "nvidia-modeset", NVIDIA_MAJOR, NVIDIA_MODESET_MINOR, use_mknod)
    for gpu in profile.gpus:
        char_device(dev_root / f"nvidia{gpu.minor}", NVIDIA_MAJOR, gpu.minor, use_mknod)
    if lazy_nodes and use_mknod:
        return  # nvidia-modprobe's to make, on first use
    if profile.gpus:
        char_device(dev_root / "nvidia-uvm", NVIDIA_UVM_MAJOR, 0, use_mknod)
        char_device(dev_root / "nvidia-uvm-tools", NVIDIA_UVM_MAJOR, 1, use_mknod)
    if any(g.mig_capable for g in profile.gpus):
        caps = dev_root / "nvidia-caps"
        char_device(caps / f"nvidia-cap{MIG_CAP_CONFIG}", NVIDIA_CAPS_MAJOR, MIG_CAP_CONFIG, use_mknod)
        char_device(caps / f"nvidia-cap{MIG_CAP_MONITOR}", NVIDIA_CAPS_MAJOR, MIG_CAP_MONITOR, use_mknod)
        for gpu in profile.gpus:
            if not use_mknod and gpu.mig_mode:
                # Every capability of the GPU: an unprivileged daemon cannot make those of the MIG
                # devices it creates later (nvidia-modprobe made them all on such a node).
                minors = [
                    m
                    for gi in range(_GIS_PER_GPU)
                    for m in (
                        mig_gi_cap_minor(gpu.minor, gi),
                        *(mig_ci_cap_minor(gpu.minor, gi, ci) for ci in range(_CIS_PER_GI)),
                    )
                ]
            else:
                minors = [
                    m
                    for mig in (gpu.mig_devices if gpu.mig_mode else [])
                    if mig.ci_id is not None
                    for m in (mig_gi_cap_minor(gpu.minor, mig.gi_id), mig_ci_cap_minor(gpu.minor, mig.gi_id, mig.ci_id))
                ]
            for minor in minors:
                char_device(caps / f"nvidia-cap{minor}", NVIDIA_CAPS_MAJOR, minor, use_mknod)


def _access(minor: int) -> str:
    return f"DeviceFileMinor: {minor}\nDeviceFileMode: 292\nDeviceFileModify: 1\n"


# /proc/driver/nvidia/params as the driver prints it, the lines nvidia-modprobe reads among others
# (DeviceFileMode 438 = 0666).
_PARAMS = (
    "ResmanDebugLevel: 4294967295\nRmLogonRC: 1\nModifyDeviceFiles: 1\nDeviceFileUID: 0\n"
    "DeviceFileGID: 0\nDeviceFileMode: 438\nInitializeSystemMemoryAllocations: 1\n"
)


def render_proc(profile: NodeProfile, proc_root: Path) -> None:
    """`/proc`: the majors, the driver's parameters and MIG capabilities (again after a MIG mode change)."""
    # The kernel's format: right-aligned majors, one section per device type, a blank line between.
    chars = [(1, "mem"), (4, "tty"), (10, "misc"), (NVIDIA_MAJOR, "nvidia-frontend")]
    if profile.gpus:
        chars += [(NVIDIA_CAPS_MAJOR, "nvidia-caps"), (NVIDIA_UVM_MAJOR, "nvidia-uvm")]
    write(
        proc_root / "devices",
        "Character devices:\n"
        + "".join(f"{major:3d} {name}\n" for major, name in sorted(chars))
        + "\nBlock devices:\n  7 loop\n  8 sd\n",
    )
    if profile.gpus:
        write(proc_root / "driver" / "nvidia" / "params", _PARAMS)
    mig_gpus: list[GpuSpec] = [g for g in profile.gpus if g.mig_capable]
    if not mig_gpus:
        return
    lines = [f"config {MIG_CAP_CONFIG}", f"monitor {MIG_CAP_MONITOR}"]
    for gpu in mig_gpus:
        for gi in range(_GIS_PER_GPU):
            lines.append(f"gpu{gpu.minor}/gi{gi}/access {mig_gi_cap_minor(gpu.minor, gi)}")
            lines += [
                f"gpu{gpu.minor}/gi{gi}/ci{ci}/access {mig_ci_cap_minor(gpu.minor, gi, ci)}"
                for ci in range(_CIS_PER_GI)
            ]
    write(proc_root / "driver" / "nvidia-caps" / "mig-minors", "\n".join(lines) + "\n")
    caps = proc_root / "driver" / "nvidia" / "capabilities"
    write(caps / "mig" / "config", _access(MIG_CAP_CONFIG))
    write(caps / "mig" / "monitor", _access(MIG_CAP_MONITOR))
    for gpu in mig_gpus:
        for mig in gpu.mig_devices if gpu.mig_mode else []:
            gi_dir = caps / f"gpu{gpu.minor}" / "mig" / f"gi{mig.gi_id}"
            write(gi_dir / "access", _access(mig_gi_cap_minor(gpu.minor, mig.gi_id)))
            if mig.ci_id is not None:
                write(
                    gi_dir / f"ci{mig.ci_id}" / "access",
                    _access(mig_ci_cap_minor(gpu.minor, mig.gi_id, mig.ci_id)),
                )


def render_node(
    profile: NodeProfile, sysfs_root: Path, dev_root: Path, proc_root: Path | None = None, lazy_nodes: bool = False
) -> None:
    """Render the whole node: NUMA topology, GPUs (PCI, /dev, /proc when given), then NICs.

    `lazy_nodes`: leave the nodes nvidia-modprobe makes on first use absent (see the module
    docstring); give `proc_root` with it, or nothing can make them.
    """
    _render_numa(profile, sysfs_root)
    for gpu in profile.gpus:
        pci_device_dir(
            sysfs_root,
            gpu.pci_bus_id,
            gpu.pcie_root,
            gpu.numa_node,
            gpu.pci_vendor_id,
            gpu.pci_device_id,
            "nvidia",
            bridges=gpu.pcie_bridges,
            link=Link(gpu.pcie_link_gen, gpu.pcie_link_width, gpu.pcie_link_gen_gpu_max, gpu.pcie_link_width_max),
        )
    _render_gpu_dev_nodes(profile, dev_root, lazy_nodes)
    if proc_root is not None:
        render_proc(profile, proc_root)
    render_kernel_modules(profile, sysfs_root, proc_root)
    for nic in profile.nics:
        render_nic(nic, sysfs_root, dev_root)
