"""The DRAResourceHealth stream over a real gRPC server on a Unix socket, fed by a real Inventory."""

from __future__ import annotations

import itertools
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from driver.inventory.store import Inventory
from driver.kubelet.api.dra_health.v1 import api_pb2 as health_v1
from driver.kubelet.api.dra_health.v1 import api_pb2_grpc as health_v1_grpc
from driver.kubelet.api.dra_health.v1alpha1 import api_pb2 as health_v1alpha1
from driver.kubelet.api.dra_health.v1alpha1 import api_pb2_grpc as health_v1alpha1_grpc
from driver.kubelet.health import (
    MESSAGE_LIMIT,
    HealthBroadcaster,
    TooManyStreams,
    add_health_services,
    truncate_message,
)
from driver.model import Condition, Device, DeviceKind, Health, TaintEffect
from sim.kubelet import HealthSnapshot, HealthWatch, PluginRpcError

POOL = "node-a"
XID = Condition("tandem.dev/xid", TaintEffect.NO_SCHEDULE, "79", "XID 79: GPU fell off the bus")
APP_XID = Condition("tandem.dev/xid", TaintEffect.NONE, "13", "XID 13: application error", unhealthy=False)
DEVICES = ["gpu-0", "gpu-1", "nic-0"]
API = {
    "v1": (health_v1, health_v1_grpc.DRAResourceHealthStub),
    "v1alpha1": (health_v1alpha1, health_v1alpha1_grpc.DRAResourceHealthStub),
}
WAIT = 10.0  # generous deadline for things that should happen at once


def _inventory() -> Inventory:
    inv = Inventory()
    inv.replace("gpu", [Device("gpu-0", DeviceKind.GPU), Device("gpu-1", DeviceKind.GPU)])
    inv.replace("nic", [Device("nic-0", DeviceKind.NIC)])
    return inv


@dataclass
class Plugin:
    inventory: Inventory
    broadcaster: HealthBroadcaster
    server: grpc.Server
    channel: grpc.Channel

    def stub(self, version: str):  # type: ignore[no-untyped-def]
        pb, stub_cls = API[version]
        return pb, stub_cls(self.channel)

    def watch(self, version: str = "v1") -> HealthWatch:
        pb, stub = self.stub(version)
        return HealthWatch(stub.NodeWatchResources(pb.NodeWatchResourcesRequest()), pb.HealthStatus)


@pytest.fixture
def make_plugin() -> Iterator[Callable[..., Plugin]]:
    started: list[tuple[Plugin, Path]] = []

    def make(**kwargs: object) -> Plugin:
        root = Path(tempfile.mkdtemp(prefix="td-"))
        inv = _inventory()
        broadcaster = HealthBroadcaster(inv, POOL, **kwargs)  # type: ignore[arg-type]
        server = grpc.server(ThreadPoolExecutor(max_workers=8))
        add_health_services(server, broadcaster)
        sock = root / "dra.sock"
        assert server.add_insecure_port(f"unix://{sock}") != 0
        server.start()
        plugin = Plugin(inv, broadcaster, server, grpc.insecure_channel(f"unix://{sock}"))
        started.append((plugin, root))
        return plugin

    yield make
    for plugin, root in started:
        plugin.broadcaster.close()
        plugin.channel.close()
        plugin.server.stop(grace=None).wait()
        shutil.rmtree(root, ignore_errors=True)


def _by_name(snapshot: HealthSnapshot) -> dict[str, tuple[str, str]]:
    return {r.device: (r.health, r.message) for r in snapshot}


