"""Device health in the real cluster: an XID raised in the simulated NVML becomes a device taint that
the real scheduler honours and the real controller manager evicts for, and that clears again;
and a DeviceTaintRule from examples/ works against the real API."""

from __future__ import annotations

import os
import signal
from typing import Any

import pytest
from kube import Cluster, attribute, claim_template, example, pod, report_script, request, wait_for, wait_report

from sim.nvml import append_event

XID_EVENT = 0x8  # nvmlEventTypeXidCriticalError
XID_NO_SCHEDULE = 92  # high single-bit ECC error rate: keep new work away, leave running pods alone
XID_NO_EXECUTE = 79  # GPU fallen off the bus: needs a reset, so evict
QUIET = 6  # seconds without a new XID before its taint clears (short here; 600 by default)
GPU = "gpu-3"


def taints(cluster: Cluster, device: str) -> list[dict[str, Any]]:
    return cluster.devices()[device].get("taints") or []


def claim_for(name: str, uuid: str, tolerations: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """A template whose one request can only be met by the GPU with this UUID."""
    r = request("gpu", "gpu.tandem.dev", f'device.attributes["tandem.dev"].uuid == "{uuid}"')
    if tolerations:
        r["exactly"]["tolerations"] = tolerations
    return claim_template(name, [r])


def unschedulable(cluster: Cluster, namespace: str, name: str) -> bool:
    conditions = (cluster.get("pod", name, namespace) or {}).get("status", {}).get("conditions") or []
    return any(c["type"] == "PodScheduled" and c.get("reason") == "Unschedulable" for c in conditions)


@pytest.fixture
def healthy_gpu(cluster: Cluster, tandem) -> str:
    """GPU's UUID, on a Tandem with a short quiet period and no taint left on the GPU."""
    tandem.ensure("--health-quiet-period", str(QUIET))
    wait_for(f"{GPU} untainted", lambda: not taints(cluster, GPU), timeout=QUIET * 3)
    return attribute(cluster.devices()[GPU], "uuid")


def test_xid_taint_keeps_new_pods_away_until_it_clears(cluster: Cluster, tandem, healthy_gpu: str,
                                                       namespace: str) -> None:  # fmt: skip
    append_event(tandem.node.nvml_state, healthy_gpu, XID_EVENT, XID_NO_SCHEDULE)
    (taint,) = wait_for("the XID taint in the slice", lambda: taints(cluster, GPU))
    assert (taint["key"], taint["effect"]) == ("tandem.dev/xid", "NoSchedule")

    cluster.apply(claim_for("gpu-3", healthy_gpu), pod(cluster, "refused", "true", {"gpu": "gpu-3"}),
                  namespace=namespace)  # fmt: skip
    wait_for("the scheduler to refuse the tainted GPU", lambda: unschedulable(cluster, namespace, "refused"))

    wait_for("the taint to clear after the quiet period", lambda: not taints(cluster, GPU), timeout=QUIET * 4)
    cluster.apply(pod(cluster, "accepted", report_script("true"), {"gpu": "gpu-3"}), namespace=namespace)
    wait_report(cluster, namespace, "accepted")


def test_no_execute_xid_evicts_the_running_pod(cluster: Cluster, tandem, healthy_gpu: str, namespace: str) -> None:
    cluster.apply(claim_for("gpu-3", healthy_gpu), pod(cluster, "victim", report_script("true"), {"gpu": "gpu-3"}),
                  namespace=namespace)  # fmt: skip
    wait_report(cluster, namespace, "victim")
    append_event(tandem.node.nvml_state, healthy_gpu, XID_EVENT, XID_NO_EXECUTE)
    wait_for("a NoExecute taint", lambda: any(t["effect"] == "NoExecute" for t in taints(cluster, GPU)))

    def evicted() -> bool:
        p = cluster.get("pod", "victim", namespace)
        if p is None or p["metadata"].get("deletionTimestamp"):
            return True
        return any(c["type"] == "DisruptionTarget" for c in p["status"].get("conditions") or [])

    wait_for("the controller manager to evict the pod", evicted)
    wait_for("the taint to clear after the quiet period", lambda: not taints(cluster, GPU), timeout=QUIET * 4)


def test_device_taint_rule_example(cluster: Cluster, tandem, healthy_gpu: str, namespace: str) -> None:
    """The cordon rule of examples/device-taint-rule.yaml, pointed at this cluster's node: a claim for
    the cordoned GPU waits; the example's tolerating claim may have it."""
    rule, _maintenance, tolerating = example(cluster, "device-taint-rule")
    rule["spec"]["deviceSelector"]["pool"] = cluster.node_name
    name = rule["metadata"]["name"]
    cluster.apply(rule)
    try:
        cluster.apply(claim_for("gpu-3", healthy_gpu), pod(cluster, "refused", "true", {"gpu": "gpu-3"}),
                      namespace=namespace)  # fmt: skip
        wait_for("the scheduler to honour the rule", lambda: unschedulable(cluster, namespace, "refused"))
        tolerations = tolerating["spec"]["spec"]["devices"]["requests"][0]["exactly"]["tolerations"]
        cluster.apply(claim_for("tolerating", healthy_gpu, tolerations),
                      pod(cluster, "diagnostics", report_script("true"), {"gpu": "tolerating"}),
                      namespace=namespace)  # fmt: skip
        wait_report(cluster, namespace, "diagnostics")
    finally:
        cluster.kubectl("delete", "devicetaintrule", name, "--wait=true")


def test_a_node_whose_api_server_is_stopped_says_so_and_recovers(cluster: Cluster, tandem) -> None:
    """The real kube-apiserver killed: the slices Tandem published can no longer follow health
    changes, and `tandemctl health` says so (exit 1, naming the API server) instead of "healthy";
    once the API server is back, the slices are confirmed again and health is clean (a watch
    resumed without a list confirmed nothing: driver/slices/cache.py, `_relist_until_listed`)."""
    tandem.ensure()
    wait_for("healthy to begin with", tandem.healthy)
    pid = int((cluster.state / "run" / "kube-apiserver.pid").read_text())
    try:
        os.kill(pid, signal.SIGKILL)
        # The broken watch is told first (the stream ends mid-read), the unreachable server once
        # the list that follows fails: health must come to name the server.
        outage = wait_for("tandemctl health to name the unreachable API server",
                          lambda: (h := tandem.health())[0] == 1 and "cannot be reached" in h[1] and h[1],
                          timeout=90)  # fmt: skip
        text = str(outage)
        assert "ResourceSlices not confirmed" in text, text
    finally:
        cluster.cluster_sh("restart", "kube-apiserver", timeout=300)
    wait_for("the API server back", lambda: cluster.kubectl("get", "--raw", "/readyz", timeout=10), timeout=120)
    wait_for("health clean once the slices are confirmed again", tandem.healthy, timeout=120)
