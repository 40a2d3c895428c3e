"""The kubelet's DRAResourceHealth stream (v1 and v1alpha1), fed from the inventory.

Contract (docs/reference/kubelet-plugin.md, 'Health service' and 'Kubelet restarts'): every message is the *complete* list of the
driver's devices with their health; it is sent at once when the kubelet opens the stream, on
every change, and periodically. The kubelet shows a device as Unknown once its
`last_updated_time` is older than the health timeout (the device's
`health_check_timeout_seconds`, or the kubelet's default of about 30 s), so
`last_updated_time` is the time the message was produced: the inventory is the live state that
the health sources keep current, so reading it *is* determining the status, and the periodic
resend keeps a quiet, healthy device from turning Unknown. The period must therefore stay well
under the timeout.

One broadcaster serves every stream. It keeps only the newest snapshot and a version counter
behind a condition variable: a stream that fell behind skips straight to the newest snapshot,
so a burst of 1,000 changes costs a slow reader one message, not a queue of 1,000 stale ones.
Each open stream holds one gRPC worker thread while it waits, hence `max_streams`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Protocol

import grpc

from driver.errors import EndpointError
from driver.inventory.store import Inventory
from driver.kubelet.api.dra_health.v1 import api_pb2 as v1_pb2
from driver.kubelet.api.dra_health.v1 import api_pb2_grpc as v1_grpc
from driver.kubelet.api.dra_health.v1alpha1 import api_pb2 as v1alpha1_pb2
from driver.kubelet.api.dra_health.v1alpha1 import api_pb2_grpc as v1alpha1_grpc
from driver.model import Device, Health

log = logging.getLogger(__name__)

# What GetInfo advertises for health, after the DRAPlugin strings (docs/reference/kubelet-plugin.md, 'Supported versions').
HEALTH_SERVICES = ["v1.DRAResourceHealth", "v1alpha1.DRAResourceHealth"]

MESSAGE_LIMIT = 1024  # the kubelet truncates longer messages itself; we do it the same way
_ELLIPSIS = "..."

DEFAULT_PERIOD = 10.0  # a third of the kubelet's default health timeout (~30 s)
DEFAULT_MAX_STREAMS = 4  # the kubelet opens one; a few more for tandemctl and overlap on reconnects

_DEFAULT_MESSAGES = {
    Health.HEALTHY: "healthy",
    Health.UNHEALTHY: "unhealthy",
    Health.UNKNOWN: "health not yet determined",
}


def truncate_message(message: str, limit: int = MESSAGE_LIMIT) -> str:
    """At most `limit` characters, the way the kubelet shortens it: the head plus '...'."""
    if len(message) <= limit:
        return message
    return message[: limit - len(_ELLIPSIS)] + _ELLIPSIS


@dataclass(frozen=True)
class DeviceStatus:
    """One device's entry in a health message, before the timestamp is stamped on."""

    name: str
    health: Health
    message: str


def device_status(device: Device) -> DeviceStatus:
    """A healthy device still gets a message: an informational taint's reason, or 'healthy'."""
    message = device.health_message or _DEFAULT_MESSAGES[device.health]
    return DeviceStatus(device.name, device.health, truncate_message(message))


@dataclass(frozen=True)
class HealthSnapshot:
    """The complete list of the driver's devices, stamped with when it was determined."""

    devices: tuple[DeviceStatus, ...]
    determined_at: int  # Unix seconds


class StreamContext(Protocol):
    """The part of grpc.ServicerContext a stream needs; tests may pass a stand-in."""

    def is_active(self) -> bool: ...

    def add_callback(self, callback: Callable[[], None]) -> bool: ...


class TooManyStreams(EndpointError):
    """More concurrent streams than `max_streams`: each one holds a gRPC worker thread."""


