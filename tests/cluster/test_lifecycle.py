"""Restarts and crashes in the real cluster: the kubelet restarts, Tandem is killed with SIGKILL while
pods are being created, and everything is cleaned up when pods and claims go."""

from __future__ import annotations

import signal
from collections import Counter

from kube import Cluster, claim_template, pod, report_script, request, wait_for, wait_pod, wait_report


def gpu_pods(cluster: Cluster, namespace: str, count: int, prefix: str = "p") -> list[str]:
    names = [f"{prefix}{i}" for i in range(count)]
    cluster.apply(
        claim_template("one-gpu", [request("gpu", "gpu.tandem.dev")]),
        *[pod(cluster, n, report_script("ls /dev | grep -E '^nvidia[0-9]+$'"), {"gpu": "one-gpu"}) for n in names],
        namespace=namespace,
    )
    return names


def container_id(cluster: Cluster, namespace: str, name: str) -> str:
    return cluster.get("pod", name, namespace)["status"]["containerStatuses"][0]["containerID"]


def test_kubelet_restart(cluster: Cluster, tandem, namespace: str) -> None:
    """The kubelet wipes the node's slices when it starts; Tandem re-registers and publishes them
    again, the running pod keeps running, and a new pod starts."""
    (running,) = gpu_pods(cluster, namespace, 1)
    wait_report(cluster, namespace, running)
    before = container_id(cluster, namespace, running)
    devices = set(cluster.devices())
    slice_uids = {s["metadata"]["uid"] for s in cluster.slices()}

    cluster.cluster_sh("restart", "kubelet")

    wait_for(
        "the wiped slices published again",
        lambda: (s := cluster.slices()) and {x["metadata"]["uid"] for x in s}.isdisjoint(slice_uids) and s,
    )
    assert set(cluster.devices()) == devices
    wait_for("Tandem registered with the new kubelet", tandem.healthy)
    assert container_id(cluster, namespace, running) == before
    assert cluster.get("pod", running, namespace)["status"]["containerStatuses"][0]["restartCount"] == 0
    (new,) = gpu_pods(cluster, namespace, 1, prefix="after")
    wait_report(cluster, namespace, new)


def test_sigkill_while_pods_are_created(cluster: Cluster, tandem, namespace: str) -> None:
    """kill -9 in the middle of a burst of prepares; the restarted driver completes or rolls back
    each one, the kubelet retries, every pod runs on a GPU of its own, and nothing is left after."""
    tandem.ensure()
    names = gpu_pods(cluster, namespace, 6)
    wait_for("the first prepares to begin", lambda: tandem.prepared_claims() or tandem.files(), timeout=30,
             interval=0.02)  # fmt: skip
    tandem.node.stop(signal.SIGKILL)
    tandem.start(*tandem.flags)

    for n in names:
        wait_pod(cluster, namespace, n, ("Running",), timeout=120)
    claims = tandem.prepared_claims()
    owners = Counter(d["device"] for c in claims for d in c["devices"])
    assert len(claims) == len(names)
    assert all(n == 1 for n in owners.values()), f"a device is prepared for more than one claim: {owners}"
    seen = [wait_report(cluster, namespace, n).split() for n in names]
    assert all(len(nodes) == 1 for nodes in seen) and len({nodes[0] for nodes in seen}) == len(names)

    cluster.kubectl("delete", "pods", "--all", "-n", namespace, "--wait=true", "--timeout=120s")
    wait_for("every claim unprepared", lambda: not tandem.prepared_claims())
    wait_for("no CDI file of Tandem left", lambda: not tandem.files())


def test_everything_withdrawn_when_pods_and_claims_go(cluster: Cluster, tandem, namespace: str) -> None:
    """A claim of its own (not from a template) outlives its pod: once the pod is gone Tandem has
    unprepared it and withdrawn its status.devices; once the claim is gone no file of Tandem's is left."""
    claim = claim_template("shared", [request("gpu", "gpu.tandem.dev"), request("nic", "nic.tandem.dev")])
    claim = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": "shared"},
             "spec": claim["spec"]["spec"]}  # fmt: skip
    user = pod(cluster, "user", report_script("true"))
    user["spec"]["resourceClaims"] = [{"name": "shared", "resourceClaimName": "shared"}]
    user["spec"]["containers"][0]["resources"] = {"claims": [{"name": "shared"}]}
    cluster.apply(claim, user, namespace=namespace)
    wait_report(cluster, namespace, "user")
    status = cluster.get("resourceclaim", "shared", namespace)["status"]
    assert len(status["devices"]) == 2 and all(d["conditions"][0]["status"] == "True" for d in status["devices"])
    uid = cluster.get("resourceclaim", "shared", namespace)["metadata"]["uid"]
    assert any(uid in f for f in tandem.files())

    cluster.kubectl("delete", "pod", "user", "-n", namespace, "--wait=true")
    wait_for("the claim unprepared", lambda: uid not in {c["uid"] for c in tandem.prepared_claims()})
    wait_for("status.devices withdrawn",
             lambda: not cluster.get("resourceclaim", "shared", namespace)["status"].get("devices"))  # fmt: skip
    assert not [f for f in tandem.files() if uid in f]
    metadata = tandem.node.data_dir / "dra-device-metadata"
    assert not [p for p in metadata.rglob("*") if uid in str(p) or namespace in str(p)] if metadata.exists() else True

    cluster.kubectl("delete", "resourceclaim", "shared", "-n", namespace, "--wait=true")
    assert not tandem.files()
