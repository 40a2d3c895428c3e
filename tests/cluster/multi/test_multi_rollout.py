"""Tandem's DaemonSet rolled to a new image over the three nodes while pods with claims run on each.

daemonset.yaml's DaemonSet (`maxSurge: 1`, `maxUnavailable: 0`: node by node, the new pod starts
beside the old one on pod-UID sockets, and the old one stops once the new one is Ready) takes the
place of every node's Tandem process, pointed at the simulated hardware as in test_daemonset.py.
Its one pod template names node 1's hardware directory, which in the mount namespace of nodes 2
and 3 is each node's own (hack/cluster/nodes.sh), so each pod publishes its own node's devices: the
small node's 4 GPUs and 2 NICs, not node 1's 8 and 4. Through the rollout a pod holding a GPU on
every node runs on, untouched; pods with claims created and deleted on every node meanwhile and
afterwards all run; and no slice is rewritten, as the devices did not change.
"""

from __future__ import annotations

import shutil
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from kube import (
    DRIVER_IMAGES,
    DRIVER_NAMESPACE,
    REPO,
    Cluster,
    claim_template,
    daemonset,
    driver_pods,
    pod,
    ready,
    report_script,
    request,
    wait_for,
    wait_pod,
)
from multinode import Node, containers, versions


def device_names(node: Node) -> set[str]:
    """Every device Tandem publishes for the node."""
    return {d["name"] for s in node.slices() for d in s["spec"].get("devices") or []}


def driver_pods_on(cluster: Cluster, node: Node) -> list[dict[str, Any]]:
    return [p for p in driver_pods(cluster) if p["spec"].get("nodeName") == node.name]


def on_node(p: dict[str, Any], node: Node) -> dict[str, Any]:
    """The pod pinned to `node`, so each node's Tandem prepares its claims whatever the scheduler prefers."""
    p["spec"]["nodeSelector"] = {"kubernetes.io/hostname": node.name}
    return p


@pytest.fixture(scope="module")
def deployed(cluster: Cluster, nodes: list[Node]) -> Iterator[None]:
    """The DaemonSet in place of every node's Tandem process, from a clean slate (no slices left
    behind); each node's driver pod Ready and publishing the devices its node's process published.
    Afterwards every node's Tandem process serves again, as the `nodes` fixture leaves them."""
    for image in DRIVER_IMAGES:
        cluster.cluster_sh("image", image, timeout=1200)
    published = {n.name: device_names(n) for n in nodes}
    try:
        for n in nodes:
            shutil.copytree(REPO / "sim" / "fake_pynvml", n.tandem.root / "fake_pynvml", dirs_exist_ok=True)
            n.tandem.stop()
            wait_for(f"Tandem on {n.name} deregistered", lambda n=n: not n.healthy())
        cluster.kubectl("delete", "resourceslices", "--field-selector", "spec.driver=tandem.dev", "--wait=true")
        cluster.apply(daemonset(nodes[0].tandem.root, DRIVER_IMAGES[0]))
        for n in nodes:
            wait_for(f"a driver pod Ready on {n.name}", lambda n=n: any(ready(p) for p in driver_pods_on(cluster, n)),
                     timeout=180)  # fmt: skip
            wait_for(f"the driver pod registered with {n.name}'s kubelet", n.healthy)
            wait_for(f"{n.name}'s slices published by its driver pod", n.slices)
            assert device_names(n) == published[n.name], f"{n.name}'s driver pod sees another node's hardware"
        yield
    finally:
        cluster.kubectl("delete", "daemonset", "tandem-driver", "-n", DRIVER_NAMESPACE, "--ignore-not-found", "--wait=true",
                        "--timeout=120s", timeout=150)  # fmt: skip
        wait_for("the driver pods gone", lambda: not cluster.get("pods", namespace=DRIVER_NAMESPACE), timeout=120)
        for n in nodes:
            n.restart_tandem()