class HealthBroadcaster:
    """The newest health snapshot of the inventory, handed to any number of streams."""

    def __init__(
        self,
        inventory: Inventory,
        pool_name: str,
        period: float = DEFAULT_PERIOD,
        health_check_timeout_seconds: int = 0,
        max_streams: int = DEFAULT_MAX_STREAMS,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if period <= 0:
            raise ValueError(f"health resend period must be positive, not {period}")
        if 0 < health_check_timeout_seconds <= period:
            raise ValueError(
                f"health resend period {period}s must be shorter than health_check_timeout_seconds "
                f"{health_check_timeout_seconds}, or the kubelet shows quiet devices as Unknown"
            )
        self.pool_name = pool_name
        self.period = period
        self.health_check_timeout_seconds = max(0, health_check_timeout_seconds)
        self._inventory = inventory
        self._max_streams = max_streams
        self._clock = clock
        self._cond = threading.Condition()
        self._devices: tuple[DeviceStatus, ...] = ()
        self._version = 0
        self._streams = 0
        self._closed = False
        self._refresh()
        inventory.subscribe(self._refresh)

    def _refresh(self) -> None:
        """Inventory subscriber: cheap, and bumps the version only if the health view changed.

        The inventory is read under our own lock so that two health sources notifying at once
        cannot apply an older view after a newer one.
        """
        with self._cond:
            if self._closed:
                return
            devices = tuple(device_status(d) for d in self._inventory.devices())
            if devices == self._devices:
                return
            self._devices = devices
            self._version += 1
            self._cond.notify_all()

    @property
    def version(self) -> int:
        """How many times the health view changed; for tests and diagnostics."""
        with self._cond:
            return self._version

    @property
    def open_streams(self) -> int:
        with self._cond:
            return self._streams

    def snapshot(self) -> HealthSnapshot:
        with self._cond:
            return HealthSnapshot(self._devices, int(self._clock()))

    def close(self) -> None:
        """Ends every stream: the daemon calls this before stopping the gRPC server so it never waits."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def watch(self, context: StreamContext) -> Iterator[HealthSnapshot]:
        """Snapshots for one stream: now, after every change, and every `period` seconds.

        Returns when the client goes away or the broadcaster is closed. Raises TooManyStreams
        before yielding anything when `max_streams` are already open.
        """
        with self._cond:
            if self._streams >= self._max_streams:
                raise TooManyStreams(f"{self._streams} health streams already open (limit {self._max_streams})")
            self._streams += 1
        try:
            # False: the RPC already ended, so no callback would ever wake us.
            if not context.add_callback(self._wake):
                return
            seen = -1
            while True:
                with self._cond:
                    deadline = time.monotonic() + self.period
                    while not self._closed and self._version == seen and context.is_active():
                        remaining = deadline - time.monotonic()
                        if remaining <= 0:
                            break
                        self._cond.wait(remaining)
                    if self._closed or not context.is_active():
                        return
                    seen = self._version
                    snapshot = HealthSnapshot(self._devices, int(self._clock()))
                yield snapshot
        finally:
            with self._cond:
                self._streams -= 1


class _HealthServicerBase:
    pb2: ModuleType

    def __init__(self, broadcaster: HealthBroadcaster) -> None:
        self._broadcaster = broadcaster

    def _response(self, snapshot: HealthSnapshot) -> object:
        pb = self.pb2
        b = self._broadcaster
        return pb.NodeWatchResourcesResponse(
            devices=[
                pb.DeviceHealth(
                    device=pb.DeviceIdentifier(pool_name=b.pool_name, device_name=d.name),
                    health=pb.HealthStatus.Value(d.health.name),
                    last_updated_time=snapshot.determined_at,
                    health_check_timeout_seconds=b.health_check_timeout_seconds,
                    message=d.message,
                )
                for d in snapshot.devices
            ]
        )

    def NodeWatchResources(
        self,
        request: v1_pb2.NodeWatchResourcesRequest | v1alpha1_pb2.NodeWatchResourcesRequest,
        context: grpc.ServicerContext,
    ) -> Iterator[object]:
        log.info("health stream opened (%s)", self.pb2.DESCRIPTOR.package)
        try:
            for snapshot in self._broadcaster.watch(context):
                yield self._response(snapshot)
        except TooManyStreams as e:
            log.warning("refusing a health stream: %s", e)
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        log.info("health stream closed (%s)", self.pb2.DESCRIPTOR.package)


class DRAResourceHealthV1(_HealthServicerBase, v1_grpc.DRAResourceHealthServicer):
    pb2 = v1_pb2


class DRAResourceHealthV1alpha1(_HealthServicerBase, v1alpha1_grpc.DRAResourceHealthServicer):
    pb2 = v1alpha1_pb2


def add_health_services(server: grpc.Server, broadcaster: HealthBroadcaster) -> list[str]:
    """Registers both health versions; returns the strings GetInfo must advertise for them."""
    v1_grpc.add_DRAResourceHealthServicer_to_server(DRAResourceHealthV1(broadcaster), server)
    v1alpha1_grpc.add_DRAResourceHealthServicer_to_server(DRAResourceHealthV1alpha1(broadcaster), server)
    return list(HEALTH_SERVICES)
