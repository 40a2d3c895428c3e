"""`tandemctl`: the node-level CLI for SREs.

It reads what the daemon recorded in its data directory (the prepared-claims checkpoint); it
never rediscovers devices on its own, so what it shows is what the daemon acts on.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from driver.checkpoint import Checkpoint
from driver.fsutil import boot_id

EXIT_UNREACHABLE = 2


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tandemctl", description="Inspect the Tandem DRA driver on this node")
    p.add_argument("--driver-name", default="tandem.dev")
    p.add_argument("--kubelet-plugins-dir", default="/var/lib/kubelet/plugins")
    sub = p.add_subparsers(dest="command", required=True)
    claims = sub.add_parser("claims", help="claims prepared on this node and their devices")
    claims.add_argument("--json", action="store_true", help="machine-readable output")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    ns = _parser().parse_args(argv)
    data_dir = Path(ns.kubelet_plugins_dir) / ns.driver_name
    if not data_dir.is_dir():
        print(f"tandemctl: no driver data directory at {data_dir}", file=sys.stderr)
        return EXIT_UNREACHABLE
    claims = Checkpoint(data_dir, boot_id()).read()
    if ns.json:
        print(json.dumps({uid: c.to_json() for uid, c in sorted(claims.items())}, indent=2))
        return 0
    rows = [("CLAIM", "UID", "STATE", "DEVICES")]
    for uid, c in sorted(claims.items(), key=lambda kv: (kv[1].namespace, kv[1].name)):
        rows.append((f"{c.namespace}/{c.name}", uid, c.state, ",".join(d.device for d in c.devices) or "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for r in rows:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip())
    return 0
