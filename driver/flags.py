"""The daemon's command line: every flag, the environment variable that can set it instead, its
default and its check, and the `Config` they make.

Every daemon flag can also come from an environment variable, because a DaemonSet sets
NODE_NAME and POD_UID through the downward API and later tooling drives the daemon that way.
A bad value is a one-line error and exit code 2, never a traceback. The flags are declared in
one table (`add_run_flags`), which README's flag table mirrors and which reads best whole.
Over 400 lines on purpose: that table and the parser it feeds are one thing to read.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from driver.config import (
    DEFAULT_NIC_SHARES,
    Config,
    ConfigError,
    GpuSelection,
    NicExclusions,
    parse_device_kinds,
    parse_xids,
)
from driver.health import parse_taint_effects
from driver.health.thresholds import parse_thresholds

EXIT_USAGE = 2


@dataclass(frozen=True)
class _FromEnv:
    """Where a flag not given on the command line takes its value: the environment variable `env`
    (unset or empty: `default`), turned into the flag's value by `convert`."""

    dest: str
    flag: str
    env: str
    default: str
    convert: Callable[[str], Any]


class Parser(argparse.ArgumentParser):
    """argparse prints usage plus an error; we want exactly one line an SRE can read in a pod log.

    Environment values are converted after parsing, by the same function as a command-line value,
    so a bad one is the same one-line error (naming the variable) and never a traceback at start.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.env_flags: list[_FromEnv] = []

    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        raise SystemExit(EXIT_USAGE)

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        ns, rest = super().parse_known_args(args, namespace)
        for f in (f for f in self.env_flags if getattr(ns, f.dest, None) is None):
            raw = os.environ.get(f.env, "") or f.default
            try:
                setattr(ns, f.dest, f.convert(raw))
            except (ValueError, argparse.ArgumentTypeError) as e:
                self.error(f"argument {f.flag} (from {f.env}={raw!r}): {e}")
            if os.environ.get(f.env):  # for Config's checks: ConfigError.naming
                vars(ns).setdefault("env_sources", {})[f.flag] = f"{f.env}={raw!r}"
        return ns, rest


def _flag(
    p: Parser, *names: str, env: str, default: str, help: str, convert: Callable[[str], Any] = str, **kwargs: Any
) -> None:
    """A flag that falls back to `env`. Without an explicit action the command-line value goes
    through `convert` as well; actions (count, append, store_const) say how to convert the
    environment's text in `convert`."""
    if "action" not in kwargs:
        kwargs["type"] = convert
    action = p.add_argument(*names, default=None, help=f"{help} ({env})", **kwargs)
    p.env_flags.append(_FromEnv(action.dest, "/".join(names), env, default, convert))


