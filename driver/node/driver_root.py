"""The NVIDIA user-space driver files a CUDA container needs, found under the driver root.

A container image carries CUDA but not the driver's user-space half (libcuda, NVML, the JIT
compilers, nvidia-smi): it must match the kernel module, so it comes from the node. NVIDIA's own
DRA driver puts these files into every claim's CDI spec (docs/reference/drivers.md, 'NVIDIA DRA driver for GPUs': "driver library mounts;
binaries nvidia-smi, nvidia-debugdump, nvidia-persistenced, nvidia-cuda-mps-control,
nvidia-cuda-mps-server, nvidia-imex, nvidia-imex-ctl; GSP firmware"); Tandem does the same as
read-only bind mounts.

Libraries must be loadable whatever distribution the image is built from, and the host's
directory means nothing to the image's loader: Ubuntu keeps them in `/usr/lib/x86_64-linux-gnu`,
which a UBI image's loader never searches, and a RHEL host's `/usr/lib64` is not searched by an
Ubuntu image's. The ways to tell the loader, weighed:

* `LD_LIBRARY_PATH` in the CDI env: works in any image, but CDI replaces env by key, so it
  would wipe the image's own value (NGC images list CUDA compat, PyTorch and TensorRT directories
  there), and a variable CDI sets cannot be corrected from the pod spec.
* A drop-in in `/etc/ld.so.conf.d` plus a hook running ldconfig (what nvidia-ctk's
  `update-ldcache` does): a `startContainer` hook runs the image's ldconfig, which distroless,
  busybox and musl images lack, which fails as a non-root user or on a read-only root, and which
  fails the container when it fails; a `createContainer` hook runs on the host as root against the
  container's root filesystem, so it needs a hook binary installed on every node and is exactly
  the attack surface of NVIDIA's hook CVEs (CVE-2024-0132, CVE-2025-23266). Tandem installs
  nothing on the host.
* Bind mounts into the loader's own search path: glibc's loader, after `/etc/ld.so.cache` and
  before giving up, searches the directories it was built with: `/lib/<triplet>`,
  `/usr/lib/<triplet>`, `/lib`, `/usr/lib` on Debian and Ubuntu, `/lib64`, `/usr/lib64` on RHEL,
  UBI, Rocky, Fedora, SUSE and Amazon Linux, `/usr/lib` on Arch. Mounts need no cache, hook,
  environment, tool in the image, writable root or privilege, and CDI 0.3.0 has them.

Tandem takes the last: every library name is mounted in each of `LOADER_DIRS` (`/usr/lib/<triplet>`
for the node's machine, `/usr/lib64`, `/usr/lib`), whatever directory the host keeps it in. A name
the image already has there is shadowed by the driver's, as with NVIDIA's mounts. NVIDIA also adds
the soname links (`libcuda.so.1 -> libcuda.so.580.95.05`) with a `create-symlinks` hook; Tandem
bind-mounts every name instead, the real file's and each link's (a bind mount of a link mounts the
file it points to).

The scan runs at start-up and on rediscovery, never on the prepare path. The driver root may be
a driver container's root filesystem (`/run/nvidia/driver`), so links are resolved as if the root
were `/` (an absolute target means a path inside the root) and a link that climbs out of the root
is ignored: a file planted outside the driver root must never end up in a container.
"""

from __future__ import annotations

import logging
import os
import platform
import re
import stat
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from driver.errors import NodeError

log = logging.getLogger(__name__)

# Directories (relative to the driver root) where distributions install the driver's 64-bit
# libraries; plain `usr/lib` is left out because RPM distributions keep 32-bit libraries there.
LIBRARY_DIRS = (
    "usr/lib/x86_64-linux-gnu",
    "lib/x86_64-linux-gnu",
    "usr/lib/aarch64-linux-gnu",
    "lib/aarch64-linux-gnu",
    "usr/lib64",
    "lib64",
)
# Where the libraries go in the container (see the module docstring); `{triplet}` is the node's
# multiarch directory, left out on a machine not in `TRIPLETS`.
LOADER_DIRS = ("/usr/lib/{triplet}", "/usr/lib64", "/usr/lib")
TRIPLETS = {"x86_64": "x86_64-linux-gnu", "aarch64": "aarch64-linux-gnu", "ppc64le": "powerpc64le-linux-gnu"}
BINARY_DIRS = ("usr/bin", "bin")
FIRMWARE_DIRS = ("lib/firmware/nvidia", "usr/lib/firmware/nvidia")

