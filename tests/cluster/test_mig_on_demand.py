"""Dynamic MIG against the real scheduler, kubelet and containerd: GPU 7 of the simulated node in
MIG mode, Tandem started with `--dynamic-mig 7`, examples/mig-on-demand.yaml applied as a user
would. Two pods run at once on a 1g and a 3g partition carved for them; a pod that asks for the
whole GPU waits until both are gone; when the pods and claims go, so do the partitions. And a kill
-9 of Tandem in the middle of making or destroying a partition costs nothing."""

from __future__ import annotations

import signal
from collections.abc import Iterator

import pytest
from kube import Cluster, claim_template, example, pod, report_script, request, wait_for, wait_pod, wait_report

from sim import nvml as sim_nvml

GPU = 7  # the simulated node's last GPU: index and minor
REPORT = report_script("ls /dev/nvidia-caps | sort; echo ---; env | grep ^TANDEM_DEVICE_ | sort")


@pytest.fixture
def mig_gpu(cluster: Cluster, tandem) -> Iterator[str]:
    """GPU 7 in MIG mode, served dynamically; its UUID. MIG mode is switched as an administrator
    does it (`nvidia-smi -i 7 -mig 1`), with Tandem stopped: the driver refuses it while a process
    holds the GPU. Afterwards MIG mode goes off again (refused while any partition is left)."""
    state = tandem.node.nvml_state
    if not sim_nvml.read_state(state).gpus[GPU].mig_capable:
        pytest.skip("the cluster's simulated node predates MIG-capable GPUs: hack/cluster.sh down, then up")
    tandem.node.stop()
    uuid = sim_nvml.set_mig_mode(state, GPU, True).gpus[GPU].uuid
    tandem.restart("--dynamic-mig", str(GPU))
    wait_for("GPU 7's partitions published", lambda: f"gpu-{GPU}-mig-3g-40gb-p4" in cluster.devices())
    yield uuid
    tandem.node.stop()
    sim_nvml.set_mig_mode(state, GPU, False)
    tandem.ensure()


def gpu_instances(tandem) -> list[tuple[str, int, int | None]]:
    """What NVML holds on GPU 7: (profile, GPU instance, compute instance)."""
    return sorted(
        (m.profile, m.gi_id, m.ci_id) for m in sim_nvml.read_state(tandem.node.nvml_state).gpus[GPU].mig_devices
    )


def allocated(cluster: Cluster, namespace: str, pod_name: str) -> str:
    (status,) = cluster.get("pod", pod_name, namespace)["status"]["resourceClaimStatuses"]
    claim = cluster.get("resourceclaim", status["resourceClaimName"], namespace)
    (result,) = claim["status"]["allocation"]["devices"]["results"]
    return str(result["device"])


def whole_gpu_pod(cluster: Cluster, uuid: str) -> list[dict]:
    selector = f'device.attributes["tandem.dev"].uuid == "{uuid}"'
    return [
        claim_template("whole-gpu-7", [request("gpu", "gpu.tandem.dev", selector)]),
        pod(cluster, "whole", REPORT, {"gpu": "whole-gpu-7"}),
    ]


def unschedulable(cluster: Cluster, namespace: str, name: str) -> bool:
    conditions = (cluster.get("pod", name, namespace) or {}).get("status", {}).get("conditions") or []
    return any(c["type"] == "PodScheduled" and c.get("reason") == "Unschedulable" for c in conditions)


