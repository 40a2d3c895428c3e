"""The device nodes a claim hands to containers: found under `--dev-root`, or made there the way
nvidia-modprobe makes them; a node that can be neither fails the claim, naming the node.

The NVIDIA kernel modules make no device files. User space does, lazily: libcuda and NVML run the
setuid `nvidia-modprobe`, which takes the major number from the kernel's `/proc/devices`, the minor
by the driver's convention and the permissions from the driver's proc files
(NVIDIA/nvidia-modprobe, `modprobe-utils/nvidia-modprobe-utils.c`). So a node where no CUDA process
ran yet has no `/dev/nvidia-uvm` and no `/dev/nvidia-caps/nvidia-cap<N>`, and a container given its
nodes through CDI cannot make them: the runtime refuses a CDI device node whose host path does not
exist, and without the node CUDA does not work. Before a claim is prepared, every NVIDIA node it
needs is therefore made here if missing (paths relative to `--proc-root`):

| Node | Major | Minor | Mode and owner; may it be made |
|---|---|---|---|
| `nvidia<N>`, `nvidiactl` | 195 | N, 255 | `driver/nvidia/params`: `DeviceFileMode`, `DeviceFileUID`, `DeviceFileGID` (default 0666 root); `ModifyDeviceFiles` |
| `nvidia-uvm`, `nvidia-uvm-tools` | `nvidia-uvm` in `devices` | 0, 1 | 0666 root; always |
| `nvidia-caps/nvidia-cap<N>` | `nvidia-caps` in `devices` | N | the capability's access file, found through `driver/nvidia-caps/mig-minors`; its `DeviceFileModify` |

A module that is not loaded (no major in `devices`), a capability without an access file (the MIG
device is gone) or a driver told not to touch device files (`ModifyDeviceFiles: 0`: whoever set it
manages them) leaves the node missing, and the claim fails.

RDMA nodes are not lazy: udev makes `infiniband/uverbs<N>` when ib_uverbs registers the device and
`umad<N>`/`issm<N>` when ib_umad does. A missing one means the module is not loaded or udev did not
run, which Tandem must not paper over, so the claim fails naming the node and the module.
`nvidia-modeset` (display, not compute) and `infiniband/rdma_cm` (librdmacm's connection manager;
NCCL and UCX work without it) are optional: handed out when present, left out with a warning when not.

Making a node is nvidia-modprobe's `mknod`, `chmod` (mknod honours the umask), `chown`, but on a
temporary name beside the node, renamed onto it at the end: the node appears whole, so neither
another process nor a daemon killed halfway leaves one with a narrower mode behind (the next
attempt removes a killed one's temporary node first). One lock covers the creation and the `stat`
after it. Made nodes are never removed, as nvidia-modprobe's are not.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import stat
import threading
from dataclasses import dataclass
from pathlib import Path

import cdi
from driver.errors import NodeError

log = logging.getLogger(__name__)

DEVICE_NODE_PERMISSIONS = "rw"
NVIDIA_MAJOR = 195  # fixed by the nvidia module (its "nvidia-frontend" entry in /proc/devices)
NVIDIACTL_MINOR = 255
DEFAULT_MODE = 0o666
UVM_MINORS = {"nvidia-uvm": 0, "nvidia-uvm-tools": 1}
OPTIONAL = frozenset({"nvidia-modeset", "infiniband/rdma_cm"})
# The kernel module whose registration makes udev create each kind of RDMA node.
RDMA_MODULES = {"uverbs": "ib_uverbs", "umad": "ib_umad", "issm": "ib_umad"}

_NVIDIA = re.compile(r"^nvidia(\d+)$")
_CAP = re.compile(r"^nvidia-caps/nvidia-cap(\d+)$")
_RDMA = re.compile(r"^infiniband/([a-z_]+?)\d+$")
_MODE_MASK = 0o777
TMP_SUFFIX = ".tandem-new"  # `.<node>.tandem-new`: a node being made, renamed onto `<node>` when whole
_LOCK = threading.Lock()


class DeviceNodeError(NodeError):
    """A node the claim needs is missing and cannot be made here; the message names it and says why."""


@dataclass(frozen=True)
class _Recipe:
    """How nvidia-modprobe would make one node."""

    major: int
    minor: int
    mode: int = DEFAULT_MODE
    uid: int = 0
    gid: int = 0


class DeviceNodes:
    """The nodes under `dev_root` as CDI device nodes, made first where the NVIDIA driver's
    conventions allow; `proc_root` is where the kernel's and the driver's proc files are read."""

    def __init__(self, dev_root: Path, proc_root: Path) -> None:
        self.dev_root = dev_root
        self.proc_root = proc_root

    def node(self, rel: str) -> cdi.DeviceNode | None:
        """`/dev/<rel>` for a CDI spec; None only for a missing optional node.

        Type and numbers come from the host node so the runtime need not stat it; a plain file (the
        unprivileged simulation) gets neither and is left for the runtime to inspect. Raises
        `DeviceNodeError` for a required node that is missing and cannot be made, or unreadable.
        """
        host = self.dev_root / rel
        with _LOCK:
            try:
                try:
                    st = os.stat(host)
                except FileNotFoundError:
                    if rel in OPTIONAL:
                        log.warning("device node %s does not exist; left out of the CDI spec", host)
                        return None
                    self._make(rel, host)
                    st = os.stat(host)
            except OSError as e:
                if rel in OPTIONAL:
                    log.warning("device node %s cannot be inspected (%s); left out of the CDI spec", host, e)
                    return None
                raise DeviceNodeError(f"device node {host} cannot be inspected: {e.strerror or e}") from e
        container = f"/dev/{rel}"
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

    # -- making a node ----------------------------------------------------------------------------

    def _make(self, rel: str, host: Path) -> None:
        recipe = self._recipe(rel, host)
        new = host.with_name(f".{host.name}{TMP_SUFFIX}")
        try:
            host.parent.mkdir(mode=0o755, exist_ok=True)  # /dev/nvidia-caps, as nvidia-modprobe makes it
            new.unlink(missing_ok=True)  # left by a daemon killed while making this node
            os.mknod(new, stat.S_IFCHR | recipe.mode, os.makedev(recipe.major, recipe.minor))
            os.chmod(new, recipe.mode)
            os.chown(new, recipe.uid, recipe.gid)
            os.rename(new, host)
        except OSError as e:
            with contextlib.suppress(OSError):
                new.unlink(missing_ok=True)
            raise DeviceNodeError(f"device node {host} is missing and could not be created: {e.strerror or e}") from e
        log.info("created device node %s (%d:%d, mode %04o)", host, recipe.major, recipe.minor, recipe.mode)

    def _recipe(self, rel: str, host: Path) -> _Recipe:
        """How to make `rel`, or DeviceNodeError saying why it cannot be made here."""
        gpu = _NVIDIA.match(rel)
        if gpu or rel == "nvidiactl":
            minor = int(gpu.group(1)) if gpu else NVIDIACTL_MINOR
            return self._permissions(host, NVIDIA_MAJOR, minor, self.proc_root / "driver/nvidia/params", False)
        if rel in UVM_MINORS:
            return _Recipe(self._major("nvidia-uvm", host), UVM_MINORS[rel])
        cap = _CAP.match(rel)
        if cap:
            minor = int(cap.group(1))
            major = self._major("nvidia-caps", host)
            return self._permissions(host, major, minor, self._cap_access_file(minor, host), True)
        rdma = _RDMA.match(rel)
        if rdma and rdma.group(1) in RDMA_MODULES:
            module = RDMA_MODULES[rdma.group(1)]
            raise DeviceNodeError(
                f"device node {host} is missing: udev makes it when the {module} kernel module registers "
                f"the device, so {module} is not loaded or udev has not run on this node"
            )
        raise DeviceNodeError(f"device node {host} is missing")

    def _major(self, name: str, host: Path) -> int:
        """The major number the kernel gave the character device `name` (nvidia_get_chardev_major)."""
        path = self.proc_root / "devices"
        try:
            text = path.read_text()
        except OSError as e:
            raise DeviceNodeError(
                f"device node {host} is missing and its major number is unknown: {path}: {e.strerror or e}"
            ) from e
        _, found, rest = text.partition("Character devices:\n")
        for line in rest.split("\n\n", 1)[0].splitlines() if found else ():
            number, _, device = line.strip().partition(" ")
            if device == name and number.isdigit():
                return int(number)
        raise DeviceNodeError(
            f"device node {host} is missing and cannot be created: {path} lists no {name} character "
            f"device (is the {name} kernel module loaded?)"
        )

    def _cap_access_file(self, minor: int, host: Path) -> Path:
        """The proc file describing capability `minor`, from the driver's table of MIG minors
        (`gpu0/gi7/access 66` is `driver/nvidia/capabilities/gpu0/mig/gi7/access`)."""
        table = self.proc_root / "driver/nvidia-caps/mig-minors"
        try:
            lines = table.read_text().splitlines()
        except OSError as e:
            raise DeviceNodeError(f"device node {host} is missing and {table} cannot be read: {e.strerror or e}") from e
        caps = self.proc_root / "driver/nvidia/capabilities"
        for line in lines:
            name, _, number = line.strip().rpartition(" ")
            if number == str(minor) and name and ".." not in name.split("/"):
                gpu, _, rest = name.partition("/")
                return caps / gpu / "mig" / rest if rest else caps / "mig" / name
        raise DeviceNodeError(f"device node {host} is missing and minor {minor} is not in {table}")

    def _permissions(self, host: Path, major: int, minor: int, proc_file: Path, required: bool) -> _Recipe:
        """Mode and owner from the driver's proc file (absent: nvidia-modprobe's defaults, unless
        `required`); DeviceNodeError when the driver forbids making device files."""
        try:
            text = proc_file.read_text()
        except OSError as e:
            if required:
                raise DeviceNodeError(
                    f"device node {host} is missing and cannot be created: {proc_file}: {e.strerror or e}"
                ) from e
            text = ""
        fields: dict[str, int] = {}
        for line in text.splitlines():
            key, _, value = line.partition(":")
            if value.strip().isdigit():
                fields[key.strip()] = int(value)
        if required and fields.get("DeviceFileMinor") != minor:
            raise DeviceNodeError(f"device node {host} is missing and {proc_file} does not describe minor {minor}")
        if fields.get("ModifyDeviceFiles", fields.get("DeviceFileModify", 1)) != 1:
            raise DeviceNodeError(
                f"device node {host} is missing and the NVIDIA driver forbids creating device files "
                f"({proc_file}): whoever manages them on this node must create it"
            )
        mode = fields.get("DeviceFileMode", DEFAULT_MODE) & _MODE_MASK
        return _Recipe(major, minor, mode, fields.get("DeviceFileUID", 0), fields.get("DeviceFileGID", 0))
