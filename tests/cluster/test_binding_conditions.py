"""Binding conditions against the real scheduler (KEP-5007, beta and on in 1.37): a dynamic-MIG
partition is made before the pod binds, and a partition that cannot be made sends the pod to
another GPU instead of leaving it in ContainerCreating.

GPUs 6 and 7 of the simulated node are in MIG mode and served with `--dynamic-mig 6,7`. The
allocator tries GPU 6's partitions first (devices in name order), so an NVML failure injected at
GPU-instance creation on GPU 6 meets the first try: with binding conditions the pod ends Running
on GPU 7; with `--no-binding-conditions` it stays in ContainerCreating on GPU 6."""

from __future__ import annotations

import datetime
import signal
from collections.abc import Iterator

import pytest
from kube import DRIVER, Cluster, claim_template, pod, report_script, request, wait_for, wait_pod, wait_report

from sim import nvml as sim_nvml

GPUS = (6, 7)
ERROR_UNKNOWN = 999  # NVML_ERROR_UNKNOWN
REPORT = report_script("env | grep ^TANDEM_DEVICE_ | sort")
READY = f"{DRIVER}/partition-ready"


@pytest.fixture
def mig_gpus(cluster: Cluster, tandem) -> Iterator[None]:
    """GPUs 6 and 7 in MIG mode (switched with Tandem stopped, as an administrator does it)."""
    state = tandem.node.nvml_state
    if not sim_nvml.read_state(state).gpus[GPUS[0]].mig_capable:
        pytest.skip("the cluster's simulated node predates MIG-capable GPUs: hack/cluster.sh down, then up")
    tandem.node.stop()
    for gpu in GPUS:
        sim_nvml.set_mig_mode(state, gpu, True)
    yield
    tandem.node.stop()
    profile = sim_nvml.read_state(state)
    profile.gpus[GPUS[0]].nvml_errors = {}
    sim_nvml.write_state(profile, state)
    for gpu in GPUS:
        sim_nvml.set_mig_mode(state, gpu, False)
    tandem.ensure()


def one_g_pod(cluster: Cluster, name: str) -> list[dict]:
    selector = 'device.attributes["tandem.dev"].profile == "1g.10gb"'
    return [
        claim_template(f"{name}-1g", [request("mig", "mig.tandem.dev", selector)]),
        pod(cluster, name, REPORT, {"mig": f"{name}-1g"}),
    ]


def claim_of(cluster: Cluster, namespace: str, pod_name: str) -> dict:
    (status,) = cluster.get("pod", pod_name, namespace)["status"]["resourceClaimStatuses"]
    return cluster.get("resourceclaim", status["resourceClaimName"], namespace)


def condition(obj: dict, kind: str) -> dict | None:
    return next((c for c in obj.get("conditions") or [] if c.get("type") == kind), None)


def when(stamp: str) -> datetime.datetime:
    return datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00"))


def fail_gpu_instance_creation(tandem, gpu: int) -> None:
    profile = sim_nvml.read_state(tandem.node.nvml_state)
    profile.gpus[gpu].nvml_errors = {"nvmlDeviceCreateGpuInstanceWithPlacement": ERROR_UNKNOWN}
    sim_nvml.write_state(profile, tandem.node.nvml_state)


def test_a_partition_is_ready_before_its_pod_binds(cluster: Cluster, tandem, mig_gpus, namespace: str) -> None:
    tandem.restart("--dynamic-mig", "6,7")
    wait_for("the partitions published", lambda: "gpu-6-mig-1g-10gb-p0" in cluster.devices())
    assert cluster.devices()["gpu-6-mig-1g-10gb-p0"]["bindingConditions"] == [READY]
    cluster.apply(*one_g_pod(cluster, "early"), namespace=namespace)
    assert "=MIG-" in wait_report(cluster, namespace, "early", timeout=180)
    claim = claim_of(cluster, namespace, "early")
    (entry,) = [e for e in claim["status"]["devices"] if condition(e, READY)]
    ready = condition(entry, READY)
    assert ready is not None and ready["status"] == "True"
    scheduled = condition(cluster.get("pod", "early", namespace)["status"], "PodScheduled")
    assert scheduled is not None and when(ready["lastTransitionTime"]) <= when(scheduled["lastTransitionTime"])


def test_a_partition_that_cannot_be_made_sends_the_pod_to_the_other_gpu(
    cluster: Cluster, tandem, mig_gpus, namespace: str
) -> None:
    fail_gpu_instance_creation(tandem, 6)
    tandem.restart("--dynamic-mig", "6,7")
    wait_for("the partitions published", lambda: "gpu-7-mig-1g-10gb-p0" in cluster.devices())
    cluster.apply(*one_g_pod(cluster, "moved"), namespace=namespace)
    wait_pod(cluster, namespace, "moved", ("Running", "Succeeded"), timeout=240)
    (result,) = claim_of(cluster, namespace, "moved")["status"]["allocation"]["devices"]["results"]
    assert result["device"].startswith("gpu-7-"), result
    events = cluster.get("events", namespace=namespace)
    assert any(e.get("reason") == "BindingFailed" for e in events), [e.get("reason") for e in events]


