"""KubeletSim against small in-process fake plugins on real Unix sockets."""

from __future__ import annotations

import os
import socket
import tempfile
import threading
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest

from driver.kubelet.api.dra.v1 import api_pb2 as dra_v1
from driver.kubelet.api.dra.v1 import api_pb2_grpc as dra_v1_grpc
from driver.kubelet.api.dra.v1beta1 import api_pb2 as dra_v1beta1
from driver.kubelet.api.dra.v1beta1 import api_pb2_grpc as dra_v1beta1_grpc
from driver.kubelet.api.dra_health.v1 import api_pb2 as health_v1
from driver.kubelet.api.dra_health.v1 import api_pb2_grpc as health_v1_grpc
from driver.kubelet.api.dra_health.v1alpha1 import api_pb2 as health_v1alpha1
from driver.kubelet.api.dra_health.v1alpha1 import api_pb2_grpc as health_v1alpha1_grpc
from driver.kubelet.api.pluginregistration.v1 import api_pb2 as reg_pb2
from driver.kubelet.api.pluginregistration.v1 import api_pb2_grpc as reg_grpc
from sim.kubelet import (
    ClaimRef,
    DeviceHealthReport,
    KubeletSim,
    KubeletSimError,
    NotRegisteredError,
    PluginRpcError,
    PreparedClaimResult,
    PreparedDevice,
    ProtocolError,
    RegistrationError,
)

DRIVER = "gpu.tandem.example.com"
ALL_VERSIONS = ["v1.DRAPlugin", "v1beta1.DRAPlugin", "v1.DRAResourceHealth", "v1alpha1.DRAResourceHealth"]
CLAIM_OK = ClaimRef(namespace="ns", name="ok", uid="uid-ok")
CLAIM_FAILS = ClaimRef(namespace="ns", name="fails", uid="uid-fails")
CLAIM_DROPPED = ClaimRef(namespace="ns", name="dropped", uid="uid-dropped")
CLAIM_BROKEN = ClaimRef(namespace="ns", name="broken", uid="uid-broken")


@pytest.fixture
def sock_dir(tmp_path: Path) -> Iterator[Path]:
    """tmp_path, unless it is too long for sun_path (108 bytes) with a socket name appended."""
    if len(str(tmp_path)) < 60:
        yield tmp_path
        return
    with tempfile.TemporaryDirectory(prefix="ksim-") as short:
        yield Path(short)


@dataclass
class FakeRegistration(reg_grpc.RegistrationServicer):
    info: reg_pb2.PluginInfo
    statuses: list[reg_pb2.RegistrationStatus] = field(default_factory=list)

    def GetInfo(self, request: Any, context: Any) -> reg_pb2.PluginInfo:
        return self.info

    def NotifyRegistrationStatus(self, request: Any, context: Any) -> reg_pb2.RegistrationStatusResponse:
        self.statuses.append(request)
        if not request.plugin_registered:  # what the Go kubeletplugin library does
            context.abort(grpc.StatusCode.UNKNOWN, f"failed registration process: {request.error}")
        return reg_pb2.RegistrationStatusResponse()


