"""Keeps this node's ResourceSlices equal to the inventory, writing only what changed.

The publisher feeds the pure half (`build_slices`, `plan`) and carries the planned writes out
through `KubeAPI`: bursts of device changes are coalesced into few syncs, writes are
rate-limited, failures retried with backoff, and a server that silently drops list-typed
attributes, device taints, shared counters, consumable capacity or binding conditions (feature
gate off) is answered with a fallback instead of endless rewrites (`driver.slices.fallbacks`).
What came of its attempts (failures by reason, the last publish) is kept by
`driver.slices.progress`.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from driver.backoff import Backoff, Retry
from driver.kube.api import ApiError, Conflict, KubeAPI, NotFound, retry_after
from driver.model import Device
from driver.slices.build import SCALAR_CAPABLE_LIST_ATTRIBUTES, build_slices, device_to_api, metadata, taint_times_of
from driver.slices.cache import LiveSlices
from driver.slices.fallbacks import Fallbacks
from driver.slices.plan import plan
from driver.slices.progress import PublishProgress

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PublisherOptions:
    """Timing of the publisher. Defaults suit a node; tests shorten them."""

    # Least time between two batches of writes: a burst of device changes becomes a few writes.
    min_write_interval: float = 0.5
    # Wait this long after the first trigger of a quiet period, so that a burst starts coalesced.
    debounce: float = 0.05
    # Compare desired and live even without any event (the watch could have missed something).
    resync_period: float = 30.0
    backoff_initial: float = 0.2
    backoff_max: float = 30.0
    # Server-side timeout of one watch request; the watch is then resumed.
    watch_timeout: int = 300
    scalar_capable_attributes: frozenset[str] = SCALAR_CAPABLE_LIST_ATTRIBUTES


@dataclass
class PublisherStats:
    syncs: int = 0
    writes: int = 0
    creates: int = 0
    updates: int = 0
    deletes: int = 0
    errors: int = 0  # failed attempts: Node lookups, lists, watches, writes; by reason in `error_reasons`
    error_reasons: dict[str, int] = field(default_factory=dict)
    published_at: float | None = None  # Unix time of the last publish or confirmation
    watch_restarts: int = 0  # times the watch was opened again after it ended or failed
    skipped_devices: int = 0  # devices left out because the API cannot represent them


class SlicePublisher:
    """Keeps this node's ResourceSlices equal to `get_devices()`, writing only what changed.

    Two threads: this worker ("slice-publisher"), which resolves the Node, lists, and syncs
    (coalesced, rate-limited, retried with backoff), and the watch thread of `LiveSlices`, which
    keeps the cache of the live slices it plans against. API errors are retried forever, and
    counted, logged and told by `progress`; nothing here exits because the API server misbehaves.
    """

    def __init__(
        self,
        api: KubeAPI,
        driver_name: str,
        node_name: str,
        get_devices: Callable[[], Sequence[Device]],
        options: PublisherOptions | None = None,
    ) -> None:
        self._api = api
        self._driver = driver_name
        self._node = node_name
        self._get_devices = get_devices
        self._opts = options or PublisherOptions()
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self.progress = PublishProgress(api.server)
        self._cache = LiveSlices(
            api,
            node_name,
            driver_name,
            self._cond,
            self._mark_dirty,
            self._stop,
            Backoff(initial=self._opts.backoff_initial, maximum=self._opts.backoff_max),
            self._opts.watch_timeout,
            self.progress.failed,
        )
        # Guarded by _cond:
        self._node_uid: str | None = None
        self._dirty = True
        self._dirty_since = 0.0
        self._retry_at = 0.0
        self._last_write = float("-inf")
        self._fallbacks = Fallbacks(self._cond, self._mark_dirty, self._opts.scalar_capable_attributes)
        self._stats = PublisherStats()
        self._skipped: set[str] = set()
        self._writing = False
        # What the last sync that planned nothing compared (devices, live slices, modes): the
        # same inputs plan nothing again (`plan` is pure), so a resync or a trigger that changed
        # nothing costs a comparison by value, not a build and a plan (most of an idle daemon's
        # syncs). One entry, replaced by the next sync that plans nothing.
        self._agreed: tuple[object, ...] | None = None
        self._worker: threading.Thread | None = None

    # -- public ----------------------------------------------------------------------------

    def start(self) -> None:
        self._worker = threading.Thread(target=self._run, name="slice-publisher", daemon=True)
        self._worker.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop both threads. Deletes nothing: slices outlive a driver restart on purpose."""
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        self._cache.stop_watch()
        if self._worker is not None:
            self._worker.join(timeout)
        self._cache.join(timeout)

    def trigger(self) -> None:
        """The devices changed: sync soon. Bursts of triggers coalesce into few syncs."""
        with self._cond:
            self._mark_dirty()

    def wait_synced(self, timeout: float) -> bool:
        """True once the live slices equal the desired ones and no write is in flight (for tests
        and the demo)."""
        deadline = time.monotonic() + timeout
        while True:
            if self._in_sync():
                return True
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            with self._cond:
                self._cond.wait(min(remaining, 0.1))

    @property
    def stats(self) -> PublisherStats:
        errors, published_at = self.progress.errors(), self.progress.published_at
        with self._cond:
            return dataclasses.replace(
                self._stats,
                watch_restarts=self._cache.watch_restarts,
                errors=sum(errors.values()),
                error_reasons=errors,
                published_at=published_at,
            )

    def summary(self) -> dict[str, Any]:
        """What `tandemctl health` shows of the publisher: its work, and whether it published."""
        stats = self.stats
        return {"syncs": stats.syncs, "writes": stats.writes, "errors": stats.errors, **self.progress.summary()}

    @property
    def list_attributes_active(self) -> bool:
        """False once the server was seen dropping list-typed attributes (scalar fallback)."""
        return self._fallbacks.list_attributes

    @property
    def taints_active(self) -> bool:
        """False once the server was seen dropping device taints."""
        return self._fallbacks.sent("taints")

    # -- worker ----------------------------------------------------------------------------

    def _mark_dirty(self) -> None:
        if not self._dirty:
            self._dirty = True
            self._dirty_since = time.monotonic()
        self._cond.notify_all()

    def _desired(self, devices: Sequence[Device], live: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        devices = self._fallbacks.adapt([d for d in devices if self._publishable(d)])
        assert self._node_uid is not None
        return build_slices(devices, self._driver, self._node, self._node_uid, 0, taint_times=taint_times_of(live))

    def _publishable(self, device: Device) -> bool:
        """One device the API cannot represent must not keep the whole pool unpublished."""
        try:
            device_to_api(device, {}, "")
        except ValueError as exc:
            with self._cond:
                if device.name not in self._skipped:
                    self._skipped.add(device.name)
                    self._stats.skipped_devices += 1
                    log.error("not publishing device %s: %s", device.name, exc)
            return False
        return True

    def _in_sync(self) -> bool:
        with self._cond:
            # While writes are in flight the watch may already show their results; waiting
            # for the batch to end keeps stats and server request logs consistent with "synced".
            if not self._cache.listed or self._node_uid is None or self._writing:
                return False
            live = self._cache.snapshot()
        try:
            return plan(self._desired(self._get_devices(), live), live).empty
        except Exception:
            return False

    def _run(self) -> None:
        backoff = Retry(Backoff(initial=self._opts.backoff_initial, maximum=self._opts.backoff_max))
        while not self._stop.is_set():
            try:
                self._read_node()
                break
            except Exception as exc:  # never let the publisher thread die: retry everything
                self.progress.failed(exc)
                self._stop.wait(backoff.next(retry_after(exc)))
        backoff.reset()
        rv = ""
        while not self._stop.is_set():
            try:
                rv = self._cache.relist()
                break
            except Exception as exc:
                self.progress.failed(exc)
                self._stop.wait(backoff.next(retry_after(exc)))
        if self._stop.is_set():
            return
        self._cache.start_watch(rv)
        backoff.reset()
        relist, resets = False, 0
        while self._wait_due():
            try:
                if relist:
                    self._cache.relist()
                    relist = False
                if self._cache.resets != resets:  # a restored server's Node may be a new one
                    self._read_node()
                    resets = self._cache.resets
                self._sync_once()
                self._confirmed()
                backoff.reset()
            except Exception as exc:  # a publisher must survive anything the API or caller throws
                if isinstance(exc, ApiError) and self._fallbacks.refused(exc, self._get_devices()):
                    continue
                relist = isinstance(exc, (Conflict, NotFound))
                delay = backoff.next(retry_after(exc))
                self.progress.failed(exc)
                with self._cond:
                    self._retry_at = time.monotonic() + delay
                    self._mark_dirty()

    def _read_node(self) -> None:
        """The Node's UID, which owns the slices: at start, and again after the server's history
        went back (`LiveSlices.resets`), where the kubelet may have registered the Node anew (a
        server started empty): slices owned by the old UID would be garbage-collected for ever."""
        ref = self._api.get_node(self._node)
        with self._cond:
            self._node_uid = ref.uid

    def _confirmed(self) -> None:
        """A sync left the live slices equal to the desired ones: published, if the watch keeps
        the cache it compared with current (a stale copy confirms nothing). Under the condition,
        as the watch's failure is told, so that the two cannot cross."""
        with self._cond:
            if self._cache.current:
                self.progress.published()

    def _wait_due(self) -> bool:
        """Block until a sync is due; False when stopping."""
        opts = self._opts
        next_resync = time.monotonic() + opts.resync_period
        with self._cond:
            while not self._stop.is_set():
                now = time.monotonic()
                if not self._dirty and now >= next_resync:
                    self._mark_dirty()
                if self._dirty:
                    due = max(
                        self._dirty_since + opts.debounce,
                        self._last_write + opts.min_write_interval,
                        self._retry_at,
                    )
                    if now >= due:
                        self._dirty = False
                        return True
                    self._cond.wait(due - now)
                else:
                    self._cond.wait(next_resync - now)
            return False

    def _sync_once(self) -> None:
        devices = self._get_devices()
        with self._cond:
            live = self._cache.snapshot()
            self._stats.syncs += 1
            inputs = (self._fallbacks.key(), self._node_uid, live, devices)  # everything the plan depends on
            if inputs == self._agreed:  # cheap when unchanged: the same objects compare by identity
                self._cond.notify_all()
                return
        p = plan(self._desired(devices, live), live)
        if p.empty:
            with self._cond:
                self._agreed = inputs
                self._cond.notify_all()
            return
        log.info(
            "publishing pool %s generation %d: %d delete(s), %d update(s), %d create(s)",
            self._node,
            p.generation,
            len(p.deletes),
            len(p.updates),
            len(p.creates),
        )
        with self._cond:
            self._writing = True
        try:
            for name, rv in p.deletes:
                self._api.delete_slice(name, rv or None)
                with self._cond:
                    self._count("deletes")
                    self._cache.remove(name)
            for body in p.updates:
                try:
                    self._stored("updates", body, self._api.update_slice(body))
                except NotFound:
                    self._recreate(body)
            for body in p.creates:
                self._stored("creates", body, self._api.create_slice(body))
        finally:
            with self._cond:
                self._writing = False
                self._last_write = time.monotonic()
                self._cond.notify_all()

    def _recreate(self, body: dict[str, Any]) -> None:
        """A slice the cache holds is gone from the server (deleted before its watch event came,
        or a server restored from a backup without it): create it under its name instead of
        listing and planning again, so that no update is sent for a slice that is not there."""
        meta = metadata(body)
        name = str(meta.get("name"))
        log.info("slice %s is gone from the API server; creating it again", name)
        with self._cond:
            self._cache.remove(name)
        kept = {k: meta[k] for k in ("name", "labels", "annotations", "ownerReferences") if k in meta}
        self._stored("creates", body, self._api.create_slice({**body, "metadata": kept}))

    def _count(self, kind: str) -> None:
        """Count one write. Caller holds _cond, and updates the cache in the same critical
        section, so that no reader sees the new state with the old counts."""
        setattr(self._stats, kind, getattr(self._stats, kind) + 1)
        self._stats.writes += 1

    def _stored(self, kind: str, sent: dict[str, Any], stored: dict[str, Any]) -> None:
        name = metadata(stored).get("name")
        with self._cond:
            self._count(kind)
            if not isinstance(name, str):
                raise ApiError("server returned a slice without metadata.name", retryable=True)
            self._cache.put(name, stored)
        self._fallbacks.check(sent, stored)
