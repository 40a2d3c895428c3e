"""The daemon's local status endpoint: HTTP/1.1 + JSON on a root-only Unix socket in its data dir.

`tandemctl` asks here instead of rediscovering, so it shows exactly what the daemon acts on, and
`curl --unix-socket <data dir>/status.sock http://localhost/health` works without it. Access
control is the file mode: the socket is 0600 and root's, and it is never reachable under its
public name with any other mode (it is bound in a private directory, then renamed into place).

During a rolling update two instances share the data dir: the newer one takes the name over,
and an instance only removes the socket on stop if the name still points at its own.

Endpoints: GET /devices, /claims, /claims/<uid or namespace/name> (`driver.status.documents`: one
claim's record, files, status and last error), /health; POST /cordon {"device", "reason", "by"},
POST /uncordon {"device"}; POST /release {"device" or "all": true, "reason", "by"} and
POST /reacquire {"device" or "all": true} (`health.gpu_release`: a release answers once NVML let
go, 503 when it did not in time); POST /clear {"device", "reason", "by"} (the operator's word that
a GPU was reset: `health.gpu_resets`). Errors are {"error": "..."} with a 4xx/5xx status. Each
answer's shape is a TypedDict of `driver.status.shapes`, which `tandemctl` reads it as.

/health's `status` is "healthy", "degraded" (a device, the registration, a discovery source), or
"unhealthy": the node's devices may be invisible to the scheduler (no ResourceSlices published).
Its `ready` (what `tandem-driver liveness --ready` and the probe file, `driver.kubelet.liveness`,
say) is false exactly while the node is unhealthy, or while the daemon's own facts cannot be read.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import socket
import socketserver
import stat
import struct
import tempfile
import threading
import urllib.parse
from collections import Counter
from collections.abc import Callable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

from driver.errors import EndpointError
from driver.health.cordon import MAX_NAME, CordonError, CordonStore, UnknownDevice, check_text
from driver.health.gpu.release import GpuReleases, ReleaseError, ReleaseTimeout
from driver.inventory.store import Inventory
from driver.model import Health
from driver.status import shapes
from driver.status.documents import (
    BadClaimKey,
    ClaimFacts,
    Holders,
    UnknownClaim,
    cordon_doc,
    device_doc,
    holders_by_device,
    record_doc,
    release_doc,
)
from driver.wakepipe import WakePipe

log = logging.getLogger(__name__)

UNIX_PATH_MAX = 107  # sun_path is 108 bytes including the terminating NUL
MAX_BODY = 64 * 1024
REQUEST_TIMEOUT = 10.0  # seconds a client may take to send its request


class RequestError(EndpointError):
    def __init__(self, status: HTTPStatus, message: str) -> None:
        super().__init__(message)
        self.status = status


class StatusServer:
    def __init__(
        self,
        socket_path: Path,
        inventory: Inventory,
        claims: ClaimFacts,
        cordons: CordonStore,
        releases: GpuReleases,
        info: Callable[[], dict[str, Any]],
    ) -> None:
        """`info()` adds daemon facts to /health; a list of strings under its "problems" key makes the node
        degraded, one under "unready" unhealthy and not ready."""
        self.socket_path = socket_path
        self._inventory = inventory
        self._claims = claims
        self._cordons = cordons
        self._releases = releases
        self._info = info
        self._server: _UnixHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._wake = WakePipe()
        self._identity: tuple[int, int] | None = None  # (st_dev, st_ino) of the socket we bound

    # --- endpoints -------------------------------------------------------------------------------

    def devices(self) -> shapes.DevicesDoc:
        by_device = holders_by_device(self._claims.prepared())
        none = Holders([], [])
        return {"devices": [device_doc(d, by_device.get(d.name, none)) for d in self._inventory.devices()]}

    def claims(self) -> shapes.ClaimsDoc:
        prepared = sorted(self._claims.prepared().items(), key=lambda kv: (kv[1].namespace, kv[1].name))
        return {"claims": [record_doc(uid, c) for uid, c in prepared]}

    def health(self) -> shapes.HealthDoc:
        devices = self._inventory.devices()
        counts = Counter(d.health for d in devices)
        unhealthy: list[shapes.UnhealthyDoc] = [
            {"device": d.name, "reason": d.health_message} for d in devices if d.health != Health.HEALTHY
        ]
        present = {d.name for d in devices}
        cordoned: list[shapes.CordonedDoc] = [
            {**cordon_doc(c), "present": c.device in present} for c in self._cordons.list()
        ]
        reasons = self._releases.problems()
        if not devices:
            reasons.append("no devices discovered")
        if unhealthy:
            reasons.append(f"{len(unhealthy)} device(s) not healthy: {', '.join(u['device'] for u in unhealthy)}")
        try:
            info, known = dict(self._info()), True
        except Exception as e:
            log.exception("status info failed")
            info, known = {}, False
            reasons.append(f"daemon status unavailable: {e}")
        problems, unready = (_strings(info.get(key)) for key in ("problems", "unready"))
        reasons = unready + reasons + problems
        return {
            "status": "unhealthy" if unready else "degraded" if reasons else "healthy",
            "ready": known and not unready,
            "reasons": reasons,
            "devices": {
                "total": len(devices),
                "Healthy": counts[Health.HEALTHY],
                "Unhealthy": counts[Health.UNHEALTHY],
                "Unknown": counts[Health.UNKNOWN],
            },
            "unhealthy": unhealthy,
            "cordoned": cordoned,
            "released": [release_doc(r) for r in self._releases.current()],
            "daemon": info,
        }

    def cordon(self, body: dict[str, Any], peer: str) -> shapes.CordonAnswer:
        device, reason, by = (_field(body, k) for k in ("device", "reason", "by"))
        c = self._cordons.cordon(device, reason, _author(by, peer))
        log.info("cordon of %s requested through the status socket by %s", device, peer)
        return {"cordon": cordon_doc(c)}

    def uncordon(self, body: dict[str, Any], peer: str) -> shapes.UncordonAnswer:
        device = _field(body, "device")
        changed = self._cordons.uncordon(device)
        log.info("uncordon of %s requested through the status socket by %s (changed=%s)", device, peer, changed)
        return {"device": device, "changed": changed}

    def release(self, body: dict[str, Any], peer: str) -> shapes.ReleaseAnswer:
        device, reason, by = (_field(body, k) for k in ("device", "reason", "by"))
        _one_target(body, device)
        log.info("release of %s requested through the status socket by %s", device or "NVML", peer)
        tainted = self._releases.release(device, reason, _author(by, peer))
        return {"released": device or "nvml", "devices": tainted}

    def reacquire(self, body: dict[str, Any], peer: str) -> shapes.ReacquireAnswer:
        device = _field(body, "device")
        _one_target(body, device)
        log.info("reacquire of %s requested through the status socket by %s", device or "everything", peer)
        ended = self._releases.reacquire(device)
        return {
            "reacquired": [release_doc(r) for r in ended],
            "released": [release_doc(r) for r in self._releases.current()],
        }

    def clear(self, body: dict[str, Any], peer: str) -> shapes.ClearAnswer:
        device, reason, by = (_field(body, k) for k in ("device", "reason", "by"))
        log.info("clear of %s requested through the status socket by %s", device, peer)
        return {"cleared": device, "devices": self._releases.clear(device, reason, _author(by, peer))}

    def handle(self, method: str, path: str, body: dict[str, Any] | None, peer: str) -> shapes.Document:
        """Routes one request; raises RequestError for anything the client got wrong."""
        gets: dict[str, Callable[[], shapes.Document]] = {
            "/devices": self.devices,
            "/claims": self.claims,
            "/health": self.health,
        }
        posts: dict[str, Callable[[dict[str, Any], str], shapes.Document]] = {
            "/cordon": self.cordon,
            "/uncordon": self.uncordon,
            "/release": self.release,
            "/reacquire": self.reacquire,
            "/clear": self.clear,
        }
        path = path.split("?", 1)[0].rstrip("/") or "/"
        if method == "GET" and path in gets:
            return gets[path]()
        if method == "GET" and path.startswith("/claims/"):
            try:
                return self._claims.report(urllib.parse.unquote(path.removeprefix("/claims/")))
            except UnknownClaim as e:
                raise RequestError(HTTPStatus.NOT_FOUND, str(e)) from e
            except BadClaimKey as e:
                raise RequestError(HTTPStatus.BAD_REQUEST, str(e)) from e
        if method == "POST" and path in posts:
            try:
                return posts[path](body or {}, peer)
            except UnknownDevice as e:
                raise RequestError(HTTPStatus.NOT_FOUND, str(e)) from e
            except (CordonError, ReleaseError) as e:
                raise RequestError(HTTPStatus.BAD_REQUEST, str(e)) from e
            except ReleaseTimeout as e:
                raise RequestError(HTTPStatus.SERVICE_UNAVAILABLE, str(e)) from e
        if path in gets or path in posts:
            raise RequestError(HTTPStatus.METHOD_NOT_ALLOWED, f"{method} is not allowed on {path}")
        raise RequestError(HTTPStatus.NOT_FOUND, f"no such endpoint {path}; try /devices, /claims, /health")

    # --- lifecycle -------------------------------------------------------------------------------

    def start(self) -> None:
        path = self.socket_path
        if len(str(path).encode()) > UNIX_PATH_MAX:
            raise RuntimeError(f"status socket path {path} is over the {UNIX_PATH_MAX}-byte limit of Unix sockets")
        with contextlib.suppress(FileNotFoundError):
            if not stat.S_ISSOCK(path.lstat().st_mode):
                raise RuntimeError(f"{path} exists and is not a socket; refusing to replace it")
        self._server = _UnixHTTPServer(self)
        private = Path(tempfile.mkdtemp(dir=path.parent, prefix=".st-"))  # mode 0700
        try:
            staged = private / "s"
            if len(str(staged).encode()) > UNIX_PATH_MAX:
                raise RuntimeError(f"{path.parent} is too long a path for Unix sockets ({UNIX_PATH_MAX} bytes)")
            self._server.socket.bind(str(staged))
            os.chmod(staged, 0o600)
            os.replace(staged, path)  # replaces a stale socket atomically
        except BaseException:
            self._server.server_close()
            raise
        finally:
            with contextlib.suppress(OSError):
                (private / "s").unlink()
            private.rmdir()
        st = path.lstat()
        self._identity = (st.st_dev, st.st_ino)
        self._server.server_activate()
        self._thread = threading.Thread(
            target=_serve, args=(self._server, self._wake), name="status-socket", daemon=True
        )
        self._thread.start()
        log.info("status endpoint on %s", path)

    def stop(self) -> None:
        if self._server is None:
            return
        self._wake.wake()
        if self._thread is not None:
            self._thread.join()
        self._server.server_close()
        self._wake.close()
        with contextlib.suppress(FileNotFoundError):
            st = self.socket_path.lstat()
            if (st.st_dev, st.st_ino) == self._identity:
                self.socket_path.unlink()
        self._server = None


def _strings(value: Any) -> list[str]:
    """A list of reasons from `info()`: a list, one value, or none."""
    return [str(v) for v in (value if isinstance(value, list) else [value] if value else [])]


def _author(by: str, peer: str) -> str:
    """Who did it, for whoever looks next: the name the client gave (`--by`, $SUDO_USER, $LOGNAME)
    and always the kernel's word on the process (under `kubectl exec` no name is set)."""
    by = check_text("by", by, MAX_NAME, required=False)
    return f"{by} ({peer})" if by else peer