def number(text: str) -> float:
    """A finite number (range checks are the Config's): `nan` and `inf` are not periods."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def _count(text: str) -> int:
    if not text.strip().isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not a verbosity level (0, 1, 2, ...)")
    return int(text)


def _whole_number(text: str) -> int:
    if not text.strip().isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number")
    return int(text)


def _boolean(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"{text!r} is not a boolean (true/false, 1/0, yes/no)")


def _comma_list(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def _choice(*choices: str) -> Callable[[str], str]:
    def convert(text: str) -> str:
        if text not in choices:
            raise argparse.ArgumentTypeError(f"{text!r} is not one of: {', '.join(choices)}")
        return text

    convert.__name__ = "choice"
    return convert


def add_socket_flags(p: Parser) -> None:
    """The flags that decide the socket names; shared by `run` and `liveness` so both agree."""
    _flag(p, "--driver-name", env="DRIVER_NAME", default="tandem.dev", help="DRA driver name")
    _flag(
        p,
        "--kubelet-registrar-dir",
        env="KUBELET_REGISTRAR_DIRECTORY_PATH",
        default="/var/lib/kubelet/plugins_registry",
        help="kubelet plugin registry directory",
    )
    _flag(p, "--pod-uid", env="POD_UID", default="", help="this pod's UID, enables rolling-update sockets")
    _flag(
        p,
        "--kubelet-plugins-dir",
        env="KUBELET_PLUGINS_DIRECTORY_PATH",
        default="/var/lib/kubelet/plugins",
        help="parent of the driver's data dir <it>/<driver-name>",
    )


def add_run_flags(p: Parser) -> None:
    _flag(p, "--node-name", env="NODE_NAME", default="", help="this node's name, required")
    _flag(
        p,
        "--kubeconfig",
        env="KUBECONFIG",
        default="",
        help="kubeconfig file, or a ':'-separated list merged as kubectl merges it; default in-cluster",
    )
    add_socket_flags(p)
    _flag(p, "--cdi-root", env="CDI_ROOT", default="/var/run/cdi", help="CDI spec directory")
    _flag(p, "--sysfs-root", env="SYSFS_ROOT", default="/sys", help="sysfs mount")
    _flag(p, "--dev-root", env="DEV_ROOT", default="/dev", help="where device nodes are found and made")
    _flag(
        p,
        "--proc-root",
        env="PROC_ROOT",
        default="/proc",
        help="procfs mount: the kernel's device majors and the NVIDIA driver's proc files",
    )
    _flag(
        p,
        "--nvidia-driver-root",
        env="NVIDIA_DRIVER_ROOT",
        default="/",
        help="root of the NVIDIA user-space driver files, as the daemon sees it",
    )
    _flag(
        p,
        "--nvidia-driver-root-host",
        env="NVIDIA_DRIVER_ROOT_HOST",
        default="",
        help="the same root on the host, where the container runtime resolves CDI mounts; "
        "default: --nvidia-driver-root",
    )
    _flag(p, "--device-kinds", env="DEVICE_KINDS", default="gpu,nic", help="kinds to serve: gpu,nic")
    _flag(
        p,
        "--list-attributes",
        env="LIST_ATTRIBUTES",
        default="false",
        convert=_boolean,
        action="store_const",
        const=True,
        help="publish list-typed attributes (needs the DRAListTypeAttributes gate)",
    )
    _flag(
        p,
        "--rediscover-period",
        env="REDISCOVER_PERIOD",
        default="300",
        convert=number,
        help="seconds between full rediscoveries, for what no event reports (a GPU hot-plug or driver reload, "
        "an administrator's MIG change with nvidia-smi, a NIC change only sysfs shows); SIGHUP rediscovers at once",
    )
    _flag(p, "--metrics-address", env="METRICS_ADDRESS", default="", help="HOST:PORT for Prometheus metrics")
    _flag(
        p,
        "--ignored-xids",
        env="IGNORED_XIDS",
        default="",
        help="XIDs to treat as application errors, besides 13,31,43,45,68,109",
    )
    _flag(
        p,
        "--taint-effect",
        env="TAINT_EFFECTS",
        default="",
        convert=_comma_list,
        action="append",
        metavar="KEY=EFFECT",
        help="override a health taint's effect, e.g. tandem.dev/xid=NoExecute; repeatable "
        "(the environment's list is comma-separated)",
    )
    _flag(
        p,
        "--health-quiet-period",
        env="HEALTH_QUIET_PERIOD",
        default="600",
        convert=number,
        help="seconds without a new XID/ECC event before its taint clears",
    )
    _flag(
        p,
        "--grey-threshold",
        env="GREY_THRESHOLDS",
        default="",
        convert=_comma_list,
        action="append",
        metavar="NAME=VALUE",
        help="override a grey-failure threshold, e.g. window=600 or flaps=5 (docs/health.md lists them); "
        "repeatable (the environment's list is comma-separated)",
    )
    _flag(
        p,
        "--link-debounce",
        env="LINK_DEBOUNCE",
        default="2",
        convert=number,
        help="seconds a NIC link change must hold before its taint or published state changes",
    )
    _flag(
        p,
        "--netns",
        env="NETNS",
        default="",
        help="network namespace (name under /var/run/netns) whose NICs to serve; default: the daemon's own",
    )
    _flag(
        p,
        "--exclude-nics",
        env="EXCLUDE_NICS",
        default="",
        metavar="PATTERNS",
        help="NICs never to publish, comma-separated: netdev names or PCI addresses, shell-style globs "
        "allowed (eth*, 0000:3b:00.*)",
    )
    _flag(
        p,
        "--dynamic-mig",
        env="DYNAMIC_MIG",
        default="",
        metavar="GPUS",
        help="GPUs in MIG mode whose MIG devices are made on demand: all, or comma-separated minor numbers "
        "and GPU UUIDs",
    )
    _flag(
        p,
        "--no-binding-conditions",
        env="NO_BINDING_CONDITIONS",
        default="false",
        convert=_boolean,
        action="store_const",
        const=True,
        help="make dynamic-MIG partitions at prepare, after the pod is bound, instead of before binding "
        "(binding conditions: a failure then sends the pod to another GPU or node)",
    )
    _flag(
        p,
        "--nic-binding-conditions",
        env="NIC_BINDING_CONDITIONS",
        default="false",
        convert=_boolean,
        action="store_const",
        const=True,
        help="check a whole NIC (present, healthy, link up) before the scheduler binds its pod; "
        "costs each such pod the scheduler's binding-condition poll (up to 5 s)",
    )
    _flag(
        p,
        "--gpu-sharing",
        env="GPU_SHARING",
        default="",
        metavar="GPUS",
        help="full GPUs many claims may share (memory and computePercent consumable capacity; MPS limits): "
        "all, or comma-separated minor numbers and GPU UUIDs",
    )
    _flag(
        p,
        "--nic-shares",
        env="NIC_SHARES",
        default=str(DEFAULT_NIC_SHARES),
        convert=_whole_number,
        help="claims that may share one RoCE NIC (its `shares` capacity); 1: each NIC to one claim",
    )
    _flag(
        p,
        "--nic-link-source",
        env="NIC_LINK_SOURCE",
        default="netlink",
        convert=_choice("netlink", "sysfs"),
        help="NIC link facts from netlink (real nodes) or sysfs only (simulated nodes)",
    )
    add_log_flags(p)


class _Verbosity(argparse.Action):
    """`-v`, `-vv`, `--verbose` count up; `-v=4`, `-v 4`, `--v=4` set the level, as klog users type it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **{**kwargs, "nargs": "?"})

    def __call__(self, parser: argparse.ArgumentParser, ns: argparse.Namespace, value: Any, flag: Any = None) -> None:
        if value is None or set(value) == {"v"}:  # -v, or -vv read as -v with the value "v"
            setattr(ns, self.dest, (getattr(ns, self.dest) or 0) + 1 + len(value or ""))
            return
        try:
            setattr(ns, self.dest, _count(value))
        except argparse.ArgumentTypeError as e:
            raise argparse.ArgumentError(self, str(e)) from None