# The compute and utility libraries of the driver (libnvidia-container's compute/utility sets);
# graphics, video and OpenGL libraries are left out: Tandem hands out compute devices.
LIBRARIES = (
    "libcuda.so",
    "libcudadebugger.so",
    "libnvidia-allocator.so",
    "libnvidia-cfg.so",
    "libnvidia-gpucomp.so",
    "libnvidia-ml.so",
    "libnvidia-nvvm.so",
    "libnvidia-opencl.so",
    "libnvidia-pkcs11-openssl3.so",
    "libnvidia-pkcs11.so",
    "libnvidia-ptxjitcompiler.so",
    "libnvidia-tls.so",
)
BINARIES = (
    "nvidia-smi",
    "nvidia-debugdump",
    "nvidia-persistenced",
    "nvidia-cuda-mps-control",
    "nvidia-cuda-mps-server",
    "nvidia-imex",
    "nvidia-imex-ctl",
)

_MAX_LINKS = 40  # the kernel's limit on symlinks followed in one lookup
_LIBCUDA_VERSION = re.compile(r"^libcuda\.so\.(\d+\.\d+(?:\.\d+)?)$")


@dataclass(frozen=True)
class DriverFiles:
    """What to bind-mount, as (host path, container path) pairs.

    The host path is the resolved regular file (or directory) inside the driver root; the container
    path of a library is its name in each of `LOADER_DIRS`, that of a binary or firmware directory
    the name found, relative to the driver root and re-rooted at `/`.
    """

    libraries: tuple[tuple[str, str], ...] = ()
    binaries: tuple[tuple[str, str], ...] = ()
    firmware: tuple[tuple[str, str], ...] = ()
    version: str = ""  # from the real libcuda file name; "" when no libcuda was found

    @property
    def mounts(self) -> tuple[tuple[str, str], ...]:
        return self.libraries + self.binaries + self.firmware


class OutsideRoot(NodeError):
    """A path leaves the driver root or cannot be resolved inside it."""


def resolve_in_root(root: Path, relative: PurePosixPath) -> Path:
    """Resolve `relative` inside `root` as a chroot would, following links; raise `OutsideRoot`.

    Absolute link targets are taken relative to `root` (they name files of the root's own tree);
    a `..` that would go above `root` is an escape, not clamped, because it means the tree was not
    laid out by a driver installer.
    """
    parts = list(relative.parts)
    resolved: list[str] = []
    links = 0
    while parts:
        part = parts.pop(0)
        if part in ("", "."):
            continue
        if part == "..":
            if not resolved:
                raise OutsideRoot(f"{relative} climbs out of the driver root")
            resolved.pop()
            continue
        candidate = root.joinpath(*resolved, part)
        try:
            mode = os.lstat(candidate).st_mode
        except OSError as e:
            raise OutsideRoot(f"{candidate}: {e.strerror}") from None
        if not stat.S_ISLNK(mode):
            resolved.append(part)
            continue
        links += 1
        if links > _MAX_LINKS:
            raise OutsideRoot(f"{relative}: too many levels of symbolic links")
        target = PurePosixPath(os.readlink(candidate))
        if target.is_absolute():
            resolved = []
            target = target.relative_to("/")
        parts = list(target.parts) + parts
    return root.joinpath(*resolved)


def driver_program(driver_root: Path, name: str) -> Path | None:
    """The driver root's executable `name` in `BINARY_DIRS`, its links resolved inside the root,
    for what the node itself runs from the driver (MPS control daemons, `nvidia-smi`); None when
    there is none."""
    for d in BINARY_DIRS:
        try:
            path = resolve_in_root(driver_root, PurePosixPath(d, name))
        except OutsideRoot:
            continue
        if os.access(path, os.X_OK):
            return path
    return None


def _is_library_name(name: str) -> bool:
    """`libcuda.so`, `libcuda.so.1` and `libcuda.so.580.95.05` are all names of one library."""
    return any(name == lib or name.startswith(lib + ".") for lib in LIBRARIES)


def _scan_dirs(root: Path, dirs: tuple[str, ...]) -> list[tuple[PurePosixPath, Path]]:
    """(relative directory, resolved directory) for each existing directory, skipping aliases.

    `lib64` is often a link to `usr/lib64`: scanning both would mount every file twice.
    """
    seen: set[Path] = set()
    out = []
    for rel in dirs:
        try:
            real = resolve_in_root(root, PurePosixPath(rel))
        except OutsideRoot as e:
            if os.path.lexists(root / rel):
                log.warning("ignoring driver directory %s: %s", root / rel, e)
            continue
        if real in seen or not real.is_dir():
            continue
        seen.add(real)
        out.append((PurePosixPath(rel), real))
    return out


