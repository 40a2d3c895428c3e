"""A node's Tandem lost, and a node lost, in a three-node cluster.

Tandem killed on one node: its slices stay as they were (the kubelet removes a driver's slices only
when the driver stays away longer than its grace, `defaultWipingDelay`, 30 s in
pkg/kubelet/cm/dra/manager.go of 1.37), the other nodes go on preparing claims, and the restarted
Tandem finds its slices current and writes none.

A node deleted: in 1.37 nothing of the kubelet or the scheduler removes its slices (the kubelet
wipes them only when it starts and when a driver unregisters, pkg/kubelet/cm/dra/plugin/
dra_plugin_manager.go, and needs its Node to do so); the garbage collector of the
kube-controller-manager does, because Tandem makes each slice a dependent of its Node
(`ownerReferences`, driver/slices/build.py). The test stops the node's kubelet and Tandem first, as
when a machine is gone, so nothing else could have removed them.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from kube import Cluster, claim_template, pod, report_script, request, wait_for, wait_pod
from multinode import Node, kubectl_as, versions


def all_versions(nodes: list[Node]) -> dict[str, dict[str, str]]:
    return {n.name: versions(n.slices()) for n in nodes}


def test_a_killed_tandem_leaves_its_slices_and_the_other_nodes_alone(
    cluster: Cluster, nodes: list[Node], namespace: str
) -> None:
    lost, other = nodes[1], nodes[2]
    before = all_versions(nodes)
    lost.tandem.stop(signal.SIGKILL)
    assert not lost.healthy()
    # Another node prepares a claim while this one's Tandem is gone.
    cluster.apply(claim_template("one-gpu", [request("gpu", "gpu.tandem.dev")]), namespace=namespace)
    p = pod(cluster, "elsewhere", report_script("true"), {"gpu": "one-gpu"})
    p["spec"]["nodeSelector"] = {"kubernetes.io/hostname": other.name}
    cluster.apply(p, namespace=namespace)
    assert wait_pod(cluster, namespace, "elsewhere", ("Running",))["spec"]["nodeName"] == other.name
    assert all_versions(nodes) == before, "a slice was written or removed while one node's Tandem was down"
    lost.restart_tandem()
    assert all_versions(nodes) == before, "the restarted Tandem rewrote slices that were current"


def stop_pid_file(pid_file: Path) -> None:
    """SIGTERM to the process `hack/cluster.sh` started, and wait until it is gone."""
    pid = int(pid_file.read_text())
    os.kill(pid, signal.SIGTERM)

    def gone() -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return False

    wait_for(f"process {pid} gone", gone, timeout=30)


@pytest.fixture
def lost_node(cluster: Cluster, nodes: list[Node]) -> Iterator[Node]:
    """The small node, to be deleted; afterwards it is back as a new Node (its kubelet registers it
    again) with a Tandem whose token is bound to that new Node."""
    node = nodes[2]
    yield node
    cluster.cluster_sh("restart", "kubelet", node.name)
    node.restart_tandem()


def test_a_deleted_nodes_slices_are_removed_by_the_garbage_collector(
    cluster: Cluster, nodes: list[Node], lost_node: Node
) -> None:
    node = lost_node
    uid = cluster.get("node", node.name)["metadata"]["uid"]
    slices = node.slices()
    assert slices
    for s in slices:
        assert s["metadata"]["ownerReferences"] == [
            {"apiVersion": "v1", "kind": "Node", "name": node.name, "uid": uid, "controller": True}
        ]
    others = all_versions([n for n in nodes if n is not node])
    # The machine is gone: the kubelet first (it cancels its pending wipes when it stops), then Tandem.
    stop_pid_file(node.state / "run" / "kubelet.pid")
    node.tandem.stop()
    assert node.slices() == slices
    cluster.kubectl("delete", "node", node.name)
    wait_for(f"{node.name}'s slices removed", lambda: node.slices() == [], timeout=60)
    # Tandem's token was bound to that Node: it is refused now (once the API server's cache of
    # accepted tokens lets go of it, 10 s by default in 1.37), so nothing could bring them back.
    wait_for(
        f"the token of {node.name}'s Tandem refused",
        lambda: "Unauthorized" in kubectl_as(cluster, node.tandem_kubeconfig, "get", "resourceslices"),
        timeout=30,
    )
    assert all_versions([n for n in nodes if n is not node]) == others