class FakeDRA:
    """One implementation of both DRAPlugin versions; records which service each call used.

    Claim names steer the answer: "fails" gets a per-claim error, "dropped" is left out of the
    response, "broken" fails the whole RPC.
    """

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, list[tuple[str, str, str]]]] = []

    def servicer(self, pb: Any, base: type) -> Any:
        fake = self

        class Servicer(base):  # type: ignore[misc, valid-type]
            def NodePrepareResources(self, request: Any, context: Any) -> Any:
                fake._record(pb, "prepare", request, context)
                response = pb.NodePrepareResourcesResponse()
                for claim in request.claims:
                    if claim.name == "fails":
                        response.claims[claim.uid].error = "no such device"
                    elif claim.name != "dropped":
                        entry = response.claims[claim.uid]
                        first = entry.devices.add(
                            request_names=["gpu"],
                            pool_name="node-a",
                            device_name="gpu-0",
                            cdi_device_ids=["k8s.x/gpu=a"],
                        )
                        entry.devices.add(pool_name="node-a", device_name="nic-0")
                        if "share_id" in pb.Device.DESCRIPTOR.fields_by_name:
                            first.share_id = "share-1"
                return response

            def NodeUnprepareResources(self, request: Any, context: Any) -> Any:
                fake._record(pb, "unprepare", request, context)
                response = pb.NodeUnprepareResourcesResponse()
                for claim in request.claims:
                    if claim.name == "fails":
                        response.claims[claim.uid].error = "device busy"
                    elif claim.name != "dropped":
                        response.claims[claim.uid].SetInParent()
                return response

        return Servicer()

    def _record(self, pb: Any, op: str, request: Any, context: Any) -> None:
        self.calls.append((pb.DESCRIPTOR.package, op, [(c.namespace, c.name, c.uid) for c in request.claims]))
        if any(c.name == "broken" for c in request.claims):
            context.abort(grpc.StatusCode.UNAVAILABLE, "api server unreachable")


def _health_servicer(pb: Any, base: type) -> Any:
    class Servicer(base):  # type: ignore[misc, valid-type]
        def NodeWatchResources(self, request: Any, context: Any) -> Iterator[Any]:
            done = threading.Event()
            context.add_callback(done.set)
            for health in (pb.UNKNOWN, pb.UNHEALTHY):
                yield pb.NodeWatchResourcesResponse(
                    devices=[
                        pb.DeviceHealth(
                            device=pb.DeviceIdentifier(pool_name="node-a", device_name="gpu-0"),
                            health=health,
                            last_updated_time=1700000000,
                            message="XID 79" if health == pb.UNHEALTHY else "",
                        )
                    ]
                )
            done.wait()  # keep the stream open until the client cancels, like a real plugin

    return Servicer()


@dataclass
class FakePlugin:
    reg_socket: Path
    dra_socket: Path
    registration: FakeRegistration
    dra: FakeDRA


def _serve(path: Path, register: Any) -> grpc.Server:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    register(server)
    server.add_insecure_port(f"unix://{path}")
    server.start()
    return server


@pytest.fixture
def start_plugin(sock_dir: Path) -> Iterator[Any]:
    servers: list[grpc.Server] = []

    def start(
        supported_versions: list[str] = ALL_VERSIONS,
        plugin_type: str = "DRAPlugin",
        name: str = DRIVER,
        endpoint: str | None = None,
        reg_name: str = f"{DRIVER}-reg.sock",
    ) -> FakePlugin:
        dra_socket = sock_dir / reg_name.replace("-reg.sock", "-dra.sock")
        info = reg_pb2.PluginInfo(
            type=plugin_type,
            name=name,
            endpoint=str(dra_socket) if endpoint is None else endpoint,
            supported_versions=supported_versions,
        )
        plugin = FakePlugin(sock_dir / reg_name, dra_socket, FakeRegistration(info), FakeDRA())

        def add_dra(server: grpc.Server) -> None:
            dra_v1_grpc.add_DRAPluginServicer_to_server(
                plugin.dra.servicer(dra_v1, dra_v1_grpc.DRAPluginServicer), server
            )
            dra_v1beta1_grpc.add_DRAPluginServicer_to_server(
                plugin.dra.servicer(dra_v1beta1, dra_v1beta1_grpc.DRAPluginServicer), server
            )
            health_v1_grpc.add_DRAResourceHealthServicer_to_server(
                _health_servicer(health_v1, health_v1_grpc.DRAResourceHealthServicer), server
            )
            health_v1alpha1_grpc.add_DRAResourceHealthServicer_to_server(
                _health_servicer(health_v1alpha1, health_v1alpha1_grpc.DRAResourceHealthServicer), server
            )

        # DRA socket first, as the reference library does.
        servers.append(_serve(dra_socket, add_dra))
        servers.append(
            _serve(
                plugin.reg_socket,
                lambda s: reg_grpc.add_RegistrationServicer_to_server(plugin.registration, s),
            )
        )
        return plugin

    yield start
    for server in servers:
        server.stop(None)


