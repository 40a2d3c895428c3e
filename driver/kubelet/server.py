"""The one gRPC server the kubelet talks to: the DRA and health services on the DRA socket, the
Registration service on the registration socket.

One server serves both sockets: each server has its own polling thread, which wakes about ten
times a second even when idle (half the daemon's idle CPU with two servers). The registration
socket is bound under a hidden name (the kubelet's plugin watcher ignores names starting with
`.`) and renamed into place once the server runs, so it appears only when DRA is served. grpc is
imported only inside `driver.kubelet` (an import-linter contract).
"""

from __future__ import annotations

import contextlib
import logging
import stat
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

from driver.claims.prepare import Preparer
from driver.kubelet.api.pluginregistration.v1 import api_pb2_grpc as reg_grpc
from driver.kubelet.health import HealthBroadcaster, add_health_services
from driver.kubelet.registration import RegistrationServicer, check_socket_path, grpc_unix_address
from driver.kubelet.service import CallMetrics, add_dra_services

log = logging.getLogger(__name__)

WORKERS = 16  # concurrent kubelet calls and health streams (the thread names `kubelet-grpc_*`)


def _remove_stale_socket(path: Path) -> None:
    """A socket file left by a killed instance would make bind fail; anything else is not ours."""
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise RuntimeError(f"{path} exists and is not a socket; refusing to replace it")
    path.unlink()


def _serve_unix(server: grpc.Server, path: Path) -> None:
    check_socket_path(path)
    _remove_stale_socket(path)
    if server.add_insecure_port(grpc_unix_address(path)) == 0:
        raise RuntimeError(f"cannot listen on {path}")


def _hidden(path: Path) -> Path:
    """Where a socket is bound before it is renamed to `path`: a name the kubelet's plugin
    watcher ignores (a leading `.`), no longer than `path`'s (so it fits wherever `path` does),
    in the same directory (a rename across mounts fails)."""
    return path.with_name("." + path.name[1:])


class KubeletServer:
    """Started once, after everything the kubelet's calls reach is ready; stopped first."""

    def __init__(self, driver_name: str, dra_socket: Path, reg_socket: Path) -> None:
        self.driver_name = driver_name
        self.dra_socket = dra_socket
        self.reg_socket = reg_socket
        self._server: grpc.Server | None = None
        self.registration: RegistrationServicer | None = None

    @property
    def serving(self) -> bool:
        return self._server is not None

    def start(self, preparer: Preparer, health: HealthBroadcaster, metrics: CallMetrics) -> None:
        server = grpc.server(ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="kubelet-grpc"))
        services = add_dra_services(server, preparer, metrics)
        services += add_health_services(server, health)
        self.registration = RegistrationServicer(self.driver_name, self.dra_socket, services)
        reg_grpc.add_RegistrationServicer_to_server(self.registration, server)
        _serve_unix(server, self.dra_socket)
        hidden_reg = _hidden(self.reg_socket)
        _serve_unix(server, hidden_reg)
        server.start()
        self._server = server
        log.info("serving %s on %s", ", ".join(services), self.dra_socket)
        _remove_stale_socket(self.reg_socket)
        hidden_reg.rename(self.reg_socket)  # the kubelet sees the socket now, with DRA served
        log.info("registration socket %s ready for the kubelet", self.reg_socket)

    def deregister(self) -> None:
        """The kubelet deregisters the plugin when the registration socket goes."""
        with contextlib.suppress(FileNotFoundError):
            self.reg_socket.unlink()

    def stop(self, grace: float) -> None:
        """In-flight calls get `grace` seconds; then this instance's DRA socket goes (a rolling
        update's other instance keeps its own)."""
        if self._server is not None:
            self._server.stop(grace=grace).wait()
        with contextlib.suppress(FileNotFoundError):
            self.dra_socket.unlink()
