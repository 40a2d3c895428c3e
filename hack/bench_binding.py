"""Binding conditions in the real cluster of hack/cluster.sh: what they cost a dynamic-MIG pod,
and how fast they recover from a partition that cannot be made.

1. create-to-Running of a pod on a 1g partition of a `--dynamic-mig` GPU, one pod at a time,
   with binding conditions (the default) and with `--no-binding-conditions`: the first makes the
   partition before binding and waits for the scheduler's PreBind poll (every 5 s), the second
   makes it at NodePrepareResources;
2. from an NVML failure injected on GPU 6 (the allocator's first choice) to the pod Running on GPU
   7: the failure condition, the scheduler's deallocation and a second scheduling cycle, averaged
   over a few pods. Without binding conditions the same pod never starts (tests/cluster/
   test_binding_conditions.py shows it), so there is no figure to set beside it.

Tandem is restarted with the flags each part needs (as the real-cluster tests do) and left as
`hack/cluster.sh up` started it.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

from bench_cluster import _cluster_env, _delete_and_wait, _one_pod_start, _pod

from demo.cluster_node import ClusterNode
from sim import nvml as sim_nvml

GPUS = (6, 7)
ERROR_UNKNOWN = 999
STATE = Path("/var/lib/tandem-cluster")


def _template(name: str) -> dict[str, Any]:
    selector = 'device.attributes["tandem.dev"].profile == "1g.10gb"'
    request = {
        "name": "mig",
        "exactly": {"deviceClassName": "mig.tandem.dev", "selectors": [{"cel": {"expression": selector}}]},
    }
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate", "metadata": {"name": name},
            "spec": {"spec": {"devices": {"requests": [request]}}}}  # fmt: skip


def _set_gpus(state: Path, mig: bool, failing: int | None) -> None:
    profile = sim_nvml.read_state(state)
    for gpu in GPUS:
        profile.gpus[gpu].nvml_errors = (
            {"nvmlDeviceCreateGpuInstanceWithPlacement": ERROR_UNKNOWN} if gpu == failing else {}
        )
    sim_nvml.write_state(profile, state)
    for gpu in GPUS:
        sim_nvml.set_mig_mode(state, gpu, mig)


def _ms(times: list[float]) -> dict[str, float]:
    ordered = sorted(times)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return {
        "p50_ms": round(statistics.median(times) * 1000),
        "p99_ms": round(p99 * 1000),
        "max_ms": round(max(times) * 1000),
    }


def _wait_published(env: dict[str, str], device: str, binding: bool, timeout: float = 60) -> None:
    """Until the node publishes `device`, with binding conditions or without as asked."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = subprocess.run(["kubectl", "get", "resourceslices", "-o", "json"], capture_output=True, text=True,
                             env=env, timeout=30)  # fmt: skip
        devices = [
            d for s in json.loads(out.stdout or '{"items": []}')["items"] for d in s["spec"].get("devices") or []
        ]
        if any(d["name"] == device and bool(d.get("bindingConditions")) == binding for d in devices):
            return
        time.sleep(0.5)
    raise RuntimeError(f"{device} not published {'with' if binding else 'without'} binding conditions in {timeout} s")


def bench_binding(pods: int = 20, failovers: int = 5) -> dict[str, Any]:
    env = _cluster_env()
    if env is None:
        return {"skipped": "the real cluster is not built or not up: run hack/cluster.sh up (root and Go)"}
    from kubernetes import client, config, utils

    config.load_kube_config(env["KUBECONFIG"])
    api = client.ApiClient()
    core = client.CoreV1Api(api)
    node = ClusterNode(STATE / "node", STATE / "tandem" / "kubeconfig", "tandem-node")
    namespace = f"bench-{uuid.uuid4().hex[:6]}"
    core.create_namespace(client.V1Namespace.model_validate({"metadata": {"name": namespace}}))
    utils.create_from_dict(api, _template("mig-1g"), namespace=namespace)
    out: dict[str, Any] = {}

    def run(flags: tuple[str, ...], failing: int | None, count: int) -> list[float]:
        node.stop()
        _set_gpus(node.nvml_state, True, failing)
        node.start("--log-format", "json", "--dynamic-mig", "6,7", *flags)
        _wait_published(env, "gpu-7-mig-1g-10gb-p0", binding=not flags)
        times = []
        for i in range(count):
            name = f"p{i}-{uuid.uuid4().hex[:4]}"
            times.append(_one_pod_start(core, namespace, _pod(name, "mig-1g", env["TANDEM_TEST_IMAGE"])))
            _delete_and_wait(core, namespace, name)
        return times

    try:
        out["with_binding_conditions"] = {"pods": pods, **_ms(run((), None, pods))}
        out["without_binding_conditions"] = {"pods": pods, **_ms(run(("--no-binding-conditions",), None, pods))}
        # Each failover from a fresh start: the failed GPU stays tainted for 5 minutes, so a second
        # pod in the same run would go to GPU 7 at once.
        out["failure_on_gpu6_to_running_on_gpu7"] = {
            "pods": failovers, **_ms([t for _ in range(failovers) for t in run((), 6, 1)]),
        }  # fmt: skip
    finally:
        core.delete_namespace(namespace)
        node.stop()
        _set_gpus(node.nvml_state, False, None)
        node.start("--log-format", "json")
    return out
