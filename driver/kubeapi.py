"""The one door to the Kubernetes API: nodes, ResourceClaims (read, status SSA) and ResourceSlices.

Everything else in the driver gets plain camelCase dicts and our own exceptions from here, never
client models, `ApiException` or urllib3 errors, so that callers decide retry versus give-up from
one small vocabulary (`ApiError.retryable`) and the client library can be swapped or upgraded in
one place.

Why raw JSON instead of client models for reads: the `kubernetes` client's pydantic models
silently drop every JSON key they do not know (docs/reference/resource-api.md, 'Python client notes'). A claim or slice read
through a model would lose fields newer than the client; the slice publisher also needs the exact
bytes the server stored to notice fields the server dropped (list-typed attributes with their
feature gate off). So every call that returns an object uses `_preload_content=False` and
json-decodes the body itself.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pydantic
import urllib3
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from kubernetes.watch.watch import iter_resp_lines

from driver.resource_api import API_VERSION

log = logging.getLogger(__name__)

# (connect, read) seconds for every ordinary request: a hung API server must turn into a
# retryable error, never a thread blocked forever.
DEFAULT_TIMEOUT = (5.0, 15.0)

# HTTP statuses worth retrying: throttling, server-side trouble, and 0 for "no response at all"
# (connection refused/reset, timeout).
_RETRYABLE = frozenset({0, 408, 429, 500, 502, 503, 504})


class ApiError(Exception):
    """A failed API call. `status` is the HTTP status, 0 when no response came back."""

    def __init__(self, message: str, status: int = 0, retryable: bool | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.retryable = status in _RETRYABLE if retryable is None else retryable


class Conflict(ApiError):
    """409: the object changed since it was read (optimistic concurrency) or already exists.

    Retryable once the caller has re-read the object.
    """


class NotFound(ApiError):
    """404: the object (or the API itself) does not exist."""


@dataclass(frozen=True)
class NodeRef:
    name: str
    uid: str


def _error_from(exc: Exception, what: str) -> ApiError:
    if isinstance(exc, ApiException):
        status = int(exc.status or 0)
        reason = exc.reason or ""
        detail = ""
        if exc.body:
            try:
                detail = str(json.loads(exc.body).get("message", ""))
            except (ValueError, AttributeError):
                detail = str(exc.body)[:200]
        msg = f"{what}: HTTP {status} {reason}: {detail}".rstrip(": ")
        if status == 404:
            return NotFound(msg, status)
        if status == 409:
            return Conflict(msg, status, retryable=True)
        return ApiError(msg, status)
    if isinstance(exc, pydantic.ValidationError):
        # The client validates bodies against its models before sending: a malformed body is
        # our bug or bad input, and sending it again will not help.
        return ApiError(f"{what}: invalid request body: {exc}", 0, retryable=False)
    return ApiError(f"{what}: {type(exc).__name__}: {exc}", 0, retryable=True)


def _decode(resp: Any, what: str) -> dict[str, Any]:
    """The body is read here, lazily (`_preload_content=False`): a connection that breaks or
    times out mid-body raises from urllib3 now, and must still become an ApiError."""
    try:
        obj = json.loads(resp.data)
    except (ValueError, TypeError) as exc:
        raise ApiError(f"{what}: response is not JSON: {exc}", resp.status, retryable=True) from exc
    except Exception as exc:
        raise _error_from(exc, what) from exc
    finally:
        with contextlib.suppress(Exception):
            _discard(resp)
    if not isinstance(obj, dict):
        raise ApiError(f"{what}: response is not a JSON object", resp.status, retryable=True)
    return obj


class SliceWatch(Iterator[tuple[str, dict[str, Any]]]):
    """An open watch stream. `stop()` may be called from another thread to end it at once.

    Without it a stopping publisher would wait for the server-side watch timeout, because a
    blocked socket read cannot be interrupted any other way.
    """

    def __init__(self, resp: Any, what: str) -> None:
        self._resp = resp
        self._what = what
        self._events = self._read()

    def stop(self) -> None:
        # ValueError/OSError: already ended, the connection was released or closed.
        with contextlib.suppress(ValueError, OSError):
            self._resp.shutdown()

    def __next__(self) -> tuple[str, dict[str, Any]]:
        return next(self._events)

    def _read(self) -> Iterator[tuple[str, dict[str, Any]]]:
        what = self._what
        try:
            for line in iter_resp_lines(self._resp):
                if not line:
                    continue
                try:
                    event = json.loads(line)
                    etype, obj = event["type"], event["object"]
                except (ValueError, KeyError, TypeError) as exc:
                    raise ApiError(f"{what}: malformed event: {line[:200]}", retryable=True) from exc
                if not isinstance(obj, dict) or not isinstance(etype, str):
                    raise ApiError(f"{what}: malformed event: {line[:200]}", retryable=True)
                if etype == "ERROR":
                    code = obj.get("code")
                    status = code if isinstance(code, int) else 0
                    raise ApiError(f"{what}: {obj.get('message', 'watch error')}", status, retryable=True)
                yield etype, obj
        except ApiError:
            raise
        except Exception as exc:
            raise _error_from(exc, what) from exc
        finally:
            # close, not release: a half-read stream must never go back to the pool, or the
            # next request on that connection would read the rest of this watch.
            self._resp.close()


def _discard(resp: Any) -> None:
    """Read the body before releasing the connection: an unread body left in a pooled
    connection would be read as the answer to the next request."""
    try:
        resp.drain_conn()
    finally:
        resp.release_conn()


def _slice_selector(node_name: str, driver: str) -> str:
    return f"spec.nodeName={node_name},spec.driver={driver}"


class KubeAPI:
    """Typed wrapper over the official client; all methods raise only `ApiError` and subclasses."""

    def __init__(self, kubeconfig: str | None = None, timeout: tuple[float, float] = DEFAULT_TIMEOUT) -> None:
        cfg = client.Configuration()
        try:
            if kubeconfig is None:
                config.load_incluster_config(client_configuration=cfg)
            else:
                config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
        except (config.ConfigException, OSError, ValueError) as exc:
            raise ApiError(f"cannot load Kubernetes client configuration: {exc}", retryable=False) from exc
        # Retry only failed connects inside urllib3 (the request never left); everything else
        # surfaces as an error so that the caller's backoff, not a hidden loop, decides.
        cfg.retries = urllib3.Retry(total=2, connect=2, read=0, status=0, other=0, redirect=0)
        self._timeout = timeout
        self._client = client.ApiClient(cfg)
        self._core = client.CoreV1Api(self._client)
        self._resource = client.ResourceV1Api(self._client)

    def close(self) -> None:
        self._client.close()

    # -- nodes -------------------------------------------------------------------------------

    def get_node(self, name: str) -> NodeRef:
        what = f"get node {name}"
        try:
            resp = self._core.read_node(name, _preload_content=False, _request_timeout=self._timeout)
        except Exception as exc:
            raise _error_from(exc, what) from exc
        obj = _decode(resp, what)
        uid = obj.get("metadata", {}).get("uid")
        if not isinstance(uid, str) or not uid:
            raise ApiError(f"{what}: node has no metadata.uid", retryable=False)
        return NodeRef(name=name, uid=uid)

    # -- claims ------------------------------------------------------------------------------

    def get_claim(self, namespace: str, name: str) -> dict[str, Any]:
        """The v1 ResourceClaim as the server sent it (camelCase).

        Decoded from the raw body rather than into `ResourceV1ResourceClaim`, because the model
        drops fields newer than the client (docs/reference/resource-api.md, 'Python client notes'): the prepare path must see the
        whole allocation result, and a later read-modify-write must not erase what it lost.
        """
        what = f"get claim {namespace}/{name}"
        try:
            resp = self._resource.read_namespaced_resource_claim(
                name, namespace, _preload_content=False, _request_timeout=self._timeout
            )
        except Exception as exc:
            raise _error_from(exc, what) from exc
        return _decode(resp, what)

    def apply_claim_status(
        self, namespace: str, name: str, devices: list[dict[str, Any]], field_manager: str, *, uid: str
    ) -> None:
        """Server-side apply of `status.devices` (docs/reference/resource-api.md, 'Writing claim status').

        SSA with our own field manager owns only the entries we send, so the scheduler's
        allocation and other drivers' device entries stay untouched; force=True takes over
        fields a previous incarnation of the driver (same manager) or a stray writer set.
        `uid` makes the server refuse (409) to apply to a claim that was deleted and recreated
        under the same name: a late call about the old claim must not rewrite the new one.
        """
        what = f"apply status of claim {namespace}/{name}"
        body = {
            "apiVersion": API_VERSION,
            "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": namespace, "uid": uid},
            "status": {"devices": devices},
        }
        try:
            resp = self._resource.patch_namespaced_resource_claim_status(
                name,
                namespace,
                body,
                field_manager=field_manager,
                force=True,
                _content_type="application/apply-patch+yaml",
                _preload_content=False,
                _request_timeout=self._timeout,
            )
        except Exception as exc:
            raise _error_from(exc, what) from exc
        _discard(resp)

    # -- slices ------------------------------------------------------------------------------

    def list_slices(self, node_name: str, driver: str) -> tuple[list[dict[str, Any]], str]:
        """This node's slices of `driver`, and the list's resourceVersion to start a watch from."""
        what = f"list slices of {driver} on {node_name}"
        try:
            resp = self._resource.list_resource_slice(
                field_selector=_slice_selector(node_name, driver),
                _preload_content=False,
                _request_timeout=self._timeout,
            )
        except Exception as exc:
            raise _error_from(exc, what) from exc
        obj = _decode(resp, what)
        items = obj.get("items") or []
        if not isinstance(items, list) or not all(isinstance(i, dict) for i in items):
            raise ApiError(f"{what}: malformed list", retryable=True)
        rv = obj.get("metadata", {}).get("resourceVersion", "")
        return items, str(rv)

    def watch_slices(self, node_name: str, driver: str, resource_version: str, timeout_seconds: int) -> SliceWatch:
        """Open a watch from `resource_version`; iterate it for (type, object) events.

        Reads the stream itself instead of `kubernetes.watch.Watch` so that objects stay raw
        dicts (no model round trip). BOOKMARK events are yielded too: their resourceVersion lets
        the caller resume. An ERROR event (e.g. 410 Gone: the resourceVersion is too old) is
        raised as `ApiError` with the status it carries; the caller must list again.
        """
        what = f"watch slices of {driver} on {node_name}"
        try:
            resp = self._resource.list_resource_slice(
                field_selector=_slice_selector(node_name, driver),
                resource_version=resource_version,
                allow_watch_bookmarks=True,
                timeout_seconds=timeout_seconds,
                watch=True,
                _preload_content=False,
                # The read timeout must outlast the server-side watch timeout.
                _request_timeout=(self._timeout[0], timeout_seconds + self._timeout[1]),
            )
        except Exception as exc:
            raise _error_from(exc, what) from exc
        return SliceWatch(resp, what)

    def create_slice(self, body: dict[str, Any]) -> dict[str, Any]:
        """POST a slice (use metadata.generateName); returns what the server stored."""
        what = "create slice"
        try:
            resp = self._resource.create_resource_slice(body, _preload_content=False, _request_timeout=self._timeout)
        except Exception as exc:
            raise _error_from(exc, what) from exc
        return _decode(resp, what)

    def update_slice(self, body: dict[str, Any]) -> dict[str, Any]:
        """PUT a slice. `metadata.resourceVersion` in `body` makes it conditional (409 = Conflict)."""
        name = body.get("metadata", {}).get("name", "")
        what = f"update slice {name}"
        try:
            resp = self._resource.replace_resource_slice(
                name, body, _preload_content=False, _request_timeout=self._timeout
            )
        except Exception as exc:
            raise _error_from(exc, what) from exc
        return _decode(resp, what)

    def delete_slice(self, name: str, resource_version: str | None = None) -> None:
        """DELETE a slice; already gone is success. With a resourceVersion, only that version."""
        what = f"delete slice {name}"
        body = None
        if resource_version:
            body = client.V1DeleteOptions(preconditions=client.V1Preconditions(resource_version=resource_version))
        try:
            resp = self._resource.delete_resource_slice(
                name, body=body, _preload_content=False, _request_timeout=self._timeout
            )
        except Exception as exc:
            err = _error_from(exc, what)
            if isinstance(err, NotFound):
                return
            raise err from exc
        _discard(resp)