def _field(body: dict[str, Any], key: str) -> str:
    value = body.get(key, "")
    if not isinstance(value, str):
        raise CordonError(f"{key!r} must be a string")
    return value


def _one_target(body: dict[str, Any], device: str) -> None:
    """A release or reacquire names one device or says "all", never both or neither."""
    everything = body.get("all", False)
    if not isinstance(everything, bool):
        raise ReleaseError("'all' must be true or false")
    if everything == bool(device):
        raise ReleaseError("name one device, or all (true) for the whole of NVML")


def _serve(server: socketserver.UnixStreamServer, wake: WakePipe) -> None:
    """Accept clients until `wake`, asleep in select() in between. (socketserver's serve_forever
    polls for its shutdown flag instead: 10 times a second at the 0.1 s that keeps a stop quick,
    a quarter of the idle daemon's CPU.)"""
    while True:
        readable, _, _ = select.select([server.fileno(), wake.fileno()], [], [])
        if wake.fileno() in readable:
            return
        server.handle_request()


class _UnixHTTPServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True

    def __init__(self, status: StatusServer) -> None:
        # Bound by StatusServer.start, so the socket never has its public name with a wider mode.
        super().__init__("", _Handler, bind_and_activate=False)
        self.status = status


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "tandem-status"
    timeout = REQUEST_TIMEOUT
    server: _UnixHTTPServer

    def do_GET(self) -> None:
        self._serve(None)

    def do_POST(self) -> None:
        try:
            body = self._read_body()
        except RequestError as e:
            self._reply(e.status, {"error": str(e)})
            return
        self._serve(body)

    def _read_body(self) -> dict[str, Any]:
        if self.headers.get("Transfer-Encoding"):
            raise RequestError(HTTPStatus.LENGTH_REQUIRED, "send the body with a Content-Length")
        try:
            length = int(self.headers.get("Content-Length", "0"))
        except ValueError as e:
            raise RequestError(HTTPStatus.BAD_REQUEST, "bad Content-Length") from e
        if length < 0 or length > MAX_BODY:
            raise RequestError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"body over {MAX_BODY} bytes")
        try:
            body = json.loads(self.rfile.read(length) or b"{}")
        except (ValueError, UnicodeDecodeError) as e:
            raise RequestError(HTTPStatus.BAD_REQUEST, f"body is not JSON: {e}") from e
        if not isinstance(body, dict):
            raise RequestError(HTTPStatus.BAD_REQUEST, "body must be a JSON object")
        return body

    def _serve(self, body: dict[str, Any] | None) -> None:
        try:
            payload = self.server.status.handle(self.command, self.path, body, self._peer())
        except RequestError as e:
            self._reply(e.status, {"error": str(e)})
        except Exception as e:
            log.exception("status endpoint %s %s failed", self.command, self.path)
            self._reply(HTTPStatus.INTERNAL_SERVER_ERROR, {"error": f"internal error: {e}"})
        else:
            self._reply(HTTPStatus.OK, payload)

    def _peer(self) -> str:
        """Who is asking, from the kernel (SO_PEERCRED), for the audit log and a cordon's author."""
        try:
            creds = self.request.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        except OSError:
            return "unknown"
        pid, uid, _gid = struct.unpack("3i", creds)
        return f"uid {uid}, pid {pid}"

    def _reply(self, status: HTTPStatus, payload: shapes.Document) -> None:
        data = json.dumps(payload, indent=1).encode() + b"\n"
        self.close_connection = True  # one request per connection: no idle threads held by clients
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        # The default writes to stderr and indexes client_address, which is "" for Unix sockets.
        log.debug("status socket: " + format, *args)
