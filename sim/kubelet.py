"""A kubelet stand-in: the gRPC client side of the DRA kubelet-plugin contract.

Tests and `tandem-driver demo` use it to drive a plugin exactly the way the kubelet does: find
the registration socket in the registry directory, call GetInfo, validate the answer, pick a
DRAPlugin version (v1 before v1beta1), report the outcome with NotifyRegistrationStatus, then
call NodePrepareResources / NodeUnprepareResources and watch device health on the DRA socket.
Only the generated kubelet API is imported from `driver`: the simulation must not share the
driver's own assumptions (see the import-linter contract in pyproject.toml).
"""

from __future__ import annotations

import contextlib
import os
import queue
import stat
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, NamedTuple, Self

import grpc

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

DRA_PLUGIN_TYPE = "DRAPlugin"
REG_SOCKET_SUFFIX = "-reg.sock"
# Hashed rolling-update registration sockets (docs/reference/kubelet-plugin.md, 'Rolling-update names') carry no
# driver name, only this prefix.
HASHED_REG_SOCKET_PREFIX = "dra-"

# supported_versions strings this kubelet speaks, in its order of preference.
DRA_SERVICES = ("v1.DRAPlugin", "v1beta1.DRAPlugin")
HEALTH_SERVICES = ("v1.DRAResourceHealth", "v1alpha1.DRAResourceHealth")

_POLL_INTERVAL_S = 0.05
_REGISTRATION_TIMEOUT_S = 10.0


class KubeletSimError(Exception):
    """Base of everything the simulated kubelet rejects."""


class RegistrationError(KubeletSimError):
    """The plugin's registration was rejected (the kubelet would not use it)."""


class NotRegisteredError(KubeletSimError):
    """A DRA call was attempted before a successful `register`."""