def _entry(root: Path, rel: PurePosixPath, want_dir: bool = False) -> tuple[str, str] | None:
    try:
        real = resolve_in_root(root, rel)
        st = os.stat(real)
    except (OutsideRoot, OSError) as e:
        log.warning("ignoring NVIDIA driver file %s: %s", root / rel, e)
        return None
    if (stat.S_ISDIR if want_dir else stat.S_ISREG)(st.st_mode):
        return str(real), "/" + str(rel)
    log.warning("ignoring NVIDIA driver file %s: not a %s", root / rel, "directory" if want_dir else "regular file")
    return None


def loader_dirs(machine: str) -> tuple[str, ...]:
    """`LOADER_DIRS` for a machine (`platform.machine()`)."""
    triplet = TRIPLETS.get(machine)
    return tuple(d.format(triplet=triplet) for d in LOADER_DIRS if triplet or "{triplet}" not in d)


def find_driver_files(driver_root: Path, host_root: Path | None = None, machine: str = "") -> DriverFiles:
    """Scan `driver_root` (the host's `/` or a driver container's root) for the driver's files.

    `host_root` is where the container runtime finds that same root on the host, when the daemon
    sees it elsewhere (the DaemonSet mounts the host directories that hold the driver below
    `/driver-root`, never the host's whole root): CDI host paths are resolved by the runtime on the
    host, so they are re-rooted there.
    Unreadable or escaping entries are logged and skipped; a root without a driver yields an
    empty `DriverFiles`, and the claim specs then carry only device nodes. `machine` (default: this
    one's) picks the multiarch directory of `LOADER_DIRS`.
    """
    root = Path(os.path.abspath(driver_root))
    found_libraries: dict[str, str] = {}  # file name -> host file; the first library directory wins
    version = ""
    for rel_dir, real_dir in _scan_dirs(root, LIBRARY_DIRS):
        try:
            names = sorted(os.listdir(real_dir))
        except OSError as e:
            log.warning("cannot list %s: %s", real_dir, e)
            continue
        for name in names:
            if not _is_library_name(name) or name in found_libraries:
                continue
            found = _entry(root, rel_dir / name)
            if found is None:
                continue
            found_libraries[name] = found[0]
            m = _LIBCUDA_VERSION.match(Path(found[0]).name)
            if m and not version:
                version = m.group(1)
    targets = loader_dirs(machine or platform.machine())
    libraries = [(host, f"{d}/{name}") for name, host in found_libraries.items() for d in targets]
    binaries: list[tuple[str, str]] = []
    binary_dirs = _scan_dirs(root, BINARY_DIRS)
    for binary in BINARIES:
        for rel_dir, _ in binary_dirs:
            found = _entry(root, rel_dir / binary) if os.path.lexists(root / rel_dir / binary) else None
            if found is not None:
                binaries.append(found)
                break  # the first directory wins, as on $PATH
    firmware: list[tuple[str, str]] = []
    if version:
        for rel_dir, _ in _scan_dirs(root, FIRMWARE_DIRS):
            if os.path.lexists(root / rel_dir / version):
                found = _entry(root, rel_dir / version, want_dir=True)
                if found is not None:
                    firmware.append(found)
                    break
    if host_root is not None and Path(os.path.abspath(host_root)) != root:
        host = Path(os.path.abspath(host_root))

        def rehome(pairs: list[tuple[str, str]]) -> list[tuple[str, str]]:
            return [(str(host / Path(h).relative_to(root)), c) for h, c in pairs]

        libraries, binaries, firmware = rehome(libraries), rehome(binaries), rehome(firmware)
    files = DriverFiles(tuple(libraries), tuple(binaries), tuple(firmware), version)
    if not libraries:
        log.warning("no NVIDIA driver libraries under %s: GPU containers get device nodes only", root)
    else:
        log.info(
            "NVIDIA driver %s under %s: %d library names (each mounted in %s), %d binaries, %d firmware directories",
            version or "(unknown version)",
            root,
            len(found_libraries),
            ", ".join(targets),
            len(binaries),
            len(firmware),
        )
    return files
