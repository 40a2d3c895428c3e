"""`tandemctl`: the node-level CLI for SREs, a thin client of the daemon's status socket.

It never rediscovers devices or reads the daemon's files on its own, so what it shows is what
the daemon acts on. Exit codes make it usable as a probe (node-problem-detector, scripts), and
tell the three answers apart: 0 ok/healthy, 1 degraded, unhealthy or a refused request, 2 a usage
error (argparse's own), 3 daemon unreachable. Expected failures are one line on stderr, never a
traceback. Output is a table, `-o wide`, or `-o json` (`--json`: the endpoint's document;
`driver.ctl.render`). The readiness probe asks through `unready_reason`.

What the daemon answers is JSON from another process: each answer becomes its document
(`driver.status.shapes`) in one place, `_checked`, and one that does not fit is told as an
unusable answer (exit 3), saying where, never a traceback.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import quote

from driver.ctl.render import OUTPUTS, render_claim, render_claims, render_devices, render_health, text
from driver.errors import EndpointError
from driver.health.gpu.release import RELEASE_TIMEOUT
from driver.kubelet.liveness import unready
from driver.status.paths import status_socket_path
from driver.status.shapes import (
    ClaimDoc,
    ClaimsDoc,
    ClearAnswer,
    CordonAnswer,
    DevicesDoc,
    ErrorDoc,
    HealthDoc,
    ReacquireAnswer,
    ReleaseAnswer,
    UncordonAnswer,
    checked,
)
from driver.version import add_version_flag

EXIT_OK = 0
EXIT_DEGRADED = 1  # also: unhealthy, or the daemon refused the request
EXIT_USAGE = 2  # what argparse exits with
EXIT_UNREACHABLE = 3
READS = ("devices", "claims", "claim", "health")  # the commands that print one document

D = TypeVar("D")


class Unreachable(EndpointError):
    """No usable answer from the daemon: no socket, refused, timed out, or not our protocol."""


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: Path, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(str(self._path))
        except BaseException:
            sock.close()
            raise
        self.sock = sock


def request(sock: Path, method: str, path: str, body: dict[str, Any] | None, timeout: float) -> tuple[int, object]:
    """One request to the status socket: (HTTP status, decoded JSON, not yet checked: `_checked`)."""
    conn = _UnixConnection(sock, timeout)
    try:
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json"} if data is not None else {}
        conn.request(method, path, body=data, headers=headers)
        resp = conn.getresponse()
        raw = resp.read()
    except FileNotFoundError as e:
        raise Unreachable(f"no daemon socket at {sock} (is the driver running on this node?)") from e
    except PermissionError as e:
        raise Unreachable(f"permission denied on {sock} (run as root)") from e
    except TimeoutError as e:
        raise Unreachable(f"no answer from {sock} within {timeout:g}s") from e
    except (OSError, http.client.HTTPException) as e:
        raise Unreachable(f"cannot talk to the daemon at {sock}: {e}") from e
    finally:
        conn.close()
    try:
        return resp.status, json.loads(raw)
    except ValueError as e:
        raise Unreachable(f"the daemon at {sock} answered with something that is not JSON") from e


def unready_reason(sock: Path, timeout: float) -> str | None:
    """Why the daemon behind `sock` is not ready (its /health's `ready`), or None when it is."""
    try:
        status, doc = request(sock, "GET", "/health", None, timeout)
    except Unreachable as e:
        return str(e)
    if status != 200:
        return f"the daemon's /health answered HTTP {status}"
    try:
        health = checked(HealthDoc, doc)
    except TypeError as e:
        return f"the daemon's /health answered an unexpected document: {e}"
    return unready(dict(health))


def _checked(shape: type[D], doc: object, sock: Path) -> D:
    """The daemon's answer as the document `shape` (`driver.status.shapes`), once it fits."""
    try:
        return checked(shape, doc)
    except TypeError as e:
        raise Unreachable(f"the daemon at {sock} answered with an unexpected document: {e}") from e


def _who() -> str:
    """Who runs tandemctl, as the environment says: under sudo the user behind it; under
    `kubectl exec` nobody (the daemon adds the kernel's uid and pid to whatever is said)."""
    env = os.environ.get
    return env("SUDO_USER") or env("LOGNAME") or env("USER") or ""


def _parser() -> argparse.ArgumentParser:
    env = os.environ.get
    p = argparse.ArgumentParser(
        prog="tandemctl",
        description="Inspect, cordon and release the Tandem DRA driver's devices on this node (asks the running daemon)",
        epilog="exit codes: 0 ok/healthy, 1 degraded, unhealthy or request refused, 2 usage error, "
        "3 daemon unreachable",
    )
    add_version_flag(p)
    p.add_argument("--driver-name", default=env("DRIVER_NAME", "tandem.dev"), help="(DRIVER_NAME)")
    p.add_argument(
        "--kubelet-plugins-dir",
        default=env("KUBELET_PLUGINS_DIRECTORY_PATH", "/var/lib/kubelet/plugins"),
        help="parent of the daemon's data dir (KUBELET_PLUGINS_DIRECTORY_PATH)",
    )
    p.add_argument("--socket", type=Path, help="status socket path (default <plugins dir>/<driver name>/status.sock)")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the daemon")
    sub = p.add_subparsers(dest="command", required=True)
    reads = {
        "devices": sub.add_parser("devices", help="the node's devices: topology, health, taints, claims and pods"),
        "health": sub.add_parser("health", help="health summary (exit 0 healthy, 1 degraded or unhealthy)"),
        "claims": sub.add_parser("claims", help="claims prepared on this node, their devices and pods"),
        "claim": sub.add_parser("claim", help="one claim: record, pods, devices, files, status, last error"),
        "pod": sub.add_parser("pod", help="the claims a pod holds on this node, each as `claim` tells it"),
    }
    reads["claim"].add_argument("claim", help="its UID, or NAMESPACE/NAME")
    reads["pod"].add_argument("pod", help="NAMESPACE/NAME, as kubectl names it")
    for read in reads.values():
        out = read.add_mutually_exclusive_group()
        out.add_argument("-o", "--output", choices=OUTPUTS, default="text", help="table (text), wider, or JSON")
        out.add_argument("--json", dest="output", action="store_const", const="json", help="the same as -o json")
    cordon = sub.add_parser("cordon", help="take one device out of scheduling (survives restarts)")
    cordon.add_argument("device")
    cordon.add_argument("--reason", required=True, help="why, for whoever looks next (at most 256 characters)")
    cordon.add_argument("--by", default=_who(), help="who (default $SUDO_USER, $LOGNAME or $USER; uid and pid added)")
    uncordon = sub.add_parser("uncordon", help="return a cordoned device to scheduling")
    uncordon.add_argument("device")
    release = sub.add_parser(
        "release",
        help="make the daemon let go of a GPU (before nvidia-smi -r) or of NVML (--all, before a driver "
        "upgrade); it stays unmonitored and tainted until reacquired, across restarts",
    )
    reacquire = sub.add_parser("reacquire", help="take back a released GPU, or everything (--all)")
    for q in (release, reacquire):
        q.add_argument("device", nargs="?", default="", help="a GPU's device, or one of its MIG devices")
        q.add_argument("--all", action="store_true", help="all of NVML instead of one GPU")
    release.add_argument("--reason", required=True, help="why, for whoever looks next (at most 256 characters)")
    release.add_argument("--by", default=_who(), help="who (default $SUDO_USER, $LOGNAME or $USER; uid and pid added)")
    clear = sub.add_parser(
        "clear", help="say a GPU was reset or is healthy: clears its reset XIDs that no recovery action will clear"
    )
    clear.add_argument("device", help="a GPU's device, or one of its MIG devices")
    clear.add_argument("--reason", required=True, help="why, kept with who and when (at most 256 characters)")
    clear.add_argument("--by", default=_who(), help="who (default $SUDO_USER, $LOGNAME or $USER; uid and pid added)")
    return p


def _ask(ns: argparse.Namespace, sock: Path) -> tuple[int, object]:
    if ns.command == "claim":
        return request(sock, "GET", f"/claims/{quote(ns.claim, safe='/')}", None, ns.timeout)
    if ns.command in READS:
        return request(sock, "GET", f"/{ns.command}", None, ns.timeout)
    if ns.command == "cordon":
        body = {"device": ns.device, "reason": ns.reason, "by": ns.by}
        return request(sock, "POST", "/cordon", body, ns.timeout)
    if ns.command == "release":  # answers once NVML let go: allow for the daemon's whole wait
        body = {"device": ns.device, "all": ns.all, "reason": ns.reason, "by": ns.by}
        return request(sock, "POST", "/release", body, max(ns.timeout, RELEASE_TIMEOUT + 10))
    if ns.command == "reacquire":
        return request(sock, "POST", "/reacquire", {"device": ns.device, "all": ns.all}, ns.timeout)
    if ns.command == "clear":
        body = {"device": ns.device, "reason": ns.reason, "by": ns.by}
        return request(sock, "POST", "/clear", body, ns.timeout)
    return request(sock, "POST", "/uncordon", {"device": ns.device}, ns.timeout)


def _show(ns: argparse.Namespace, doc: D, render: Callable[[D, bool], str]) -> None:
    print(json.dumps(doc, indent=2) if ns.output == "json" else render(doc, ns.output == "wide"))


def _refused(status: int, doc: object) -> int:
    """The daemon's refusal, said on stderr: exit 1."""
    try:
        error = checked(ErrorDoc, doc)["error"]
    except TypeError:
        error = f"request failed with HTTP {status}"
    print(f"tandemctl: {error}", file=sys.stderr)
    return EXIT_DEGRADED


def _pod(ns: argparse.Namespace, sock: Path) -> int:
    """An SRE is handed a pod (`ml-team/train-0`), not its claims: the claims prepared here that are
    reserved for it, each told as `tandemctl claim` tells it."""
    namespace, _, name = ns.pod.partition("/")
    if not (namespace and name) or "/" in name:
        print(f"tandemctl: pod {ns.pod!r} is not NAMESPACE/NAME", file=sys.stderr)
        return EXIT_USAGE
    status, doc = request(sock, "GET", "/claims", None, ns.timeout)
    if status != 200:
        return _refused(status, doc)
    held = [
        c for c in _checked(ClaimsDoc, doc, sock)["claims"] if c["namespace"] == namespace and name in c.get("pods", [])
    ]
    if not held:
        print(f"tandemctl: no claim prepared on this node is reserved for pod {namespace}/{name}", file=sys.stderr)
        return EXIT_DEGRADED
    stories = []
    for claim in held:
        status, doc = request(sock, "GET", f"/claims/{quote(claim['uid'], safe='')}", None, ns.timeout)
        if status != 200:
            return _refused(status, doc)
        stories.append(_checked(ClaimDoc, doc, sock))
    if ns.output == "json":
        print(json.dumps({"pod": f"{namespace}/{name}", "claims": stories}, indent=2))
    else:
        print("\n\n".join(render_claim(story, ns.output == "wide") for story in stories))
    return EXIT_OK


def _run(ns: argparse.Namespace, sock: Path) -> int:
    if ns.command == "pod":
        return _pod(ns, sock)
    status, doc = _ask(ns, sock)
    if status != 200:
        return _refused(status, doc)
    if ns.command == "devices":
        _show(ns, _checked(DevicesDoc, doc, sock), render_devices)
    elif ns.command == "claims":
        _show(ns, _checked(ClaimsDoc, doc, sock), render_claims)
    elif ns.command == "claim":
        _show(ns, _checked(ClaimDoc, doc, sock), render_claim)
    elif ns.command == "health":
        health = _checked(HealthDoc, doc, sock)
        _show(ns, health, render_health)
        if health["status"] != "healthy":
            return EXIT_DEGRADED
    elif ns.command == "cordon":
        cordon = _checked(CordonAnswer, doc, sock)["cordon"]
        print(f"{ns.device} cordoned: {cordon['reason']}")
    elif ns.command == "release":
        released = _checked(ReleaseAnswer, doc, sock)
        what = ns.device or "NVML"
        print(f"{what} released: the daemon holds no NVML handle at all; tainted: {text(released['devices'])}")
        print(f"reset or upgrade now, then: tandemctl reacquire {ns.device or '--all'}")
    elif ns.command == "reacquire":
        reacquired = _checked(ReacquireAnswer, doc, sock)
        what = ns.device or "everything"
        print(f"{what} reacquired" if reacquired["reacquired"] else f"{what} was not released")
        still = [r["device"] or r["gpu"] or "NVML" for r in reacquired["released"]]
        if still:
            print(f"still released: {', '.join(still)} (NVML stays let go until each is reacquired)")
        elif reacquired["reacquired"]:
            print("monitoring and discovery resume")
    elif ns.command == "clear":
        cleared = _checked(ClearAnswer, doc, sock)
        print(f"{ns.device} cleared: what waited for a GPU reset lifts from {text(cleared['devices'])}")
    else:
        changed = _checked(UncordonAnswer, doc, sock)["changed"]
        print(f"{ns.device} uncordoned" if changed else f"{ns.device} was not cordoned")
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    ns = parser.parse_args(argv)
    if ns.command in ("release", "reacquire") and ns.all == bool(ns.device):
        parser.error(f"{ns.command}: name one GPU device, or --all")
    sock = ns.socket or status_socket_path(Path(ns.kubelet_plugins_dir) / ns.driver_name)
    try:
        return _run(ns, sock)
    except Unreachable as e:
        print(f"tandemctl: {e}", file=sys.stderr)
        return EXIT_UNREACHABLE
