"""The kubelet's calls reach the metrics: each failed claim by its error's kind, and the call
counted in flight while it runs."""

from __future__ import annotations

from types import SimpleNamespace

from driver.claims.prepare import PrepareResult
from driver.inventory import Inventory
from driver.kubelet.api.dra.v1 import api_pb2
from driver.kubelet.service import DRAPluginV1
from driver.metrics import Metrics


class FakePreparer:
    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self.in_flight_seen: list[bytes] = []

    def prepare(self, refs, alive):
        self.in_flight_seen.append(self.metrics.render())
        return {
            "a": PrepareResult(error="no such device", error_kind="config"),
            "b": PrepareResult(error="MIG device not made", error_kind="device"),
            "c": PrepareResult(),
        }

    def unprepare(self, refs):
        return {"a": "gone wrong"}


def test_prepare_counts_errors_by_kind_and_the_call_in_flight():
    metrics = Metrics(Inventory())
    preparer = FakePreparer(metrics)
    service = DRAPluginV1(preparer, metrics)  # type: ignore[arg-type]
    claims = [api_pb2.Claim(namespace="ns", name=n, uid=n) for n in "abc"]
    service.NodePrepareResources(api_pb2.NodePrepareResourcesRequest(claims=claims), SimpleNamespace(is_active=None))
    service.NodeUnprepareResources(api_pb2.NodeUnprepareResourcesRequest(claims=claims[:1]), None)
    assert b'tandem_node_calls_in_flight{op="prepare"} 1.0' in preparer.in_flight_seen[0]
    text = metrics.render().decode()
    assert 'tandem_node_calls_in_flight{op="prepare"} 0.0' in text
    assert 'tandem_prepare_errors_total{error_type="config"} 1.0' in text
    assert 'tandem_prepare_errors_total{error_type="device"} 1.0' in text
    assert 'tandem_node_claims_total{op="prepare",result="error"} 2.0' in text
    assert 'tandem_node_claims_total{op="unprepare",result="error"} 1.0' in text