def test_partitions_on_demand_and_the_whole_gpu_waits(cluster: Cluster, tandem, mig_gpu: str, namespace: str) -> None:
    counter_slices = [s for s in cluster.slices() if s["spec"].get("sharedCounters")]
    assert counter_slices and all("devices" not in s["spec"] for s in counter_slices)
    assert f"gpu-{GPU}-counters" in {c["name"] for s in counter_slices for c in s["spec"]["sharedCounters"]}

    cluster.apply(example(cluster, "mig-on-demand", REPORT), namespace=namespace)
    small, large = (wait_report(cluster, namespace, n) for n in ("mig-1g-pod", "mig-3g-pod"))
    one, three = allocated(cluster, namespace, "mig-1g-pod"), allocated(cluster, namespace, "mig-3g-pod")
    assert one.startswith(f"gpu-{GPU}-mig-1g-10gb-p") and three.startswith(f"gpu-{GPU}-mig-3g-40gb-p")
    assert [p for p, _, ci in gpu_instances(tandem) if ci is not None] == ["1g.10gb", "3g.40gb"]
    for text in (small, large):  # each container: its MIG device's two capabilities, its UUID
        caps, env = text.split("---\n")
        assert len(caps.split()) == 2 and "=MIG-" in env

    cluster.apply(*whole_gpu_pod(cluster, mig_gpu), namespace=namespace)
    wait_for("the whole-GPU pod found unschedulable", lambda: unschedulable(cluster, namespace, "whole"))
    assert cluster.get("pod", "whole", namespace)["status"]["phase"] == "Pending"

    cluster.kubectl("delete", "pod", "mig-1g-pod", "mig-3g-pod", "-n", namespace, "--wait=true", "--timeout=120s")
    wait_report(cluster, namespace, "whole", timeout=180)  # now it fits: the 7g instance spanning the GPU
    assert allocated(cluster, namespace, "whole") == f"gpu-{GPU}"
    assert gpu_instances(tandem) == [("7g.80gb", 0, 0)]

    cluster.kubectl("delete", "pod", "whole", "-n", namespace, "--wait=true", "--timeout=120s")
    wait_for("the claims deleted", lambda: not cluster.get("resourceclaims", namespace=namespace))
    wait_for("every partition destroyed", lambda: gpu_instances(tandem) == [])
    wait_for("every claim unprepared", lambda: not tandem.prepared_claims())


@pytest.mark.parametrize("step", ["after:nvmlDeviceCreateGpuInstanceWithPlacement", "after:nvmlComputeInstanceDestroy"])
def test_kill_in_the_middle_of_a_partition(cluster: Cluster, tandem, mig_gpu: str, namespace: str, step: str) -> None:
    """Tandem killed between the two NVML steps of making (or destroying) a partition, then
    restarted: the kubelet's retry gets the pod its partition, made once; then nothing is left."""
    state = tandem.node.nvml_state

    def hang(at: str) -> None:
        profile = sim_nvml.read_state(state)
        profile.gpus[GPU].nvml_hang = at
        sim_nvml.write_state(profile, state)
        state.with_name(state.name + ".hung").unlink(missing_ok=True)

    one_g = [d for d in example(cluster, "mig-on-demand", REPORT) if "1g" in d["metadata"]["name"]]
    if step.endswith("Placement"):
        hang(step)
    cluster.apply(*one_g, namespace=namespace)
    if not step.endswith("Placement"):
        wait_report(cluster, namespace, "mig-1g-pod")
        hang(step)
        cluster.kubectl("delete", "pod", "mig-1g-pod", "-n", namespace, "--wait=false")
    wait_for(f"Tandem stopped at {step}", lambda: sim_nvml.hung_at(state) == step, timeout=120)
    tandem.node.stop(signal.SIGKILL)
    hang("")
    tandem.start(*tandem.flags)

    if step.endswith("Placement"):
        wait_pod(cluster, namespace, "mig-1g-pod", ("Running",), timeout=180)
        assert [(p, ci) for p, _, ci in gpu_instances(tandem)] == [("1g.10gb", 0)]  # one, complete
        assert len(tandem.prepared_claims()) == 1  # prepared once
        cluster.kubectl("delete", "pod", "mig-1g-pod", "-n", namespace, "--wait=true", "--timeout=120s")
    wait_for("the partition destroyed", lambda: gpu_instances(tandem) == [], timeout=120)
    wait_for("every claim unprepared", lambda: not tandem.prepared_claims())
