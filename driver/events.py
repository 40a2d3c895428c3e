"""Kubernetes Events (events.k8s.io/v1), where users look for them: `kubectl describe`.

What is reported (docs/deployment.md, 'Events'):

* on the **ResourceClaim**, `Warning PrepareFailed` (action `PrepareResources`) when preparing it
  fails, with the error: `kubectl describe resourceclaim` shows why its pod hangs in
  ContainerCreating (the kubelet puts its own event on the pod);
* on the **Node**, `Warning DeviceUnhealthy` when a device turns unhealthy (with the reason),
  `Normal DeviceHealthy` when it is healthy again, `Normal DeviceCordoned` / `DeviceUncordoned`
  when an SRE cordons or uncordons it, `Warning DeviceRemoved` when a device leaves the published
  set (hot-removed, a driver reload, a MIG reconfiguration). The state at start-up is the
  baseline, not an event: the device's taint already says it. Also `Warning NicNotReturned` when
  an exclusive NIC back from its pod cannot be given back its host name and addresses (once per
  NIC and reason);
* on each prepared **ResourceClaim** holding that device, the same `DeviceUnhealthy` /
  `DeviceHealthy`, in the claim's namespace: the pod's owner can read it there (`kubectl describe
  resourceclaim`), and not those in `default`. Which claims hold a device is the checkpoint's word.

The last failed prepare of each claim (at most `BUCKETS` claims, the oldest forgotten) is also
kept for `tandemctl claim` (`last_failure`): an event may be dropped, or read by nobody.

As client-go's event recorder (k8s.io/client-go/tools/events) does: an event that repeats (same
object, reason, action and note) while the last one is less than `SERIES_WINDOW` old becomes a
series, its `series.count` and `lastObservedTime` patched onto the first object instead of a new
one; each object has a token bucket (`BURST` events, one more every `REFILL` seconds: client-go's
spam filter; as there, the buckets of at most `BUCKETS` objects are kept, the least recently used
forgotten), and what it refuses is dropped and counted. Events go out from a thread of their own
(`events`) through a bounded queue: `emit` never blocks and never raises, so an event is never a
reason to fail or slow a prepare, and an API server that is down costs dropped events only.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Protocol

from driver.kube.api import KubeAPI
from driver.kube.errors import NotFound
from driver.model import Device, Health

log = logging.getLogger(__name__)

API_VERSION = "events.k8s.io/v1"
SERIES_WINDOW = 6 * 60.0  # client-go: a series ends after 6 minutes without a repeat
BURST = 25  # client-go EventSourceObjectSpamFilter: burst 25, refill 1 per 5 minutes
REFILL = 300.0
BUCKETS = 4096  # client-go keeps the spam filter's buckets in an LRU cache of this size
QUEUE = 1000
NOTE_LIMIT = 1024  # the API server's limit on `note`, in bytes (of UTF-8)
_NODE_NAMESPACE = "default"  # events about cluster-scoped objects live here (as the kubelet's)


@dataclass(frozen=True)
class Regarding:
    """The object an event is about."""

    api_version: str
    kind: str
    name: str
    uid: str
    namespace: str = ""

    def to_api(self) -> dict[str, str]:
        out = {"apiVersion": self.api_version, "kind": self.kind, "name": self.name, "uid": self.uid}
        if self.namespace:
            out["namespace"] = self.namespace
        return out


class HeldDevice(Protocol):
    @property
    def device(self) -> str: ...


class Holder(Protocol):
    """A prepared claim as the events need it (`driver.claims.checkpoint.ClaimRecord` is one)."""

    @property
    def namespace(self) -> str: ...
    @property
    def name(self) -> str: ...
    @property
    def devices(self) -> Sequence[HeldDevice]: ...


@dataclass(frozen=True)
class ClaimFailure:
    """A claim's last failed prepare, as `tandemctl claim` shows it."""

    namespace: str
    name: str
    uid: str
    at: float
    error: str


@dataclass(frozen=True)
class Occurrence:
    regarding: Regarding
    type: str  # Normal | Warning
    reason: str
    action: str
    note: str


@dataclass
class _Series:
    namespace: str
    name: str
    count: int
    last: float


@dataclass
class _Bucket:
    tokens: float = BURST
    at: float = field(default_factory=time.monotonic)

    def take(self, now: float) -> bool:
        self.tokens = min(BURST, self.tokens + (now - self.at) / REFILL)
        self.at = now
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True


