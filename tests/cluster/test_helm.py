"""The Helm chart in the real cluster: its renders accepted by the real API server (a server-side
dry run of daemonset.yaml, which is the default render, and of a non-default one), and the chart
installed with `helm install` as docs/deployment.md says, serving a claim and its metrics, then
removed with `helm uninstall` and the documented clean-up.

The installed release is a second one beside the cluster's own Tandem (the node process keeps
serving `tandem.dev`): driver name `e2e.tandem.dev`, release and namespace `tandem-e2e`, so its
cluster-wide objects, data directory and slices are its own, and its uninstall leaves the cluster
as `hack/cluster.sh up` made it. Only the simulated node's paths are patched in, by a helm
post-renderer (sim_post_renderer.py), as tests/cluster/test_daemonset.py patches daemonset.yaml.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from kube import (
    DRIVER_IMAGES,
    REPO,
    Cluster,
    claim_template,
    pod,
    report_script,
    request,
    wait_for,
    wait_report,
)

CHART = REPO / "deployments" / "helm" / "tandem"
RELEASE = NAMESPACE = "tandem-e2e"
E2E_DRIVER = "e2e.tandem.dev"
METRICS_PORT = 9477  # the node's port (the pod is host-network): one nothing else here uses
K8S_VERSION = "1.37.0"


@pytest.fixture(scope="module")
def helm(cluster: Cluster) -> str:
    done = subprocess.run([REPO / "hack" / "helm.sh"], capture_output=True, text=True, timeout=1800, check=False)
    assert done.returncode == 0, f"hack/helm.sh failed: {done.stderr}"
    return done.stdout.strip()


def run_helm(cluster: Cluster, helm: str, *args: str, timeout: float = 300) -> str:
    # The post-renderer imports tests/cluster/kube.py, which imports sim/ and tests/waiting.py.
    env = {**cluster.env, "PYTHONPATH": ":".join(str(p) for p in (REPO, REPO / "tests", REPO / "tests" / "cluster"))}
    done = subprocess.run([helm, *args], capture_output=True, text=True, timeout=timeout, env=env, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"helm {' '.join(args)} failed: {done.stderr.strip()}")
    return done.stdout


def e2e_slices(cluster: Cluster) -> list[dict]:
    return cluster.get("resourceslices", selector=f"spec.nodeName={cluster.node_name},spec.driver={E2E_DRIVER}")


def installed(cluster: Cluster, helm: str) -> bool:
    return RELEASE in run_helm(cluster, helm, "list", "--namespace", NAMESPACE, "--short")


def test_renders_pass_a_server_side_dry_run(cluster: Cluster, helm: str) -> None:
    """The real API server (its schemas, defaulting and admission) accepts every object of the
    default render and of one with the optional objects and settings on."""
    for values in ((), ("metrics.enabled=true", "nvidiaDriverRoot=/run/nvidia/driver", "gpuSharing=all")):
        manifest = run_helm(cluster, helm, "template", "tandem", str(CHART), "--namespace", "tandem-system",
                            "--kube-version", K8S_VERSION, *[a for v in values for a in ("--set", v)])  # fmt: skip
        out = cluster.kubectl("apply", "--dry-run=server", "-f", "-", stdin=manifest)
        assert "daemonset.apps/tandem-driver" in out and "deviceclass.resource.k8s.io/gpu.tandem.dev" in out, out
        if values:
            assert "service/tandem-driver-metrics" in out, out


@pytest.fixture(scope="module")
def release(cluster: Cluster, tandem, helm: str) -> Iterator[Path]:
    """The chart installed as docs/deployment.md installs it; its node data directory yielded.
    Uninstalled and cleaned up afterwards if a test left it installed."""
    cluster.cluster_sh("image", DRIVER_IMAGES[0], timeout=1200)
    node_root = tandem.node.root
    shutil.copytree(REPO / "sim" / "fake_pynvml", node_root / "fake_pynvml", dirs_exist_ok=True)
    repository, tag = DRIVER_IMAGES[0].rsplit(":", 1)
    values = [f"driverName={E2E_DRIVER}", f"image.repository={repository}", f"image.tag={tag}",
              # nvidia.com/gpu stays the cluster's own Tandem's.
              "deviceClasses.gpu.extendedResourceName=", "metrics.enabled=true", f"metrics.port={METRICS_PORT}"]  # fmt: skip
    data_dir = Path("/var/lib/kubelet/plugins") / E2E_DRIVER
    try:
        cluster.kubectl("create", "namespace", NAMESPACE)
        post_renderer = str(Path(__file__).parent / "sim_post_renderer.py")
        run_helm(cluster, helm, "install", RELEASE, str(CHART), "--namespace", NAMESPACE, "--take-ownership",
                 *[a for v in values for a in ("--set", v)], "--post-renderer", sys.executable,
                 "--post-renderer-args", post_renderer, "--post-renderer-args", str(node_root),
                 "--wait", "--timeout", "180s", timeout=240)  # fmt: skip
        yield data_dir
    finally:
        if cluster.get("namespace", NAMESPACE) is not None and installed(cluster, helm):
            run_helm(cluster, helm, "uninstall", RELEASE, "--namespace", NAMESPACE, "--wait", "--timeout", "180s")
        cluster.kubectl("delete", "namespace", NAMESPACE, "--ignore-not-found", "--wait=true", check=False)
        cluster.kubectl("delete", "resourceslices", "--field-selector", f"spec.driver={E2E_DRIVER}", check=False)
        shutil.rmtree(data_dir, ignore_errors=True)


def test_installed_chart_serves_claims_and_metrics(cluster: Cluster, release: Path, namespace: str) -> None:
    ns = cluster.get("namespace", NAMESPACE)
    assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"  # the chart's, adopted
    # The simulated HGX node: 8 GPUs, 4 NICs (a NIC is published once its link facts held).
    wait_for("the release's 12 devices", lambda: sum(len(s["spec"]["devices"]) for s in e2e_slices(cluster)) == 12)
    cluster.apply(
        claim_template("one-gpu", [request("gpu", f"gpu.{E2E_DRIVER}")]),
        pod(cluster, "user", report_script("ls /dev | grep -E '^nvidia[0-9]+$'"), {"gpu": "one-gpu"}),
        namespace=namespace,
    )
    assert len(wait_report(cluster, namespace, "user").split()) == 1
    (claim,) = cluster.get("resourceclaims", namespace=namespace)
    assert {r["driver"] for r in claim["status"]["allocation"]["devices"]["results"]} == {E2E_DRIVER}
    # The headless Service lists the driver pod at the node's address, where it serves /metrics.
    (slice_,) = cluster.get("endpointslices", namespace=NAMESPACE, selector="")
    address = slice_["endpoints"][0]["addresses"][0]
    with urllib.request.urlopen(f"http://{address}:{METRICS_PORT}/metrics", timeout=10) as answer:
        assert "tandem_node_claims_total" in answer.read().decode()


def test_uninstall_leaves_what_the_guide_says_and_its_clean_up_removes_it(
    cluster: Cluster, tandem, helm: str, release: Path
) -> None:
    run_helm(cluster, helm, "uninstall", RELEASE, "--namespace", NAMESPACE, "--wait", "--timeout", "180s")
    for kind, name in [
        ("clusterrole", f"{RELEASE}-driver"),
        ("clusterrolebinding", f"{RELEASE}-driver"),
        ("validatingadmissionpolicy", f"{RELEASE}-driver-own-node-slices"),
        ("validatingadmissionpolicy", f"{RELEASE}-opaque-config"),
        ("deviceclass", f"gpu.{E2E_DRIVER}"),
        ("deviceclass", f"nic.{E2E_DRIVER}"),
    ]:
        assert cluster.get(kind, name) is None, f"{kind}/{name} outlived helm uninstall"
    # What stays on purpose (docs/deployment.md, 'Uninstall'): the namespace, the slices and the
    # node's state.
    assert cluster.get("namespace", NAMESPACE) is not None
    assert e2e_slices(cluster) and (release / "checkpoint.json").exists()
    cluster.kubectl("delete", "namespace", NAMESPACE, "--wait=true", timeout=150)
    cluster.kubectl("delete", "resourceslices", "--field-selector", f"spec.driver={E2E_DRIVER}")
    shutil.rmtree(release)
    assert not e2e_slices(cluster)
    assert not list(Path("/var/run/cdi").glob(f"*{E2E_DRIVER}*"))  # every claim was unprepared
    # The cluster's own Tandem never noticed.
    assert tandem.healthy() and cluster.slices()
