"""Command lines: `tandem-driver` (run, liveness, demo) and `tandemctl`.

The daemon's flags, their environment variables and the Config they make are `driver.flags`;
this module picks the subcommand and hands over.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from driver.config import ConfigError
from driver.flags import Parser, add_log_flags, add_run_flags, add_socket_flags, config_from_args, number
from driver.version import add_version_flag

__all__ = ["config_from_args", "ctl_main", "driver_main", "driver_parser"]


def driver_parser() -> argparse.ArgumentParser:
    p = Parser(prog="tandem-driver", description="Tandem DRA driver for NVIDIA GPUs and RDMA NICs")
    add_version_flag(p)
    sub = p.add_subparsers(dest="command", parser_class=Parser)

    def command(name: str, help: str) -> Parser:
        return sub.add_parser(name, help=help)

    add_run_flags(command("run", "run the node daemon (default)"))
    live = command("liveness", "probe a running daemon through its kubelet sockets (exit 0 = alive)")
    add_socket_flags(live)
    live.add_argument("--timeout", type=number, default=5.0, help="seconds to wait for each call")
    live.add_argument(
        "--ready", action="store_true", help="also ask the status socket whether ResourceSlices are published"
    )
    add_log_flags(live)
    demo = command("demo", "run the whole driver on a simulated cluster and node")
    demo.add_argument("--keep", action="store_true", help="keep the demo's temporary directory")
    add_log_flags(demo)
    return p


def driver_main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] not in ("run", "demo", "liveness", "-h", "--help", "--version"):
        args.insert(0, "run")
    parser = driver_parser()
    ns = parser.parse_args(args)
    from driver import logs

    logs.setup(ns.verbose, ns.log_format)
    if ns.command == "liveness":
        return _liveness(ns)
    if ns.command == "demo":
        # The one place the product reaches into the simulation (an import-linter exception).
        try:
            from demo.story import run_demo
        except ModuleNotFoundError as e:
            # One line, not a traceback, for the two installs that cannot run it: the image leaves
            # demo/ and sim/ out, and an install without the `sim` extra lacks what the simulation
            # imports (the kubernetes client, jsonschema), which the driver itself never needs.
            if (e.name or "").partition(".")[0] in ("", "demo", "sim"):
                problem = f"the demo runs from a checkout of Tandem, not this install ({e})"
            else:
                problem = (
                    f"the demo needs the simulation's extra dependencies ({e}): in a checkout, run "
                    "hack/demo.sh or `pip install '.[sim]'`"
                )
            print(f"tandem-driver demo: {problem}", file=sys.stderr)
            return 2

        return run_demo(keep=ns.keep, verbose=ns.verbose)
    try:
        config = config_from_args(ns)
    except ConfigError as e:
        parser.error(e.naming(getattr(ns, "env_sources", {})))
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
    if ns.ready:
        from driver.ctl.commands import unready_reason
        from driver.status.paths import status_socket_path

        reason = unready_reason(status_socket_path(Path(ns.kubelet_plugins_dir) / ns.driver_name), ns.timeout)
        if reason is not None:
            sys.stderr.write(f"tandem-driver liveness --ready: not ready: {reason}\n")
            return 1
    print(f"alive{' and ready' if ns.ready else ''}: {sock} -> {endpoint}")
    return 0


def ctl_main(argv: Sequence[str] | None = None) -> int:
    from driver.ctl.commands import main

    return main(argv)
