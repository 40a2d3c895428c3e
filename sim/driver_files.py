"""Render a fake NVIDIA user-space driver tree, laid out the way the driver installer lays it out.

Under `root` (standing in for `--nvidia-driver-root`):

* `usr/lib/x86_64-linux-gnu/<lib>.so.<version>`: small regular files, each with its soname link
  (`libcuda.so.1 -> libcuda.so.<version>`) and, for libcuda, the development link
  (`libcuda.so -> libcuda.so.1`), all relative as the installer makes them;
* `usr/bin/nvidia-smi` and the other driver binaries: `#!/bin/sh` scripts (they must run inside a
  busybox container); `nvidia-smi` lists the `/dev/nvidia<N>` nodes the container can see, in the
  style of `nvidia-smi -L`, so a container test shows which GPUs were handed over;
* `lib/firmware/nvidia/<version>/gsp_*.bin`.

Rendering is idempotent.
"""

from __future__ import annotations

import os
from pathlib import Path

LIB_DIR = "usr/lib/x86_64-linux-gnu"
BIN_DIR = "usr/bin"
FIRMWARE_DIR = "lib/firmware/nvidia"

# library -> its soname's version suffix ("" = the installer makes no soname link)
_LIBRARIES = {
    "libcuda.so": "1",
    "libnvidia-ml.so": "1",
    "libnvidia-ptxjitcompiler.so": "1",
    "libnvidia-nvvm.so": "4",
    "libcudadebugger.so": "1",
    "libnvidia-gpucomp.so": "",
}

_NVIDIA_SMI = """#!/bin/sh
# Simulated nvidia-smi (Tandem): lists the GPU device nodes this container was given.
echo "NVIDIA-SMI simulated, driver version {version}"
i=0
for dev in /dev/nvidia[0-9]*; do
    [ -e "$dev" ] || continue
    echo "GPU $i: Simulated NVIDIA GPU (device: $dev)"
    i=$((i + 1))
done
"""

_OTHER_BINARY = """#!/bin/sh
# Simulated {name} (Tandem).
echo "{name} simulated, driver version {version}"
"""

_OTHER_BINARIES = ("nvidia-debugdump", "nvidia-persistenced", "nvidia-cuda-mps-control", "nvidia-cuda-mps-server")


def _file(path: Path, text: str, mode: int = 0o644) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    os.chmod(path, mode)


def _link(link: Path, target: str) -> None:
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(target)


def render_driver_files(root: Path, version: str = "580.95.05") -> None:
    root = Path(root)
    libs = root / LIB_DIR
    for lib, soname_version in _LIBRARIES.items():
        real = f"{lib}.{version}"
        _file(libs / real, f"simulated {real}\n")
        if soname_version:
            _link(libs / f"{lib}.{soname_version}", real)
    _link(libs / "libcuda.so", "libcuda.so.1")
    bins = root / BIN_DIR
    _file(bins / "nvidia-smi", _NVIDIA_SMI.format(version=version), 0o755)
    for name in _OTHER_BINARIES:
        _file(bins / name, _OTHER_BINARY.format(name=name, version=version), 0o755)
    firmware = root / FIRMWARE_DIR / version
    for blob in ("gsp_ga10x.bin", "gsp_tu10x.bin"):
        _file(firmware / blob, "simulated GSP firmware\n")
