"""Pod start in the real cluster of hack/cluster.sh: create-to-Running for pods with Tandem claims.

One pod at a time (20 by default) with a 1-GPU claim, then with a GPU+NIC claim on one PCIe root,
each from its ResourceClaimTemplate, so every figure includes the real scheduler's allocation, the
claim controller, the kubelet's NodePrepareResources call into Tandem and the container start. The
kubelet's own histograms say how much of it was spent in Tandem: `dra_grpc_operations_duration_seconds`
for the NodePrepareResources call, `dra_operations_duration_seconds` for the kubelet's whole DRA
prepare step around it. Timing starts at the create request and ends when a watch sees the pod
Running.
"""

from __future__ import annotations

import re
import statistics
import subprocess
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported by the benchmarks themselves, when they run: it is slow to import
    from kubernetes.client import CoreV1Api

REPO = Path(__file__).resolve().parent.parent
PREPARE_GRPC = "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources"
METRIC = re.compile(r"^(dra_\w+_duration_seconds)_(sum|count)\{([^}]*)\} (\S+)$")


def _cluster_env() -> dict[str, str] | None:
    proc = subprocess.run([str(REPO / "hack" / "cluster.sh"), "env"], capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        return None
    return dict(line.removeprefix("export ").split("=", 1) for line in proc.stdout.splitlines())


def _kubelet_prepare_seconds(api: CoreV1Api, node: str) -> dict[str, float]:
    """Cumulative sums and counts of the kubelet's DRA prepare histograms."""
    text = api.connect_get_node_proxy_with_path(node, "metrics")
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = METRIC.match(line)
        if not m:
            continue
        name, kind, labels, value = m.groups()
        if name == "dra_grpc_operations_duration_seconds" and PREPARE_GRPC in labels and 'code="OK"' in labels:
            out[f"grpc_{kind}"] = out.get(f"grpc_{kind}", 0.0) + float(value)
        elif name == "dra_operations_duration_seconds" and '"PrepareResources"' in labels and '"false"' in labels:
            out[f"op_{kind}"] = out.get(f"op_{kind}", 0.0) + float(value)
    return out


def _mean_ms(before: dict[str, float], after: dict[str, float], kind: str) -> float:
    """Mean milliseconds per call between two readings; a histogram the kubelet has not reported
    yet (no call of that kind since it started: a fresh cluster) counts as zero calls."""
    calls = after.get(f"{kind}_count", 0.0) - before.get(f"{kind}_count", 0.0)
    seconds = after.get(f"{kind}_sum", 0.0) - before.get(f"{kind}_sum", 0.0)
    return 1000 * seconds / max(1.0, calls)


def _template(name: str, with_nic: bool) -> dict[str, Any]:
    requests = [{"name": "gpu", "exactly": {"deviceClassName": "gpu.tandem.dev"}}]
    devices: dict[str, Any] = {"requests": requests}
    if with_nic:
        requests.append({"name": "nic", "exactly": {"deviceClassName": "nic.tandem.dev"}})
        devices["constraints"] = [{"requests": ["gpu", "nic"], "matchAttribute": "resource.kubernetes.io/pcieRoot"}]
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate", "metadata": {"name": name},
            "spec": {"spec": {"devices": devices}}}  # fmt: skip


def _pod(name: str, template: str, image: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
        "spec": {
            "restartPolicy": "Never", "terminationGracePeriodSeconds": 1,
            "resourceClaims": [{"name": "devices", "resourceClaimTemplateName": template}],
            "containers": [{"name": "main", "image": image, "command": ["sleep", "3600"],
                            "resources": {"claims": [{"name": "devices"}]}}],
        },
    }  # fmt: skip


def _one_pod_start(core: CoreV1Api, namespace: str, body: dict[str, Any]) -> float:
    from kubernetes.client import V1Pod
    from kubernetes.watch import Watch

    w = Watch()
    t0 = time.perf_counter()
    created = core.create_namespaced_pod(namespace, V1Pod.model_validate(body)).metadata
    try:
        for event in w.stream(
            core.list_namespaced_pod,
            namespace,
            timeout_seconds=120,
            field_selector=f"metadata.name={body['metadata']['name']}",
            resource_version=created.resource_version if created else None,
        ):
            if event["object"].status.phase == "Running":
                return time.perf_counter() - t0
    finally:
        w.stop()
    raise RuntimeError(f"pod {body['metadata']['name']} did not reach Running in 120 s")


def _delete_and_wait(core: CoreV1Api, namespace: str, name: str) -> None:
    """Each pod starts on a node where the one before is gone and its claim unprepared: a pod forced
    away (grace 0) leaves the API before the kubelet unprepares its claim, the scheduler hands the
    same GPU to the next claim, and Tandem refuses that prepare until the old one is undone."""
    from kubernetes.watch import Watch

    w = Watch()
    core.delete_namespaced_pod(name, namespace, grace_period_seconds=1)
    for event in w.stream(core.list_namespaced_pod, namespace, timeout_seconds=120,
                          field_selector=f"metadata.name={name}"):  # fmt: skip
        if event["type"] == "DELETED":
            w.stop()
            return
    raise RuntimeError(f"pod {name} was not deleted in 120 s")


def _node_name(core: CoreV1Api) -> str:
    """The cluster's one node (the client's models leave every field optional)."""
    meta = core.list_node().items[0].metadata
    if meta is None or not meta.name:
        raise RuntimeError("the cluster's node has no name")
    return meta.name


def bench_pod_start(pods: int = 20) -> dict[str, Any]:
    env = _cluster_env()
    if env is None:
        return {"skipped": "the real cluster is not built or not up: run hack/cluster.sh up (root and Go)"}
    from kubernetes import client, config, utils

    config.load_kube_config(env["KUBECONFIG"])
    api = client.ApiClient()
    core = client.CoreV1Api(api)
    node = _node_name(core)
    namespace = f"bench-{uuid.uuid4().hex[:6]}"
    core.create_namespace(client.V1Namespace.model_validate({"metadata": {"name": namespace}}))
    out: dict[str, Any] = {}
    try:
        for label, with_nic in (("1_gpu", False), ("gpu_and_nic_one_pcie_root", True)):
            utils.create_from_dict(api, _template(label.replace("_", "-"), with_nic), namespace=namespace)
            times: list[float] = []
            before = _kubelet_prepare_seconds(core, node)
            for i in range(pods):
                name = f"{label.replace('_', '-')}-{i}"
                times.append(
                    _one_pod_start(core, namespace, _pod(name, label.replace("_", "-"), env["TANDEM_TEST_IMAGE"]))
                )
                _delete_and_wait(core, namespace, name)
            after = _kubelet_prepare_seconds(core, node)
            grpc_ms = _mean_ms(before, after, "grpc")
            op_ms = _mean_ms(before, after, "op")
            p50 = statistics.median(times) * 1000
            out[label] = {
                "pods": pods,
                "create_to_running_p50_ms": round(p50, 1),
                "create_to_running_max_ms": round(max(times) * 1000, 1),
                "node_prepare_resources_mean_ms": round(grpc_ms, 1),
                "kubelet_dra_prepare_mean_ms": round(op_ms, 1),
                "share_in_tandem_percent": round(100 * grpc_ms / p50, 1),
            }
    finally:
        core.delete_namespace(namespace)
    return out
