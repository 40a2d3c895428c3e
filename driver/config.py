"""The daemon's validated configuration, built once from flags and environment.

Every value that reaches a file path or an API object is checked here, so that a bad flag is a
one-line error at start-up instead of a failure deep inside a prepare call.
"""

from __future__ import annotations

import dataclasses
import enum
import fnmatch
import math
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from cdi import is_dns_subdomain
from driver.errors import InvalidInput
from driver.model import DeviceKind

# Pod and claim UIDs are RFC 4122 UUIDs in practice; accept the safe character set a UID can use.
_UID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9-]{0,62}$")
_LISTEN = re.compile(r"^(?P<host>[^:]*|\[[0-9a-fA-F:]+\]):(?P<port>\d{1,5})$")

DRIVER_NAME_MAX = 63
# Shares of one RoCE NIC: the NVIDIA Network Operator's default for the RDMA shared device plugin
# (`rdmaHcaMax: 63`); at most as many as that plugin's own largest examples (1000).
DEFAULT_NIC_SHARES = 63
MAX_NIC_SHARES = 1000


class ConfigError(InvalidInput):
    """A configuration value is invalid; the message names the flag and says what is wrong."""

    def naming(self, sources: Mapping[str, str]) -> str:
        """The message, and the environment variable that set its flag when one did (`sources`:
        flag names joined by '/' -> `NIC_SHARES='2000'`), so the SRE knows which of the
        DaemonSet's settings to fix: `--nic-shares 2000 must be 1 to 1000 (from NIC_SHARES='2000')`."""
        flag = str(self).partition(" ")[0].rstrip(":")
        source = next((s for names, s in sources.items() if flag in names.split("/")), None)
        return f"{self} (from {source})" if source else str(self)


def is_uid(value: str) -> bool:
    return bool(_UID.fullmatch(value))


# A netdev name (IFNAMSIZ 16 with the NUL) or PCI address pattern: glob characters allowed, no
# separators, whitespace or path characters.
_NETDEV_PATTERN = re.compile(r"^[^\s/,:]{1,64}$")
_PCI_PATTERN = re.compile(r"^[0-9a-f*?\[\]!:.-]{1,64}$")


@dataclass(frozen=True)
class NicExclusions:
    """`--exclude-nics`: the NICs an operator keeps out (storage or management ports, VFs another
    operator owns). Each pattern is a shell-style glob; one with a `:` matches the PCI address
    (lower case, `0000:3b:00.1`, `0000:3b:00.*`), any other the netdev names (`eth*`, `ens1f1np1`).
    A NIC is out when any pattern matches its PCI address or any of its netdevs' names.
    """

    patterns: tuple[str, ...] = ()

    @classmethod
    def parse(cls, text: str) -> NicExclusions:
        """`eth*,0000:3b:00.1` -> the patterns; ConfigError naming a malformed one."""
        patterns = []
        for part in (p.strip() for p in text.split(",")):
            if not part:
                continue
            is_pci = ":" in part
            if not (_PCI_PATTERN if is_pci else _NETDEV_PATTERN).fullmatch(part.lower() if is_pci else part):
                what = "PCI address (0000:3b:00.1, globs allowed)" if is_pci else "netdev name or glob"
                raise ConfigError(f"--exclude-nics: {part!r} is not a {what}")
            patterns.append(part.lower() if is_pci else part)
        return cls(tuple(patterns))

    def match(self, pci_address: str, netdevs: Iterable[str] = ()) -> str | None:
        """The first pattern that excludes this NIC (for the log), or None."""
        names = tuple(netdevs)
        for pattern in self.patterns:
            if ":" in pattern:
                if fnmatch.fnmatchcase(pci_address.lower(), pattern):
                    return pattern
            elif any(fnmatch.fnmatchcase(n, pattern) for n in names):
                return pattern
        return None


NO_EXCLUSIONS = NicExclusions()


