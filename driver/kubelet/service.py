"""The kubelet's DRAPlugin v1 and v1beta1 services, both backed by one Preparer.

v1beta1 has the same messages as v1 minus `Device.share_id`, so the only difference between
the two servicers is which generated module builds the response.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from types import ModuleType
from typing import Protocol

import grpc

from driver.claims.allocation import ClaimRef
from driver.claims.prepare import Preparer, PrepareResult
from driver.claims.unprepare import Unprepared
from driver.kubelet.api.dra.v1 import api_pb2 as v1_pb2
from driver.kubelet.api.dra.v1 import api_pb2_grpc as v1_grpc
from driver.kubelet.api.dra.v1beta1 import api_pb2 as v1beta1_pb2
from driver.kubelet.api.dra.v1beta1 import api_pb2_grpc as v1beta1_grpc

log = logging.getLogger(__name__)

# What GetInfo advertises, in the kubelet's order of preference (it takes the first it knows).
DRA_SERVICES = ["v1.DRAPlugin", "v1beta1.DRAPlugin"]


# The requests of both versions: the same fields. The answers are built from `pb2`, the version's module.
PrepareRequest = v1_pb2.NodePrepareResourcesRequest | v1beta1_pb2.NodePrepareResourcesRequest
UnprepareRequest = v1_pb2.NodeUnprepareResourcesRequest | v1beta1_pb2.NodeUnprepareResourcesRequest


def _refs(request: PrepareRequest | UnprepareRequest) -> list[ClaimRef]:
    return [ClaimRef(namespace=c.namespace, name=c.name, uid=c.uid) for c in request.claims]


def _failed_kinds(results: dict[str, PrepareResult] | dict[str, Unprepared]) -> list[str]:
    """The kind of each failed claim's error, for the metrics; "other" where none was given (a bug)."""
    return [r.error_kind or "other" for r in results.values() if r.error]


class CallMetrics(Protocol):
    """What counts the kubelet's calls (`driver.metrics.Metrics`)."""

    def in_flight(self, op: str) -> AbstractContextManager[object]:
        """Held while a call of `op` runs."""

    def observe(self, op: str, seconds: float, claims: int, errors: Sequence[str]) -> None:
        """One finished call; `errors` has one entry per failed claim: its error's kind."""


class _Ignore:
    def in_flight(self, op: str) -> AbstractContextManager[object]:
        return nullcontext()

    def observe(self, op: str, seconds: float, claims: int, errors: Sequence[str]) -> None:
        return None


NO_METRICS = _Ignore()


class _DRAPluginBase:
    pb2: ModuleType
    with_share_id: bool

    def __init__(self, preparer: Preparer, metrics: CallMetrics = NO_METRICS) -> None:
        self._preparer = preparer
        self._metrics = metrics

    def _counted(self, refs: list[ClaimRef]) -> CallMetrics:
        """The metrics of a call with claims: an empty one is a liveness check (the daemon checks
        itself every 10 s, `driver.kubelet.liveness`), which would swamp the call rate."""
        return self._metrics if refs else NO_METRICS

    def NodePrepareResources(self, request: PrepareRequest, context: grpc.ServicerContext) -> object:
        refs = _refs(request)
        t0, metrics = time.monotonic(), self._counted(refs)
        with metrics.in_flight("prepare"):
            results = self._preparer.prepare(refs, alive=context.is_active)
        metrics.observe("prepare", time.monotonic() - t0, len(refs), _failed_kinds(results))
        resp = self.pb2.NodePrepareResourcesResponse()
        for uid, result in results.items():
            entry = resp.claims[uid]
            if result.error:
                entry.error = result.error
                continue
            for d in result.devices:
                dev = entry.devices.add(
                    request_names=list(d.request_names),
                    pool_name=d.pool,
                    device_name=d.device,
                    cdi_device_ids=list(d.cdi_device_ids),
                )
                if self.with_share_id and d.share_id is not None:
                    dev.share_id = d.share_id
        return resp

    def NodeUnprepareResources(self, request: UnprepareRequest, context: grpc.ServicerContext) -> object:
        refs = _refs(request)
        t0, metrics = time.monotonic(), self._counted(refs)
        with metrics.in_flight("unprepare"):
            results = self._preparer.unprepare(refs)
        metrics.observe("unprepare", time.monotonic() - t0, len(refs), _failed_kinds(results))
        resp = self.pb2.NodeUnprepareResourcesResponse()
        for uid, result in results.items():
            resp.claims[uid].error = result.error
        return resp


class DRAPluginV1(_DRAPluginBase, v1_grpc.DRAPluginServicer):
    pb2 = v1_pb2
    with_share_id = True


class DRAPluginV1beta1(_DRAPluginBase, v1beta1_grpc.DRAPluginServicer):
    pb2 = v1beta1_pb2
    with_share_id = False


def add_dra_services(server: grpc.Server, preparer: Preparer, metrics: CallMetrics = NO_METRICS) -> list[str]:
    """Registers both DRAPlugin versions; returns the strings GetInfo must advertise for them."""
    v1_grpc.add_DRAPluginServicer_to_server(DRAPluginV1(preparer, metrics), server)
    v1beta1_grpc.add_DRAPluginServicer_to_server(DRAPluginV1beta1(preparer, metrics), server)
    return list(DRA_SERVICES)
