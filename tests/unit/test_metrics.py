"""Prometheus metrics: call counters, inventory-driven gauges, publisher and health-source counters."""

from __future__ import annotations

import urllib.request
from dataclasses import dataclass, field

import pytest
from prometheus_client.parser import text_string_to_metric_families
from waiting import wait_for

from driver.discovery.gpu.discover import GpuDiscovery
from driver.discovery.nic.discover import NicDiscovery
from driver.health.grey_monitor import GreyMonitor
from driver.health.thresholds import GreyThresholds
from driver.inventory.store import Inventory
from driver.metrics import Metrics, MetricsEndpoint, ScrapeSources, parse_address
from driver.model import Condition, Device, DeviceKind, TaintEffect
from sim import nvml as sim_nvml
from sim.profile import h100_node
from sim.sysfs import render_node

XID = Condition("tandem.dev/xid", TaintEffect.NO_SCHEDULE, "79", "XID 79: GPU fell off the bus")
APP_XID = Condition("tandem.dev/xid", TaintEffect.NONE, "13", "XID 13", unhealthy=False)


@dataclass
class FakeStats:
    """The attributes of driver.slices.publisher.PublisherStats."""

    syncs: int = 0
    writes: int = 0
    creates: int = 0
    updates: int = 0
    deletes: int = 0
    errors: int = 0
    watch_restarts: int = 0
    skipped_devices: int = 0
    error_reasons: dict[str, int] = field(default_factory=dict)
    published_at: float | None = None


def _inventory() -> Inventory:
    inv = Inventory()
    inv.replace("gpu", [Device("gpu-0", DeviceKind.GPU), Device("gpu-1", DeviceKind.GPU)])
    inv.replace("nic", [Device("nic-0", DeviceKind.NIC)])
    return inv


