"""The control plane restarted under three nodes: etcd and kube-apiserver stop and start again.

Every node's Tandem loses its slice watch, lists again and confirms its slices against the new
watch; none of them writes a slice it need not (each slice keeps its resourceVersion, the publisher
its write count), and the pods holding claims on every node run on, untouched.
"""

from __future__ import annotations

import calendar
import time

from kube import Cluster, claim_template, pod, report_script, request, wait_for, wait_pod
from multinode import Node, containers, versions


def published_at(node: Node) -> float:
    """When the node's Tandem last confirmed its slices, as Unix time (0 before the first time)."""
    stamp = node.publisher().get("publishedAt")
    return float(calendar.timegm(time.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ"))) if stamp else 0.0


def test_a_restarted_control_plane_makes_no_node_republish_and_leaves_pods_running(
    cluster: Cluster, nodes: list[Node], namespace: str
) -> None:
    cluster.apply(claim_template("one-gpu", [request("gpu", "gpu.tandem.dev")]), namespace=namespace)
    for n in nodes:
        p = pod(cluster, f"on-{n.name}", report_script("true"), {"gpu": "one-gpu"})
        p["spec"]["nodeSelector"] = {"kubernetes.io/hostname": n.name}
        cluster.apply(p, namespace=namespace)
    for n in nodes:
        wait_pod(cluster, namespace, f"on-{n.name}", ("Running",))
    slices = {n.name: versions(n.slices()) for n in nodes}
    writes = {n.name: n.publisher()["writes"] for n in nodes}
    running = {n.name: containers(cluster, namespace, f"on-{n.name}") for n in nodes}
    since = int(time.time()) + 1  # publishedAt has whole seconds
    cluster.cluster_sh("restart", "etcd")
    cluster.cluster_sh("restart", "kube-apiserver")
    for n in nodes:
        wait_for(f"{n.name}'s Tandem confirming its slices after the restart", lambda n=n: published_at(n) >= since,
                 timeout=120)  # fmt: skip
    assert {n.name: n.publisher()["writes"] for n in nodes} == writes
    assert {n.name: versions(n.slices()) for n in nodes} == slices
    assert {n.name: containers(cluster, namespace, f"on-{n.name}") for n in nodes} == running
