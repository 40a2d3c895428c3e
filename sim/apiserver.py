"""A simulated Kubernetes API server for ResourceSlices, ResourceClaims, DeviceClasses, Nodes and Pods.

The driver talks to it with the official `kubernetes` client through a generated kubeconfig, as to
a real server, so everything here speaks real Kubernetes REST/JSON: metav1.Status errors with the
right codes, list envelopes, chunked newline-delimited watch streams with 410 Gone for expired
resourceVersions and watch-list streams (`sendInitialEvents`, client-go's default), server-side
apply of claim status. Faults (error codes, delays, dropped watches) can be injected to test the
driver's retry paths, and every request is logged for assertions. `snapshot` and `restore` are an
etcd backup and its restore under a restarted API server (`apistore`); `restore()` with no
snapshot is an API server started empty.

Storage and admission live in `apistore`, validation in `apivalidate`, URL paths and discovery
documents in `apiroutes`; this module is the HTTP door plus an in-process door (`srv.create`, `srv.get`, ...) that goes through the same admission rules.

Run standalone: `python -m sim.apiserver --kubeconfig PATH` (serves until SIGTERM).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import select
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, TypeVar
from urllib.parse import parse_qs, urlsplit

import yaml

from sim import apiroutes, apivalidate
from sim.apierrors import ApiError, bad_request
from sim.apiselect import field_selector, label_selector
from sim.apistore import Snapshot, Store, Watcher
from sim.apitypes import ResourceType

PathT = TypeVar("PathT", str, os.PathLike)
DEFAULT_WATCH_SECONDS = 1800  # a real server picks 30-60 min; clients reconnect either way
_WATCH_POLL_SECONDS = 0.5  # how often an idle watch checks whether its client went away
_MAX_BODY = 64 * 1024 * 1024


@dataclass(frozen=True)
class RequestRecord:
    """One HTTP request as the server saw and answered it."""

    method: str
    path: str
    query: dict[str, str]
    verb: str  # get, list, watch, create, update, patch, delete, deletecollection
    api_group: str  # "" for core and for non-resource paths
    resource: str  # plural, "" for non-resource paths (discovery)
    subresource: str
    namespace: str
    name: str
    status: int
    field_manager: str
    content_type: str
    time: float  # time.monotonic() when the request arrived


@dataclass
class _Fault:
    method: str
    path: re.Pattern[str]
    status: int
    remaining: int
    delay: float
    arrived: threading.Event = dataclasses.field(default_factory=threading.Event)


class Faults:
    """Failures to inject into the next matching requests (thread-safe)."""

    def __init__(self, store: Store):
        self._store = store
        self._lock = threading.Lock()
        self._faults: list[_Fault] = []

    def inject(
        self, method: str = "*", path: str = ".*", status: int = 500, count: int = 1, delay: float = 0.0
    ) -> threading.Event:
        """The next `count` requests matching `method` ("*" = any) and `path` (regex search on the URL path)
        sleep `delay` seconds and then get `status` (0: served normally after the delay).

        Returns an event set when the first matching request arrives: with a delay, that is the
        moment a client is known to be waiting on the server (`requests` records it only once
        answered)."""
        fault = _Fault(method.upper(), re.compile(path), status, count, delay)
        with self._lock:
            self._faults.append(fault)
        return fault.arrived

    def close_watches(self) -> None:
        """End every open watch stream now; clients see the stream end (and usually reconnect)."""
        self._store.close_watches()

    def clear(self) -> None:
        with self._lock:
            self._faults.clear()

    def take(self, method: str, path: str) -> _Fault | None:
        with self._lock:
            for fault in self._faults:
                if fault.remaining > 0 and fault.method in ("*", method) and fault.path.search(path):
                    fault.remaining -= 1
                    fault.arrived.set()
                    return fault
            self._faults = [f for f in self._faults if f.remaining > 0]
            return None


class SimApiServer:
    """The simulated API server; see the module docstring. Not listening until `start()`."""

    def __init__(self, validate: bool = True):
        self.store = Store(validate=validate)
        self.faults = Faults(self.store)
        self._requests: list[RequestRecord] = []
        self._requests_lock = threading.Lock()
        self._httpd: _HttpServer | None = None
        self._thread: threading.Thread | None = None

    # --- lifecycle ------------------------------------------------------------------------------

    def start(self, port: int = 0) -> SimApiServer:
        """Bind 127.0.0.1 on `port` (0: a free one) and serve from daemon threads; starting twice is
        a no-op. A given port is where a kubeconfig already points (an API server that comes back)."""
        if self._httpd is not None:
            return self
        if self.store.validate:
            apivalidate.warm_up()
        self._httpd = _HttpServer(("127.0.0.1", port), _Handler, self)
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, name="sim-apiserver", daemon=True
        )
        self._thread.start()
        return self

    @property
    def url(self) -> str:
        if self._httpd is None:
            raise RuntimeError("the simulated API server is not started")
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    def write_kubeconfig(self, path: PathT) -> PathT:
        """Write a kubeconfig (no credentials needed) pointing at this server; returns `path`."""
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "sim", "cluster": {"server": self.url}}],
            "users": [{"name": "sim", "user": {}}],
            "contexts": [{"name": "sim", "context": {"cluster": "sim", "user": "sim"}}],
            "current-context": "sim",
        }
        with open(path, "w", encoding="utf-8") as f:
            yaml.safe_dump(config, f)
        return path

    def stop(self) -> None:
        self.store.close()
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.close_connections()
            self._httpd.server_close()
            self._httpd = None

    def snapshot(self) -> Snapshot:
        """A backup of every object and the revision (etcdctl snapshot save)."""
        return self.store.snapshot()

    def restore(self, snapshot: Snapshot | None = None) -> None:
        """etcd restored from `snapshot` (None: started empty) and the API server restarted on it:
        the objects and revision go back, every watch ends and kept-alive connections drop."""
        self.store.restore(snapshot)
        if self._httpd is not None:
            self._httpd.close_connections()

    def __enter__(self) -> SimApiServer:
        return self.start()

    def __exit__(self, *_exc: object) -> None:
        self.stop()

    # --- switches -------------------------------------------------------------------------------

    @property
    def list_attributes_enabled(self) -> bool:
        """False simulates the DRAListTypeAttributes gate being off: list attribute values are dropped."""
        return self.store.list_attributes_enabled

    @list_attributes_enabled.setter
    def list_attributes_enabled(self, value: bool) -> None:
        self.store.list_attributes_enabled = value

    @property
    def device_taints_enabled(self) -> bool:
        """False simulates the DRADeviceTaints gate being off (or an older server): taints are dropped."""
        return self.store.device_taints_enabled

    @device_taints_enabled.setter
    def device_taints_enabled(self, value: bool) -> None:
        self.store.device_taints_enabled = value

    @property
    def partitionable_devices_enabled(self) -> bool:
        """False simulates the DRAPartitionableDevices gate being off: counters are dropped."""
        return self.store.partitionable_devices_enabled

    @partitionable_devices_enabled.setter
    def partitionable_devices_enabled(self, value: bool) -> None:
        self.store.partitionable_devices_enabled = value

    @property
    def consumable_capacity_enabled(self) -> bool:
        """False simulates the DRAConsumableCapacity gate being off: allowMultipleAllocations and
        request policies are dropped."""
        return self.store.consumable_capacity_enabled

    @consumable_capacity_enabled.setter
    def consumable_capacity_enabled(self, value: bool) -> None:
        self.store.consumable_capacity_enabled = value

    @property
    def binding_conditions_enabled(self) -> bool:
        """False simulates the DRADeviceBindingConditions gate being off: a device's bindingConditions,
        bindingFailureConditions and bindsToNode are dropped."""
        return self.store.binding_conditions_enabled

    @binding_conditions_enabled.setter
    def binding_conditions_enabled(self, value: bool) -> None:
        self.store.binding_conditions_enabled = value

    # --- in-process access ----------------------------------------------------------------------

    def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Create `obj` (status kept, so tests can create allocated claims); supports generateName."""
        rtype = self.store.find_kind(obj)
        return self.store.create(rtype, (obj.get("metadata") or {}).get("namespace"), obj, keep_status=True)

    def get(self, plural: str, name: str, namespace: str | None = None) -> dict[str, Any]:
        """The object; raises KeyError (an ApiError 404) if missing."""
        return self.store.get(apiroutes.resource_type(plural), namespace, name)

    def list(self, plural: str, namespace: str | None = None) -> list[dict[str, Any]]:
        items, _ = self.store.list(apiroutes.resource_type(plural), namespace, lambda _obj: True)
        return items

    def update(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Full replace including status; a set metadata.resourceVersion must be current (else 409)."""
        rtype = self.store.find_kind(obj)
        meta = obj.get("metadata") or {}
        return self.store.update(rtype, meta.get("namespace"), meta.get("name"), obj, replace_status=True)

    def delete(self, plural: str, name: str, namespace: str | None = None) -> dict[str, Any]:
        return self.store.delete(apiroutes.resource_type(plural), namespace, name)

    def add_node(self, name: str) -> dict[str, Any]:
        return self.create({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}, "spec": {}})

    # --- request log ----------------------------------------------------------------------------

    @property
    def requests(self) -> list[RequestRecord]:
        with self._requests_lock:
            return list(self._requests)

    def clear_requests(self) -> None:
        with self._requests_lock:
            self._requests.clear()

    def _log(self, record: RequestRecord) -> None:
        with self._requests_lock:
            self._requests.append(record)

    @staticmethod
    def wait_for(predicate: Callable[[], bool], timeout: float = 10) -> bool:
        """Poll `predicate` until it holds (True) or `timeout` seconds pass (False)."""
        deadline = time.monotonic() + timeout
        while True:
            if predicate():
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)


class _HttpServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler], sim: SimApiServer):
        super().__init__(address, handler)
        self.sim = sim
        self._connections: set[socket.socket] = set()
        self._connections_lock = threading.Lock()

    def track(self, conn: socket.socket, open_: bool) -> None:
        with self._connections_lock:
            if open_:
                self._connections.add(conn)
            else:
                self._connections.discard(conn)

    def close_connections(self) -> None:
        """Drop kept-alive client connections so that stop() leaves nothing served."""
        with self._connections_lock:
            conns = list(self._connections)
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _HttpServer

    def setup(self) -> None:
        super().setup()
        # Headers and body go out in separate writes; with Nagle's algorithm the body would wait
        # for the client's delayed ACK (~40 ms a request). Go's API server sets TCP_NODELAY too.
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.server.track(self.connection, True)

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            self.server.track(self.connection, False)

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: the request log (`srv.requests`) is the record."""

    def do_GET(self) -> None:
        self._handle("GET")

    def do_POST(self) -> None:
        self._handle("POST")

    def do_PUT(self) -> None:
        self._handle("PUT")

    def do_PATCH(self) -> None:
        self._handle("PATCH")

    def do_DELETE(self) -> None:
        self._handle("DELETE")

    # --- request flow ---------------------------------------------------------------------------

    def _handle(self, method: str) -> None:
        sim = self.server.sim
        url = urlsplit(self.path)
        query = {k: v[-1] for k, v in parse_qs(url.query, keep_blank_values=True).items()}
        content_type = (self.headers.get("Content-Type") or "").split(";")[0].strip()
        route = apiroutes.route(url.path, self.server.server_address)
        verb = apiroutes.verb(method, route, query)
        self._pending_record: RequestRecord | None = RequestRecord(
            method=method,
            path=url.path,
            query=query,
            verb=verb,
            api_group=route.group,
            resource=route.plural,
            subresource=route.subresource,
            namespace=route.namespace,
            name=route.name,
            status=0,
            field_manager=query.get("fieldManager", ""),
            content_type=content_type,
            time=time.monotonic(),
        )
        try:
            raw = self._read_body()
            fault = sim.faults.take(method, url.path)
            if fault is not None:
                time.sleep(fault.delay)
                if fault.status:
                    raise ApiError(fault.status, f"injected fault: {fault.status}")
            self._serve(method, route, verb, query, content_type, raw)
        except ApiError as e:
            self._send_error(e)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        except Exception as e:  # never let one bad request take down the server thread
            self._send_error(ApiError(500, f"internal error: {type(e).__name__}: {e}"))
        finally:
            self._log_status(499)  # no answer was sent: the client went away

    def send_response(self, code: int, message: str | None = None) -> None:
        """Log the request before any byte of the answer leaves, so a client that has its answer
        always finds the request in `srv.requests`."""
        self._log_status(code)
        super().send_response(code, message)

    def _log_status(self, code: int) -> None:
        record = getattr(self, "_pending_record", None)
        if record is not None:
            self._pending_record = None
            self.server.sim._log(dataclasses.replace(record, status=code))

    def _read_body(self) -> bytes:
        if (self.headers.get("Transfer-Encoding") or "").lower() == "chunked":
            body = b""
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return body
                body += self.rfile.read(size)
                self.rfile.readline()
                if len(body) > _MAX_BODY:
                    raise ApiError(413, "request entity too large", "RequestEntityTooLarge")
        length = int(self.headers.get("Content-Length") or 0)
        if length > _MAX_BODY:
            self.close_connection = True
            raise ApiError(413, "request entity too large", "RequestEntityTooLarge")
        return self.rfile.read(length) if length else b""

    def _serve(
        self, method: str, route: apiroutes.Route, verb: str, query: dict[str, str], content_type: str, raw: bytes
    ) -> int:
        store = self.server.sim.store
        if route.discovery is not None:
            if method != "GET":
                raise ApiError(405, f"{method} is not allowed on {self.path}", "MethodNotAllowed")
            return self._send_json(200, route.discovery)
        rtype = route.rtype
        if rtype is None:
            raise ApiError(404, "the server could not find the requested resource", "NotFound")
        namespace = route.namespace or None
        dry_run = query.get("dryRun") == "All"
        if verb in ("list", "watch", "deletecollection"):
            match_fields = field_selector(query.get("fieldSelector"), rtype.fields)
            match_labels = label_selector(query.get("labelSelector"))

            def match(obj: dict[str, Any]) -> bool:
                return match_fields(obj) and match_labels(obj)

            if verb == "watch":
                return self._watch(rtype, namespace, match, query)
            if verb == "deletecollection":
                store.delete_collection(rtype, namespace, match, dry_run=dry_run)
                return self._send_json(200, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success"})
            items, rv = store.list(rtype, namespace, match)
            return self._send_json(
                200,
                {
                    "kind": f"{rtype.kind}List",
                    "apiVersion": rtype.api_version,
                    "metadata": {"resourceVersion": rv},
                    "items": items,
                },
            )
        if verb == "get":
            return self._send_json(200, store.get(rtype, namespace, route.name))
        if verb == "create":
            if route.name:
                raise ApiError(405, "POST is not allowed on a named object", "MethodNotAllowed")
            return self._send_json(201, store.create(rtype, namespace, _json_body(raw), dry_run=dry_run))
        if verb == "update":
            body = _json_body(raw)
            result = store.update(rtype, namespace, route.name, body, subresource=route.subresource, dry_run=dry_run)
            return self._send_json(200, result)
        if verb == "patch":
            patch = _yaml_body(raw) if content_type == "application/apply-patch+yaml" else _json_body(raw)
            result = store.patch(
                rtype,
                namespace,
                route.name,
                patch,
                content_type,
                subresource=route.subresource,
                manager=query.get("fieldManager"),
                force=query.get("force") in ("true", "1"),
                dry_run=dry_run,
            )
            return self._send_json(200, result)
        if verb == "delete":
            options = _json_body(raw) if raw.strip() else {}
            result = store.delete(rtype, namespace, route.name, options.get("preconditions"), dry_run=dry_run)
            return self._send_json(200, result)
        raise ApiError(405, f"{method} is not supported here", "MethodNotAllowed")

    def _watch(
        self, rtype: ResourceType, namespace: str | None, match: Callable[[dict], bool], query: dict[str, str]
    ) -> int:
        try:
            timeout = float(query.get("timeoutSeconds") or DEFAULT_WATCH_SECONDS)
        except ValueError:
            raise bad_request(f"invalid timeoutSeconds {query.get('timeoutSeconds')!r}") from None
        send_initial_events = query.get("sendInitialEvents") in ("true", "1")
        if send_initial_events and query.get("resourceVersionMatch") != "NotOlderThan":
            raise ApiError(422, "sendInitialEvents requires setting resourceVersionMatch to NotOlderThan", "Invalid")
        if send_initial_events and query.get("allowWatchBookmarks") not in ("true", "1"):
            raise ApiError(422, "sendInitialEvents requires allowWatchBookmarks=true", "Invalid")
        watcher: Watcher | None = None
        error: ApiError | None = None
        try:
            watcher = self.server.sim.store.watch(
                rtype, namespace, match, query.get("resourceVersion"), send_initial_events
            )
        except ApiError as e:
            if e.code != 410:
                raise
            error = e
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        self.close_connection = True
        deadline = time.monotonic() + timeout
        try:
            while error is None and watcher is not None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                try:
                    events = watcher.next_events(min(remaining, _WATCH_POLL_SECONDS))
                except ApiError as e:
                    error = e
                    break
                if events is None:
                    break
                if not events and self._client_gone():
                    return 200
                for event_type, obj in events:
                    self._chunk({"type": event_type, "object": obj})
            if error is not None:
                self._chunk({"type": "ERROR", "object": error.status()})
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        except OSError:
            pass  # the client hung up: the watch just ends
        finally:
            if watcher is not None:
                watcher.close()
        return 200

    def _chunk(self, event: dict[str, Any]) -> None:
        line = json.dumps(event, separators=(",", ":")).encode() + b"\n"
        self.wfile.write(f"{len(line):x}\r\n".encode() + line + b"\r\n")
        self.wfile.flush()

    def _client_gone(self) -> bool:
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True

    def _send_json(self, code: int, body: dict[str, Any]) -> int:
        data = json.dumps(body, separators=(",", ":")).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
        return code

    def _send_error(self, error: ApiError) -> None:
        data = json.dumps(error.status(), separators=(",", ":")).encode()
        try:
            self.send_response(error.code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            if error.code == 429:
                self.send_header("Retry-After", "1")
            self.end_headers()
            self.wfile.write(data)
        except OSError:
            self.close_connection = True


def _json_body(raw: bytes) -> Any:
    try:
        return json.loads(raw or b"{}")
    except (ValueError, UnicodeDecodeError) as e:
        raise bad_request(f"the request body is not valid JSON: {e}") from None


def _yaml_body(raw: bytes) -> Any:
    """An apply body. Clients (client-go, kubectl, the Python client) send JSON, which is YAML too:
    it is parsed as JSON, as cheaply as the real server's Go decoder parses it, instead of by
    PyYAML's pure-Python loader, which took 1.4 ms of each status apply. Anything else is YAML
    (libyaml's loader where PyYAML has it)."""
    try:
        return json.loads(raw) or {}
    except (ValueError, UnicodeDecodeError):
        pass
    try:
        return yaml.load(raw.decode(), Loader=_YAML_LOADER) or {}
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise bad_request(f"the apply body is not valid YAML: {e}") from None


_YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run the simulated Kubernetes API server until SIGTERM.")
    parser.add_argument("--kubeconfig", required=True, help="where to write a kubeconfig pointing at the server")
    parser.add_argument("--no-validate", action="store_true", help="skip schema and DRA validation of writes")
    args = parser.parse_args(argv)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    with SimApiServer(validate=not args.no_validate) as srv:
        srv.write_kubeconfig(args.kubeconfig)
        print(srv.url, flush=True)
        stop.wait()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
