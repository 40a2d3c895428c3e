"""This node's ResourceSlices as the server holds them: listed, then kept current by a watch.

The publisher plans against this cache instead of listing before every sync, so a steady state
costs no API reads; the watch makes slices that someone else deleted or changed wake the
publisher within moments. Writes the publisher made are put in at once (their watch events come
later), and resourceVersions decide which copy is newer, so a late event never undoes a write.

A list is read without the lock held, so the watch goes on applying events while it is in
flight; merging the list must not undo them either. A changed slice carries its newer
resourceVersion, but a deleted one leaves nothing behind: the deletions seen while a list is in
flight are remembered (with their resourceVersions) until it is merged, so that one after the
list's snapshot is not put back from it. The list is a consistent read, so a deletion seen before
it was asked for is already missing from it. Of two lists in flight at once, the older answer
is dropped if the newer one was merged first.

A consistent list answers at a resourceVersion no lower than any the cache had met when it was
asked (a list, an event, one of our writes). One that answers lower comes from a server whose
history went back: etcd restored from a backup keeps the backup's objects with their old
versions and numbers on from there, or an API server started empty numbers from the start. The
cache then holds versions that server never had, so "newer wins" would keep them against it
for ever (updates refused with 404 or 409, lists dropped as old). Such a list resets the cache:
it is taken as it is, with a WARNING line that says so, and `resets` counts it. A list asked
before a reset answers for the server before it, and is dropped.

The cache is `current` from a list until the watch fails: a sync that agrees with it then confirms
nothing (`driver.slices.progress`). Every failed watch and list is reported (`failed`), except a
410 Gone: a resourceVersion that left the server's history is how a watch ends, not a failure.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from driver.backoff import Backoff, Retry
from driver.kube.api import ApiError, KubeAPI, retry_after
from driver.kube.watch import Watch
from driver.slices.build import metadata

log = logging.getLogger(__name__)


def resource_version(obj: Mapping[str, Any]) -> int | None:
    """resourceVersion as a number, when the server uses numbers (every real one does).

    Used only to drop stale watch events; when RVs are not numeric every event is applied.
    """
    rv = metadata(obj).get("resourceVersion")
    return int(rv) if isinstance(rv, str) and rv.isdigit() else None


class LiveSlices:
    """The live slices of one node and driver, and the "slice-watch" thread that keeps them.

    Shares the publisher's condition: every change is made under it and reported by calling
    `changed` (still under it), which is how the publisher learns it must compare again. The
    publisher's worker lists (`relist`) and records its own writes (`put`, `remove`); the watch
    thread applies events and lists again when the watch fails, reporting each failure to `failed`.
    """

    def __init__(
        self,
        api: KubeAPI,
        node_name: str,
        driver_name: str,
        cond: threading.Condition,
        changed: Callable[[], None],
        stop: threading.Event,
        backoff: Backoff,
        watch_timeout: int,
        failed: Callable[[BaseException], None],
    ) -> None:
        self._api = api
        self._node = node_name
        self._driver = driver_name
        self._cond = cond
        self._changed = changed
        self._stop = stop
        self._backoff = backoff
        self._watch_timeout = watch_timeout
        self._failed = failed
        # Guarded by _cond:
        self._live: dict[str, dict[str, Any]] = {}
        self._list_rv: int | None = None
        self._seen_rv: int | None = None  # the highest resourceVersion met: lists, events, our writes
        self._relists = 0  # lists in flight
        self._deleted: dict[str, int] = {}  # name -> resourceVersion of deletions seen meanwhile
        self.listed = False
        self.current = False  # listed, and the watch has not failed since
        self.watch_restarts = 0  # times the watch was opened again after it ended or failed
        self.resets = 0  # times a list showed the server's history gone back (module docstring)
        self._watch: Watch | None = None
        self._thread: threading.Thread | None = None

    def snapshot(self) -> list[dict[str, Any]]:
        with self._cond:
            return list(self._live.values())

    def start_watch(self, rv: str) -> None:
        """Follow changes from the list at `rv` in the "slice-watch" thread."""
        self._thread = threading.Thread(target=self._watch_loop, args=(rv,), name="slice-watch", daemon=True)
        self._thread.start()

    def stop_watch(self) -> None:
        """End an open watch at once (the shared stop event must be set first)."""
        with self._cond:
            watch = self._watch
        if watch is not None:
            watch.stop()

    def join(self, timeout: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def put(self, name: str, obj: dict[str, Any]) -> bool:
        """Cache `obj` unless the cache already holds a newer version. Caller holds the condition."""
        cur = self._live.get(name)
        new_rv = resource_version(obj)
        if cur is not None and new_rv is not None and (resource_version(cur) or -1) >= new_rv:
            return False
        self._live[name] = obj
        self._saw(new_rv)
        return True

    def _saw(self, rv: int | None) -> None:
        """The server has reached `rv`: a later consistent list answers at no lower one. Caller
        holds the condition."""
        if rv is not None and (self._seen_rv is None or rv > self._seen_rv):
            self._seen_rv = rv

    def remove(self, name: str) -> None:
        """A slice this process deleted. Caller holds the condition."""
        self._live.pop(name, None)

    def relist(self) -> str:
        """List the slices again; returns the list's resourceVersion to watch from."""
        with self._cond:
            self._relists += 1
            asked = (self._seen_rv, self.resets)
        try:
            items, rv = self._api.list_slices(self._node, self._driver)
            with self._cond:
                self._merge(items, int(rv) if rv.isdigit() else None, *asked)
        finally:
            with self._cond:
                self._relists -= 1
                if not self._relists:
                    self._deleted.clear()
        return rv

    def _merge(self, items: list[dict[str, Any]], list_rv: int | None, seen_rv: int | None, resets: int) -> None:
        """Make the listed slices the cache, keeping what happened after the list's snapshot;
        `seen_rv` and `resets` are what the cache had when the list was asked. Caller holds the
        condition."""
        if resets != self.resets:
            return  # asked of the server as it was before its history went back
        if list_rv is not None and seen_rv is not None and list_rv < seen_rv:
            log.warning(
                "the API server's resourceVersion went back from %d to %d (etcd restored from a backup, "
                "or an API server started empty?): forgetting the %d cached slice(s) and taking its list",
                seen_rv,
                list_rv,
                len(self._live),
            )
            self._live, self._list_rv, self._seen_rv = {}, None, None
            self._deleted.clear()
            self.resets += 1
        elif list_rv is not None and self._list_rv is not None and list_rv < self._list_rv:
            return  # a newer list was merged meanwhile: this one has nothing it lacks
        fresh = {}
        for obj in items:
            name = metadata(obj).get("name")
            if not isinstance(name, str):
                continue
            deleted_rv = self._deleted.get(name)
            if list_rv is not None and deleted_rv is not None and deleted_rv > list_rv:
                continue  # the watch saw it deleted after the list's snapshot
            fresh[name] = obj
        # Keep what the watch or our own writes delivered after the list's snapshot.
        for name, obj in self._live.items():
            obj_rv = resource_version(obj)
            if list_rv is not None and obj_rv is not None and obj_rv > list_rv:
                cur = fresh.get(name)
                if cur is None or (resource_version(cur) or -1) < obj_rv:
                    fresh[name] = obj
        self._live = fresh
        self._list_rv = list_rv
        self._saw(list_rv)
        self.listed = self.current = True
        self._changed()

    def _watch_loop(self, rv: str) -> None:
        backoff = Retry(self._backoff)
        first = True
        while not self._stop.is_set():
            opened = time.monotonic()
            try:
                if not first:
                    with self._cond:
                        self.watch_restarts += 1
                first = False
                watch = self._api.watch_slices(self._node, self._driver, rv, self._watch_timeout)
                with self._cond:
                    self._watch = watch
                if self._stop.is_set():
                    watch.stop()
                    return
                for etype, obj in watch:
                    obj_rv = metadata(obj).get("resourceVersion")
                    if isinstance(obj_rv, str) and obj_rv:
                        rv = obj_rv
                    if etype in ("ADDED", "MODIFIED", "DELETED"):
                        self._apply_event(etype, obj)
            except Exception as exc:
                if self._stop.is_set():
                    return
                if time.monotonic() - opened >= 1.0:
                    # A watch that worked failed: a new outage, whose first list is not to wait as
                    # long as the last one's did (a health check would see the broken watch, not
                    # the unreachable server, for seconds).
                    backoff.reset()
                with self._cond:  # the publisher's confirmations see both at once
                    self.current = False
                    if isinstance(exc, ApiError) and exc.status == 410:
                        log.info("ResourceSlice watch expired (%s); listing again", exc)
                    else:
                        self._failed(exc)
                rv = self._relist_until_listed(backoff, exc)
                continue
            # The server ended the watch. Resume from the last version seen; a server that keeps
            # closing watches at once must not turn this into a busy loop.
            if time.monotonic() - opened < 1.0:
                self._stop.wait(backoff.next())
            else:
                backoff.reset()

    def _relist_until_listed(self, backoff: Retry, exc: BaseException) -> str:
        """After a failed watch: list again, with backoff, until a list succeeds; its version.

        Only a list makes the cache `current` again. A watch resumed from the last version seen
        instead (a list failed, then the server came back) can run for its whole timeout while the
        cache stays not current, and it resumes without a list when it ends: the publisher
        confirmed nothing for as long, and the node stayed degraded (a real kube-apiserver,
        restarted, accepts that version when nothing was written meanwhile)."""
        while True:
            self._stop.wait(backoff.next(retry_after(exc)))
            if self._stop.is_set():
                return ""
            try:
                return self.relist()
            except Exception as list_exc:
                self._failed(list_exc)
                exc = list_exc

    def _apply_event(self, etype: str, obj: dict[str, Any]) -> None:
        name = metadata(obj).get("name")
        if not isinstance(name, str):
            log.warning("ignoring watch event for a slice without a name")
            return
        obj_rv = resource_version(obj)
        with self._cond:
            if self._list_rv is not None and obj_rv is not None and obj_rv <= self._list_rv:
                return  # already part of the last list
            if etype == "DELETED":
                self._saw(obj_rv)
                if self._relists and obj_rv is not None:
                    self._deleted[name] = obj_rv  # for the lists in flight to merge (`relist`)
                if self._live.pop(name, None) is None:
                    return
            elif not self.put(name, obj):
                return
            self._changed()
