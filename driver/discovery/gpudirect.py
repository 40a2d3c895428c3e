"""GPUDirect RDMA readiness: can a NIC on this node read and write GPU memory directly?

Published on GPUs and NICs alike as `gpuDirectRDMA` (bool) and, when true, `gpuDirectRDMAMode`
(`dma-buf` or `nvidia-peermem`, the one NCCL uses first), so a training job selects only devices
where it works, and a pod that asks for it on a node without it stays unschedulable instead of
silently running at a fraction of the bandwidth.

Two ways exist (docs/reference/drivers.md, 'GPUDirect RDMA'), and what can be read of each:

* **nvidia-peermem**: the kernel module that registers GPU memory with the RDMA stack's
  peer-memory API. That API exists only in MLNX_OFED's/DOCA-OFED's ib_core: the module cannot load
  against an upstream kernel's, so "loaded" (`/sys/module/nvidia_peermem/initstate` = `live`)
  means it works, for every RDMA device of that stack.
* **dma-buf**: GPU memory exported as a dma-buf (CUDA `cuMemGetHandleForAddressRange`) and
  registered with `ibv_reg_dmabuf_mr`. Needs the NVIDIA *open* kernel modules, release 515 or
  later (`/proc/driver/nvidia/version` says "Open Kernel Module"), a kernel of 5.12 or later
  (RDMA dma-buf memory regions, `/proc/sys/kernel/osrelease`), and an RDMA driver that implements
  dma-buf regions: mlx5 (ConnectX, since 5.12). What cannot be read: whether the container's
  rdma-core and CUDA are new enough (rdma-core 34, CUDA 11.7); that is the image's business.

GPU-side facts (the NVIDIA module) decide a GPU's attributes; a NIC needs those facts too (the
GPU memory it would access is on this node) plus its own driver's support.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path

from driver.model import AttrValue

log = logging.getLogger(__name__)

GPUDIRECT = "gpuDirectRDMA"
GPUDIRECT_MODE = "gpuDirectRDMAMode"
MODE_DMABUF = "dma-buf"
MODE_PEERMEM = "nvidia-peermem"
MIN_KERNEL_DMABUF = (5, 12)
MIN_DRIVER_DMABUF = 515
# PCI drivers of RDMA NICs whose RDMA driver registers dma-buf memory regions (mlx5_ib).
DMABUF_NIC_DRIVERS = frozenset({"mlx5_core"})
_OPEN_MODULE = "Open Kernel Module"
_NVRM = re.compile(r"NVRM version:.*?\s(\d+)\.\d+(?:\.\d+)?\s")
_RELEASE = re.compile(r"^(\d+)\.(\d+)")


@dataclass(frozen=True)
class GpuDirect:
    """What the node's kernel and NVIDIA driver allow; `why` says what is missing, for the log."""

    peermem: bool
    dmabuf: bool
    why: str = ""


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def read_gpudirect(sysfs_root: Path, proc_root: Path) -> GpuDirect:
    """The node's GPUDirect RDMA modes (module docstring)."""
    peermem = _read(sysfs_root / "module" / "nvidia_peermem" / "initstate").strip() == "live"
    missing = []
    nvrm = _read(proc_root / "driver" / "nvidia" / "version")
    version = _NVRM.search(nvrm)
    if not nvrm:
        missing.append("the NVIDIA kernel module is not loaded")
    elif _OPEN_MODULE not in nvrm:
        missing.append("the NVIDIA kernel modules are the proprietary ones, not the open ones")
    elif version is None or int(version.group(1)) < MIN_DRIVER_DMABUF:
        missing.append(f"the NVIDIA driver is older than {MIN_DRIVER_DMABUF}")
    release = _RELEASE.match(_read(proc_root / "sys" / "kernel" / "osrelease").strip())
    if release is None:
        missing.append("the kernel release is unknown")
    elif (int(release.group(1)), int(release.group(2))) < MIN_KERNEL_DMABUF:
        missing.append("the kernel is older than {}.{}".format(*MIN_KERNEL_DMABUF))
    why = "" if peermem or not missing else f"no nvidia-peermem, and no dma-buf: {'; '.join(missing)}"
    return GpuDirect(peermem=peermem, dmabuf=not missing, why=why)


def gpu_attributes(gd: GpuDirect) -> dict[str, AttrValue]:
    return _attributes(gd.dmabuf, gd.peermem)


def nic_attributes(gd: GpuDirect, pci_driver: str) -> dict[str, AttrValue]:
    return _attributes(gd.dmabuf and pci_driver in DMABUF_NIC_DRIVERS, gd.peermem)


def _attributes(dmabuf: bool, peermem: bool) -> dict[str, AttrValue]:
    if dmabuf:
        return {GPUDIRECT: True, GPUDIRECT_MODE: MODE_DMABUF}
    if peermem:
        return {GPUDIRECT: True, GPUDIRECT_MODE: MODE_PEERMEM}
    return {GPUDIRECT: False}