@pytest.fixture
def kubelet(sock_dir: Path) -> Iterator[KubeletSim]:
    with KubeletSim(sock_dir) as sim:
        yield sim


# --- registration ---------------------------------------------------------------------------


def test_register_prefers_v1_regardless_of_advertised_order(start_plugin: Any, kubelet: KubeletSim) -> None:
    plugin = start_plugin(
        supported_versions=[
            "v1beta1.DRAPlugin",
            "v1alpha1.DRAResourceHealth",
            "v1.DRAPlugin",
            "v1.DRAResourceHealth",
        ]
    )
    sock = kubelet.wait_for_registration_socket(DRIVER)
    assert sock == plugin.reg_socket

    info = kubelet.register(sock)

    assert info.name == DRIVER
    assert info.endpoint == str(plugin.dra_socket)
    assert info.dra_version == "v1.DRAPlugin"
    assert info.health_version == "v1.DRAResourceHealth"
    assert [s.plugin_registered for s in plugin.registration.statuses] == [True]


def test_register_falls_back_to_v1beta1_and_no_health(start_plugin: Any, kubelet: KubeletSim) -> None:
    plugin = start_plugin(supported_versions=["v1beta1.DRAPlugin", "v1alpha1.DRAResourceHealth", "v2.DRAPlugin"])

    info = kubelet.register(plugin.reg_socket)

    assert (info.dra_version, info.health_version) == ("v1beta1.DRAPlugin", "v1alpha1.DRAResourceHealth")
    only_beta = start_plugin(supported_versions=["v1beta1.DRAPlugin"], reg_name="other-reg.sock")
    assert kubelet.register(only_beta.reg_socket).health_version is None


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        ({"plugin_type": "CSIPlugin"}, "CSIPlugin"),
        ({"name": ""}, "name"),
        ({"endpoint": "unix:///run/dra.sock"}, "endpoint"),
        ({"endpoint": ""}, "endpoint"),
        ({"supported_versions": ["v1.DRAResourceHealth", "v2.DRAPlugin"]}, "DRAPlugin service"),
    ],
)
def test_register_rejects_invalid_plugin_and_says_so(
    start_plugin: Any, kubelet: KubeletSim, overrides: dict[str, Any], reason: str
) -> None:
    plugin = start_plugin(**overrides)

    with pytest.raises(RegistrationError, match=reason):
        kubelet.register(plugin.reg_socket)

    [status] = plugin.registration.statuses
    assert not status.plugin_registered
    assert reason in status.error
    with pytest.raises(NotRegisteredError):
        kubelet.prepare([CLAIM_OK])


def test_register_on_dead_socket_is_a_registration_error(sock_dir: Path, kubelet: KubeletSim) -> None:
    with pytest.raises(RegistrationError, match="GetInfo"):
        kubelet.register(sock_dir / "nobody-reg.sock")


# --- prepare / unprepare --------------------------------------------------------------------


def test_prepare_v1_converts_devices_errors_and_share_id(start_plugin: Any, kubelet: KubeletSim) -> None:
    plugin = start_plugin()
    kubelet.register(plugin.reg_socket)

    results = kubelet.prepare([CLAIM_OK, CLAIM_FAILS])

    assert plugin.dra.calls == [
        ("k8s.io.kubelet.pkg.apis.dra.v1", "prepare", [("ns", "ok", "uid-ok"), ("ns", "fails", "uid-fails")])
    ]
    assert results == {
        "uid-ok": PreparedClaimResult(
            error="",
            devices=[
                PreparedDevice(["gpu"], "node-a", "gpu-0", ["k8s.x/gpu=a"], share_id="share-1"),
                PreparedDevice([], "node-a", "nic-0", [], share_id=None),
            ],
        ),
        "uid-fails": PreparedClaimResult(error="no such device", devices=[]),
    }


