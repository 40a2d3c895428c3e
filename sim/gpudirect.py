"""What a node shows of its GPUDirect RDMA support: kernel modules in sysfs, versions in /proc.

As the kernel and the NVIDIA driver show them:

* `module/nvidia/{version,initstate}` for the loaded GPU driver, and `module/nvidia_peermem/...`
  when nvidia-peermem is loaded (the peer-memory client that lets the RDMA stack pin GPU memory;
  it loads only against MLNX_OFED's/DOCA-OFED's ib_core).
* `/proc/driver/nvidia/version`: "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64 ..."
  for the open kernel modules, "NVRM version: NVIDIA UNIX x86_64 Kernel Module ..." for the
  proprietary ones. GPU memory can be exported as dma-buf only by the open modules.
* `/proc/sys/kernel/osrelease`: the running kernel (RDMA dma-buf memory regions need 5.12).
* `module/ib_core/parameters/netns_mode`: the RDMA namespace mode, `Y` shared (the default), `N`
  exclusive.
"""

from __future__ import annotations

from pathlib import Path

from sim.fstree import write
from sim.profile import NodeProfile

_BUILD = "Release Build  (dvs-builder@U22-I3-AE18-23-3)  Thu Sep 18 20:02:16 UTC 2025"


def nvrm_version_line(version: str, open_modules: bool) -> str:
    flavour = "NVIDIA UNIX Open Kernel Module for x86_64" if open_modules else "NVIDIA UNIX x86_64 Kernel Module"
    return f"NVRM version: {flavour}  {version}  {_BUILD}\n"


def render_kernel_modules(profile: NodeProfile, sysfs_root: Path, proc_root: Path | None) -> None:
    """The node's kernel, and (with GPUs) the NVIDIA modules; `proc_root` None renders no /proc."""
    if proc_root is not None:
        write(proc_root / "sys" / "kernel" / "osrelease", f"{profile.kernel_release}\n")
    if profile.nics:
        mode = "Y" if profile.rdma_netns_shared else "N"
        write(sysfs_root / "module" / "ib_core" / "parameters" / "netns_mode", f"{mode}\n")
    if not profile.gpus:
        return
    modules = ["nvidia"] + (["nvidia_peermem"] if profile.nvidia_peermem else [])
    for name in modules:
        write(sysfs_root / "module" / name / "version", f"{profile.driver_version}\n")
        write(sysfs_root / "module" / name / "initstate", "live\n")
    if proc_root is not None:
        write(
            proc_root / "driver" / "nvidia" / "version",
            nvrm_version_line(profile.driver_version, profile.nvidia_open_modules)
            + "GCC version:  gcc version 12.3.0 (Ubuntu 12.3.0-1ubuntu1~22.04)\n",
        )
