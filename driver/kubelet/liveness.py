"""Liveness check that exercises the same sockets the kubelet uses.

A process can be running while its gRPC servers are wedged; the only honest probe is the
kubelet's own path: GetInfo on the registration socket, then an empty NodePrepareResources on
the DRA endpoint it names (an empty request must always succeed).
"""

from __future__ import annotations

from pathlib import Path

import grpc

from driver.errors import EndpointError
from driver.kubelet.api.dra.v1 import api_pb2 as dra_pb2
from driver.kubelet.api.dra.v1 import api_pb2_grpc as dra_grpc
from driver.kubelet.api.pluginregistration.v1 import api_pb2 as reg_pb2
from driver.kubelet.api.pluginregistration.v1 import api_pb2_grpc as reg_grpc
from driver.kubelet.registration import PLUGIN_TYPE


class NotAlive(EndpointError):
    pass


def check(reg_socket: Path, driver_name: str, timeout: float = 5.0) -> str:
    """Returns the DRA endpoint on success; raises NotAlive saying which step failed."""
    try:
        with grpc.insecure_channel(f"unix://{reg_socket}") as ch:
            info: reg_pb2.PluginInfo = reg_grpc.RegistrationStub(ch).GetInfo(reg_pb2.InfoRequest(), timeout=timeout)
    except grpc.RpcError as e:
        raise NotAlive(f"GetInfo on {reg_socket} failed: {e.code().name} {e.details()}") from e
    if info.type != PLUGIN_TYPE or info.name != driver_name:
        raise NotAlive(f"{reg_socket} answers as {info.type}/{info.name}, not {PLUGIN_TYPE}/{driver_name}")
    try:
        with grpc.insecure_channel(f"unix://{info.endpoint}") as ch:
            dra_grpc.DRAPluginStub(ch).NodePrepareResources(dra_pb2.NodePrepareResourcesRequest(), timeout=timeout)
    except grpc.RpcError as e:
        raise NotAlive(f"empty NodePrepareResources on {info.endpoint} failed: {e.code().name} {e.details()}") from e
    return info.endpoint