def test_prepare_and_unprepare_v1beta1_use_the_v1beta1_service(start_plugin: Any, kubelet: KubeletSim) -> None:
    plugin = start_plugin()
    kubelet.register(plugin.reg_socket)

    results = kubelet.prepare([CLAIM_OK], version="v1beta1")
    errors = kubelet.unprepare([CLAIM_OK], version="v1beta1")

    assert [(pkg, op) for pkg, op, _ in plugin.dra.calls] == [
        ("k8s.io.kubelet.pkg.apis.dra.v1beta1", "prepare"),
        ("k8s.io.kubelet.pkg.apis.dra.v1beta1", "unprepare"),
    ]
    assert [d.share_id for d in results["uid-ok"].devices] == [None, None]
    assert [d.device_name for d in results["uid-ok"].devices] == ["gpu-0", "nic-0"]
    assert errors == {"uid-ok": ""}


def test_chosen_versions_are_accepted_as_version_arguments(start_plugin: Any, kubelet: KubeletSim) -> None:
    plugin = start_plugin(supported_versions=["v1beta1.DRAPlugin", "v1alpha1.DRAResourceHealth"])
    info = kubelet.register(plugin.reg_socket)

    assert kubelet.prepare([CLAIM_OK], version=info.dra_version)["uid-ok"].error == ""
    assert info.health_version is not None
    watch = kubelet.watch_health(info.health_version)
    assert watch.next(timeout=10)[0].device == "gpu-0"
    watch.cancel()
    assert plugin.dra.calls[0][:2] == ("k8s.io.kubelet.pkg.apis.dra.v1beta1", "prepare")
    with pytest.raises(ValueError, match="v2"):
        kubelet.prepare([CLAIM_OK], version="v2")


def test_unprepare_reports_errors_per_claim(start_plugin: Any, kubelet: KubeletSim) -> None:
    plugin = start_plugin()
    kubelet.register(plugin.reg_socket)

    assert kubelet.unprepare([CLAIM_OK, CLAIM_FAILS]) == {"uid-ok": "", "uid-fails": "device busy"}
    assert plugin.dra.calls[-1][:2] == ("k8s.io.kubelet.pkg.apis.dra.v1", "unprepare")


def test_empty_requests_succeed_with_empty_results(start_plugin: Any, kubelet: KubeletSim) -> None:
    kubelet.register(start_plugin().reg_socket)

    assert kubelet.prepare([]) == {}
    assert kubelet.unprepare([]) == {}


@pytest.mark.parametrize("op", ["prepare", "unprepare"])
def test_claim_left_out_of_response_is_a_protocol_error(start_plugin: Any, kubelet: KubeletSim, op: str) -> None:
    kubelet.register(start_plugin().reg_socket)

    with pytest.raises(ProtocolError, match="uid-dropped"):
        getattr(kubelet, op)([CLAIM_OK, CLAIM_DROPPED])


def test_rpc_failure_is_reported_with_its_status_code(start_plugin: Any, kubelet: KubeletSim) -> None:
    kubelet.register(start_plugin().reg_socket)

    with pytest.raises(PluginRpcError) as err:
        kubelet.prepare([CLAIM_BROKEN])

    assert err.value.code == grpc.StatusCode.UNAVAILABLE
    assert err.value.details == "api server unreachable"


def test_version_not_advertised_is_refused(start_plugin: Any, kubelet: KubeletSim) -> None:
    plugin = start_plugin(supported_versions=["v1.DRAPlugin"])
    kubelet.register(plugin.reg_socket)

    with pytest.raises(KubeletSimError, match=r"v1beta1\.DRAPlugin"):
        kubelet.prepare([CLAIM_OK], version="v1beta1")
    with pytest.raises(KubeletSimError, match=r"v1\.DRAResourceHealth"):
        kubelet.watch_health()
    assert plugin.dra.calls == []


def test_close_forgets_the_plugin(start_plugin: Any, sock_dir: Path) -> None:
    plugin = start_plugin()
    with KubeletSim(sock_dir) as sim:
        sim.register(plugin.reg_socket)
        assert sim.prepare([CLAIM_OK])["uid-ok"].error == ""

    with pytest.raises(NotRegisteredError):
        sim.prepare([CLAIM_OK])


