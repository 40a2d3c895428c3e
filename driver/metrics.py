"""Prometheus metrics: kubelet calls, device health and taints, slice publishing, health events.

Call metrics are ordinary counters and a histogram, updated by whoever times the kubelet's
calls. Everything that already has a home (the inventory, the publisher's counters, the health
sources' counters) is read at scrape time by a custom collector instead of being copied into
metric objects, so there is no second copy of device state that could drift (docs/architecture.md:
the inventory is the one place that knows the devices). Each Metrics has its own registry so that
tests, and two daemons in one process, never share series.

Cardinality is bounded by the node, never by its tenants: one health series per device (its
current state only), a taint series per published taint (at most 16 a device, by the API), XIDs by
the caller's bounded codes, errors by kind; no label holds a claim UID, and no counter has a
`_created` twin. docs/deployment.md states the count for an 8-GPU + 8-NIC node with dynamic MIG,
and tests/unit/test_metrics.py keeps it. The one exception, `tandem_claim_gpu_*`, is bounded by
what the node has prepared (at most three series per pod holding a GPU or MIG device, gone with
the claim's record); its claim and pod labels are names the API server validated, never a UID.
The grey-failure counters (`tandem_device_counter`) are by device and by a counter name from the
code's own fixed lists. Over 400 lines on purpose: every family's name, help and labels are in
this one file, which docs/deployment.md's metrics table mirrors, beside the endpoint that serves
them.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import NamedTuple, Protocol, get_args
from wsgiref.simple_server import WSGIServer

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
    start_http_server,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from driver.backoff import KeepTrying
from driver.errors import Kind
from driver.inventory.store import Inventory
from driver.model import BINDING_FAILURE_REASONS, DeviceKind
from driver.version import build

log = logging.getLogger(__name__)

OPS = ("prepare", "unprepare")
# From a cached claim (milliseconds) to a GET, SSA and MIG work near the kubelet's 45 s timeout.
CALL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 45.0)

# PublisherStats attribute -> (metric name without _total, help).
_SLICE_COUNTERS = {
    "syncs": ("tandem_slice_syncs", "Times the publisher compared the desired slices with the live ones."),
    "watch_restarts": ("tandem_slice_watch_restarts", "Times the slice watch was opened again."),
    "skipped_devices": ("tandem_slice_skipped_devices", "Devices left out because the API cannot represent them."),
}
_SLICE_WRITES = {"creates": "create", "updates": "update", "deletes": "delete"}

_LISTEN = re.compile(r"^(?P<host>[^:]*|\[[0-9a-fA-F:]+\]):(?P<port>\d{1,5})$")


class SliceStats(Protocol):
    """What is read of the publisher's `PublisherStats` (a sibling this module does not import):
    these, and the counters of the tables above by name."""

    @property
    def error_reasons(self) -> Mapping[str, int]: ...

    @property
    def published_at(self) -> float | None: ...


class ClaimGpu(Protocol):
    """What is read of a prepared claim's GPU (`driver.claims.usage.GpuUsage`, a sibling's):
    the labels of its series, and NVML's values, None where NVML gave none."""

    @property
    def namespace(self) -> str: ...
    @property
    def pod(self) -> str: ...
    @property
    def claim(self) -> str: ...
    @property
    def device(self) -> str: ...
    @property
    def uuid(self) -> str: ...
    @property
    def utilization(self) -> float | None: ...
    @property
    def memory_used(self) -> int | None: ...
    @property
    def memory_total(self) -> int | None: ...


CLAIM_GPU_LABELS = ["namespace", "pod", "claim", "device", "uuid"]


