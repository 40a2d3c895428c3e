"""The node's devices as ResourceSlices: pure building, splitting and diffing, and the publisher.

The pure half (`build_slices`, `slice_spec_equal`, `plan`) turns a device list and the slices
the server holds into the minimal set of writes; the `SlicePublisher` thread only feeds it and
carries the writes out through `KubeAPI`. It follows the Go `resourceslice` controller
(kubelet-contract.md §6) where that matters to consumers: one pool per node, generation bumps,
delete-then-update-then-create, semantic comparison.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from kubernetes.utils import parse_quantity

from driver.backoff import Backoff, Retry
from driver.kubeapi import ApiError, Conflict, KubeAPI, NotFound, SliceWatch
from driver.model import NUMA_NODE, Device, attribute_to_api

log = logging.getLogger(__name__)

API_VERSION = "resource.k8s.io/v1"
MAX_DEVICES_PER_SLICE = 128
# Limit for a slice in which any device has taints, consumesCounters or a list-typed attribute.
MAX_DEVICES_ADVANCED = 64
# generateName longer than this is cut by the apiserver (63 - 5 random characters).
_MAX_GENERATE_NAME = 58

_LIST_KEYS = ("bools", "ints", "strings", "versions")
# Attributes whose list form has a meaningful scalar form (its first element): the standard
# numaNode publishes the device's own node first (kubelet-contract.md §7). Other list attributes
# have no scalar meaning and are dropped when the server cannot store lists.
SCALAR_CAPABLE_LIST_ATTRIBUTES = frozenset({NUMA_NODE})

# (device name, taint key, taint value, taint effect) -> timeAdded as stored by the server.
TaintTimes = Mapping[tuple[str, str, str, str], str]


# -- building ------------------------------------------------------------------------------------


def _now_rfc3339() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def device_to_api(device: Device, taint_times: TaintTimes, now: str) -> dict[str, Any]:
    out: dict[str, Any] = {"name": device.name}
    if device.attributes:
        out["attributes"] = {k: attribute_to_api(v) for k, v in sorted(device.attributes.items())}
    if device.capacity:
        out["capacity"] = {k: {"value": v} for k, v in sorted(device.capacity.items())}
    if device.taints:
        taints = []
        for t in device.taints:
            api_taint: dict[str, Any] = {"key": t.key, "effect": str(t.effect)}
            if t.value:
                api_taint["value"] = t.value
            api_taint["timeAdded"] = taint_times.get((device.name, t.key, t.value, str(t.effect)), now)
            taints.append(api_taint)
        out["taints"] = taints
    return out


def uses_advanced_features(api_device: Mapping[str, Any]) -> bool:
    """Whether the device lowers its slice's limit to 64 (taints, counters, list attributes)."""
    if api_device.get("taints") or api_device.get("consumesCounters"):
        return True
    return any(k in _LIST_KEYS for attr in (api_device.get("attributes") or {}).values() for k in attr)