# --- health ---------------------------------------------------------------------------------


@pytest.mark.parametrize("version", ["v1", "v1alpha1"])
def test_watch_health_yields_snapshots_until_cancelled(start_plugin: Any, kubelet: KubeletSim, version: str) -> None:
    kubelet.register(start_plugin().reg_socket)
    watch = kubelet.watch_health(version)

    first = watch.next(timeout=10)
    unhealthy = watch.wait_for(lambda snap: snap[0].health == "UNHEALTHY", timeout=10)
    watch.cancel()

    assert first == [DeviceHealthReport("node-a", "gpu-0", "UNKNOWN", "", 1700000000)]
    assert unhealthy == [DeviceHealthReport("node-a", "gpu-0", "UNHEALTHY", "XID 79", 1700000000)]
    assert list(watch) == []


def test_watch_health_times_out_when_nothing_arrives(start_plugin: Any, kubelet: KubeletSim) -> None:
    kubelet.register(start_plugin().reg_socket)
    watch = kubelet.watch_health()

    with pytest.raises(TimeoutError):
        watch.wait_for(lambda snap: snap[0].health == "HEALTHY", timeout=1)
    watch.cancel()


# --- registration socket discovery ----------------------------------------------------------


@pytest.fixture
def make_socket(sock_dir: Path) -> Iterator[Any]:
    sockets: list[socket.socket] = []

    def make(name: str, mtime_s: int) -> Path:
        path = sock_dir / name
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(str(path))
        sockets.append(s)
        os.utime(path, (mtime_s, mtime_s))
        return path

    yield make
    for s in sockets:
        s.close()


def test_discovery_finds_rolling_update_names_and_prefers_newest(
    make_socket: Any, sock_dir: Path, kubelet: KubeletSim
) -> None:
    make_socket(f"{DRIVER}-reg.sock", 1000)
    pod_uid = make_socket(f"{DRIVER}-0b3c1f7e-5d6a-4c1e-9a3b-2f1e0d9c8b7a-reg.sock", 2000)
    make_socket("other.example.com-reg.sock", 9000)  # another driver
    make_socket(f"{DRIVER}-dra.sock", 9000)  # not a registration socket
    (sock_dir / f"{DRIVER}-stale-reg.sock").write_text("")  # a regular file, not a socket
    os.utime(sock_dir / f"{DRIVER}-stale-reg.sock", (9000, 9000))

    assert kubelet.wait_for_registration_socket(DRIVER, timeout=1) == pod_uid

    hashed = make_socket("dra-Vm9KgYkq3n1pQh7sE2xW0A-reg.sock", 3000)
    assert kubelet.wait_for_registration_socket(DRIVER, timeout=1) == hashed

    hashed_short = make_socket(f"{DRIVER}-qL8d2Xz0aB4-reg.sock", 4000)
    assert kubelet.wait_for_registration_socket(DRIVER, timeout=1) == hashed_short


def test_discovery_waits_for_a_socket_to_appear(make_socket: Any, kubelet: KubeletSim) -> None:
    created = threading.Event()

    def create_later() -> None:
        make_socket(f"{DRIVER}-reg.sock", 1000)
        created.set()

    timer = threading.Timer(0.2, create_later)
    timer.start()
    try:
        found = kubelet.wait_for_registration_socket(DRIVER, timeout=10)
    finally:
        timer.cancel()
    assert created.is_set()
    assert found.name == f"{DRIVER}-reg.sock"


def test_discovery_times_out_without_a_socket(sock_dir: Path, kubelet: KubeletSim) -> None:
    (sock_dir / f"{DRIVER}-reg.sock").write_text("")  # left behind, but nobody listens

    with pytest.raises(TimeoutError, match=DRIVER):
        kubelet.wait_for_registration_socket(DRIVER, timeout=0.2)


def test_discovery_of_missing_registry_dir_times_out(tmp_path: Path) -> None:
    with KubeletSim(tmp_path / "absent") as sim, pytest.raises(TimeoutError):
        sim.wait_for_registration_socket(DRIVER, timeout=0.1)