@dataclass(frozen=True)
class GpuSelection:
    """Some of the node's GPUs (`all`, or minor numbers and GPU UUIDs), for a flag that changes
    what they publish, so a flag and not a DeviceClass: it acts before any claim exists.
    `--dynamic-mig`: GPUs whose MIG devices Tandem makes on demand (partitions and counters instead
    of the MIG devices an administrator made; only GPUs the administrator put in MIG mode, whose
    mode Tandem never switches). `--gpu-sharing`: full GPUs many claims may share (consumable
    capacity, `driver.discovery.gpu.shared`)."""

    everything: bool = False
    gpus: frozenset[str] = frozenset()

    @classmethod
    def parse(cls, text: str, flag: str) -> GpuSelection:
        parts = [p.strip() for p in text.split(",") if p.strip()]
        if parts == ["all"]:
            return cls(everything=True)
        for part in parts:
            if not (part.isdigit() or re.fullmatch(r"GPU-[0-9A-Fa-f-]{1,60}", part)):
                raise ConfigError(f"{flag}: {part!r} is not 'all', a GPU minor number or a GPU UUID")
        return cls(gpus=frozenset(parts))

    def selects(self, minor: int, uuid: str) -> bool:
        return self.everything or str(minor) in self.gpus or uuid in self.gpus


@dataclass(frozen=True)
class Config:
    node_name: str
    driver_name: str = "tandem.dev"
    kubeconfig: str | None = None
    registrar_dir: Path = Path("/var/lib/kubelet/plugins_registry")
    plugins_dir: Path = Path("/var/lib/kubelet/plugins")
    cdi_root: Path = Path("/var/run/cdi")
    sysfs_root: Path = Path("/sys")
    dev_root: Path = Path("/dev")
    proc_root: Path = Path("/proc")
    nvidia_driver_root: Path = Path("/")
    # The same root as the container runtime sees it on the host (CDI host paths); None = same path.
    nvidia_driver_root_host: Path | None = None
    pod_uid: str = ""
    device_kinds: frozenset[DeviceKind] = field(default_factory=lambda: frozenset({DeviceKind.GPU, DeviceKind.NIC}))
    list_attributes: bool = False
    # Link, address and default-route changes and Tandem's own MIG changes are events; the period
    # is for what no event reports (hot-plug, driver reload, nvidia-smi). Idle cost: docs/architecture.md.
    rediscover_period: float = 300.0
    metrics_address: str = ""
    # Where NIC link facts come from: netlink (real nodes) or sysfs alone (the simulated node,
    # whose NICs exist only as sysfs trees and have no netdevs the kernel knows).
    nic_link_source: str = "netlink"
    # Network namespace whose NICs to serve (a name under /var/run/netns); empty = the daemon's own.
    netns: str = ""
    exclude_nics: NicExclusions = NO_EXCLUSIONS
    dynamic_mig: GpuSelection = GpuSelection()
    gpu_sharing: GpuSelection = GpuSelection()
    # Health policy: XIDs that are the application's fault, per-key taint effects (KEY=EFFECT),
    # how long a transient GPU condition must stay quiet before its taint clears, link debounce.
    ignored_xids: frozenset[int] = frozenset()
    taint_effects: tuple[str, ...] = ()
    health_quiet_period: float = 600.0
    link_debounce: float = 2.0
    # Grey-failure thresholds overridden (NAME=VALUE, `driver.health.thresholds`); the rest default.
    grey_thresholds: tuple[str, ...] = ()
    # Claims one RoCE NIC may serve at once (consumable capacity `shares`; 1: not shared).
    nic_shares: int = DEFAULT_NIC_SHARES
    # Binding conditions (`driver.claims.binding`): dynamic-MIG partitions made, and whole NICs
    # checked, before the scheduler binds the pod; off, both happen at prepare as before.
    mig_binding_conditions: bool = True
    nic_binding_conditions: bool = False

    def as_log(self) -> dict[str, object]:
        """Every field as plain JSON values, for the start-up log line: what the daemon runs with,
        whichever flag or variable set it. No field holds a secret (the kubeconfig is a path; the
        tokens it leads to are read by `driver.kube.kubeconfig` and never kept here)."""
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @property
    def data_dir(self) -> Path:
        """Per-driver state directory; the kubelet requires it to be the same inside and outside the pod."""
        return self.plugins_dir / self.driver_name

    def validate(self) -> Config:
        if not self.node_name:
            raise ConfigError("--node-name (NODE_NAME) is required")
        if not is_dns_subdomain(self.node_name):
            raise ConfigError(f"--node-name {self.node_name!r} is not a valid node name (DNS subdomain)")
        if not is_dns_subdomain(self.driver_name, DRIVER_NAME_MAX) or "." not in self.driver_name:
            raise ConfigError(
                f"--driver-name {self.driver_name!r} must be a lower-case DNS subdomain of at most "
                f"{DRIVER_NAME_MAX} characters in a domain you own, e.g. tandem.dev"
            )
        if self.kubeconfig is not None:
            check_kubeconfig(self.kubeconfig)
        if self.pod_uid and not is_uid(self.pod_uid):
            raise ConfigError(f"--pod-uid {self.pod_uid!r} is not a valid pod UID")
        for flag, path in (
            ("--kubelet-registrar-dir", self.registrar_dir),
            ("--kubelet-plugins-dir", self.plugins_dir),
            ("--cdi-root", self.cdi_root),
            ("--sysfs-root", self.sysfs_root),
            ("--dev-root", self.dev_root),
            ("--proc-root", self.proc_root),
            ("--nvidia-driver-root", self.nvidia_driver_root),
            ("--nvidia-driver-root-host", self.nvidia_driver_root_host or Path("/")),
        ):
            if not path.is_absolute():
                raise ConfigError(f"{flag} {str(path)!r} must be an absolute path")
        if not self.device_kinds:
            raise ConfigError("--device-kinds must name at least one of: gpu, nic")
        for flag, seconds, allow_zero in (
            ("--rediscover-period", self.rediscover_period, False),
            ("--health-quiet-period", self.health_quiet_period, False),
            ("--link-debounce", self.link_debounce, True),
        ):
            if not (math.isfinite(seconds) and (seconds >= 0 if allow_zero else seconds > 0)):  # NaN fails too
                rule = "zero or more" if allow_zero else "more than zero"
                raise ConfigError(f"{flag} {seconds} must be a finite number of seconds, {rule}")
        if self.netns and not (re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", self.netns) and self.netns not in (".", "..")):
            raise ConfigError(f"--netns {self.netns!r} must be the name of a namespace under /var/run/netns")
        if not 1 <= self.nic_shares <= MAX_NIC_SHARES:
            raise ConfigError(f"--nic-shares {self.nic_shares} must be 1 to {MAX_NIC_SHARES}")
        if self.nic_link_source not in ("netlink", "sysfs"):
            raise ConfigError(f"--nic-link-source {self.nic_link_source!r} must be netlink or sysfs")
        listen = _LISTEN.fullmatch(self.metrics_address)
        if self.metrics_address and not (listen and int(listen["port"]) <= 65535):
            raise ConfigError(f"--metrics-address {self.metrics_address!r} must be HOST:PORT (port 0-65535)")
        return self


def _plain(value: object) -> object:
    """A field's value as JSON shows it: paths and enums as their text, sets sorted, the selections'
    own fields."""
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, frozenset | tuple):
        return [_plain(v) for v in (sorted(value) if isinstance(value, frozenset) else value)]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    return value


