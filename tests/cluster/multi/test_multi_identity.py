"""Node identities kept apart: one node's Tandem, and one node's kubelet, cannot touch another
node's ResourceSlices, with the real credentials `hack/cluster.sh` gave each node.

Tandem's credentials are a token of its service account bound to its own Node (`kubectl create
token --bound-object-kind Node`, as the kubelet mounts it in the driver's pod), which the API server
turns into the node-name claim that daemonset.yaml's admission policy `tandem-driver-own-node-slices`
checks. The kubelet's are its client certificate, system:node:<name>, which the Node authorizer and
the NodeRestriction admission plugin check.
"""

from __future__ import annotations

import copy
from typing import Any

from kube import DRIVER, Cluster
from multinode import Node, kubectl_as, versions


def forged_slice(owner: Node) -> dict[str, Any]:
    """A slice that claims a pool on `owner`'s node."""
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": f"forged-{owner.name}"},
        "spec": {
            "driver": DRIVER,
            "nodeName": owner.name,
            "pool": {"name": owner.name, "generation": 1, "resourceSliceCount": 1},
            "devices": [],
        },
    }


def labelled(obj: dict[str, Any]) -> dict[str, Any]:
    """`obj` as an update would send it: the same object, one label more."""
    changed = copy.deepcopy(obj)
    changed["metadata"].pop("managedFields", None)
    changed["metadata"].setdefault("labels", {})["e2e.tandem.dev/touched"] = "yes"
    return changed


def test_one_nodes_tandem_cannot_create_update_or_delete_another_nodes_slices(
    cluster: Cluster, nodes: list[Node]
) -> None:
    owner, intruder = nodes[0], nodes[1]
    before = versions(owner.slices())
    target = owner.slices()[0]
    refused = f"the Tandem driver on node '{intruder.name}' may not modify ResourceSlices of node '{owner.name}'"
    as_tandem = intruder.tandem_kubeconfig
    assert refused in kubectl_as(cluster, as_tandem, "create", "-f", "-", body=forged_slice(owner))
    assert refused in kubectl_as(cluster, as_tandem, "replace", "-f", "-", body=labelled(target))
    assert refused in kubectl_as(cluster, as_tandem, "delete", "resourceslice", target["metadata"]["name"])
    # The same credentials may write their own node's slices: the refusals are about the node.
    own = intruder.slices()[0]
    assert kubectl_as(cluster, as_tandem, "replace", "--dry-run=server", "-f", "-", body=labelled(own)) == ""
    assert kubectl_as(cluster, as_tandem, "delete", "--dry-run=server", "resourceslice", own["metadata"]["name"]) == ""
    assert versions(owner.slices()) == before


def test_one_nodes_kubelet_cannot_create_or_delete_another_nodes_slices(cluster: Cluster, nodes: list[Node]) -> None:
    owner, intruder = nodes[2], nodes[1]
    before = versions(owner.slices())
    target = owner.slices()[0]["metadata"]["name"]
    as_kubelet = intruder.kubelet_kubeconfig
    # NodeRestriction reads the new object's node; the Node authorizer knows which slices are whose.
    refused = kubectl_as(cluster, as_kubelet, "create", "-f", "-", body=forged_slice(owner))
    assert "can only create ResourceSlice with the same NodeName as the requesting node" in refused
    refused = kubectl_as(cluster, as_kubelet, "delete", "resourceslice", target)
    assert f'User "system:node:{intruder.name}" cannot delete resource "resourceslices"' in refused, refused
    own = intruder.slices()[0]["metadata"]["name"]
    assert kubectl_as(cluster, as_kubelet, "delete", "--dry-run=server", "resourceslice", own) == ""
    assert versions(owner.slices()) == before