def split_devices(api_devices: Sequence[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Cut the (sorted) devices into slices within the per-slice limits.

    Devices are cut into fixed blocks of 64; blocks 2k and 2k+1 share one slice of up to 128
    when neither holds an advanced device. Plain pools therefore pack 128 per slice, and a
    device gaining a taint (the common change: health) only splits its own pair of blocks
    instead of shifting every later slice, as greedy packing would. Always at least one slice:
    an empty pool is published as one empty slice.
    """
    blocks = [list(api_devices[i : i + MAX_DEVICES_ADVANCED]) for i in range(0, len(api_devices), 64)]
    chunks: list[list[dict[str, Any]]] = []
    for i in range(0, len(blocks), 2):
        pair = blocks[i : i + 2]
        if len(pair) == 2 and not any(uses_advanced_features(d) for b in pair for d in b):
            chunks.append(pair[0] + pair[1])
        else:
            chunks.extend(pair)
    return chunks or [[]]


def generate_name(node_name: str, driver_name: str, index: int = 0, count: int = 1) -> str:
    """`<index in hex>-<driver>-<node>-` as the Go kubeletplugin library names slices (the
    allocator sorts slices by name), made a valid DNS-subdomain prefix the apiserver will not cut."""
    width = max(5, len(f"{max(count - 1, 0):x}"))
    raw = f"{index:0{width}x}-{driver_name}-{node_name}".lower()
    name = re.sub(r"[^a-z0-9.-]", "-", raw).strip(".-") or "slice"
    return name[: _MAX_GENERATE_NAME - 1].rstrip(".-") + "-"


def owner_reference(node_name: str, node_uid: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Node", "name": node_name, "uid": node_uid, "controller": True}


def build_slices(
    devices: Sequence[Device],
    driver_name: str,
    node_name: str,
    node_uid: str,
    generation: int,
    *,
    taint_times: TaintTimes | None = None,
    now: str | None = None,
) -> list[dict[str, Any]]:
    """The node's pool as complete ResourceSlice bodies (camelCase, ready to POST).

    `taint_times` carries the timeAdded the server holds for taints that are already published,
    so that a taint keeps the time it first appeared; new taints get `now`.
    """
    stamp = now or _now_rfc3339()
    times = taint_times or {}
    api_devices = [device_to_api(d, times, stamp) for d in sorted(devices, key=lambda d: d.name)]
    chunks = split_devices(api_devices)
    owners = [owner_reference(node_name, node_uid)]
    return [
        {
            "apiVersion": API_VERSION,
            "kind": "ResourceSlice",
            "metadata": {
                "generateName": generate_name(node_name, driver_name, i, len(chunks)),
                "ownerReferences": list(owners),
            },
            "spec": {
                "driver": driver_name,
                "nodeName": node_name,
                "pool": {"name": node_name, "generation": generation, "resourceSliceCount": len(chunks)},
                "devices": chunk,
            },
        }
        for i, chunk in enumerate(chunks)
    ]


def taint_times_of(live_slices: Sequence[Mapping[str, Any]]) -> dict[tuple[str, str, str, str], str]:
    """timeAdded of every published taint, to be kept when the slice is rewritten."""
    times: dict[tuple[str, str, str, str], str] = {}
    for obj in live_slices:
        for dev in _devices(obj.get("spec")):
            for t in dev.get("taints") or []:
                if isinstance(t, dict) and isinstance(t.get("timeAdded"), str):
                    key = (dev.get("name"), t.get("key"), t.get("value") or "", t.get("effect"))
                    times[key] = t["timeAdded"]  # type: ignore[index]
    return times


def scalar_attributes(device: Device, scalar_capable: Collection[str]) -> Device:
    """The device as a server without list-typed attributes can store it.

    A scalar-capable list attribute keeps its first element; any other list attribute is dropped.
    """
    attrs = {}
    for name, value in device.attributes.items():
        if not isinstance(value, tuple):
            attrs[name] = value
        elif value and name in scalar_capable:
            attrs[name] = value[0]
    if attrs == device.attributes:
        return device
    return dataclasses.replace(device, attributes=attrs)


# -- comparing -----------------------------------------------------------------------------------


def _devices(spec: object) -> list[dict[str, Any]]:
    if not isinstance(spec, dict):
        return []
    devices = spec.get("devices") or []
    return [d for d in devices if isinstance(d, dict)] if isinstance(devices, list) else []


def _prune(value: Any) -> Any:
    """Drop None, {} and [] recursively: the server omits them (omitempty), we may not."""
    if isinstance(value, dict):
        pruned = {k: _prune(v) for k, v in value.items()}
        return {k: v for k, v in pruned.items() if v is not None and v != {} and v != []}
    if isinstance(value, list):
        return [_prune(v) for v in value]
    return value


def _quantity(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return parse_quantity(value)
        except ValueError:
            return value
    return value


def _canon_device(dev: Mapping[str, Any]) -> Any:
    out = dict(_prune(dict(dev)))
    if isinstance(out.get("capacity"), dict):
        out["capacity"] = {
            k: {**c, "value": _quantity(c.get("value"))} if isinstance(c, dict) else c
            for k, c in out["capacity"].items()
        }
    if isinstance(out.get("taints"), list):
        out["taints"] = [
            (t.get("key"), t.get("value") or "", t.get("effect")) if isinstance(t, dict) else t for t in out["taints"]
        ]
    return out


def _canon_devices(spec: object) -> list[Any]:
    return [_canon_device(d) for d in _devices(spec)]


def _canon_spec(spec: object) -> Any:
    if not isinstance(spec, dict):
        return None
    out = dict(_prune(dict(spec)))
    out["devices"] = _canon_devices(spec)
    if out.get("allNodes") is False:
        del out["allNodes"]
    return out


def slice_spec_equal(desired: Mapping[str, Any], live: Mapping[str, Any]) -> bool:
    """Semantic equality of two slice specs, as the server would see them.

    Quantities compare by value ("1024Mi" == "1Gi": the server canonicalises them), taint
    timeAdded is ignored (the server sets it, we keep it), and absent, null and empty fields are
    equal. Device order counts: it is the order consumers see.
    """
    return _canon_spec(dict(desired)) == _canon_spec(dict(live))


# -- planning ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    """Writes that bring the live pool to the desired one, in the order they must be done."""

    generation: int
    deletes: list[tuple[str, str]] = field(default_factory=list)  # (name, resourceVersion)
    updates: list[dict[str, Any]] = field(default_factory=list)  # full bodies with name + RV
    creates: list[dict[str, Any]] = field(default_factory=list)  # full bodies with generateName

    @property
    def empty(self) -> bool:
        return not (self.deletes or self.updates or self.creates)

    @property
    def writes(self) -> int:
        return len(self.deletes) + len(self.updates) + len(self.creates)


def _generation(obj: Mapping[str, Any]) -> int:
    pool = (obj.get("spec") or {}).get("pool") or {}
    gen = pool.get("generation")
    return gen if isinstance(gen, int) and not isinstance(gen, bool) else -1


def _meta(obj: Mapping[str, Any]) -> dict[str, Any]:
    meta = obj.get("metadata")
    return meta if isinstance(meta, dict) else {}


def _with_pool(body: dict[str, Any], generation: int, count: int) -> dict[str, Any]:
    spec = dict(body["spec"])
    spec["pool"] = {**spec["pool"], "generation": generation, "resourceSliceCount": count}
    return {**body, "spec": spec}


def _device_names(obj: Mapping[str, Any]) -> set[str]:
    return {d.get("name") for d in _devices(obj.get("spec")) if isinstance(d.get("name"), str)}


def plan(desired: Sequence[dict[str, Any]], live: Sequence[Mapping[str, Any]]) -> Plan:
    """The minimal writes that turn `live` (this node's slices of this driver) into `desired`.

    `desired` comes from `build_slices`; its pool generation and count are decided here.
    Matching reuses live slices: first those whose devices are already exactly right, then by
    the largest overlap of device names, so that a steady state plans nothing and one changed
    device plans one update. Unmatched live slices, slices of an older generation or another
    pool are deleted; missing ones are created.

    Generation (kubelet-contract.md §6.3 step 6): consumers use only the slices with the highest
    generation and count them against resourceSliceCount. One rewritten slice is atomic, so the
    generation can stay. When new slices appear or several change, a consumer could see some
    old and some new slices at the same generation (a device moved between slices would show
    twice or not at all); a higher generation in all of them makes it ignore the old ones until
    the set is complete. The bump rewrites every kept slice, so it is done only then.
    """
    if not desired:
        raise ValueError("desired pool has no slices (build_slices always returns at least one)")
    pool_name = desired[0]["spec"]["pool"]["name"]
    asked = max(_generation(d) for d in desired)
    owners = desired[0]["metadata"].get("ownerReferences")

    current = max((_generation(obj) for obj in live), default=0)
    candidates: list[Mapping[str, Any]] = []
    deletes: list[tuple[str, str]] = []
    for obj in sorted(live, key=lambda o: str(_meta(o).get("name", ""))):
        meta = _meta(obj)
        name = meta.get("name")
        if not isinstance(name, str) or not name:
            continue
        pool = (obj.get("spec") or {}).get("pool") or {}
        if pool.get("name") == pool_name and _generation(obj) == current:
            candidates.append(obj)
        else:
            deletes.append((name, str(meta.get("resourceVersion") or "")))

    matched: dict[int, Mapping[str, Any]] = {}
    for i, body in enumerate(desired):
        want = _canon_devices(body["spec"])
        for obj in candidates:
            if _canon_devices(obj.get("spec")) == want:
                matched[i] = obj
                candidates.remove(obj)
                break
    for i, body in enumerate(desired):
        if i in matched or not candidates:
            continue
        names = _device_names(body)
        best = max(candidates, key=lambda o: len(names & _device_names(o)))
        matched[i] = best
        candidates.remove(best)
    deletes += [(str(_meta(o)["name"]), str(_meta(o).get("resourceVersion") or "")) for o in candidates]

    count = len(desired)
    missing = [i for i in range(count) if i not in matched]

    def changed(i: int, generation: int) -> bool:
        obj = matched[i]
        want = _with_pool(desired[i], generation, count)
        same_owner = _prune(_meta(obj).get("ownerReferences")) == _prune(owners)
        return not (same_owner and slice_spec_equal(want["spec"], obj.get("spec") or {}))

    changed_now = [i for i in matched if changed(i, current)]
    if asked > current:
        generation = asked
    elif not missing and len(changed_now) <= 1:
        generation = current
    else:
        generation = current + 1
    to_update = sorted(matched) if generation != current else changed_now

    updates = []
    for i in to_update:
        body = _with_pool(desired[i], generation, count)
        meta = {**_meta(matched[i]), "ownerReferences": owners}
        meta.pop("managedFields", None)
        updates.append({**body, "metadata": meta})
    creates = [_with_pool(desired[i], generation, count) for i in missing]
    return Plan(generation=generation, deletes=deletes, updates=updates, creates=creates)


def list_attributes_dropped(sent: Mapping[str, Any], stored: Mapping[str, Any]) -> bool:
    """Whether the server silently dropped list-typed attribute values we sent.

    An apiserver with DRAListTypeAttributes off keeps the attribute key but drops the list, so
    the stored attribute has no value at all.
    """
    stored_devices = {d.get("name"): d for d in _devices(stored.get("spec"))}
    for dev in _devices(sent.get("spec")):
        back = stored_devices.get(dev.get("name"))
        back_attrs = (back or {}).get("attributes") or {}
        for name, attr in (dev.get("attributes") or {}).items():
            for key in _LIST_KEYS:
                if attr.get(key) and not (back_attrs.get(name) or {}).get(key):
                    return True
    return False


def taints_dropped(sent: Mapping[str, Any], stored: Mapping[str, Any]) -> bool:
    """Whether the server silently dropped device taints we sent (DRADeviceTaints off, or a
    server too old to know them): desired and live would then never agree."""
    stored_devices = {d.get("name"): d for d in _devices(stored.get("spec"))}
    return any(
        dev.get("taints") and not (stored_devices.get(dev.get("name")) or {}).get("taints")
        for dev in _devices(sent.get("spec"))
    )


# -- the publisher -------------------------------------------------------------------------------


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
    errors: int = 0
    watch_restarts: int = 0  # times the watch was opened again after it ended or failed
    skipped_devices: int = 0  # devices left out because the API cannot represent them


def _rv(obj: Mapping[str, Any]) -> int | None:
    """resourceVersion as a number, when the server uses numbers (every real one does).

    Used only to drop stale watch events; when RVs are not numeric every event is applied.
    """
    rv = _meta(obj).get("resourceVersion")
    return int(rv) if isinstance(rv, str) and rv.isdigit() else None


class SlicePublisher:
    """Keeps this node's ResourceSlices equal to `get_devices()`, writing only what changed.

    Two threads: a worker that resolves the Node, lists, and syncs (coalesced, rate-limited,
    retried with backoff), and a watcher that keeps a cache of the live slices from a watch, so
    that slices deleted or changed by someone else wake the worker within moments. API errors
    are logged and retried forever; nothing here exits because the API server misbehaves.
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
        # Guarded by _cond:
        self._live: dict[str, dict[str, Any]] = {}
        self._list_rv: int | None = None
        self._listed = False
        self._node_uid: str | None = None
        self._dirty = True
        self._dirty_since = 0.0
        self._retry_at = 0.0
        self._last_write = float("-inf")
        self._list_mode = True
        self._taint_mode = True
        self._stats = PublisherStats()
        self._skipped: set[str] = set()
        self._writing = False
        self._watch: SliceWatch | None = None
        self._worker: threading.Thread | None = None
        self._watcher: threading.Thread | None = None

    # -- public ----------------------------------------------------------------------------

    def start(self) -> None:
        self._worker = threading.Thread(target=self._run, name="slice-publisher", daemon=True)
        self._worker.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop both threads. Deletes nothing: slices outlive a driver restart on purpose."""
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
            watch = self._watch
        if watch is not None:
            watch.stop()
        for thread in (self._worker, self._watcher):
            if thread is not None:
                thread.join(timeout)

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
        with self._cond:
            return dataclasses.replace(self._stats)

    @property
    def list_attributes_active(self) -> bool:
        """False once the server was seen dropping list-typed attributes (scalar fallback)."""
        with self._cond:
            return self._list_mode

    # -- worker ----------------------------------------------------------------------------

    def _mark_dirty(self) -> None:
        if not self._dirty:
            self._dirty = True
            self._dirty_since = time.monotonic()
        self._cond.notify_all()

    def _desired(self, live: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        devices = [d for d in self._get_devices() if self._publishable(d)]
        if not self._list_mode:
            devices = [scalar_attributes(d, self._opts.scalar_capable_attributes) for d in devices]
        if not self._taint_mode:
            devices = [dataclasses.replace(d, taints=()) if d.taints else d for d in devices]
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
            if not self._listed or self._node_uid is None or self._writing:
                return False
            live = list(self._live.values())
        try:
            return plan(self._desired(live), live).empty
        except Exception:
            return False

    def _run(self) -> None:
        backoff = Retry(Backoff(initial=self._opts.backoff_initial, maximum=self._opts.backoff_max))
        while not self._stop.is_set():
            try:
                ref = self._api.get_node(self._node)
                with self._cond:
                    self._node_uid = ref.uid
                break
            except Exception as exc:  # never let the publisher thread die: retry everything
                log.warning("resolving node %s failed (will retry): %s", self._node, exc)
                self._stop.wait(backoff.next())
        backoff.reset()
        rv = ""
        while not self._stop.is_set():
            try:
                rv = self._relist()
                break
            except Exception as exc:
                log.warning("listing ResourceSlices failed (will retry): %s", exc)
                self._stop.wait(backoff.next())
        if self._stop.is_set():
            return
        self._watcher = threading.Thread(target=self._watch_loop, args=(rv,), name="slice-watch", daemon=True)
        self._watcher.start()
        backoff.reset()
        relist = False
        while self._wait_due():
            try:
                if relist:
                    self._relist()
                    relist = False
                self._sync_once()
                backoff.reset()
            except Exception as exc:  # a publisher must survive anything the API or caller throws
                if isinstance(exc, ApiError) and self._lists_rejected(exc):
                    continue
                relist = isinstance(exc, (Conflict, NotFound))
                delay = backoff.next()
                log.warning("publishing ResourceSlices failed (retry in %.1fs): %s", delay, exc)
                with self._cond:
                    self._stats.errors += 1
                    self._retry_at = time.monotonic() + delay
                    self._mark_dirty()

    def _lists_rejected(self, exc: ApiError) -> bool:
        """Switch to scalar attributes if the server refused our list-typed ones.

        A server with DRAListTypeAttributes off drops the list value and then rejects the
        now-empty attribute with "exactly one value must be specified" (resource-api.md §2.4).
        """
        if not (self._list_mode and exc.status == 422 and "exactly one value must be specified" in str(exc)):
            return False
        if not any(isinstance(v, tuple) for d in self._get_devices() for v in d.attributes.values()):
            return False
        self._fall_back_to_scalars()
        return True

    def _stop_publishing_taints(self) -> None:
        with self._cond:
            if not self._taint_mode:
                return
            log.error(
                "the API server does not store device taints (feature gate DRADeviceTaints off?): "
                "unhealthy devices stay schedulable; publishing without taints to avoid endless rewrites"
            )
            self._taint_mode = False
            self._mark_dirty()

    @property
    def taints_active(self) -> bool:
        """False once the server was seen dropping device taints."""
        with self._cond:
            return self._taint_mode

    def _fall_back_to_scalars(self) -> None:
        with self._cond:
            if not self._list_mode:
                return
            log.warning(
                "the API server does not store list-typed device attributes (feature gate "
                "DRAListTypeAttributes off?); publishing scalar attributes instead"
            )
            self._list_mode = False
            self._mark_dirty()

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
        with self._cond:
            live = list(self._live.values())
            self._stats.syncs += 1
        p = plan(self._desired(live), live)
        if p.empty:
            with self._cond:
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
                    self._live.pop(name, None)
            for body in p.updates:
                self._stored("updates", body, self._api.update_slice(body))
            for body in p.creates:
                self._stored("creates", body, self._api.create_slice(body))
        finally:
            with self._cond:
                self._writing = False
                self._last_write = time.monotonic()
                self._cond.notify_all()

    def _count(self, kind: str) -> None:
        """Count one write. Caller holds _cond, and updates the cache in the same critical
        section, so that no reader sees the new state with the old counts."""
        setattr(self._stats, kind, getattr(self._stats, kind) + 1)
        self._stats.writes += 1

    def _stored(self, kind: str, sent: dict[str, Any], stored: dict[str, Any]) -> None:
        name = _meta(stored).get("name")
        with self._cond:
            self._count(kind)
            if not isinstance(name, str):
                raise ApiError("server returned a slice without metadata.name", retryable=True)
            self._put_live(name, stored)
        if self._list_mode and list_attributes_dropped(sent, stored):
            self._fall_back_to_scalars()
        if self._taint_mode and taints_dropped(sent, stored):
            self._stop_publishing_taints()

    def _put_live(self, name: str, obj: dict[str, Any]) -> bool:
        """Cache `obj` unless the cache already holds a newer version. Caller holds _cond."""
        cur = self._live.get(name)
        new_rv = _rv(obj)
        if cur is not None and new_rv is not None and (_rv(cur) or -1) >= new_rv:
            return False
        self._live[name] = obj
        return True

    def _relist(self) -> str:
        items, rv = self._api.list_slices(self._node, self._driver)
        list_rv = int(rv) if rv.isdigit() else None
        with self._cond:
            fresh = {}
            for obj in items:
                name = _meta(obj).get("name")
                if isinstance(name, str):
                    fresh[name] = obj
            # Keep what the watch or our own writes delivered after the list's snapshot.
            for name, obj in self._live.items():
                obj_rv = _rv(obj)
                if list_rv is not None and obj_rv is not None and obj_rv > list_rv:
                    cur = fresh.get(name)
                    if cur is None or (_rv(cur) or -1) < obj_rv:
                        fresh[name] = obj
            self._live = fresh
            self._list_rv = list_rv
            self._listed = True
            self._mark_dirty()
        return rv

    # -- watcher ---------------------------------------------------------------------------

    def _watch_loop(self, rv: str) -> None:
        backoff = Retry(Backoff(initial=self._opts.backoff_initial, maximum=self._opts.backoff_max))
        first = True
        while not self._stop.is_set():
            opened = time.monotonic()
            try:
                if not first:
                    with self._cond:
                        self._stats.watch_restarts += 1
                first = False
                watch = self._api.watch_slices(self._node, self._driver, rv, self._opts.watch_timeout)
                with self._cond:
                    self._watch = watch
                if self._stop.is_set():
                    watch.stop()
                    return
                for etype, obj in watch:
                    obj_rv = _meta(obj).get("resourceVersion")
                    if isinstance(obj_rv, str) and obj_rv:
                        rv = obj_rv
                    if etype in ("ADDED", "MODIFIED", "DELETED"):
                        self._apply_event(etype, obj)
            except Exception as exc:
                if self._stop.is_set():
                    return
                log.info("ResourceSlice watch failed (%s); listing again", exc)
                self._stop.wait(backoff.next())
                try:
                    rv = self._relist()
                except Exception as list_exc:
                    log.warning("listing ResourceSlices failed: %s", list_exc)
                continue
            # The server ended the watch. Resume from the last version seen; a server that keeps
            # closing watches at once must not turn this into a busy loop.
            if time.monotonic() - opened < 1.0:
                self._stop.wait(backoff.next())
            else:
                backoff.reset()

    def _apply_event(self, etype: str, obj: dict[str, Any]) -> None:
        name = _meta(obj).get("name")
        if not isinstance(name, str):
            log.warning("ignoring watch event for a slice without a name")
            return
        obj_rv = _rv(obj)
        with self._cond:
            if self._list_rv is not None and obj_rv is not None and obj_rv <= self._list_rv:
                return  # already part of the last list
            if etype == "DELETED":
                if self._live.pop(name, None) is None:
                    return
            elif not self._put_live(name, obj):
                return
            self._mark_dirty()