class PluginRpcError(KubeletSimError):
    """A DRA RPC failed as a whole; the kubelet would ignore the response and retry later."""

    def __init__(self, method: str, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{method} failed: {code.name}: {details}")
        self.method = method
        self.code = code
        self.details = details


class ProtocolError(KubeletSimError):
    """The plugin answered, but not the way the contract requires (e.g. claims left out)."""


@dataclass(frozen=True)
class ClaimRef:
    """All the kubelet knows about a claim when it calls the plugin."""

    namespace: str
    name: str
    uid: str


@dataclass(frozen=True)
class PreparedDevice:
    request_names: list[str]
    pool_name: str
    device_name: str
    cdi_device_ids: list[str]
    # None when the plugin did not set it; always None over v1beta1, which has no such field.
    share_id: str | None = None


@dataclass(frozen=True)
class PreparedClaimResult:
    error: str
    devices: list[PreparedDevice]


@dataclass(frozen=True)
class PluginInfoResult:
    name: str
    endpoint: str
    supported_versions: list[str]
    # The advertised services this kubelet chose, e.g. "v1.DRAPlugin" and "v1.DRAResourceHealth"
    # (None: no health service). The `version` arguments of KubeletSim accept these as well as
    # the short form ("v1").
    dra_version: str
    health_version: str | None


class DeviceHealthReport(NamedTuple):
    pool: str
    device: str
    health: str  # HealthStatus name: "UNKNOWN", "HEALTHY", "UNHEALTHY"
    message: str
    last_updated: int  # Unix seconds


HealthSnapshot = list[DeviceHealthReport]

_DRA_API: dict[str, tuple[Any, Any]] = {
    "v1": (dra_v1, dra_v1_grpc.DRAPluginStub),
    "v1beta1": (dra_v1beta1, dra_v1beta1_grpc.DRAPluginStub),
}
_HEALTH_API: dict[str, tuple[Any, Any]] = {
    "v1": (health_v1, health_v1_grpc.DRAResourceHealthStub),
    "v1alpha1": (health_v1alpha1, health_v1alpha1_grpc.DRAResourceHealthStub),
}


def _unix_target(path: str | Path) -> str:
    return f"unix://{Path(path).absolute()}"


def _socket_mtime(path: Path) -> int | None:
    """None unless `path` is a socket; a stale regular file is not a plugin."""
    try:
        st = path.stat()
    except OSError:  # vanished between listing and stat: an instance shutting down
        return None
    return st.st_mtime_ns if stat.S_ISSOCK(st.st_mode) else None


def _first_preferred(advertised: Sequence[str], services: Sequence[str]) -> str | None:
    """The kubelet walks its own preference list, not the plugin's order."""
    return next((name for name in services if name in advertised), None)


def validate_plugin_info(info: reg_pb2.PluginInfo) -> PluginInfoResult:
    """Checks GetInfo's answer as the kubelet's DRA handler does; raises RegistrationError."""
    if info.type != DRA_PLUGIN_TYPE:
        raise RegistrationError(f"plugin type {info.type!r} is not {DRA_PLUGIN_TYPE!r}")
    if not info.name:
        raise RegistrationError("plugin name is empty")
    if not info.endpoint or not os.path.isabs(info.endpoint):
        raise RegistrationError(f"endpoint {info.endpoint!r} is not an absolute socket path")
    advertised = list(info.supported_versions)
    dra_version = _first_preferred(advertised, DRA_SERVICES)
    if dra_version is None:
        raise RegistrationError(
            f"none of the supported versions {advertised} is a DRAPlugin service this kubelet "
            f"speaks ({', '.join(DRA_SERVICES)})"
        )
    return PluginInfoResult(
        name=info.name,
        endpoint=info.endpoint,
        supported_versions=advertised,
        dra_version=dra_version,
        health_version=_first_preferred(advertised, HEALTH_SERVICES),
    )


def _device_from_proto(device: Any) -> PreparedDevice:
    has_share_id = "share_id" in device.DESCRIPTOR.fields_by_name and device.HasField("share_id")
    return PreparedDevice(
        request_names=list(device.request_names),
        pool_name=device.pool_name,
        device_name=device.device_name,
        cdi_device_ids=list(device.cdi_device_ids),
        share_id=device.share_id if has_share_id else None,
    )


def _check_complete(method: str, claims: Sequence[ClaimRef], answered: Sequence[str]) -> None:
    """Every requested claim needs an entry (the kubelet counts a missing one as a failure)."""
    requested = {c.uid for c in claims}
    missing = sorted(requested - set(answered))
    unexpected = sorted(set(answered) - requested)
    if missing or unexpected:
        raise ProtocolError(f"{method}: claims left out {missing}, claims not requested {unexpected}")


class HealthWatch:
    """A NodeWatchResources stream, read by a background thread so that waits can time out."""

    _END = object()

    def __init__(self, call: Any, health_enum: Any) -> None:
        self._call = call
        self._enum = health_enum
        self._queue: queue.Queue[Any] = queue.Queue()
        self._error: PluginRpcError | None = None
        self._done = False
        self._reader = threading.Thread(target=self._read, name="kubelet-sim-health", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        try:
            for response in self._call:
                self._queue.put(self._snapshot(response))
        except grpc.RpcError as err:
            if err.code() != grpc.StatusCode.CANCELLED:
                self._error = PluginRpcError("NodeWatchResources", err.code(), err.details() or "")
        finally:
            self._queue.put(self._END)

    def _snapshot(self, response: Any) -> HealthSnapshot:
        return [
            DeviceHealthReport(
                pool=d.device.pool_name,
                device=d.device.device_name,
                health=self._enum.Name(d.health),
                message=d.message,
                last_updated=d.last_updated_time,
            )
            for d in response.devices
        ]

    def next(self, timeout: float | None = None) -> HealthSnapshot:
        """The next snapshot; StopIteration when the stream ended or was cancelled.

        Raises TimeoutError if none arrives in time, PluginRpcError if the stream broke.
        """
        if self._done:
            raise StopIteration
        try:
            item = self._queue.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"no health snapshot within {timeout}s") from None
        if item is self._END:
            self._done = True
            if self._error is not None:
                raise self._error
            raise StopIteration
        return item

    def wait_for(self, predicate: Callable[[HealthSnapshot], bool], timeout: float) -> HealthSnapshot:
        """The first snapshot that satisfies `predicate`, waiting at most `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                snapshot = self.next(timeout=max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                raise TimeoutError(f"no matching health snapshot within {timeout}s") from None
            if predicate(snapshot):
                return snapshot

    def __iter__(self) -> Iterator[HealthSnapshot]:
        return self

    def __next__(self) -> HealthSnapshot:
        return self.next()

    def cancel(self) -> None:
        """Closes the stream, as the kubelet does when the plugin goes away."""
        self._call.cancel()
        self._reader.join(timeout=5.0)


class KubeletSim:
    """The kubelet's side of one DRA plugin registration; not thread-safe."""

    def __init__(self, registrar_dir: str | Path) -> None:
        self.registrar_dir = Path(registrar_dir)
        self.plugin: PluginInfoResult | None = None
        self._channel: grpc.Channel | None = None
        self._watches: list[HealthWatch] = []

    def wait_for_registration_socket(self, driver_name: str, timeout: float = 10.0) -> Path:
        """The newest registration socket that may belong to `driver_name`.

        Matches `<driver>-reg.sock` and the rolling-update names `<driver>-<podUID|hash>-reg.sock`
        and `dra-<hash>-reg.sock`. The last one carries no driver name, so with several drivers
        in one registry directory it is ambiguous; `register(...).name` tells whose it is.
        Newest wins because during a rolling update the kubelet uses the latest instance.
        """
        deadline = time.monotonic() + timeout
        while True:
            found = self._registration_sockets(driver_name)
            if found:
                return max(found, key=lambda item: (item[1], item[0].name))[0]
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"no registration socket for {driver_name!r} in {self.registrar_dir} after {timeout}s"
                )
            time.sleep(_POLL_INTERVAL_S)

    def _registration_sockets(self, driver_name: str) -> list[tuple[Path, int]]:
        """Matching sockets with their modification time (creation time, for a socket)."""
        prefixes = (f"{driver_name}-", HASHED_REG_SOCKET_PREFIX)
        try:
            entries = list(self.registrar_dir.iterdir())
        except FileNotFoundError:
            return []
        found = []
        for path in entries:
            if path.name.endswith(REG_SOCKET_SUFFIX) and path.name.startswith(prefixes):
                mtime = _socket_mtime(path)
                if mtime is not None:
                    found.append((path, mtime))
        return found

    def register(self, reg_socket: Path) -> PluginInfoResult:
        """GetInfo, validation and NotifyRegistrationStatus; raises RegistrationError if rejected."""
        with grpc.insecure_channel(_unix_target(reg_socket)) as channel:
            stub = reg_grpc.RegistrationStub(channel)
            try:
                info = stub.GetInfo(reg_pb2.InfoRequest(), timeout=_REGISTRATION_TIMEOUT_S)
            except grpc.RpcError as err:
                raise RegistrationError(f"GetInfo on {reg_socket}: {err.code().name}: {err.details()}") from err
            try:
                result = validate_plugin_info(info)
            except RegistrationError as err:
                # The Go plugin library answers a negative status with an error; that is expected.
                with contextlib.suppress(grpc.RpcError):
                    stub.NotifyRegistrationStatus(
                        reg_pb2.RegistrationStatus(plugin_registered=False, error=str(err)),
                        timeout=_REGISTRATION_TIMEOUT_S,
                    )
                raise
            try:
                stub.NotifyRegistrationStatus(
                    reg_pb2.RegistrationStatus(plugin_registered=True), timeout=_REGISTRATION_TIMEOUT_S
                )
            except grpc.RpcError as err:
                raise RegistrationError(
                    f"NotifyRegistrationStatus on {reg_socket}: {err.code().name}: {err.details()}"
                ) from err
        self._close_dra_channel()
        self.plugin = result
        self._channel = grpc.insecure_channel(_unix_target(result.endpoint))
        return result

    def _dra_channel(self, service: str) -> grpc.Channel:
        if self.plugin is None or self._channel is None:
            raise NotRegisteredError("no plugin registered; call register() first")
        if service not in self.plugin.supported_versions:
            raise KubeletSimError(
                f"plugin {self.plugin.name!r} does not advertise {service!r} "
                f"(supported_versions: {self.plugin.supported_versions})"
            )
        return self._channel

    def prepare(
        self, claims: Sequence[ClaimRef], version: str = "v1", timeout: float = 45
    ) -> dict[str, PreparedClaimResult]:
        """NodePrepareResources; result per claim UID."""
        pb, stub_cls, service = self._api(_DRA_API, version, "DRAPlugin")
        stub = stub_cls(self._dra_channel(service))
        request = pb.NodePrepareResourcesRequest(claims=[self._claim(pb, c) for c in claims])
        response = self._call("NodePrepareResources", stub.NodePrepareResources, request, timeout)
        _check_complete("NodePrepareResources", claims, list(response.claims))
        return {
            uid: PreparedClaimResult(error=r.error, devices=[_device_from_proto(d) for d in r.devices])
            for uid, r in response.claims.items()
        }

    def unprepare(self, claims: Sequence[ClaimRef], version: str = "v1", timeout: float = 45) -> dict[str, str]:
        """NodeUnprepareResources; error text per claim UID, "" for success."""
        pb, stub_cls, service = self._api(_DRA_API, version, "DRAPlugin")
        stub = stub_cls(self._dra_channel(service))
        request = pb.NodeUnprepareResourcesRequest(claims=[self._claim(pb, c) for c in claims])
        response = self._call("NodeUnprepareResources", stub.NodeUnprepareResources, request, timeout)
        _check_complete("NodeUnprepareResources", claims, list(response.claims))
        return {uid: r.error for uid, r in response.claims.items()}

    def watch_health(self, version: str = "v1") -> HealthWatch:
        """Opens NodeWatchResources; iterate the result for snapshots, `.cancel()` to stop."""
        pb, stub_cls, service = self._api(_HEALTH_API, version, "DRAResourceHealth")
        stub = stub_cls(self._dra_channel(service))
        watch = HealthWatch(stub.NodeWatchResources(pb.NodeWatchResourcesRequest()), pb.HealthStatus)
        self._watches.append(watch)
        return watch

    @staticmethod
    def _api(apis: dict[str, tuple[Any, Any]], version: str, kind: str) -> tuple[Any, Any, str]:
        """Generated module, stub class and advertised service name for "v1" or "v1.<kind>"."""
        short = version.removesuffix(f".{kind}")
        if short not in apis:
            raise ValueError(f"unknown {kind} version {version!r}; expected one of {sorted(apis)}")
        pb, stub_cls = apis[short]
        return pb, stub_cls, f"{short}.{kind}"

    @staticmethod
    def _claim(pb: Any, claim: ClaimRef) -> Any:
        return pb.Claim(namespace=claim.namespace, name=claim.name, uid=claim.uid)

    @staticmethod
    def _call(method: str, rpc: Any, request: Any, timeout: float) -> Any:
        try:
            return rpc(request, timeout=timeout)
        except grpc.RpcError as err:
            raise PluginRpcError(method, err.code(), err.details() or "") from err

    def _close_dra_channel(self) -> None:
        for watch in self._watches:
            watch.cancel()
        self._watches.clear()
        if self._channel is not None:
            self._channel.close()
            self._channel = None

    def close(self) -> None:
        self._close_dra_channel()
        self.plugin = None

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
