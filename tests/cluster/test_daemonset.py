"""Tandem deployed as a user deploys it: the image built from the project's Dockerfile, daemonset.yaml
applied with only the image and the simulated node's settings patched. Its pod becomes Ready with
its real probes, service-account token, RBAC and admission policy, serves claims, and rolls to a
new image while pods come and go without a failed pod or a rewritten slice."""

from __future__ import annotations

import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
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
    wait_report,
)

SELECTOR = "app.kubernetes.io/name=tandem"


@pytest.fixture(scope="module")
def deployed(cluster: Cluster, tandem) -> Iterator[dict[str, Any]]:
    """The DaemonSet in place of the node process, from a clean slate (no slices left behind)."""
    for image in DRIVER_IMAGES:
        cluster.cluster_sh("image", image, timeout=1200)
    node_root = tandem.node.root
    fake = REPO / "sim" / "fake_pynvml"
    shutil.copytree(fake, node_root / "fake_pynvml", dirs_exist_ok=True)
    tandem.node.stop()
    wait_for("Tandem deregistered", lambda: not tandem.healthy())
    cluster.kubectl("delete", "resourceslices", "--field-selector", "spec.driver=tandem.dev", "--wait=true")
    ds = daemonset(node_root, DRIVER_IMAGES[0])
    cluster.apply(ds)
    try:
        wait_for("the driver pod Ready", lambda: [p for p in driver_pods(cluster) if ready(p)], timeout=180)
        yield ds
    finally:
        cluster.kubectl("delete", "daemonset", "tandem-driver", "-n", DRIVER_NAMESPACE, "--wait=true", "--timeout=120s")
        wait_for("the driver pods gone", lambda: not cluster.get("pods", namespace=DRIVER_NAMESPACE), timeout=120)
        tandem.restart(*tandem.flags)


def test_daemonset_pod_is_ready_and_serves_claims(cluster: Cluster, deployed, namespace: str) -> None:
    wait_for("slices published by the driver pod", cluster.slices)
    assert len(cluster.devices()) == 12  # the simulated HGX node: 8 GPUs, 4 NICs
    cluster.apply(
        claim_template("one-gpu", [request("gpu", "gpu.tandem.dev")]),
        pod(cluster, "user", report_script("ls /dev | grep -E '^nvidia[0-9]+$'"), {"gpu": "one-gpu"}),
        namespace=namespace,
    )
    assert len(wait_report(cluster, namespace, "user").split()) == 1
    (driver,) = driver_pods(cluster)
    log = cluster.kubectl("logs", "-n", DRIVER_NAMESPACE, driver["metadata"]["name"])
    claim = cluster.get("pod", "user", namespace)["status"]["resourceClaimStatuses"][0]["resourceClaimName"]
    assert claim in log and "prepared 1 device" in log


