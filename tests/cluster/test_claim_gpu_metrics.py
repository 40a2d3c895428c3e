"""Per-pod GPU metrics in the real cluster: a pod's GPU shows up in Tandem's /metrics under the
pod's namespace and name, with what the (simulated) NVML reports of that GPU, and its series are
gone once the pod is deleted and the kubelet has unprepared its claim."""

from __future__ import annotations

import socket
import urllib.request
from collections.abc import Iterator

import pytest
from kube import Cluster, attribute, claim_template, pod, report_script, request, wait_for, wait_report
from prometheus_client.parser import text_string_to_metric_families

from sim.nvml import read_state, set_usage

GPU = "gpu-2"
GIB = 1024**3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def metrics_port(tandem) -> int:
    port = _free_port()
    tandem.ensure("--metrics-address", f"127.0.0.1:{port}")
    return port


@pytest.fixture
def busy_gpu(cluster: Cluster, tandem) -> Iterator[str]:
    """GPU's UUID, reported by NVML as 42 % busy with 3 GiB in use; idle again afterwards."""
    uuid = attribute(cluster.devices()[GPU], "uuid")
    set_usage(tandem.node.nvml_state, uuid, utilization=42, memory_used=3 * GIB)
    yield uuid
    set_usage(tandem.node.nvml_state, uuid, utilization=0, memory_used=0)


def claim_gpu_series(port: int, namespace: str) -> dict[str, dict[str, object]]:
    """This namespace's `tandem_claim_gpu_*` samples: by metric name, its labels and value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    return {
        s.name: {**s.labels, "value": s.value}
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith("tandem_claim_gpu_") and s.labels.get("namespace") == namespace
    }


def test_a_pods_gpu_shows_under_its_labels_and_goes_with_the_pod(
    cluster: Cluster, tandem, metrics_port: int, busy_gpu: str, namespace: str
) -> None:
    gpu = request("gpu", "gpu.tandem.dev", f'device.attributes["tandem.dev"].uuid == "{busy_gpu}"')
    cluster.apply(claim_template("one-gpu", [gpu]), pod(cluster, "trainer", report_script("true"), {"gpu": "one-gpu"}),
                  namespace=namespace)  # fmt: skip
    wait_report(cluster, namespace, "trainer")
    (claim,) = [
        s["resourceClaimName"] for s in cluster.get("pod", "trainer", namespace)["status"]["resourceClaimStatuses"]
    ]

    series = wait_for("the pod's GPU series", lambda: claim_gpu_series(metrics_port, namespace), timeout=30)
    labels = {"namespace": namespace, "pod": "trainer", "claim": claim, "device": GPU, "uuid": busy_gpu}
    total = next(g.memory_bytes for g in read_state(tandem.node.nvml_state).gpus if g.uuid == busy_gpu)
    assert series == {
        "tandem_claim_gpu_utilization_ratio": {**labels, "value": 0.42},
        "tandem_claim_gpu_memory_used_bytes": {**labels, "value": 3 * GIB},
        "tandem_claim_gpu_memory_total_bytes": {**labels, "value": total},
    }

    cluster.kubectl("delete", "pod", "trainer", "-n", namespace, "--wait=true", "--timeout=120s", timeout=150)
    wait_for("the series gone with the pod", lambda: claim_gpu_series(metrics_port, namespace) == {}, timeout=60)
