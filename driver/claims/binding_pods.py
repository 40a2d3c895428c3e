"""The pods the scheduler nominated to this node: where binding conditions learn of allocations.

ResourceClaims have no field selector by node, so a node cannot watch only its own claims; a
watch of every claim on every node would send each claim change to every node (at 1,000 nodes
and 100,000 claims, 1,000 copies of every change, and 100,000 claims listed at each start). Pods
have one: the scheduler sets `status.nominatedNodeName` before the binding cycle's PreBind
(NominatedNodeNameForExpectation, beta and on since Kubernetes 1.35), and the server filters a
watch by it. So each node watches only the pods about to be bound to it, and reads their claims
by name (`driver.claims.binding.PreBinder`). The price is RBAC: list and watch of pods, which
RBAC cannot narrow to a field selector (docs/security.md).

A pod already bound (`spec.nodeName` set) is skipped: its binding is over.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from driver.backoff import Backoff, Retry
from driver.kube.api import ApiError, KubeAPI, retry_after
from driver.kube.watch import Watch

log = logging.getLogger(__name__)

WATCH_TIMEOUT = 300  # seconds a watch request lasts on the server before it is opened again
_BACKOFF = Backoff(initial=1.0, maximum=30.0)


def claim_names(pod: Mapping[str, Any]) -> list[str]:
    """The names of a pod's ResourceClaims: those it names, those made from its templates (the
    claim controller writes them into the status before the pod is scheduled) and the claim of
    its extended resources."""
    spec, status = pod.get("spec") or {}, pod.get("status") or {}
    names = [c.get("resourceClaimName") for c in spec.get("resourceClaims") or []]
    names += [c.get("resourceClaimName") for c in status.get("resourceClaimStatuses") or []]
    names.append((status.get("extendedResourceClaimStatus") or {}).get("resourceClaimName"))
    return list(dict.fromkeys(n for n in names if isinstance(n, str) and n))


class NominatedPods:
    """List, then watch, the pods nominated to `node_name`; `on_claims(namespace, names)` for each
    unbound one, on every event about it. One thread; failures are retried with backoff."""

    def __init__(self, api: KubeAPI, node_name: str, on_claims: Callable[[str, Sequence[str]], None]) -> None:
        self._api = api
        self._node = node_name
        self._on_claims = on_claims
        self._stopping = threading.Event()
        self._watch: Watch | None = None
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="nominated-pods", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        with self._lock:
            if self._watch is not None:
                self._watch.stop()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _run(self) -> None:
        retry = Retry(_BACKOFF)
        while not self._stopping.is_set():
            try:
                items, rv = self._api.list_nominated_pods(self._node)
                for pod in items:
                    self._seen(pod)
                retry.reset()
                while not self._stopping.is_set():
                    rv = self._follow(rv)
            except ApiError as e:
                if e.status == 410:  # the resourceVersion is too old: list again at once
                    continue
                delay = retry.next(retry_after(e))
                log.warning("pods nominated to %s: %s; again in %.0f s", self._node, e, delay)
                self._stopping.wait(delay)
            except Exception:  # a bug must not end the watch for good: binding would stall every pod
                delay = retry.next()
                log.exception("pods nominated to %s: again in %.0f s", self._node, delay)
                self._stopping.wait(delay)

    def _follow(self, rv: str) -> str:
        """One watch request, to its end; the resourceVersion to go on from."""
        watch = self._api.watch_nominated_pods(self._node, rv, WATCH_TIMEOUT)
        with self._lock:
            self._watch = watch
        if self._stopping.is_set():
            watch.stop()
        for etype, pod in watch:
            rv = str((pod.get("metadata") or {}).get("resourceVersion") or rv)
            if etype in ("ADDED", "MODIFIED"):
                self._seen(pod)
        return rv

    def _seen(self, pod: Mapping[str, Any]) -> None:
        if (pod.get("spec") or {}).get("nodeName"):
            return
        names = claim_names(pod)
        namespace = (pod.get("metadata") or {}).get("namespace")
        if names and isinstance(namespace, str):
            self._on_claims(namespace, names)
