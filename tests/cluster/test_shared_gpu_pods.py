"""Sharing a GPU against the real scheduler, kubelet and containerd: Tandem started with
`--gpu-sharing 6`, examples/shared-gpu.yaml applied as a user would. Two pods run on GPU 6 at once,
each container with its MPS limits and the MPS daemon's pipe directory; a third pod that asks for
more memory than is left waits; the MPS daemon Tandem started goes when the last claim does, and
its private /dev/shm with it. A claim time-slicing the whole GPU sets its interval through the
driver root's nvidia-smi (the simulated one writes the fake NVML's state), and the default comes
back when it goes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from kube import Cluster, claim_template, example, pod, report_script, request, wait_for, wait_report

from driver.claims.gpu.mps_identity import PID_FILE
from sim.nvml import read_state

GPU = 6
REPORT = report_script(
    "env | grep ^CUDA_MPS_ | sort; echo ---; ls /tmp/nvidia-mps | sort; echo ---; grep ' /dev/shm ' /proc/mounts"
)


@pytest.fixture
def shared_gpu(cluster: Cluster, tandem) -> Iterator[Path]:
    """GPU 6 published for sharing; the directory of its MPS daemon."""
    tandem.ensure("--gpu-sharing", str(GPU))
    wait_for(
        "GPU 6 published with consumable capacity",
        lambda: (cluster.devices().get(f"gpu-{GPU}") or {}).get("allowMultipleAllocations"),
    )
    yield tandem.node.data_dir / "mps" / f"gpu-{GPU}"
    tandem.ensure()


def allocated(cluster: Cluster, namespace: str, pod_name: str) -> dict:
    (status,) = cluster.get("pod", pod_name, namespace)["status"]["resourceClaimStatuses"]
    claim = cluster.get("resourceclaim", status["resourceClaimName"], namespace)
    (result,) = claim["status"]["allocation"]["devices"]["results"]
    return dict(result)


def unschedulable(cluster: Cluster, namespace: str, name: str) -> bool:
    conditions = (cluster.get("pod", name, namespace) or {}).get("status", {}).get("conditions") or []
    return any(c["type"] == "PodScheduled" and c.get("reason") == "Unschedulable" for c in conditions)


def test_two_pods_share_a_gpu_with_their_limits(cluster: Cluster, tandem, shared_gpu: Path, namespace: str) -> None:
    cluster.apply(*example(cluster, "shared-gpu", REPORT), namespace=namespace)
    quarter, half = (wait_report(cluster, namespace, n) for n in ("shared-gpu-quarter", "shared-gpu-half"))
    a, b = allocated(cluster, namespace, "shared-gpu-quarter"), allocated(cluster, namespace, "shared-gpu-half")
    assert a["device"] == b["device"] == f"gpu-{GPU}" and a["shareID"] != b["shareID"]
    assert a["consumedCapacity"] == {"memory": "20Gi", "computePercent": "25"}
    for text, memory, percent in ((quarter, "20480", "25"), (half, "40960", "50")):
        env, pipe, shm = text.split("---\n")
        # The MPS daemon's private tmpfs, not the pod's own /dev/shm (64Mi) nor the host's.
        assert shm.split()[2] == "tmpfs" and "size=65536k" not in shm, shm
        assert f"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0={memory}M" in env.split()
        assert f"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE={percent}" in env.split()
        assert "CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps" in env.split()
        assert {"control", PID_FILE} <= set(pipe.split())  # the daemon's pipe directory, shared
    assert (shared_gpu / "pipe" / PID_FILE).exists()

    # 60Gi of 80Gi are taken: a share of 30Gi waits (only GPU 6 has computePercent to give).
    big = request("gpu", "gpu.tandem.dev")
    big["exactly"]["capacity"] = {"requests": {"memory": "30Gi", "computePercent": "10"}}
    cluster.apply(
        claim_template("gpu-big", [big]), pod(cluster, "big", REPORT, {"gpu": "gpu-big"}), namespace=namespace
    )
    wait_for(
        "the pod asking for more than is left found unschedulable", lambda: unschedulable(cluster, namespace, "big")
    )

    cluster.kubectl("delete", "pod", "big", "shared-gpu-quarter", "shared-gpu-half", "-n", namespace,
                    "--wait=true", "--timeout=120s")  # fmt: skip
    wait_for("every claim unprepared", lambda: not tandem.prepared_claims(), timeout=120)
    wait_for("the MPS daemon stopped", lambda: not shared_gpu.exists(), timeout=60)
    assert " " + str(shared_gpu / "shm") + " " not in Path("/proc/mounts").read_text()  # its tmpfs unmounted


def test_a_time_sliced_claim_sets_the_gpus_interval(cluster: Cluster, tandem, shared_gpu: Path, namespace: str) -> None:
    """examples/time-sliced-gpu.yaml, its claim pinned to GPU 6: both pods on the one whole GPU,
    its interval Long while they run, the default once the claim is gone."""
    docs = example(cluster, "time-sliced-gpu", report_script("ls /dev | grep nvidia"))
    uuid = read_state(tandem.node.nvml_state).gpus[GPU].uuid
    claim = next(d for d in docs if d["kind"] == "ResourceClaim")
    claim["spec"]["devices"]["requests"][0]["exactly"]["selectors"] = [
        {"cel": {"expression": f'device.attributes["tandem.dev"].uuid == "{uuid}"'}}
    ]
    cluster.apply(*docs, namespace=namespace)
    for name in ("sliced-gpu-a", "sliced-gpu-b"):
        wait_report(cluster, namespace, name)
    assert time_slice(tandem) == 3  # Long, set through nvidia-smi compute-policy
    cluster.kubectl("delete", "pod", "sliced-gpu-a", "sliced-gpu-b", "-n", namespace, "--wait=true", "--timeout=120s")
    cluster.kubectl("delete", "resourceclaim", "sliced-gpu", "-n", namespace, "--wait=true", "--timeout=120s")
    wait_for("the default time slice back", lambda: time_slice(tandem) == 0, timeout=120)


def time_slice(tandem) -> int:
    return read_state(tandem.node.nvml_state).gpus[GPU].time_slice
