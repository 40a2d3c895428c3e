"""Kubelet plugin registration: socket naming (incl. rolling updates) and the Registration service.

The kubelet discovers plugins by watching its registry directory, calls GetInfo on each socket
and connects to the DRA endpoint it names. During a rolling update two instances of the driver
run on one node, so each needs socket names of its own (docs/reference/kubelet-plugin.md, 'Rolling-update names').
"""

from __future__ import annotations

import base64
import hashlib
import logging
import threading
from dataclasses import dataclass
from pathlib import Path

import grpc

from driver.kubelet.api.pluginregistration.v1 import api_pb2 as reg_pb2
from driver.kubelet.api.pluginregistration.v1 import api_pb2_grpc as reg_grpc

log = logging.getLogger(__name__)

# The longest Unix socket path gRPC's C core binds: sun_path holds 108 bytes with the NUL. Go binds
# 108 (docs/reference/kubelet-plugin.md, 'Rolling-update names').
UNIX_PATH_MAX = 107
PLUGIN_TYPE = "DRAPlugin"


def grpc_unix_address(path: Path) -> str:
    """The address a gRPC server binds `path` at: `unix:<path>`. grpcio 1.85 binds a 107-byte
    path in this form but refuses one over 105 bytes written `unix://<path>`."""
    return f"unix:{path}"


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def registration_socket_path(registrar_dir: Path, driver_name: str, pod_uid: str = "") -> Path:
    """The registration socket path, exactly as the Go kubeletplugin library names it.

    Without a pod UID: `<driver>-reg.sock`. With one, the first candidate whose full path fits,
    so that an old and a new pod never fight over one file. Go's limit is 108 bytes, gRPC core's
    107: where a candidate is exactly 108 bytes Go would take it, and a Python server could not
    bind it, so the next candidate (unique per pod all the same) is taken; everywhere else the
    choice is Go's, byte for byte.
    """
    if not pod_uid:
        return registrar_dir / f"{driver_name}-reg.sock"
    h8 = _b64(hashlib.sha256(pod_uid.encode()).digest()[:8])
    h16 = _b64(hashlib.sha256(driver_name.encode() + b"\x00" + pod_uid.encode()).digest()[:16])
    for name in (f"{driver_name}-{pod_uid}-reg.sock", f"{driver_name}-{h8}-reg.sock"):
        path = registrar_dir / name
        if len(str(path).encode()) <= UNIX_PATH_MAX:
            return path
    return registrar_dir / f"dra-{h16}-reg.sock"


def dra_socket_path(data_dir: Path, pod_uid: str = "") -> Path:
    """`<data dir>/dra.sock`, or `dra-<podUID>.sock` in rolling-update mode (not hashed upstream)."""
    return data_dir / (f"dra-{pod_uid}.sock" if pod_uid else "dra.sock")


def check_socket_path(path: Path) -> None:
    if len(str(path).encode()) > UNIX_PATH_MAX:
        raise ValueError(
            f"socket path {str(path)!r} is {len(str(path).encode())} bytes, over the {UNIX_PATH_MAX}-byte "
            "limit of gRPC's Unix sockets; use a shorter --kubelet-plugins-dir or driver name"
        )


@dataclass
class RegistrationState:
    registered: bool = False
    error: str = ""
    notifications: int = 0


class RegistrationServicer(reg_grpc.RegistrationServicer):
    """Answers the kubelet's GetInfo and records NotifyRegistrationStatus.

    Both may be called any number of times: the kubelet calls them again after every restart.
    """

    def __init__(self, driver_name: str, endpoint: Path, supported_versions: list[str]) -> None:
        self._info = reg_pb2.PluginInfo(
            type=PLUGIN_TYPE,
            name=driver_name,
            endpoint=str(endpoint.absolute()),
            supported_versions=supported_versions,
        )
        self._lock = threading.Lock()
        self._state = RegistrationState()
        self.changed = threading.Condition(self._lock)

    def GetInfo(self, request: reg_pb2.InfoRequest, context: grpc.ServicerContext) -> reg_pb2.PluginInfo:
        return self._info

    def NotifyRegistrationStatus(
        self, request: reg_pb2.RegistrationStatus, context: grpc.ServicerContext
    ) -> reg_pb2.RegistrationStatusResponse:
        with self._lock:
            self._state = RegistrationState(
                registered=request.plugin_registered,
                error=request.error,
                notifications=self._state.notifications + 1,
            )
            self.changed.notify_all()
        if request.plugin_registered:
            log.info("registered with the kubelet")
            return reg_pb2.RegistrationStatusResponse()
        log.error("kubelet rejected the registration: %s", request.error)
        context.abort(grpc.StatusCode.UNKNOWN, f"failed registration process: {request.error}")
        raise AssertionError("unreachable")  # context.abort raises

    @property
    def state(self) -> RegistrationState:
        with self._lock:
            return self._state
