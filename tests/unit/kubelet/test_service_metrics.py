"""The kubelet's calls reach the metrics: each failed claim by its error's kind, and the call
counted in flight while it runs."""

from __future__ import annotations

from types import SimpleNamespace

from driver.claims.prepare import PrepareResult
from driver.claims.unprepare import Unprepared
from driver.inventory.store import Inventory
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
        return {"a": Unprepared("the MIG device is busy", "device"), "b": Unprepared()}


def test_prepare_and_unprepare_count_errors_by_kind_and_the_call_in_flight():
    metrics = Metrics(Inventory())
    preparer = FakePreparer(metrics)
    service = DRAPluginV1(preparer, metrics)  # type: ignore[arg-type]
    claims = [api_pb2.Claim(namespace="ns", name=n, uid=n) for n in "abc"]
    service.NodePrepareResources(api_pb2.NodePrepareResourcesRequest(claims=claims), SimpleNamespace(is_active=None))
    unprepared = service.NodeUnprepareResources(api_pb2.NodeUnprepareResourcesRequest(claims=claims[:2]), None)
    assert b'tandem_node_calls_in_flight{op="prepare"} 1.0' in preparer.in_flight_seen[0]
    text = metrics.render().decode()
    assert 'tandem_node_calls_in_flight{op="prepare"} 0.0' in text
    assert 'tandem_claim_errors_total{error_type="config",op="prepare"} 1.0' in text
    assert 'tandem_claim_errors_total{error_type="device",op="prepare"} 1.0' in text
    assert 'tandem_claim_errors_total{error_type="device",op="unprepare"} 1.0' in text
    assert 'tandem_claim_errors_total{error_type="other",op="unprepare"} 0.0' in text
    assert 'tandem_node_claims_total{op="prepare",result="error"} 2.0' in text
    assert 'tandem_node_claims_total{op="unprepare",result="error"} 1.0' in text
    assert unprepared.claims["a"].error == "the MIG device is busy" and unprepared.claims["b"].error == ""


def test_an_empty_call_is_a_liveness_check_and_not_counted():
    metrics = Metrics(Inventory())
    service = DRAPluginV1(FakePreparer(metrics), metrics)  # type: ignore[arg-type]
    service.NodePrepareResources(api_pb2.NodePrepareResourcesRequest(), SimpleNamespace(is_active=None))
    service.NodeUnprepareResources(api_pb2.NodeUnprepareResourcesRequest(), None)
    text = metrics.render().decode()
    assert 'tandem_node_calls_total{op="prepare"} 0.0' in text and 'tandem_node_calls_total{op="unprepare"} 0.0' in text
