"""The daemon's validated configuration, built once from flags and environment.

Every value that reaches a file path or an API object is checked here, so that a bad flag is a
one-line error at start-up instead of a failure deep inside a prepare call.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from cdi import is_dns_subdomain
from driver.model import DeviceKind

# Pod and claim UIDs are RFC 4122 UUIDs in practice; accept the safe character set a UID can use.
_UID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9-]{0,62}$")
_LISTEN = re.compile(r"^(?P<host>[^:]*|\[[0-9a-fA-F:]+\]):(?P<port>\d{1,5})$")

DRIVER_NAME_MAX = 63


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the flag and says what is wrong."""


def is_uid(value: str) -> bool:
    return bool(_UID.fullmatch(value))


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
    nvidia_driver_root: Path = Path("/")
    # The same root as the container runtime sees it on the host (CDI host paths); None = same path.
    nvidia_driver_root_host: Path | None = None
    pod_uid: str = ""
    device_kinds: frozenset[DeviceKind] = field(default_factory=lambda: frozenset({DeviceKind.GPU, DeviceKind.NIC}))
    list_attributes: bool = False
    rediscover_period: float = 60.0
    metrics_address: str = ""
    # Where NIC link facts come from: netlink (real nodes) or sysfs alone (the simulated node,
    # whose NICs exist only as sysfs trees and have no netdevs the kernel knows).
    nic_link_source: str = "netlink"
    # Network namespace whose NICs to serve (a name under /var/run/netns); empty = the daemon's own.
    netns: str = ""
    # Health policy: XIDs that are the application's fault, per-key taint effects (KEY=EFFECT),
    # how long a transient GPU condition must stay quiet before its taint clears, link debounce.
    ignored_xids: frozenset[int] = frozenset()
    taint_effects: tuple[str, ...] = ()
    health_quiet_period: float = 600.0
    link_debounce: float = 2.0

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
        if self.pod_uid and not is_uid(self.pod_uid):
            raise ConfigError(f"--pod-uid {self.pod_uid!r} is not a valid pod UID")
        for flag, path in (
            ("--kubelet-registrar-dir", self.registrar_dir),
            ("--kubelet-plugins-dir", self.plugins_dir),
            ("--cdi-root", self.cdi_root),
            ("--sysfs-root", self.sysfs_root),
            ("--dev-root", self.dev_root),
            ("--nvidia-driver-root", self.nvidia_driver_root),
            ("--nvidia-driver-root-host", self.nvidia_driver_root_host or Path("/")),
        ):
            if not path.is_absolute():
                raise ConfigError(f"{flag} {str(path)!r} must be an absolute path")
        if not self.device_kinds:
            raise ConfigError("--device-kinds must name at least one of: gpu, nic")
        if self.rediscover_period <= 0:
            raise ConfigError("--rediscover-period must be positive")
        if self.health_quiet_period <= 0 or self.link_debounce < 0:
            raise ConfigError("--health-quiet-period must be positive and --link-debounce not negative")
        if self.netns and not (re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", self.netns) and self.netns not in (".", "..")):
            raise ConfigError(f"--netns {self.netns!r} must be the name of a namespace under /var/run/netns")
        if self.nic_link_source not in ("netlink", "sysfs"):
            raise ConfigError(f"--nic-link-source {self.nic_link_source!r} must be netlink or sysfs")
        if self.metrics_address and not _LISTEN.fullmatch(self.metrics_address):
            raise ConfigError(f"--metrics-address {self.metrics_address!r} must be HOST:PORT")
        return self


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