class _ScrapeCollector(Collector):
    """Reads the inventory and the stats callables on every scrape.

    A failing source loses only its own families for that scrape: a broken publisher must not
    hide device health from the SRE looking at it.
    """

    def __init__(self, inventory: Inventory, sources: ScrapeSources) -> None:
        self._inventory = inventory
        self._sources = sources

    def collect(self) -> Iterator[Metric]:
        for name, part in (
            ("inventory", self._inventory_families),
            ("slice publisher", self._slice_families),
            ("health counters", self._health_families),
            ("device counters", self._device_counter_families),
            ("claims and events", self._other_families),
            ("claims' GPUs", self._claim_gpu_families),
        ):
            try:
                families = list(part())
            except Exception:
                log.exception("metrics: cannot read the %s", name)
                continue
            yield from families

    def _inventory_families(self) -> Iterator[Metric]:
        devices = self._inventory.devices()
        health = GaugeMetricFamily(
            "tandem_device_health",
            "1, labelled with the device's current health state (Healthy, Unhealthy, Unknown): one series a device.",
            labels=["device", "kind", "state"],
        )
        taints = GaugeMetricFamily(
            "tandem_device_taints",
            "1 for each taint the device is published with.",
            labels=["device", "key", "value", "effect"],
        )
        counts = dict.fromkeys(DeviceKind, 0)
        for d in devices:
            counts[d.kind] += 1
            health.add_metric([d.name, d.kind.value, d.health.value], 1.0)
            for t in d.taints:
                taints.add_metric([d.name, t.key, t.value, t.effect.value], 1.0)
        total = GaugeMetricFamily("tandem_devices", "Devices in the inventory, by kind.", labels=["kind"])
        for kind, n in counts.items():
            total.add_metric([kind.value], float(n))
        yield from (total, health, taints)

    def _slice_families(self) -> Iterator[Metric]:
        if self._sources.publisher_stats is None:
            return
        stats = self._sources.publisher_stats()
        writes = CounterMetricFamily(
            "tandem_slice_writes", "ResourceSlice writes to the API server, by operation.", labels=["op"]
        )
        for attr, op in _SLICE_WRITES.items():
            writes.add_metric([op], float(getattr(stats, attr)))
        yield writes
        for attr, (name, doc) in _SLICE_COUNTERS.items():
            yield CounterMetricFamily(name, doc, value=float(getattr(stats, attr)))
        errors = CounterMetricFamily(
            "tandem_slice_errors",
            "Failed attempts of the slice publisher (Node lookup, list, watch, write), each retried with backoff, "
            "by reason: unreachable, unauthorized, forbidden, other.",
            labels=["reason"],
        )
        for reason, n in sorted(stats.error_reasons.items()):
            errors.add_metric([reason], float(n))
        yield errors
        published = stats.published_at
        yield GaugeMetricFamily(
            "tandem_slices_published_timestamp_seconds",
            "Unix time the publisher last wrote or confirmed this node's ResourceSlices; 0 before the first time.",
            value=float(published or 0.0),
        )

    def _health_families(self) -> Iterator[Metric]:
        if self._sources.xids is not None:
            xids = CounterMetricFamily(
                "tandem_gpu_xids",
                "XID events seen by the GPU health monitor, by XID (known ones; others as 'other').",
                labels=["xid"],
            )
            for code, n in sorted(self._sources.xids().items()):
                xids.add_metric([code], float(n))
            yield xids
        if self._sources.health_counters is None:
            return
        events = CounterMetricFamily(
            "tandem_health_events",
            "Events seen by the health sources (NVML, netlink, ...), by source and event.",
            labels=["source_event"],
        )
        for name, value in sorted(self._sources.health_counters().items()):
            events.add_metric([name], float(value))
        yield events

    def _device_counter_families(self) -> Iterator[Metric]:
        if self._sources.device_counters is None:
            return
        counters = CounterMetricFamily(
            "tandem_device_counter",
            "Hardware counters the grey-failure checks read (PCIe replays and AER, carrier changes, RDMA port "
            "errors and congestion, NVLink errors), as last read: by device and counter.",
            labels=["device", "counter"],
        )
        for device, values in sorted(self._sources.device_counters().items()):
            for name, value in sorted(values.items()):
                counters.add_metric([device, name], float(value))
        yield counters

    def _other_families(self) -> Iterator[Metric]:
        if self._sources.prepared is not None:
            yield GaugeMetricFamily(
                "tandem_prepared_claims",
                "Claims prepared on this node (the checkpoint's records).",
                value=float(self._sources.prepared()),
            )
        if self._sources.events_dropped is not None:
            yield CounterMetricFamily(
                "tandem_events_dropped",
                "Kubernetes Events not sent: refused by the API server, failed, or "
                "dropped by the full queue or the per-object rate limit.",
                value=float(self._sources.events_dropped()),
            )

    def _claim_gpu_families(self) -> Iterator[Metric]:
        """One series per pod, claim and GPU or MIG device, only while the claim is prepared."""
        if self._sources.claim_gpus is None:
            return
        utilization = GaugeMetricFamily(
            "tandem_claim_gpu_utilization_ratio",
            "Fraction of NVML's last sample period in which a kernel ran on "
            "the claim's GPU (the whole GPU, shared or not; none on MIG devices).",
            labels=CLAIM_GPU_LABELS,
        )
        used = GaugeMetricFamily(
            "tandem_claim_gpu_memory_used_bytes",
            "Memory in use on the claim's GPU or MIG device.",
            labels=CLAIM_GPU_LABELS,
        )
        total = GaugeMetricFamily(
            "tandem_claim_gpu_memory_total_bytes", "Memory of the claim's GPU or MIG device.", labels=CLAIM_GPU_LABELS
        )
        for g in self._sources.claim_gpus():
            labels = [g.namespace, g.pod, g.claim, g.device, g.uuid]
            for family, value in ((utilization, g.utilization), (used, g.memory_used), (total, g.memory_total)):
                if value is not None:
                    family.add_metric(labels, float(value))
        yield from (utilization, used, total)