def check_kubeconfig(value: str) -> None:
    """`--kubeconfig`: one file, or an `os.pathsep`-separated list that
    `driver.kube.kubeconfig.from_kubeconfig` merges as kubectl does. There a listed file that does not
    exist is skipped, as kubectl skips it. Checked with the other flags, so that a mistake is a
    one-line usage error (exit code 2) rather than a failure of the started daemon: at least one
    name must be a file that exists, and every name that exists must be a file."""
    names = [name for name in value.split(os.pathsep) if name]
    if not names:
        raise ConfigError(f"--kubeconfig {value!r} names no file")
    if len(names) == 1:
        if not Path(names[0]).expanduser().is_file():
            raise ConfigError(f"--kubeconfig {value!r} is not a file")
        return
    present = False
    for name in names:
        path = Path(name).expanduser()
        if path.exists():
            if not path.is_file():
                raise ConfigError(f"--kubeconfig: {name!r} of the list {value!r} is not a file")
            present = True
    if not present:
        raise ConfigError(f"--kubeconfig {value!r}: none of the listed files exists")


def parse_device_kinds(text: str) -> frozenset[DeviceKind]:
    """`gpu,nic` -> {GPU, NIC}. MIG devices come with `gpu`: they are GPUs in another mode."""
    kinds: set[DeviceKind] = set()
    for part in (p.strip().lower() for p in text.split(",")):
        if not part:
            continue
        if part not in ("gpu", "nic"):
            raise ConfigError(f"--device-kinds: unknown kind {part!r} (expected gpu, nic)")
        kinds.add(DeviceKind(part))
    return frozenset(kinds)


def parse_xids(text: str) -> frozenset[int]:
    """`13,31,43` -> {13, 31, 43}."""
    out = set()
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        if not part.isdigit() or not 0 < int(part) < 1000:
            raise ConfigError(f"--ignored-xids: {part!r} is not an XID number")
        out.add(int(part))
    return frozenset(out)