def test_rolling_update_while_pods_come_and_go(cluster: Cluster, deployed, namespace: str) -> None:
    """maxSurge 1: the new pod starts beside the old one on pod-UID sockets; the old one stops once
    the new one is Ready. Pods with claims created and deleted meanwhile all run; the slices are not
    rewritten (an unchanged pool needs no write)."""
    wait_for("slices published", cluster.slices)
    versions = {s["metadata"]["name"]: s["metadata"]["resourceVersion"] for s in cluster.slices()}
    (old,) = driver_pods(cluster)
    cluster.apply(claim_template("one-gpu", [request("gpu", "gpu.tandem.dev")]), namespace=namespace)
    stop = threading.Event()
    started: list[str] = []
    failures: list[str] = []

    def churn() -> None:
        i = 0
        while not stop.is_set():
            name = f"churn{i}"
            cluster.apply(pod(cluster, name, report_script("true"), {"gpu": "one-gpu"}), namespace=namespace)
            started.append(name)
            try:
                wait_pod(cluster, namespace, name, ("Running",), timeout=120)
            except AssertionError as e:
                failures.append(str(e))
            cluster.kubectl("delete", "pod", name, "-n", namespace, "--wait=true", "--timeout=60s", check=False)
            i += 1

    worker = threading.Thread(target=churn, name="pod-churn")
    worker.start()
    try:
        wait_for("a first pod during the rollout", lambda: len(started) >= 1)
        cluster.kubectl("set", "image", "-n", DRIVER_NAMESPACE, "daemonset/tandem-driver", f"driver={DRIVER_IMAGES[1]}")
        cluster.kubectl("rollout", "status", "-n", DRIVER_NAMESPACE, "daemonset/tandem-driver", "--timeout=240s",
                        timeout=300)  # fmt: skip
        wait_for("the old driver pod gone", lambda: old["metadata"]["uid"] not in
                 {p["metadata"]["uid"] for p in driver_pods(cluster)}, timeout=120)  # fmt: skip
        wait_for("more pods after the rollout", lambda: len(started) >= 4, timeout=180)
    finally:
        stop.set()
        worker.join(timeout=300)
    assert not failures
    (new,) = driver_pods(cluster)
    assert new["spec"]["containers"][0]["image"] == DRIVER_IMAGES[1] and ready(new)
    assert {s["metadata"]["name"]: s["metadata"]["resourceVersion"] for s in cluster.slices()} == versions


def test_admission_policy_confines_the_driver_to_its_node(cluster: Cluster, deployed) -> None:
    """The driver pod's own token (bound to the pod and its node): RBAC lets it write slices, and the
    ValidatingAdmissionPolicy lets it write only its own node's."""
    (driver,) = driver_pods(cluster)
    uid = driver["metadata"]["uid"]
    tokens = list(Path(f"/var/lib/kubelet/pods/{uid}/volumes/kubernetes.io~projected").glob("*/token"))
    token = tokens[0].read_text()
    as_driver = ["--token", token, "--kubeconfig", "/dev/null", "--server", "https://127.0.0.1:6443",
                 "--certificate-authority", str(cluster.state / "pki" / "ca.crt")]  # fmt: skip

    def create_slice(node: str) -> str:
        obj = {
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"generateName": "e2e-"},
            "spec": {"driver": "tandem.dev", "nodeName": node, "pool": {"name": node, "generation": 1,
                     "resourceSliceCount": 1}, "devices": []},
        }  # fmt: skip
        proc = cluster.kubectl("create", "--dry-run=server", "-o", "name", "-f", "-", *as_driver,
                               stdin=yaml.safe_dump(obj), check=False)  # fmt: skip
        return proc

    assert cluster.kubectl("auth", "can-i", "create", "resourceslices", *as_driver).strip() == "yes"
    assert cluster.kubectl("auth", "can-i", "list", "secrets", *as_driver, check=False).strip() == "no"
    assert create_slice(cluster.node_name).startswith("resourceslice")
    with pytest.raises(Exception, match="may not modify ResourceSlices of node 'other-node'"):
        cluster.kubectl("create", "--dry-run=server", "-f", "-", *as_driver, stdin=yaml.safe_dump({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"generateName": "e2e-"},
            "spec": {"driver": "tandem.dev", "nodeName": "other-node", "pool": {"name": "other-node",
                     "generation": 1, "resourceSliceCount": 1}, "devices": []}}))  # fmt: skip
    # Nor another DRA driver's slices of its own node.
    with pytest.raises(Exception, match=r"may not modify ResourceSlices of driver 'other\.example\.com'"):
        cluster.kubectl("create", "--dry-run=server", "-f", "-", *as_driver, stdin=yaml.safe_dump({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"generateName": "e2e-"},
            "spec": {"driver": "other.example.com", "nodeName": cluster.node_name, "pool": {
                     "name": cluster.node_name, "generation": 1, "resourceSliceCount": 1}, "devices": []}}))  # fmt: skip