def _eventually(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {WAIT}s: {what}")
        time.sleep(0.01)


@pytest.mark.parametrize("version", ["v1", "v1alpha1"])
def test_first_message_is_the_complete_list_at_once(make_plugin, version):
    p = make_plugin(period=3600)
    before = int(time.time())
    snapshot = p.watch(version).next(timeout=WAIT)
    after = int(time.time())
    assert sorted(r.device for r in snapshot) == DEVICES
    assert {r.pool for r in snapshot} == {POOL}
    assert {r.health for r in snapshot} == {"HEALTHY"}
    assert {r.message for r in snapshot} == {"healthy"}
    assert all(before <= r.last_updated <= after for r in snapshot)


@pytest.mark.parametrize("version", ["v1", "v1alpha1"])
def test_a_change_sends_a_new_complete_list(make_plugin, version):
    p = make_plugin(period=3600)
    watch = p.watch(version)
    watch.next(timeout=WAIT)
    p.inventory.set_conditions("nvml", "gpu-0", [XID])
    snapshot = watch.wait_for(lambda s: _by_name(s)["gpu-0"][0] == "UNHEALTHY", WAIT)
    assert _by_name(snapshot) == {
        "gpu-0": ("UNHEALTHY", "XID 79: GPU fell off the bus"),
        "gpu-1": ("HEALTHY", "healthy"),
        "nic-0": ("HEALTHY", "healthy"),
    }
    p.inventory.set_conditions("nvml", "gpu-0", [])
    snapshot = watch.wait_for(lambda s: _by_name(s)["gpu-0"][0] == "HEALTHY", WAIT)
    assert len(snapshot) == 3


def test_a_removed_device_leaves_the_list_and_an_added_one_joins_it(make_plugin):
    p = make_plugin(period=3600)
    watch = p.watch()
    watch.next(timeout=WAIT)
    p.inventory.replace("nic", [Device("nic-1", DeviceKind.NIC)])
    snapshot = watch.wait_for(lambda s: "nic-1" in _by_name(s), WAIT)
    assert sorted(r.device for r in snapshot) == ["gpu-0", "gpu-1", "nic-1"]


def test_an_informational_taint_keeps_the_device_healthy_and_says_why(make_plugin):
    p = make_plugin(period=3600)
    watch = p.watch()
    watch.next(timeout=WAIT)
    p.inventory.set_conditions("nvml", "gpu-1", [APP_XID])
    snapshot = watch.wait_for(lambda s: _by_name(s)["gpu-1"][1] != "healthy", WAIT)
    assert _by_name(snapshot)["gpu-1"] == ("HEALTHY", "XID 13: application error")


def test_without_change_the_list_is_sent_again_each_period_with_a_fresh_time(make_plugin):
    clock = itertools.count(1_700_000_000)
    p = make_plugin(period=0.05, clock=lambda: float(next(clock)))
    watch = p.watch()
    first = watch.next(timeout=WAIT)
    second = watch.next(timeout=WAIT)
    third = watch.next(timeout=WAIT)
    assert _by_name(first) == _by_name(second) == _by_name(third)
    assert first[0].last_updated < second[0].last_updated < third[0].last_updated
    assert p.broadcaster.version == 1  # nothing changed: these were periodic resends


def test_the_timeout_and_pool_reach_the_wire(make_plugin):
    p = make_plugin(period=5, health_check_timeout_seconds=20)
    pb, stub = p.stub("v1")
    call = stub.NodeWatchResources(pb.NodeWatchResourcesRequest())
    response = next(call)
    call.cancel()
    assert [d.health_check_timeout_seconds for d in response.devices] == [20, 20, 20]
    assert [d.device.pool_name for d in response.devices] == [POOL] * 3
    assert [d.health for d in response.devices] == [pb.HEALTHY] * 3


def test_a_period_not_shorter_than_the_timeout_is_refused():
    with pytest.raises(ValueError, match="shorter than"):
        HealthBroadcaster(_inventory(), POOL, period=30, health_check_timeout_seconds=30)
    with pytest.raises(ValueError, match="positive"):
        HealthBroadcaster(_inventory(), POOL, period=0)


def test_two_concurrent_streams_of_both_versions_see_the_same_change(make_plugin):
    p = make_plugin(period=3600)
    watches = [p.watch("v1"), p.watch("v1alpha1")]
    for w in watches:
        w.next(timeout=WAIT)
    p.inventory.set_conditions("nvml", "nic-0", [XID])
    seen = [w.wait_for(lambda s: _by_name(s)["nic-0"][0] == "UNHEALTHY", WAIT) for w in watches]
    assert _by_name(seen[0]) == _by_name(seen[1])


def test_a_stream_that_is_behind_gets_only_the_newest_snapshot():
    """Without gRPC in the way: the stream is pulled only when its reader is ready."""

    class Ctx:
        def is_active(self) -> bool:
            return True

        def add_callback(self, callback: Callable[[], None]) -> bool:
            return True

    inv = _inventory()
    b = HealthBroadcaster(inv, POOL, period=3600)
    stream = b.watch(Ctx())
    assert {d.health for d in next(stream).devices} == {Health.HEALTHY}
    for i in range(1000):
        inv.set_conditions("nvml", "gpu-0", [Condition("tandem.dev/xid", TaintEffect.NO_SCHEDULE, str(i), f"xid {i}")])
    newest = next(stream)
    assert [d.message for d in newest.devices if d.name == "gpu-0"] == ["xid 999"]
    b.close()
    assert list(stream) == []


def test_a_thousand_rapid_changes_do_not_queue_a_thousand_messages(make_plugin):
    p = make_plugin(period=3600)
    watch = p.watch()
    watch.next(timeout=WAIT)
    for i in range(1000):
        p.inventory.set_conditions("nvml", "gpu-0", [Condition("tandem.dev/xid", TaintEffect.NONE, str(i), f"xid {i}")])
    received = 0

    def final(s: HealthSnapshot) -> bool:
        nonlocal received
        received += 1
        return _by_name(s)["gpu-0"][1] == "xid 999"

    watch.wait_for(final, WAIT)
    # A queue would deliver all 1,000 in order; coalescing skips to the newest.
    assert received < 1000


def test_close_ends_every_stream(make_plugin):
    p = make_plugin(period=3600)
    watches = [p.watch("v1"), p.watch("v1alpha1")]
    for w in watches:
        w.next(timeout=WAIT)
    _eventually(lambda: p.broadcaster.open_streams == 2, "both streams open")
    p.broadcaster.close()
    for w in watches:
        with pytest.raises(StopIteration):
            w.next(timeout=WAIT)
    _eventually(lambda: p.broadcaster.open_streams == 0, "streams released")


def test_a_client_that_goes_away_releases_its_stream(make_plugin):
    p = make_plugin(period=3600)
    watch = p.watch()
    watch.next(timeout=WAIT)
    _eventually(lambda: p.broadcaster.open_streams == 1, "stream open")
    watch.cancel()
    _eventually(lambda: p.broadcaster.open_streams == 0, "stream released after cancel")


def test_streams_beyond_the_limit_are_refused(make_plugin):
    p = make_plugin(period=3600, max_streams=1)
    first = p.watch()
    first.next(timeout=WAIT)
    with pytest.raises(PluginRpcError) as err:
        p.watch().next(timeout=WAIT)
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    p.inventory.set_conditions("nvml", "gpu-0", [XID])
    first.wait_for(lambda s: _by_name(s)["gpu-0"][0] == "UNHEALTHY", WAIT)


def test_watch_refuses_directly_beyond_the_limit():
    class Ctx:
        def is_active(self) -> bool:
            return True

        def add_callback(self, callback: Callable[[], None]) -> bool:
            return True

    b = HealthBroadcaster(_inventory(), POOL, max_streams=1)
    first = b.watch(Ctx())
    next(first)
    with pytest.raises(TooManyStreams):
        next(b.watch(Ctx()))


def test_a_long_message_is_truncated_the_way_the_kubelet_does(make_plugin):
    p = make_plugin(period=3600)
    long = "".join(chr(ord("a") + i % 26) for i in range(5000))
    watch = p.watch()
    watch.next(timeout=WAIT)
    p.inventory.set_conditions("nvml", "gpu-0", [Condition("tandem.dev/xid", TaintEffect.NO_SCHEDULE, "1", long)])
    snapshot = watch.wait_for(lambda s: _by_name(s)["gpu-0"][0] == "UNHEALTHY", WAIT)
    message = _by_name(snapshot)["gpu-0"][1]
    assert len(message) == MESSAGE_LIMIT
    assert message == long[: MESSAGE_LIMIT - 3] + "..."


def test_truncate_message_edges():
    assert truncate_message("x" * MESSAGE_LIMIT) == "x" * MESSAGE_LIMIT
    assert truncate_message("x" * (MESSAGE_LIMIT + 1)) == "x" * (MESSAGE_LIMIT - 3) + "..."
    assert truncate_message("") == ""


def test_add_health_services_advertises_both_versions_v1_first():
    server = grpc.server(ThreadPoolExecutor(max_workers=1))
    assert add_health_services(server, HealthBroadcaster(_inventory(), POOL)) == [
        "v1.DRAResourceHealth",
        "v1alpha1.DRAResourceHealth",
    ]