def test_without_binding_conditions_the_same_failure_sticks_the_pod(
    cluster: Cluster, tandem, mig_gpus, namespace: str
) -> None:
    fail_gpu_instance_creation(tandem, 6)
    tandem.restart("--dynamic-mig", "6,7", "--no-binding-conditions")
    wait_for("the partitions published", lambda: "gpu-7-mig-1g-10gb-p0" in cluster.devices())
    assert "bindingConditions" not in cluster.devices()["gpu-6-mig-1g-10gb-p0"]
    cluster.apply(*one_g_pod(cluster, "stuck"), namespace=namespace)

    def failed_prepare() -> bool:
        events = cluster.get("events", namespace=namespace)
        return any(e.get("reason") == "FailedPrepareDynamicResources" for e in events)

    wait_for("the kubelet failing to prepare", failed_prepare, timeout=180)
    assert cluster.get("pod", "stuck", namespace)["spec"]["nodeName"]  # bound, and stuck there
    (result,) = claim_of(cluster, namespace, "stuck")["status"]["allocation"]["devices"]["results"]
    assert result["device"].startswith("gpu-6-"), result
    assert cluster.get("pod", "stuck", namespace)["status"]["phase"] == "Pending"


def hang(tandem, gpu: int, step: str) -> None:
    """Block NVML calls on `gpu` at `step` ("" releases them); `sim_nvml.hung_at` says when one got there."""
    state = tandem.node.nvml_state
    profile = sim_nvml.read_state(state)
    profile.gpus[gpu].nvml_hang = step
    sim_nvml.write_state(profile, state)
    if step:
        state.with_name(state.name + ".hung").unlink(missing_ok=True)


def instances(tandem) -> list[tuple[int, str, int | None]]:
    """(GPU, profile, compute instance) of every GPU instance on GPUs 6 and 7."""
    gpus = sim_nvml.read_state(tandem.node.nvml_state).gpus
    return sorted((g, m.profile, m.ci_id) for g in GPUS for m in gpus[g].mig_devices)


def test_kill_between_making_the_partition_and_setting_its_condition(
    cluster: Cluster, tandem, mig_gpus, namespace: str
) -> None:
    """Tandem killed right after NVML made the partition, before the condition is set; restarted,
    it makes the partition again (start-up destroyed the one its dead predecessor noted) and the
    pod runs on exactly one partition."""
    tandem.restart("--dynamic-mig", "6,7")
    wait_for("the partitions published", lambda: "gpu-6-mig-1g-10gb-p0" in cluster.devices())
    step = "after:nvmlGpuInstanceCreateComputeInstance"
    hang(tandem, 6, step)
    cluster.apply(*one_g_pod(cluster, "killed"), namespace=namespace)
    wait_for(f"Tandem stopped at {step}", lambda: sim_nvml.hung_at(tandem.node.nvml_state) == step, timeout=120)
    assert not cluster.get("pod", "killed", namespace)["spec"].get("nodeName")  # still waiting to bind
    tandem.node.stop(signal.SIGKILL)
    hang(tandem, 6, "")
    tandem.start(*tandem.flags)
    assert "=MIG-" in wait_report(cluster, namespace, "killed", timeout=180)
    assert [(p, ci) for _, p, ci in instances(tandem)] == [("1g.10gb", 0)]


def test_a_pod_deleted_while_waiting_for_binding_leaves_no_partition(
    cluster: Cluster, tandem, mig_gpus, namespace: str
) -> None:
    """The pod (and with it its claim) deleted while Tandem makes its partition: the partition,
    finished after the claim is gone, is destroyed; the pod never ran."""
    tandem.restart("--dynamic-mig", "6,7")
    wait_for("the partitions published", lambda: "gpu-6-mig-1g-10gb-p0" in cluster.devices())
    step = "after:nvmlDeviceCreateGpuInstanceWithPlacement"
    hang(tandem, 6, step)
    cluster.apply(*one_g_pod(cluster, "dropped"), namespace=namespace)
    wait_for(f"Tandem stopped at {step}", lambda: sim_nvml.hung_at(tandem.node.nvml_state) == step, timeout=120)
    assert [(g, p) for g, p, _ in instances(tandem)] == [(6, "1g.10gb")]  # its GPU instance, being made
    cluster.kubectl("delete", "pod", "dropped", "-n", namespace, "--wait=true", "--timeout=120s")
    wait_for("the claim deleted", lambda: not cluster.get("resourceclaims", namespace=namespace), timeout=120)
    hang(tandem, 6, "")
    wait_for("the partition destroyed", lambda: instances(tandem) == [], timeout=60)
    assert not tandem.prepared_claims()