def micro_time(at: float) -> str:
    """MicroTime, as the API wants `eventTime`: RFC 3339 with microseconds."""
    return datetime.fromtimestamp(at, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class EventRecorder:
    """Sends events from its own thread; `claim_failed`, `nic_not_home` and `inventory_changed` are
    the sources."""

    def __init__(
        self,
        api: KubeAPI,
        driver_name: str,
        node_name: str,
        devices: Callable[[], list[Device]],
        clock: Callable[[], float] = time.time,
        claims: Callable[[], Mapping[str, Holder]] = dict,
    ) -> None:
        """`claims()`: the prepared claims by UID, whose devices' health changes are told on them too."""
        self._api = api
        self._controller = driver_name
        self._node = node_name
        self._devices = devices
        self._claims = claims
        self._clock = clock
        self._failures: collections.OrderedDict[str, ClaimFailure] = collections.OrderedDict()
        self._cond = threading.Condition()
        self._queue: collections.deque[tuple[Occurrence, float]] = collections.deque()
        self._inventory_changed = False
        self._series: dict[Occurrence, _Series] = {}
        # One per object that had events, least recently used first (bounded by BUCKETS): the
        # claims of a long-running node come and go, and so would the memory of a plain dict.
        self._buckets: collections.OrderedDict[Regarding, _Bucket] = collections.OrderedDict()
        self._last_stamp = 0  # nanoseconds of the last event name made: names must not repeat
        self._health: dict[str, tuple[Health, bool]] | None = None  # device -> (health, cordoned)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.sent = 0
        self.dropped = 0

    # -- sources (any thread; never block, never raise) ------------------------------------------

    def claim_failed(self, namespace: str, name: str, uid: str, error: str) -> None:
        regarding = Regarding("resource.k8s.io/v1", "ResourceClaim", name, uid, namespace)
        with self._cond:
            self._failures.pop(uid, None)  # the newest last, so the oldest is forgotten first
            self._failures[uid] = ClaimFailure(namespace, name, uid, self._clock(), error)
            if len(self._failures) > BUCKETS:
                self._failures.popitem(last=False)
        self._put(Occurrence(regarding, "Warning", "PrepareFailed", "PrepareResources", error))

    def binding_failed(self, namespace: str, name: str, uid: str, error: str) -> None:
        """A device of the claim could not be made ready before binding (`driver.claims.binding`):
        the scheduler tries again, elsewhere; the claim's owner reads why here."""
        regarding = Regarding("resource.k8s.io/v1", "ResourceClaim", name, uid, namespace)
        self._put(Occurrence(regarding, "Warning", "BindingFailed", "MakeReadyForBinding", error))

    def last_failure(self, uid: str) -> ClaimFailure | None:
        with self._cond:
            return self._failures.get(uid)

    def failures(self) -> list[ClaimFailure]:
        """The remembered failures, oldest first (`tandemctl claim NAMESPACE/NAME` searches them)."""
        with self._cond:
            return list(self._failures.values())

    def nic_not_home(self, note: str) -> None:
        """An exclusive NIC back from its pod that cannot be given back its host identity
        (`driver.claims.nic.homes`): it keeps the name it came back with, without its addresses."""
        self._put(self._node_event("Warning", "NicNotReturned", "ReturnNic", note))

    def inventory_changed(self) -> None:
        """An inventory subscriber: only wakes the thread, which compares health itself."""
        with self._cond:
            self._inventory_changed = True
            self._cond.notify()

    def _put(self, occurrence: Occurrence) -> None:
        with self._cond:
            if len(self._queue) >= QUEUE:
                self._queue.popleft()
                self.dropped += 1
            self._queue.append((occurrence, self._clock()))
            self._cond.notify()

    # -- the thread ------------------------------------------------------------------------------

    def start(self) -> None:
        self._health = self._snapshot()  # the baseline: what is already so is no event
        self._thread = threading.Thread(target=self._run, name="events", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._cond:
                while not self._queue and not self._inventory_changed and not self._stop.is_set():
                    self._cond.wait()
                changed, self._inventory_changed = self._inventory_changed, False
                batch = list(self._queue)
                self._queue.clear()
            if changed:
                batch += [(o, self._clock()) for o in self._device_events()]
            for occurrence, at in batch:
                try:
                    self._send(occurrence, at)
                except Exception as e:  # an event is never worth more than a log line
                    self._count_dropped()
                    log.info(
                        "event %s on %s/%s not sent: %s",
                        occurrence.reason,
                        occurrence.regarding.kind,
                        occurrence.regarding.name,
                        e,
                    )

    def _snapshot(self) -> dict[str, tuple[Health, bool]]:
        cordoned = f"{self._controller}/cordoned"
        return {d.name: (d.health, any(t.key == cordoned for t in d.taints)) for d in self._devices()}

    def _device_events(self) -> list[Occurrence]:
        """Health and cordon changes since the last look, as Node events (health changes also on
        the claims holding the device), and devices no longer published."""
        now = self._snapshot()
        before, self._health = self._health or {}, now
        devices = {d.name: d for d in self._devices()}
        out = [
            self._node_event("Warning", "DeviceRemoved", "Discovery", f"{name} is no longer published")
            for name in sorted(before.keys() - now.keys())
        ]
        holders: dict[str, list[Regarding]] | None = None  # read once, and only for a health change
        for name, (health, cordoned) in sorted(now.items()):
            was_health, was_cordoned = before.get(name, (Health.HEALTHY, False))
            message = devices[name].health_message if name in devices else ""
            change = None
            if health == Health.UNHEALTHY and was_health != Health.UNHEALTHY:
                change = ("Warning", "DeviceUnhealthy", "HealthCheck", f"{name}: {message}")
            elif health == Health.HEALTHY and was_health == Health.UNHEALTHY:
                change = ("Normal", "DeviceHealthy", "HealthCheck", f"{name} is healthy again")
            if change is not None:
                holders = self._holders() if holders is None else holders
                out.append(self._node_event(*change))
                out += [Occurrence(claim, *change) for claim in holders.get(name, [])]
            if cordoned != was_cordoned:
                reason, what = ("DeviceCordoned", "cordoned") if cordoned else ("DeviceUncordoned", "uncordoned")
                out.append(self._node_event("Normal", reason, "Cordon", f"{name} {what} (tandemctl)"))
        return out

    def _holders(self) -> dict[str, list[Regarding]]:
        """The prepared claims holding each device; none when they cannot be read (logged): an
        event is never worth failing the Node's."""
        out: dict[str, list[Regarding]] = {}
        try:
            claims = self._claims()
        except Exception as e:
            log.info("claims holding devices unknown, their events not sent: %s", e)
            return out
        for uid, c in sorted(claims.items()):
            claim = Regarding("resource.k8s.io/v1", "ResourceClaim", c.name, uid, c.namespace)
            for device in {d.device for d in c.devices}:
                out.setdefault(device, []).append(claim)
        return out

    def _node_event(self, type_: str, reason: str, action: str, note: str) -> Occurrence:
        return Occurrence(Regarding("v1", "Node", self._node, ""), type_, reason, action, note)

    def _send(self, occurrence: Occurrence, at: float) -> None:
        regarding = occurrence.regarding
        if regarding.kind == "Node" and not regarding.uid:
            # Read each time, never remembered: a Node deleted and registered again (or restored
            # from an etcd backup) has another UID, and an event about the old one is about nothing.
            uid = self._api.get_node(self._node).uid
            regarding = Regarding(regarding.api_version, regarding.kind, regarding.name, uid)
            occurrence = Occurrence(regarding, occurrence.type, occurrence.reason, occurrence.action, occurrence.note)
        for key in [k for k, s in self._series.items() if at - s.last > SERIES_WINDOW]:
            del self._series[key]
        if not self._bucket(regarding).take(time.monotonic()):
            self._count_dropped()
            return
        series = self._series.get(occurrence)
        if series is not None:
            series.count += 1
            series.last = at
            patch = {"series": {"count": series.count, "lastObservedTime": micro_time(at)}}
            try:
                self._api.patch_event(series.namespace, series.name, patch)
            except NotFound:  # expired (the server keeps events an hour), deleted, or etcd restored
                del self._series[occurrence]
                series = None
        if series is None:
            body = self._body(occurrence, at)
            self._api.create_event(body["metadata"]["namespace"], body)
            self._series[occurrence] = _Series(body["metadata"]["namespace"], body["metadata"]["name"], 1, at)
        with self._cond:
            self.sent += 1

    def _bucket(self, regarding: Regarding) -> _Bucket:
        """The object's token bucket, now the most recently used; a new one may evict the least."""
        if regarding in self._buckets:
            self._buckets.move_to_end(regarding)
        else:
            self._buckets[regarding] = _Bucket()
            if len(self._buckets) > BUCKETS:
                self._buckets.popitem(last=False)
        return self._buckets[regarding]

    def _name(self, regarding: Regarding, at: float) -> str:
        """client-go's event name: the object's name and the time in nanoseconds, in hex. Go's
        clock tells apart events made in one loop; time.time() often does not, and a name given
        twice is a 409 and a lost event, so the time is made to increase with every name."""
        self._last_stamp = max(int(at * 1e9), self._last_stamp + 1)
        return f"{regarding.name[:230]}.{self._last_stamp:x}"

    def _count_dropped(self) -> None:
        with self._cond:
            self.dropped += 1

    def _body(self, o: Occurrence, at: float) -> dict[str, Any]:
        namespace = o.regarding.namespace or _NODE_NAMESPACE
        note = _truncated(o.note)
        return {
            "apiVersion": API_VERSION,
            "kind": "Event",
            "metadata": {"name": self._name(o.regarding, at), "namespace": namespace},
            "eventTime": micro_time(at),
            "reportingController": self._controller,
            "reportingInstance": f"{self._controller}-{self._node}"[:128],
            "action": o.action,
            "reason": o.reason,
            "regarding": o.regarding.to_api(),
            "note": note,
            "type": o.type,
        }


def _truncated(note: str) -> str:
    """`note` within NOTE_LIMIT bytes of UTF-8, cut at a character boundary and marked "...".

    What UTF-8 cannot encode (the surrogates that stand for undecodable bytes of a file name)
    becomes "?": counting bytes must not fail, and an event is not worth an error."""
    data = note.encode(errors="replace")
    if len(data) <= NOTE_LIMIT:
        return data.decode()
    # Cutting may split the last character: "ignore" drops its incomplete bytes.
    return data[: NOTE_LIMIT - 3].decode(errors="ignore") + "..."
