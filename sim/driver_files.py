"""Render a fake NVIDIA user-space driver tree, laid out the way the driver installer lays it out.

Under `root` (standing in for `--nvidia-driver-root`):

* `<lib_dir>/<lib>.so.<version>` (`usr/lib/x86_64-linux-gnu` as on Debian and Ubuntu, or
  `usr/lib64` as on RHEL): each its soname link (`libcuda.so.1 -> libcuda.so.<version>`) and, for
  libcuda, the development link (`libcuda.so -> libcuda.so.1`), all relative as the installer makes
  them. The libraries are real, if empty, ELF shared objects of this machine with that soname, so a
  container's dynamic loader loads them and ldconfig lists them as it would the driver's;
* `usr/bin/nvidia-smi` and the other driver binaries: `#!/bin/sh` scripts (they must run inside a
  busybox container); `nvidia-smi` lists the `/dev/nvidia<N>` nodes the container can see, in the
  style of `nvidia-smi -L`, so a container test shows which GPUs were handed over;
  `nvidia-cuda-mps-control` is the MPS stand-in `sim.mps_control` (Python: the node runs it, as
  Tandem starts MPS control daemons there, not a container), and `nvidia-smi compute-policy` runs
  the stand-in `sim.nvidia_smi` (rendered as `usr/share/tandem-sim/nvidia-smi-compute-policy`);
* `lib/firmware/nvidia/<version>/gsp_*.bin`.

Rendering is idempotent.
"""

from __future__ import annotations

import os
import platform
import struct
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
# Simulated nvidia-smi (Tandem): lists the GPU device nodes this container was given;
# `compute-policy` (the node's, never a container's) is the Python stand-in `sim.nvidia_smi`.
if [ "$1" = compute-policy ]; then
    exec python3 "$(dirname "$0")/../{compute_policy}" "$@"
fi
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

_OTHER_BINARIES = ("nvidia-debugdump", "nvidia-persistenced", "nvidia-cuda-mps-server")
MPS_CONTROL = "nvidia-cuda-mps-control"
COMPUTE_POLICY = "share/tandem-sim/nvidia-smi-compute-policy"  # below usr/


def _file(path: Path, text: str, mode: int = 0o644) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    os.chmod(path, mode)


def _link(link: Path, target: str) -> None:
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(target)


# ELF e_machine of the machines the simulation runs on (EM_X86_64, EM_AARCH64).
_ELF_MACHINES = {"x86_64": 62, "aarch64": 183}


def shared_object(soname: str, machine: str = "") -> bytes:
    """The smallest ELF64 shared object glibc's loader and ldconfig accept: one writable PT_LOAD
    holding the dynamic section (the loader relocates it in place), a non-executable stack, and
    DT_SONAME with the string, symbol and hash tables it needs; no code, no symbols."""
    e_machine = _ELF_MACHINES.get(machine or platform.machine(), _ELF_MACHINES["x86_64"])
    ehdr, phdr, phnum = 64, 56, 3
    strtab = b"\0" + soname.encode() + b"\0"
    str_off = ehdr + phdr * phnum
    sym_off = (str_off + len(strtab) + 7) & ~7
    hash_off = sym_off + 24  # one null Elf64_Sym
    dyn_off = hash_off + 16  # nbucket = nchain = 1, both empty
    # DT_HASH, DT_STRTAB, DT_SYMTAB, DT_STRSZ, DT_SYMENT, DT_SONAME (offset 1 in strtab), DT_NULL
    dynamic = [(4, hash_off), (5, str_off), (6, sym_off), (10, len(strtab)), (11, 24), (14, 1), (0, 0)]
    size = dyn_off + 16 * len(dynamic)
    out = bytearray(b"\x7fELF" + bytes([2, 1, 1, 0]) + bytes(8))  # 64-bit, little-endian, SysV
    out += struct.pack("<HHIQQQIHHHHHH", 3, e_machine, 1, 0, ehdr, 0, 0, ehdr, phdr, phnum, 64, 0, 0)
    out += struct.pack("<IIQQQQQQ", 1, 6, 0, 0, 0, size, size, 0x1000)  # PT_LOAD, RW
    out += struct.pack("<IIQQQQQQ", 2, 6, dyn_off, dyn_off, dyn_off, size - dyn_off, size - dyn_off, 8)  # PT_DYNAMIC
    out += struct.pack("<IIQQQQQQ", 0x6474E551, 6, 0, 0, 0, 0, 0, 16)  # PT_GNU_STACK, RW
    out += strtab + bytes(sym_off - str_off - len(strtab)) + bytes(24) + struct.pack("<IIII", 1, 1, 0, 0)
    for tag, value in dynamic:
        out += struct.pack("<qQ", tag, value)
    return bytes(out)


def render_driver_files(root: Path, version: str = "580.95.05", lib_dir: str = LIB_DIR) -> None:
    root = Path(root)
    libs = root / lib_dir
    for lib, soname_version in _LIBRARIES.items():
        real = f"{lib}.{version}"
        soname = f"{lib}.{soname_version}" if soname_version else real
        libs.mkdir(parents=True, exist_ok=True)
        (libs / real).write_bytes(shared_object(soname))
        os.chmod(libs / real, 0o755)
        if soname_version:
            _link(libs / soname, real)
    _link(libs / "libcuda.so", "libcuda.so.1")
    bins = root / BIN_DIR
    _file(bins / "nvidia-smi", _NVIDIA_SMI.format(version=version, compute_policy=COMPUTE_POLICY), 0o755)
    _file(root / "usr" / COMPUTE_POLICY, (Path(__file__).parent / "nvidia_smi.py").read_text(), 0o755)
    for name in _OTHER_BINARIES:
        _file(bins / name, _OTHER_BINARY.format(name=name, version=version), 0o755)
    _file(bins / MPS_CONTROL, (Path(__file__).parent / "mps_control.py").read_text(), 0o755)
    firmware = root / FIRMWARE_DIR / version
    for blob in ("gsp_ga10x.bin", "gsp_tu10x.bin"):
        _file(firmware / blob, "simulated GSP firmware\n")