def _samples(metrics: Metrics) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample of the text exposition, keyed by name and labels (parses what a scraper sees)."""
    out = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def _get(samples: dict, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def test_observe_counts_calls_claims_and_durations():
    m = Metrics(_inventory())
    m.observe("prepare", 0.02, claims=3, errors=["config"])
    m.observe("prepare", 2.0, claims=1, errors=[])
    m.observe("unprepare", 0.001, claims=2, errors=["node", "node"])
    s = _samples(m)
    assert _get(s, "tandem_node_calls_total", op="prepare") == 2
    assert _get(s, "tandem_node_calls_total", op="unprepare") == 1
    assert _get(s, "tandem_node_claims_total", op="prepare", result="ok") == 3
    assert _get(s, "tandem_node_claims_total", op="prepare", result="error") == 1
    assert _get(s, "tandem_node_claims_total", op="unprepare", result="ok") == 0
    assert _get(s, "tandem_node_claims_total", op="unprepare", result="error") == 2
    assert _get(s, "tandem_node_call_seconds_count", op="prepare") == 2
    assert _get(s, "tandem_node_call_seconds_sum", op="prepare") == pytest.approx(2.02)
    assert _get(s, "tandem_node_call_seconds_bucket", op="prepare", le="0.025") == 1
    assert _get(s, "tandem_node_call_seconds_bucket", op="prepare", le="2.5") == 2


def test_call_series_exist_before_the_first_call():
    s = _samples(Metrics(_inventory()))
    for op in ("prepare", "unprepare"):
        assert _get(s, "tandem_node_calls_total", op=op) == 0
        assert _get(s, "tandem_node_claims_total", op=op, result="error") == 0
        assert _get(s, "tandem_node_call_seconds_count", op=op) == 0


def test_more_errors_than_claims_never_makes_a_counter_go_negative():
    m = Metrics(_inventory())
    m.observe("prepare", 0.1, claims=1, errors=["device"] * 5)
    s = _samples(m)
    assert _get(s, "tandem_node_claims_total", op="prepare", result="ok") == 0
    assert _get(s, "tandem_node_claims_total", op="prepare", result="error") == 1


def test_device_gauges_follow_the_inventory():
    inv = _inventory()
    m = Metrics(inv)
    s = _samples(m)
    assert _get(s, "tandem_devices", kind="gpu") == 2
    assert _get(s, "tandem_devices", kind="nic") == 1
    assert _get(s, "tandem_devices", kind="mig") == 0
    assert _get(s, "tandem_device_health", device="gpu-0", kind="gpu", state="Healthy") == 1
    assert _get(s, "tandem_device_health", device="gpu-0", kind="gpu", state="Unhealthy") is None, "one series a device"
    assert not [k for k in s if k[0] == "tandem_device_taints"]

    inv.set_conditions("nvml", "gpu-0", [XID, APP_XID])
    inv.replace("nic", [])
    s = _samples(m)
    assert _get(s, "tandem_devices", kind="nic") == 0
    assert _get(s, "tandem_device_health", device="gpu-0", kind="gpu", state="Healthy") is None
    assert _get(s, "tandem_device_health", device="gpu-0", kind="gpu", state="Unhealthy") == 1
    assert _get(s, "tandem_device_health", device="nic-0", kind="nic", state="Healthy") is None
    taints = {dict(k[1])["value"]: v for k, v in s.items() if k[0] == "tandem_device_taints"}
    assert taints == {"79": 1, "13": 1}
    assert _get(s, "tandem_device_taints", device="gpu-0", key="tandem.dev/xid", value="79", effect="NoSchedule") == 1

    inv.set_conditions("nvml", "gpu-0", [])
    s = _samples(m)
    assert _get(s, "tandem_device_health", device="gpu-0", kind="gpu", state="Healthy") == 1
    assert not [k for k in s if k[0] == "tandem_device_taints"]


def test_publisher_stats_surface_as_counters():
    reasons = {"unreachable": 3, "unauthorized": 0, "forbidden": 1, "other": 0}
    stats = FakeStats(syncs=7, writes=6, creates=3, updates=2, deletes=1, errors=4, watch_restarts=5,
                      error_reasons=reasons)  # fmt: skip
    m = Metrics(_inventory(), ScrapeSources(publisher_stats=lambda: stats))
    s = _samples(m)
    assert _get(s, "tandem_slice_writes_total", op="create") == 3
    assert _get(s, "tandem_slice_writes_total", op="update") == 2
    assert _get(s, "tandem_slice_writes_total", op="delete") == 1
    assert _get(s, "tandem_slice_syncs_total") == 7
    assert _get(s, "tandem_slice_watch_restarts_total") == 5
    stats.syncs = 8  # read at scrape time, not copied once
    assert _get(_samples(m), "tandem_slice_syncs_total") == 8


def test_slice_errors_by_reason_and_the_last_publish():
    """An SRE's two alerts on a node whose slices the scheduler may not see: failures by reason
    (an unreachable API server told from an RBAC fault), and the age of the last publish."""
    stats = FakeStats(error_reasons={"unreachable": 14, "unauthorized": 0, "forbidden": 2, "other": 0})
    m = Metrics(_inventory(), ScrapeSources(publisher_stats=lambda: stats))
    s = _samples(m)
    errors = {dict(k[1])["reason"]: v for k, v in s.items() if k[0] == "tandem_slice_errors_total"}
    assert errors == {"unreachable": 14, "unauthorized": 0, "forbidden": 2, "other": 0}
    assert _get(s, "tandem_slices_published_timestamp_seconds") == 0, "never published: 0, so an age alert fires"
    stats.published_at = 1_700_000_000.5
    assert _get(_samples(m), "tandem_slices_published_timestamp_seconds") == 1_700_000_000.5


def test_health_counters_surface_by_source_event():
    counters = {"nvml_events_xid": 3, "netlink_events": 10}
    m = Metrics(_inventory(), ScrapeSources(health_counters=lambda: counters))
    s = _samples(m)
    assert _get(s, "tandem_health_events_total", source_event="nvml_events_xid") == 3
    assert _get(s, "tandem_health_events_total", source_event="netlink_events") == 10


def test_a_failing_source_does_not_hide_the_others():
    def broken() -> object:
        raise RuntimeError("publisher gone")

    s = _samples(Metrics(_inventory(), ScrapeSources(publisher_stats=broken, health_counters=lambda: {"x": 1})))
    assert _get(s, "tandem_devices", kind="gpu") == 2
    assert _get(s, "tandem_health_events_total", source_event="x") == 1
    assert not [k for k in s if k[0].startswith("tandem_slice_")]


def test_two_instances_do_not_share_series():
    a, b = Metrics(_inventory()), Metrics(_inventory())
    a.observe("prepare", 0.1, claims=1, errors=[])
    assert _get(_samples(b), "tandem_node_calls_total", op="prepare") == 0


def test_http_endpoint_serves_the_text_format():
    inv = _inventory()
    m = Metrics(inv)
    m.observe("prepare", 0.1, claims=1, errors=[])
    server = m.serve("127.0.0.1:0")
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=10) as resp:
            assert resp.status == 200
            assert resp.headers["Content-Type"].startswith("text/plain")
            body = resp.read().decode()
    finally:
        server.stop()
    assert 'tandem_node_calls_total{op="prepare"} 1.0' in body
    assert 'tandem_devices{kind="gpu"} 2.0' in body


@pytest.mark.parametrize(
    ("address", "expected"),
    [("127.0.0.1:8080", ("127.0.0.1", 8080)), (":9090", ("0.0.0.0", 9090)), ("[::1]:80", ("::1", 80))],
)
def test_parse_address(address, expected):
    assert parse_address(address) == expected


@pytest.mark.parametrize("address", ["8080", "host:", "h:99999", "a:b:1"])
def test_parse_address_rejects_garbage(address):
    with pytest.raises(ValueError, match="HOST:PORT"):
        parse_address(address)


def test_claim_errors_by_op_and_whose_problem_it_was():
    """A tenant's typo (config) is told from a broken device, for prepare and unprepare alike, so
    on-call alerts on the latter only; a kind outside the tree cannot grow the label."""
    m = Metrics(_inventory())
    before = {
        (dict(k[1])["op"], dict(k[1])["error_type"]): v
        for k, v in _samples(m).items()
        if k[0] == "tandem_claim_errors_total"
    }
    kinds = ["other", "config", "device", "node", "api", "endpoint"]
    assert before == {(op, kind): 0 for op in ("prepare", "unprepare") for kind in kinds}, "series from the start"
    m.observe("prepare", 0.1, claims=4, errors=["config", "config", "device", "no-such-kind"])
    m.observe("unprepare", 0.1, claims=2, errors=["node", "device"])
    s = _samples(m)
    assert _get(s, "tandem_claim_errors_total", op="prepare", error_type="config") == 2
    assert _get(s, "tandem_claim_errors_total", op="prepare", error_type="device") == 1
    assert _get(s, "tandem_claim_errors_total", op="prepare", error_type="other") == 1
    assert _get(s, "tandem_claim_errors_total", op="unprepare", error_type="node") == 1
    assert _get(s, "tandem_claim_errors_total", op="unprepare", error_type="device") == 1
    assert _get(s, "tandem_claim_errors_total", op="unprepare", error_type="config") == 0
    assert _get(s, "tandem_node_claims_total", op="unprepare", result="error") == 2


def test_binding_conditions_time_and_failures_by_reason():
    """How long claims wait for their binding conditions, and why some fail: series from the start,
    and a reason outside the known ones cannot grow the label."""
    m = Metrics(_inventory())
    s = _samples(m)
    assert _get(s, "tandem_binding_failures_total", reason="PartitionFailed") == 0
    assert _get(s, "tandem_binding_failures_total", reason="NicNotReady") == 0
    m.binding_seconds.observe(0.3)
    m.binding_failed("PartitionFailed")
    m.binding_failed("made-up")
    s = _samples(m)
    assert _get(s, "tandem_binding_condition_seconds_count") == 1
    assert _get(s, "tandem_binding_condition_seconds_sum") == pytest.approx(0.3)
    assert _get(s, "tandem_binding_failures_total", reason="PartitionFailed") == 1
    assert _get(s, "tandem_binding_failures_total", reason="other") == 1


def test_build_info_in_flight_prepared_claims_dropped_events_and_xids():
    prepared, dropped = [3], [0]
    sources = ScrapeSources(
        xids=lambda: {"79": 2, "other": 1}, prepared=lambda: prepared[0], events_dropped=lambda: dropped[0]
    )
    m = Metrics(_inventory(), sources)
    s = _samples(m)
    (info,) = [k for k in s if k[0] == "tandem_build_info"]
    assert s[info] == 1 and dict(info[1])["version"] and dict(info[1])["commit"]
    assert _get(s, "tandem_node_calls_in_flight", op="prepare") == 0
    with m.in_flight("prepare"):
        assert _get(_samples(m), "tandem_node_calls_in_flight", op="prepare") == 1
    assert _get(_samples(m), "tandem_node_calls_in_flight", op="prepare") == 0
    assert _get(s, "tandem_prepared_claims") == 3
    assert _get(s, "tandem_events_dropped_total") == 0
    assert _get(s, "tandem_gpu_xids_total", xid="79") == 2
    assert _get(s, "tandem_gpu_xids_total", xid="other") == 1
    prepared[0], dropped[0] = 0, 5  # read at scrape time
    s = _samples(m)
    assert _get(s, "tandem_prepared_claims") == 0
    assert _get(s, "tandem_events_dropped_total") == 5


def test_no_created_twins():
    m = Metrics(_inventory())
    m.observe("prepare", 0.1, claims=1, errors=["config"])
    assert b"_created" not in m.render()


# The bound docs/deployment.md states for a healthy 8-GPU + 8-NIC node with dynamic MIG.
SERIES_BOUND = 500


def test_series_of_an_8_gpu_8_nic_dynamic_mig_node_stay_under_500(tmp_path):
    """8 H100s in MIG mode served dynamically (each GPU and its 24 placements: 200 devices) and 8
    NICs: 310 series, one health series per device (416 more when each device had three), and the
    grey-failure counters a real round of the grey monitor read (by whole GPU and NIC, never by MIG
    device): 480, under SERIES_BOUND. Counted as a scraper sees them, histogram buckets and
    process metrics included."""
    profile = h100_node(gpus=8, nics=8, mig_capable=True)
    for gpu in profile.gpus:
        gpu.mig_mode = True
    state = tmp_path / "nvml.json"
    render_node(profile, tmp_path / "sys", tmp_path / "dev", tmp_path / "proc")
    sim_nvml.write_state(profile, state, proc_root=tmp_path / "proc")
    with sim_nvml.fake_pynvml_in_process(state) as pynvml:
        pynvml.nvmlInit()
        try:
            gpus = GpuDiscovery(tmp_path / "sys", proc_root=tmp_path / "proc", dynamic_mig=lambda m, u: True).discover()
        finally:
            pynvml.nvmlShutdown()
        inv = Inventory()
        inv.replace("gpu", gpus)
        inv.replace("nic", NicDiscovery(tmp_path / "sys", netlink=False).discover())
        grey = GreyMonitor(inv, GreyThresholds(), sysfs_root=tmp_path / "sys", driver_root=tmp_path)
        grey.poll()
    assert len(inv.devices()) == 8 + 8 * 24 + 8
    stats = FakeStats(error_reasons={"unreachable": 0, "unauthorized": 0, "forbidden": 0, "other": 0})
    counters = {f"nvml_{k}": 0 for k in ("xid", "double_bit_ecc", "single_bit_ecc", "probes", "errors")}
    counters |= {f"nic_{k}": 0 for k in ("netlink_events", "link_transitions", "condition_changes", "errors")}
    counters |= {f"grey_{k}": 0 for k in ("rounds", "errors")}
    sources = ScrapeSources(
        lambda: stats, lambda: counters, lambda: {}, lambda: 0, lambda: 0, device_counters=grey.readings
    )
    assert len(grey.readings()) == 16 and grey.errors == 0, "every GPU and NIC read, once each"
    series = len(_samples(Metrics(inv, sources)))
    print(f"series on a healthy 8-GPU + 8-NIC dynamic-MIG node: {series}")
    assert series < SERIES_BOUND


def test_the_metrics_port_is_taken_as_soon_as_the_other_instance_lets_go() -> None:
    """A rolling update on the host network: the surge instance finds the port held by the old
    one, and serves metrics once it is free instead of never."""
    holder = Metrics(Inventory()).serve("127.0.0.1:0")
    port = holder.port
    waiting = MetricsEndpoint(Metrics(Inventory()), f"127.0.0.1:{port}", retry=0.05)
    waiting.start()
    try:
        assert waiting.server is None, "the port is held: nothing bound yet"
        holder.stop()
        wait_for("the port taken once free", lambda: waiting.server)
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
        assert b"tandem_devices" in body
    finally:
        waiting.stop()
    assert waiting.server is None