def add_log_flags(p: Parser) -> None:
    _flag(
        p,
        "-v",
        "--verbose",
        "--v",
        env="VERBOSITY",
        default="0",
        convert=_count,
        action=_Verbosity,
        metavar="N",
        help="more logging: -v, -vv, or a level as klog takes it (-v=4)",
    )
    _flag(p, "--log-format", env="LOG_FORMAT", default="text", convert=_choice("text", "json"), help="text or json")


def config_from_args(ns: argparse.Namespace) -> Config:
    config = Config(
        node_name=ns.node_name,
        driver_name=ns.driver_name,
        kubeconfig=ns.kubeconfig or None,
        registrar_dir=Path(ns.kubelet_registrar_dir),
        plugins_dir=Path(ns.kubelet_plugins_dir),
        cdi_root=Path(ns.cdi_root),
        sysfs_root=Path(ns.sysfs_root),
        dev_root=Path(ns.dev_root),
        proc_root=Path(ns.proc_root),
        nvidia_driver_root=Path(ns.nvidia_driver_root),
        nvidia_driver_root_host=Path(ns.nvidia_driver_root_host) if ns.nvidia_driver_root_host else None,
        pod_uid=ns.pod_uid,
        device_kinds=parse_device_kinds(ns.device_kinds),
        list_attributes=ns.list_attributes,
        rediscover_period=ns.rediscover_period,
        metrics_address=ns.metrics_address,
        nic_link_source=ns.nic_link_source,
        netns=ns.netns,
        exclude_nics=NicExclusions.parse(ns.exclude_nics),
        dynamic_mig=GpuSelection.parse(ns.dynamic_mig, "--dynamic-mig"),
        gpu_sharing=GpuSelection.parse(ns.gpu_sharing, "--gpu-sharing"),
        ignored_xids=parse_xids(ns.ignored_xids),
        taint_effects=tuple(ns.taint_effect),
        health_quiet_period=ns.health_quiet_period,
        link_debounce=ns.link_debounce,
        grey_thresholds=tuple(ns.grey_threshold),
        nic_shares=ns.nic_shares,
        mig_binding_conditions=not ns.no_binding_conditions,
        nic_binding_conditions=ns.nic_binding_conditions,
    ).validate()
    try:
        parse_taint_effects(config.taint_effects, config.driver_name)
    except ValueError as e:
        raise ConfigError(f"--taint-effect: {e}") from e
    try:
        parse_thresholds(config.grey_thresholds)
    except ValueError as e:
        raise ConfigError(f"--grey-threshold: {e}") from e
    return config
