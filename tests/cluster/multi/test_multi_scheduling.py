"""The real scheduler choosing between nodes by what each node's Tandem publishes.

A GPU and the NIC behind the same PCIe switch (examples/gpu-nic-switch.yaml, a `matchAttribute`
constraint) go to the one node that still has such a pair once the other two are full; a claim that
no node can satisfy stays Pending, with the scheduler's reason on the pod.
"""

from __future__ import annotations

from typing import Any

from kube import Cluster, attribute, claim_template, example, pod, report_script, request, wait_for, wait_pod
from multinode import Node

SWITCH = "pcieSwitch"


def fill(cluster: Cluster, namespace: str, node: Node) -> str:
    """A running pod on `node` holding every GPU it has; its name."""
    name = f"fill-{node.name}"
    count = len(node.devices("gpu"))
    cluster.apply(claim_template(name, [request("gpu", "gpu.tandem.dev", count=count)]), namespace=namespace)
    p = pod(cluster, name, report_script("true"), {"gpus": name})
    p["spec"]["nodeSelector"] = {"kubernetes.io/hostname": node.name}
    cluster.apply(p, namespace=namespace)
    return name


def allocation(cluster: Cluster, namespace: str, pod_name: str) -> list[dict[str, Any]]:
    """The allocation results of the pod's claims."""
    found = []
    for s in cluster.get("pod", pod_name, namespace)["status"].get("resourceClaimStatuses") or []:
        claim = cluster.get("resourceclaim", s["resourceClaimName"], namespace)
        found += claim["status"]["allocation"]["devices"]["results"]
    return found


def unschedulable(cluster: Cluster, namespace: str, pod_name: str) -> str | None:
    """The scheduler's message once it has judged the pod unschedulable."""
    conditions = (cluster.get("pod", pod_name, namespace) or {}).get("status", {}).get("conditions") or []
    for c in conditions:
        if c["type"] == "PodScheduled" and c["status"] == "False" and c.get("reason") == "Unschedulable":
            return c.get("message", "")
    return None


def test_a_same_switch_pair_goes_to_the_node_that_still_has_one(
    cluster: Cluster, nodes: list[Node], namespace: str
) -> None:
    first, middle, last = nodes
    # The two others full, an HGX board and the small one: only the middle node can take the pair,
    # whichever order the scheduler would otherwise try the nodes in.
    for full in (first, last):
        wait_pod(cluster, namespace, fill(cluster, namespace, full), ("Running",))
    cluster.apply(example(cluster, "gpu-nic-switch", report_script("true")), namespace=namespace)
    placed = wait_pod(cluster, namespace, "gpu-nic-switch-pod", ("Running",))
    assert placed["spec"]["nodeName"] == middle.name
    results = allocation(cluster, namespace, "gpu-nic-switch-pod")
    assert {r["pool"] for r in results} == {middle.name}
    by_request = {r["request"]: r["device"] for r in results}
    gpus, nics = middle.devices("gpu"), middle.devices("nic")
    gpu, nic = gpus[by_request["gpu"]], nics[by_request["nic/same-switch"]]  # the first choice was there
    assert attribute(gpu, SWITCH) == attribute(nic, SWITCH) is not None


def test_a_claim_no_node_can_satisfy_stays_pending_with_the_schedulers_reason(
    cluster: Cluster, nodes: list[Node], namespace: str
) -> None:
    most = max(len(n.devices("gpu")) for n in nodes)
    cluster.apply(claim_template("too-many", [request("gpu", "gpu.tandem.dev", count=most + 1)]), namespace=namespace)
    cluster.apply(pod(cluster, "too-big", "true", {"gpus": "too-many"}), namespace=namespace)
    message = wait_for("the scheduler's verdict on too-big", lambda: unschedulable(cluster, namespace, "too-big"))
    # Every node was tried and each said why (the dynamicresources plugin's reason, 1.37).
    assert f"0/{len(nodes)} nodes are available: {len(nodes)} cannot allocate all claims" in message, message
    claim = cluster.get("resourceclaims", namespace=namespace)[0]
    assert "allocation" not in claim.get("status", {})
    assert cluster.get("pod", "too-big", namespace)["status"]["phase"] == "Pending"