@dataclass
class MetricsServer:
    """The HTTP endpoint; `port` is the bound one (useful with port 0)."""

    httpd: WSGIServer
    thread: threading.Thread

    @property
    def port(self) -> int:
        return int(self.httpd.server_address[1])

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=5.0)


class MetricsEndpoint:
    """The metrics port, served as soon as it is free. The driver pod is on the host network, so
    during a rolling update the other instance holds the port until it stops: a surge pod that
    gave up at its first try served no metrics until its own restart, on every node, after every
    upgrade. So a refused bind is tried again every `retry` seconds, and the daemon lets go of the
    port first when it stops, for the instance that replaces it."""

    def __init__(self, metrics: Metrics, address: str, retry: float = 1.0) -> None:
        self._metrics, self._address = metrics, address
        self.server: MetricsServer | None = None
        self._again = KeepTrying(self._bind, retry, "metrics-bind")

    def start(self) -> None:
        try:
            self.server = self._metrics.serve(self._address)
        except OSError as e:  # EADDRINUSE: the other instance of a rolling update, most likely
            log.warning("metrics port %s not free (%s): trying again every second", self._address, e)
            self._again.start()

    def stop(self) -> None:
        self._again.stop()
        if self.server is not None:
            self.server.stop()
            self.server = None

    def _bind(self) -> bool:
        try:
            self.server = self._metrics.serve(self._address)
        except OSError:
            return False
        return True


def parse_address(address: str) -> tuple[str, int]:
    """HOST:PORT (HOST may be empty for all interfaces, or a bracketed IPv6 address)."""
    m = _LISTEN.match(address)
    if m is None or int(m["port"]) > 65535:
        raise ValueError(f"metrics address {address!r} must be HOST:PORT")
    host = m["host"].strip("[]") or "0.0.0.0"
    return host, int(m["port"])


@dataclass(frozen=True)
class ScrapeSources:
    """What is read on each scrape, each None where the daemon has none (tests, a NIC-only node)."""

    publisher_stats: Callable[[], SliceStats] | None = None
    health_counters: Callable[[], Mapping[str, int]] | None = None
    xids: Callable[[], Mapping[str, int]] | None = None  # by XID label value: a known code or "other"
    prepared: Callable[[], int] | None = None
    events_dropped: Callable[[], int] | None = None
    claim_gpus: Callable[[], Sequence[ClaimGpu]] | None = None  # one per pod holding a prepared GPU
    # Grey-failure counters as last read, by device name then counter name (`GreyMonitor.readings`).
    device_counters: Callable[[], Mapping[str, Mapping[str, int]]] | None = None


class _CallSeries(NamedTuple):
    """One op's series."""

    calls: Counter
    ok: Counter
    errors: Counter
    seconds: Histogram


