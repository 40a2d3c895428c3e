"""Command lines: `tandem-driver` (run, demo) and `tandemctl`.

Every daemon flag can also come from an environment variable, because a DaemonSet sets
NODE_NAME and POD_UID through the downward API and later tooling drives the daemon that way.
A bad value is a one-line error and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from driver.config import Config, ConfigError, parse_device_kinds, parse_xids
from driver.health import parse_taint_effects

EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    """argparse prints usage plus an error; we want exactly one line an SRE can read in a pod log."""

    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        raise SystemExit(EXIT_USAGE)


def _env(name: str, default: str) -> str:
    return os.environ.get(name, default)


def _add_socket_flags(p: argparse.ArgumentParser) -> None:
    """The flags that decide the socket names; shared by `run` and `liveness` so both agree."""
    add = p.add_argument
    add("--driver-name", default=_env("DRIVER_NAME", "tandem.dev"), help="DRA driver name (DRIVER_NAME)")
    add(
        "--kubelet-registrar-dir",
        default=_env("KUBELET_REGISTRAR_DIRECTORY_PATH", "/var/lib/kubelet/plugins_registry"),
        help="kubelet plugin registry directory (KUBELET_REGISTRAR_DIRECTORY_PATH)",
    )
    add("--pod-uid", default=_env("POD_UID", ""), help="this pod's UID, enables rolling-update sockets (POD_UID)")


def _add_run_flags(p: argparse.ArgumentParser) -> None:
    add = p.add_argument
    add("--node-name", default=_env("NODE_NAME", ""), help="this node's name (NODE_NAME, required)")
    add("--kubeconfig", default=_env("KUBECONFIG", ""), help="kubeconfig path; default in-cluster (KUBECONFIG)")
    _add_socket_flags(p)
    add(
        "--kubelet-plugins-dir",
        default=_env("KUBELET_PLUGINS_DIRECTORY_PATH", "/var/lib/kubelet/plugins"),
        help="parent of the driver's data dir <it>/<driver-name> (KUBELET_PLUGINS_DIRECTORY_PATH)",
    )
    add("--cdi-root", default=_env("CDI_ROOT", "/var/run/cdi"), help="CDI spec directory (CDI_ROOT)")
    add("--sysfs-root", default=_env("SYSFS_ROOT", "/sys"), help="sysfs mount (SYSFS_ROOT)")
    add("--dev-root", default=_env("DEV_ROOT", "/dev"), help="where device nodes are found (DEV_ROOT)")
    add(
        "--nvidia-driver-root",
        default=_env("NVIDIA_DRIVER_ROOT", "/"),
        help="root of the NVIDIA user-space driver files, as the daemon sees it (NVIDIA_DRIVER_ROOT)",
    )
    add(
        "--nvidia-driver-root-host",
        default=_env("NVIDIA_DRIVER_ROOT_HOST", ""),
        help="the same root on the host, where the container runtime resolves CDI mounts; "
        "default: --nvidia-driver-root (NVIDIA_DRIVER_ROOT_HOST)",
    )
    add("--device-kinds", default=_env("DEVICE_KINDS", "gpu,nic"), help="kinds to serve: gpu,nic (DEVICE_KINDS)")
    add(
        "--list-attributes",
        action="store_true",
        default=_env("LIST_ATTRIBUTES", "") in ("1", "true", "yes"),
        help="publish list-typed attributes (needs the DRAListTypeAttributes gate) (LIST_ATTRIBUTES)",
    )
    add(
        "--rediscover-period",
        type=float,
        default=float(_env("REDISCOVER_PERIOD", "60")),
        help="seconds between full rediscoveries (REDISCOVER_PERIOD)",
    )
    add("--metrics-address", default=_env("METRICS_ADDRESS", ""), help="HOST:PORT for Prometheus metrics")
    add(
        "--ignored-xids",
        default=_env("IGNORED_XIDS", ""),
        help="XIDs to treat as application errors, besides 13,31,43,45,68,109 (IGNORED_XIDS)",
    )
    add(
        "--taint-effect",
        action="append",
        default=[t for t in _env("TAINT_EFFECTS", "").split(",") if t],
        metavar="KEY=EFFECT",
        help="override a health taint's effect, e.g. tandem.dev/xid=NoExecute; repeatable (TAINT_EFFECTS)",
    )
    add(
        "--health-quiet-period",
        type=float,
        default=float(_env("HEALTH_QUIET_PERIOD", "600")),
        help="seconds without a new XID/ECC event before its taint clears (HEALTH_QUIET_PERIOD)",
    )
    add(
        "--link-debounce",
        type=float,
        default=float(_env("LINK_DEBOUNCE", "2")),
        help="seconds a NIC link change must hold before its taint or published state changes (LINK_DEBOUNCE)",
    )
    add(
        "--netns",
        default=_env("NETNS", ""),
        help="network namespace (name under /var/run/netns) whose NICs to serve; default: the daemon's own (NETNS)",
    )
    add(
        "--nic-link-source",
        choices=("netlink", "sysfs"),
        default=_env("NIC_LINK_SOURCE", "netlink"),
        help="NIC link facts from netlink (real nodes) or sysfs only (simulated nodes) (NIC_LINK_SOURCE)",
    )
    _add_log_flags(p)


def _add_log_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("-v", "--verbose", action="count", default=int(_env("VERBOSITY", "0") or 0))
    p.add_argument("--log-format", choices=("text", "json"), default=_env("LOG_FORMAT", "text"), help="(LOG_FORMAT)")


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
        nvidia_driver_root=Path(ns.nvidia_driver_root),
        nvidia_driver_root_host=Path(ns.nvidia_driver_root_host) if ns.nvidia_driver_root_host else None,
        pod_uid=ns.pod_uid,
        device_kinds=parse_device_kinds(ns.device_kinds),
        list_attributes=ns.list_attributes,
        rediscover_period=ns.rediscover_period,
        metrics_address=ns.metrics_address,
        nic_link_source=ns.nic_link_source,
        netns=ns.netns,
        ignored_xids=parse_xids(ns.ignored_xids),
        taint_effects=tuple(ns.taint_effect),
        health_quiet_period=ns.health_quiet_period,
        link_debounce=ns.link_debounce,
    ).validate()
    try:
        parse_taint_effects(config.taint_effects, config.driver_name)
    except ValueError as e:
        raise ConfigError(f"--taint-effect: {e}") from e
    return config


def driver_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="tandem-driver", description="Tandem DRA driver for NVIDIA GPUs and RDMA NICs")
    sub = p.add_subparsers(dest="command", parser_class=_Parser)
    _add_run_flags(sub.add_parser("run", help="run the node daemon (default)"))
    live = sub.add_parser("liveness", help="probe a running daemon through its kubelet sockets (exit 0 = alive)")
    _add_socket_flags(live)
    live.add_argument("--timeout", type=float, default=5.0)
    _add_log_flags(live)
    demo = sub.add_parser("demo", help="run the whole driver on a simulated cluster and node")
    demo.add_argument("--keep", action="store_true", help="keep the demo's temporary directory")
    _add_log_flags(demo)
    return p


def driver_main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] not in ("run", "demo", "liveness", "-h", "--help"):
        args.insert(0, "run")
    parser = driver_parser()
    ns = parser.parse_args(args)
    from driver import logs

    logs.setup(ns.verbose, ns.log_format)
    if ns.command == "liveness":
        return _liveness(ns)
    if ns.command == "demo":
        # The one place the product reaches into the simulation (an import-linter exception).
        from demo.story import run_demo

        return run_demo(keep=ns.keep, verbose=ns.verbose)
    try:
        config = config_from_args(ns)
    except ConfigError as e:
        parser.error(str(e))
    from driver.daemon import run_daemon

    return run_daemon(config)


def _liveness(ns: argparse.Namespace) -> int:
    from driver.kubelet.liveness import NotAlive, check
    from driver.kubelet.registration import registration_socket_path

    sock = registration_socket_path(Path(ns.kubelet_registrar_dir), ns.driver_name, ns.pod_uid)
    try:
        endpoint = check(sock, ns.driver_name, ns.timeout)
    except NotAlive as e:
        sys.stderr.write(f"tandem-driver liveness: {e}\n")
        return 1
    print(f"alive: {sock} -> {endpoint}")
    return 0


def ctl_main(argv: Sequence[str] | None = None) -> int:
    from driver.ctl import main

    return main(argv)
