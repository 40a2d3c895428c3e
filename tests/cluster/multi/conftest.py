"""Fixtures of the three-node suite: the cluster of `hack/cluster.sh up --nodes 3` and its nodes.

`hack/e2e.sh --nodes 3` (and `hack/test.sh`, after the one-node suite) brings that cluster up and
sets TANDEM_E2E_NODES=3; then a cluster without those three nodes is a failure. Against the
one-node cluster every test here is skipped with that reason.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from kube import Cluster, wait_for
from multinode import NODES, Node


@pytest.fixture(scope="session")
def nodes(cluster: Cluster) -> Iterator[list[Node]]:
    """The three nodes, each Ready with Tandem serving it; afterwards each is that way again."""
    required = os.environ.get("TANDEM_E2E_NODES") == str(NODES)
    names = {n["metadata"]["name"] for n in cluster.get("nodes")}
    all_nodes = [Node(cluster, i) for i in range(1, NODES + 1)]
    missing = [n.name for n in all_nodes if n.name not in names]
    if missing:
        reason = f"the three-node cluster is not up (no {', '.join(missing)}): hack/e2e.sh --nodes 3 runs this suite"
        if required:
            pytest.fail(reason)
        pytest.skip(reason)
    for n in all_nodes:
        wait_for(f"Tandem on {n.name} serving", n.healthy, timeout=60)
    yield all_nodes
    for n in all_nodes:
        if not n.healthy():
            n.restart_tandem()