@pytest.mark.usefixtures("deployed")
def test_a_rolling_update_over_three_nodes_keeps_pods_running_and_prepares_new_claims(
    cluster: Cluster, nodes: list[Node], namespace: str
) -> None:
    for n in nodes:  # each pod reads its own node's hardware: node 3's is the smaller board
        assert (len(n.devices("gpu")), len(n.devices("nic"))) == (n.tandem.gpus, n.tandem.nics), n.name
    cluster.apply(claim_template("one-gpu", [request("gpu", "gpu.tandem.dev")]), namespace=namespace)
    for n in nodes:
        cluster.apply(on_node(pod(cluster, f"long-{n.name}", report_script("true"), {"gpu": "one-gpu"}), n),
                      namespace=namespace)  # fmt: skip
    for n in nodes:
        wait_pod(cluster, namespace, f"long-{n.name}", ("Running",))
    running = {n.name: containers(cluster, namespace, f"long-{n.name}") for n in nodes}
    slices = {n.name: versions(n.slices()) for n in nodes}
    old = {p["metadata"]["uid"] for p in driver_pods(cluster)}
    assert len(old) == len(nodes)

    rolling, rolled, stop = threading.Event(), threading.Event(), threading.Event()
    ran: list[tuple[str, str]] = []  # (node, when it was created: before, during or after the rollout)
    failures: list[str] = []

    def churn() -> None:
        """Pods with a claim, created and deleted on each node in turn; each must run."""
        i = 0
        while not stop.is_set():
            n, name = nodes[i % len(nodes)], f"churn{i}"
            when = "after" if rolled.is_set() else "during" if rolling.is_set() else "before"
            try:
                cluster.apply(on_node(pod(cluster, name, report_script("true"), {"gpu": "one-gpu"}), n),
                              namespace=namespace)  # fmt: skip
                wait_pod(cluster, namespace, name, ("Running",), timeout=120)
                ran.append((n.name, when))
            except Exception as e:  # any failure to run is the test's failure, reported below
                failures.append(f"{name} on {n.name}, created {when} the rollout: {e}")
            cluster.kubectl("delete", "pod", name, "-n", namespace, "--wait=true", "--timeout=60s", check=False,
                            timeout=90)  # fmt: skip
            i += 1

    def ran_after_everywhere() -> bool:
        return {node for node, when in ran if when == "after"} == {n.name for n in nodes}

    worker = threading.Thread(target=churn, name="pod-churn")
    worker.start()
    try:
        wait_for("a first churn pod", lambda: ran or failures)
        rolling.set()
        cluster.kubectl("set", "image", "-n", DRIVER_NAMESPACE, "daemonset/tandem-driver", f"driver={DRIVER_IMAGES[1]}")
        cluster.kubectl("rollout", "status", "-n", DRIVER_NAMESPACE, "daemonset/tandem-driver", "--timeout=300s",
                        timeout=360)  # fmt: skip
        wait_for("the old driver pods gone", lambda: not old & {p["metadata"]["uid"] for p in driver_pods(cluster)},
                 timeout=120)  # fmt: skip
        rolled.set()
        wait_for("a churn pod run on every node after the rollout", lambda: ran_after_everywhere() or failures,
                 timeout=180)  # fmt: skip
    finally:
        stop.set()
        worker.join(timeout=300)
    assert not failures, "\n".join(failures)
    assert "during" in {when for _, when in ran}, f"no churn pod was created during the rollout: {ran}"
    for n in nodes:
        (new,) = driver_pods_on(cluster, n)
        assert new["spec"]["containers"][0]["image"] == DRIVER_IMAGES[1] and ready(new), n.name
    assert {n.name: containers(cluster, namespace, f"long-{n.name}") for n in nodes} == running
    assert {cluster.get("pod", f"long-{n.name}", namespace)["status"]["phase"] for n in nodes} == {"Running"}
    assert {n.name: versions(n.slices()) for n in nodes} == slices, "a slice was rewritten during the rollout"