class Metrics:
    def __init__(self, inventory: Inventory, sources: ScrapeSources = ScrapeSources()) -> None:
        # Process-wide (prometheus_client keeps it so): each counter's `_created` twin would double
        # the counter series for a timestamp nobody alerts on.
        disable_created_metrics()  # type: ignore[no-untyped-call]  # untyped in prometheus_client 0.26
        self.registry = CollectorRegistry()
        self._calls = Counter(
            "tandem_node_calls", "NodePrepareResources / NodeUnprepareResources calls.", ["op"], registry=self.registry
        )
        self._claims = Counter(
            "tandem_node_claims", "Claims in those calls, by outcome.", ["op", "result"], registry=self.registry
        )
        self._seconds = Histogram(
            "tandem_node_call_seconds",
            "Duration of NodePrepareResources / NodeUnprepareResources calls.",
            ["op"],
            buckets=CALL_BUCKETS,
            registry=self.registry,
        )
        self._in_flight = Gauge(
            "tandem_node_calls_in_flight", "Kubelet calls running now.", ["op"], registry=self.registry
        )
        self._errors = Counter(
            "tandem_claim_errors",
            "Claims whose prepare or unprepare failed, by whose problem it was (driver/errors.py): config is "
            "the claim's own (a tenant's typo), device, node, api, endpoint, or other (a bug).",
            ["op", "error_type"],
            registry=self.registry,
        )
        # Binding conditions (driver/claims/binding.py): how long a claim waits for them, and why they fail.
        self.binding_seconds = Histogram(
            "tandem_binding_condition_seconds",
            "From a claim seen allocated here with binding conditions to its conditions set True "
            "(dynamic-MIG partitions made, NICs checked).",
            buckets=CALL_BUCKETS,
            registry=self.registry,
        )
        self._binding_failures = Counter(
            "tandem_binding_failures",
            "Claims whose devices could not be made ready before binding, by reason.",
            ["reason"],
            registry=self.registry,
        )
        for reason in BINDING_FAILURE_REASONS:
            self._binding_failures.labels(reason)
        version, commit = build()
        Gauge(
            "tandem_build_info",
            "1, labelled with this build's version and commit.",
            ["version", "commit"],
            registry=self.registry,
        ).labels(version, commit).set(1)
        # Series exist from the start, so rate() and alerts see a 0 before the first call; each
        # op's children are kept (a fixed set) so a call does not look its labels up again.
        self._series = {
            op: _CallSeries(
                self._calls.labels(op),
                self._claims.labels(op, "ok"),
                self._claims.labels(op, "error"),
                self._seconds.labels(op),
            )
            for op in OPS
        }
        for op in OPS:
            for kind in get_args(Kind):
                self._errors.labels(op, kind)
        for op in OPS:
            self._in_flight.labels(op)
        self.registry.register(_ScrapeCollector(inventory, sources))
        ProcessCollector(registry=self.registry)

    def in_flight(self, op: str) -> AbstractContextManager[object]:
        """Held while a kubelet call of `op` runs: `tandem_node_calls_in_flight`."""
        return self._in_flight.labels(op).track_inprogress()

    def observe(self, op: str, seconds: float, claims: int, errors: Sequence[str]) -> None:
        """One kubelet call of `op` that took `seconds` for `claims` claims; `errors` has one entry
        per failed claim, the kind of its error (driver/errors.py). A kind outside the tree counts
        as "other", so the label stays bounded."""
        failed = min(len(errors), max(claims, 0))
        series = self._series[op]
        series.calls.inc()
        series.ok.inc(max(claims, 0) - failed)
        series.errors.inc(failed)
        series.seconds.observe(max(seconds, 0.0))
        for kind in errors[:failed]:
            self._errors.labels(op, kind if kind in get_args(Kind) else "other").inc()

    def binding_failed(self, reason: str) -> None:
        self._binding_failures.labels(reason if reason in BINDING_FAILURE_REASONS else "other").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def serve(self, address: str) -> MetricsServer:
        """Serves /metrics on HOST:PORT in a daemon thread; stop() the result on shutdown."""
        host, port = parse_address(address)
        httpd, thread = start_http_server(port, addr=host, registry=self.registry)
        server = MetricsServer(httpd, thread)
        log.info("serving metrics on %s:%d", host, server.port)
        return server
