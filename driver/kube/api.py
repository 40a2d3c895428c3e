"""The one door to the Kubernetes API: nodes, ResourceClaims (read, status SSA), ResourceSlices,
Pods nominated to the node (list, watch), Events.

Everything else in the driver gets plain camelCase dicts and our own exceptions from here, never
HTTP responses or socket errors, so that callers decide retry versus give-up from one small
vocabulary (`ApiError.retryable`) and the transport can be swapped or upgraded in one place.

The requests are plain REST over kept-alive connections (`driver.kube.connection`), with the server, TLS
and credentials of `driver.kube.kubeconfig`, not through the official `kubernetes` client. Its package imports every
one of its pydantic models (about 35 MiB of the daemon's memory), validates every call's
arguments against them, and its models silently drop every JSON key they do not know (docs/reference/resource-api.md, 'Python client notes'): a claim
or slice read through a model would lose fields newer than the client, and the slice publisher
needs the exact objects the server stored to notice fields the server dropped (list-typed
attributes with their feature gate off). So every object is sent and read as JSON. Requests ask
for `application/json`, as the official clients do.

What the server answers is read as a stranger's: bodies within a limit, its Retry-After within
`RETRY_AFTER_MAX`, its messages shown escaped (`driver.untrusted`). The requests and the
translation of everything that can go wrong on the wire into `ApiError` are read together here;
only the errors themselves (`driver.kube.errors`) and the watch stream (`driver.kube.watch`) live
apart, so that the stream needs no import of the door.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
from dataclasses import dataclass
from typing import Any, cast
from urllib.parse import quote, urlencode

from driver.kube.connection import ConnectionPool, Response, Sent, Timeouts
from driver.kube.errors import DETAIL, error_from

# The errors callers meet, imported by them from here: the door they call.
from driver.kube.errors import ApiError as ApiError
from driver.kube.errors import Conflict as Conflict
from driver.kube.errors import NotFound as NotFound
from driver.kube.errors import retry_after as retry_after
from driver.kube.kubeconfig import KubeconfigError, cluster_access
from driver.kube.types import AllocatedDeviceStatus, ResourceClaim
from driver.kube.watch import Watch
from driver.resource_api import API_VERSION
from driver.untrusted import shown

log = logging.getLogger(__name__)

# (connect, read) seconds for every ordinary request: a hung API server must turn into a
# retryable error, never a thread blocked forever.
DEFAULT_TIMEOUT = (5.0, 15.0)

# Pooled connections kept to the API server: one per concurrent prepare (the gRPC server's
# workers), and the slice publisher's. More are opened when needed, but not kept.
CONNECTIONS = 16
USER_AGENT = "tandem-driver"

# The statuses whose Retry-After the retry loops honour: throttled, overloaded.
_RETRY_AFTER = frozenset({429, 503})

# Bytes of an answer's body read at most: a broken or hostile server (or a proxy) must not grow
# the daemon's memory without bound. One object (or one watch event): the API server stores none
# over etcd's 1.5 MiB and takes no request over 3 MiB. One list: this node's slices of this
# driver. An error: a metav1.Status, whose message is repeated only in part (`DETAIL` characters).
OBJECT_LIMIT = 4 * 2**20
LIST_LIMIT = 16 * 2**20
ERROR_LIMIT = 64 * 2**10


@dataclass(frozen=True)
class NodeRef:
    name: str
    uid: str


def _status_error(resp: Response, what: str) -> ApiError:
    """An answer outside 2xx, with the message of the metav1.Status the server sends (shown
    escaped and bounded: a server's text, which may repeat a tenant's) and the wait it asks for."""
    status = int(resp.status)
    detail = ""
    with contextlib.suppress(Exception):
        body = _body(resp, what, ERROR_LIMIT)
        try:
            detail = str(json.loads(body).get("message", ""))
        except (ValueError, AttributeError, RecursionError):
            detail = body.decode(errors="replace")
    # The standard phrase, not the server's: a reason phrase is one more string it chose.
    msg = f"{what}: HTTP {status} {http.client.responses.get(status, '')}".rstrip()
    msg += f": {shown(detail, DETAIL)}" if detail else ""
    if status == 404:
        return NotFound(msg, status)
    if status == 409:
        return Conflict(msg, status, retryable=True)
    return ApiError(msg, status, retry_after=resp.retry_after if status in _RETRY_AFTER else 0.0)


def _body(resp: Response, what: str, limit: int) -> bytes:
    """The whole body, read here, lazily: a connection that breaks or times out mid-body raises
    now, and must still become an ApiError; so does a body over `limit` bytes, refused unread
    when its Content-Length says so, else once `limit` bytes have come (no more are read)."""
    declared = resp.length
    if declared is None or declared <= limit:
        try:
            data = resp.read(limit + 1)
        except Exception as exc:
            raise error_from(exc, what) from exc
        if len(data) <= limit:
            return data
    resp.close()
    size = f"of {declared} bytes" if declared is not None else "of more bytes"
    raise ApiError(f"{what}: the answer's body {size} is over the limit of {limit}", resp.status, retryable=True)


def _decode(resp: Response, what: str, limit: int = OBJECT_LIMIT) -> dict[str, Any]:
    """The body (`_body`) as a JSON object."""
    body = _body(resp, what, limit)
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise ApiError(f"{what}: the answer is not JSON: {exc}", resp.status, retryable=True) from exc
    if not isinstance(obj, dict):
        raise ApiError(f"{what}: response is not a JSON object", resp.status, retryable=True)
    return obj


def _metadata(obj: dict[str, Any]) -> dict[str, Any]:
    """An answer's `metadata`, or {} when it has none that is an object (a server's word)."""
    metadata = obj.get("metadata")
    return metadata if isinstance(metadata, dict) else {}


def _discard(resp: Response, what: str) -> None:
    """Read the body (`_body`) so that the connection can carry the next request."""
    _body(resp, what, OBJECT_LIMIT)


def _answer(sent: Sent, what: str) -> Response:
    """The answer to `sent` when it is 2xx (body unread); any other outcome as an `ApiError`."""
    try:
        resp = sent.response()
    except Exception as exc:
        raise error_from(exc, what) from exc
    if not 200 <= resp.status < 300:
        raise _status_error(resp, what)
    return resp


class Pending:
    """A request sent whose answer is read later: `wait` reads it and keeps its error, `result`
    raises that error. Once `wait` has an answer, error or not, the server is done with the
    request; after a timeout or a broken connection no answer came, and it may still be carried
    out (as with any request whose answer is lost)."""

    def __init__(self, sent: Sent, what: str) -> None:
        self._sent: Sent | None = sent
        self._what = what
        self._error: ApiError | None = None

    def wait(self) -> ApiError | None:
        sent, self._sent = self._sent, None
        if sent is not None:
            try:
                _discard(_answer(sent, self._what), self._what)
            except Exception as exc:
                self._error = error_from(exc, self._what)
        return self._error

    def result(self) -> None:
        error = self.wait()
        if error is not None:
            raise error


def _slice_selector(node_name: str, driver: str) -> str:
    return f"spec.nodeName={node_name},spec.driver={driver}"


def _nominated_selector(node_name: str) -> str:
    return f"status.nominatedNodeName={node_name}"


class KubeAPI:
    """The driver's requests to the API server; all methods raise only `ApiError` and subclasses."""

    def __init__(self, kubeconfig: str | None = None, timeout: tuple[float, float] = DEFAULT_TIMEOUT) -> None:
        try:
            access = cluster_access(kubeconfig)
        except (KubeconfigError, OSError, ValueError) as exc:
            raise ApiError(f"cannot load Kubernetes client configuration: {exc}", retryable=False) from exc
        try:
            self._pool = ConnectionPool(
                access.server, access.tls, access.proxy, Timeouts(connect=timeout[0], read=timeout[1]), CONNECTIONS
            )
        except ValueError as exc:
            raise ApiError(f"cannot use the Kubernetes client configuration: {exc}", retryable=False) from exc
        self._credentials = access.credentials
        self.server = self._pool.server  # for messages: where the API server is
        self._read_timeout = timeout[1]

    def close(self) -> None:
        self._pool.close()

    def _request(self, method: str, path: str, what: str, **options: Any) -> Response:
        """`_send`, then the response (body unread) when the server answered 2xx."""
        return _answer(self._send(method, path, what, **options), what)

    def _send(
        self,
        method: str,
        path: str,
        what: str,
        *,
        query: dict[str, str] | None = None,
        body: Any = None,
        content_type: str = "application/json",
        read_timeout: float | None = None,
    ) -> Sent:
        """Send one request now (`Sent`); `body` is sent as JSON (a JSON document is also valid
        YAML, for apply patches). Failing to send raises `ApiError`."""
        target = path + (f"?{urlencode(query)}" if query else "")
        try:
            headers = {"Accept": "application/json", "User-Agent": USER_AGENT}
            auth = self._credentials.header()
            if auth:
                headers["Authorization"] = auth
            data = None
            if body is not None:
                data = json.dumps(body, separators=(",", ":")).encode()
                headers["Content-Type"] = content_type
            return self._pool.send(method, target, data, headers, read_timeout)
        except Exception as exc:
            raise error_from(exc, what) from exc

    # -- nodes -------------------------------------------------------------------------------

    def get_node(self, name: str) -> NodeRef:
        what = f"get node {name}"
        obj = _decode(self._request("GET", f"/api/v1/nodes/{_q(name)}", what), what)
        uid = _metadata(obj).get("uid")
        if not isinstance(uid, str) or not uid:
            raise ApiError(f"{what}: node has no metadata.uid", retryable=False)
        return NodeRef(name=name, uid=uid)

    # -- claims ------------------------------------------------------------------------------

    def get_claim(self, namespace: str, name: str) -> ResourceClaim:
        """The v1 ResourceClaim as the server sent it (camelCase), every field of it: the prepare
        path must see the whole allocation result, and a later read-modify-write must not erase
        what a client model would have lost. Of the shape `ResourceClaim`: the server validated it."""
        what = f"get claim {namespace}/{name}"
        return cast(ResourceClaim, _decode(self._request("GET", _claim_path(namespace, name), what), what))

    def apply_claim_status(
        self, namespace: str, name: str, devices: list[AllocatedDeviceStatus], field_manager: str, *, uid: str
    ) -> None:
        """Server-side apply of `status.devices` (docs/reference/resource-api.md, 'Writing claim status').

        SSA with our own field manager owns only the entries we send, so the scheduler's
        allocation and other drivers' device entries stay untouched; force=True takes over
        fields a previous incarnation of the driver (same manager) or a stray writer set.
        `uid` makes the server refuse (409) to apply to a claim that was deleted and recreated
        under the same name: a late call about the old claim must not rewrite the new one.
        """
        self.send_claim_status(namespace, name, devices, field_manager, uid=uid).result()

    def send_claim_status(
        self, namespace: str, name: str, devices: list[AllocatedDeviceStatus], field_manager: str, *, uid: str
    ) -> Pending:
        """`apply_claim_status`, sent now and answered by `Pending.result`: a prepare writes its
        files while the server applies."""
        what = f"apply status of claim {namespace}/{name}"
        body = {
            "apiVersion": API_VERSION,
            "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": namespace, "uid": uid},
            "status": {"devices": devices},
        }
        query = {"fieldManager": field_manager, "force": "true"}
        path = _claim_path(namespace, name) + "/status"
        sent = self._send("PATCH", path, what, query=query, body=body, content_type="application/apply-patch+yaml")
        return Pending(sent, what)

    # -- slices ------------------------------------------------------------------------------

    def list_slices(self, node_name: str, driver: str) -> tuple[list[dict[str, Any]], str]:
        """This node's slices of `driver`, and the list's resourceVersion to start a watch from."""
        what = f"list slices of {driver} on {node_name}"
        return self._list(_SLICES, _slice_selector(node_name, driver), what)

    def watch_slices(self, node_name: str, driver: str, resource_version: str, timeout_seconds: int) -> Watch:
        """The watch of `list_slices`' slices from `resource_version` (`_watch`)."""
        what = f"watch slices of {driver} on {node_name}"
        return self._watch(_SLICES, _slice_selector(node_name, driver), resource_version, timeout_seconds, what)

    # -- pods --------------------------------------------------------------------------------

    def list_nominated_pods(self, node_name: str) -> tuple[list[dict[str, Any]], str]:
        """The pods of every namespace that the scheduler nominated to `node_name`, and the list's
        resourceVersion: the scheduler nominates a pod before PreBind (NominatedNodeNameForExpectation),
        so its claims' allocations on this node are seen while the pod still waits for binding."""
        return self._list(_PODS, _nominated_selector(node_name), f"list pods nominated to {node_name}")

    def watch_nominated_pods(self, node_name: str, resource_version: str, timeout_seconds: int) -> Watch:
        """The watch of `list_nominated_pods`' pods from `resource_version` (`_watch`)."""
        what = f"watch pods nominated to {node_name}"
        return self._watch(_PODS, _nominated_selector(node_name), resource_version, timeout_seconds, what)

    def _list(self, path: str, selector: str, what: str) -> tuple[list[dict[str, Any]], str]:
        """The objects at `path` that `selector` (a field selector) picks, and the list's
        resourceVersion to start a watch from."""
        obj = _decode(self._request("GET", path, what, query={"fieldSelector": selector}), what, LIST_LIMIT)
        items = obj.get("items") or []
        if not isinstance(items, list) or not all(isinstance(i, dict) for i in items):
            raise ApiError(f"{what}: malformed list", retryable=True)
        rv = _metadata(obj).get("resourceVersion", "")
        return items, str(rv)

    def _watch(self, path: str, selector: str, resource_version: str, timeout_seconds: int, what: str) -> Watch:
        """Open a watch from `resource_version`; iterate it for (type, object) events.

        BOOKMARK events are yielded too: their resourceVersion lets the caller resume. An ERROR
        event (e.g. 410 Gone: the resourceVersion is too old) is raised as `ApiError` with the
        status it carries; the caller must list again.
        """
        query = {
            "fieldSelector": selector,
            "resourceVersion": resource_version,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(timeout_seconds),
            "watch": "true",
        }
        # The read timeout must outlast the server-side watch timeout.
        read_timeout = timeout_seconds + self._read_timeout
        return Watch(self._request("GET", path, what, query=query, read_timeout=read_timeout), what, OBJECT_LIMIT)

    def create_slice(self, body: dict[str, Any]) -> dict[str, Any]:
        """POST a slice (use metadata.generateName); returns what the server stored."""
        what = "create slice"
        return _decode(self._request("POST", _SLICES, what, body=body), what)

    def update_slice(self, body: dict[str, Any]) -> dict[str, Any]:
        """PUT a slice. `metadata.resourceVersion` in `body` makes it conditional (409 = Conflict)."""
        name = body.get("metadata", {}).get("name", "")
        what = f"update slice {name}"
        return _decode(self._request("PUT", f"{_SLICES}/{_q(name)}", what, body=body), what)

    def delete_slice(self, name: str, resource_version: str | None = None) -> None:
        """DELETE a slice; already gone is success. With a resourceVersion, only that version."""
        what = f"delete slice {name}"
        body = None
        if resource_version:
            body = {"apiVersion": "v1", "kind": "DeleteOptions", "preconditions": {"resourceVersion": resource_version}}
        try:
            resp = self._request("DELETE", f"{_SLICES}/{_q(name)}", what, body=body)
        except NotFound:
            return
        _discard(resp, what)

    # -- events ------------------------------------------------------------------------------

    def create_event(self, namespace: str, body: dict[str, Any]) -> None:
        """POST an events.k8s.io/v1 Event (`driver.events` builds it)."""
        what = f"create event in {namespace}"
        _discard(self._request("POST", _events_path(namespace), what, body=body), what)

    def patch_event(self, namespace: str, name: str, patch: dict[str, Any]) -> None:
        """A JSON merge patch of an Event: a repeat raises its `series` count."""
        what = f"patch event {namespace}/{name}"
        path = f"{_events_path(namespace)}/{_q(name)}"
        _discard(self._request("PATCH", path, what, body=patch, content_type="application/merge-patch+json"), what)


_SLICES = f"/apis/{API_VERSION}/resourceslices"
_PODS = "/api/v1/pods"


def _q(segment: str) -> str:
    """One path segment, escaped: a name can never reach another path."""
    return quote(segment, safe="")


def _claim_path(namespace: str, name: str) -> str:
    return f"/apis/{API_VERSION}/namespaces/{_q(namespace)}/resourceclaims/{_q(name)}"


def _events_path(namespace: str) -> str:
    return f"/apis/events.k8s.io/v1/namespaces/{_q(namespace)}/events"
