"""Per-pod GPU metrics with the daemon as a real process: a whole GPU and a dynamic-MIG partition
prepared for two pods show up in /metrics under their pods' labels with what the (simulated) NVML
reports, and are gone once the kubelet unprepares their claims."""

from __future__ import annotations

import socket
import urllib.request
import uuid

from kubelet_calls import registered
from prometheus_client.parser import text_string_to_metric_families
from waiting import poll

from demo.node import DRIVER
from sim import nvml as sim_nvml
from sim.kubelet import ClaimRef, KubeletSim
from sim.profile import h100_node
from sim.scheduler import Request, allocate, attribute, claim_object, published_devices, reserve

GIB = 1024**3
WHOLE = Request("gpu", "gpu.tandem.dev", lambda d: d["name"] == "gpu-0")
ONE_G = Request("small", "mig.tandem.dev", lambda d: attribute(d, "profile") == "1g.10gb")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _claim_gpu_series(port: int) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith("tandem_claim_gpu_")
    }


def test_a_pods_gpu_and_mig_partition_show_under_its_labels_and_go_with_it(apiserver, sim_node, start_daemon) -> None:
    profile = h100_node("node-m", gpus=2, nics=0, mig_capable=True)
    profile.gpus[1].mig_mode = True
    node = sim_node(profile)
    state = node.root / "nvml-state.json"
    port = _free_port()
    daemon = start_daemon(node, "--dynamic-mig", "all", "--metrics-address", f"127.0.0.1:{port}")
    kubelet = KubeletSim(node.registry)
    try:
        sock = kubelet.wait_for_registration_socket(DRIVER, timeout=60)
        assert poll(lambda: registered(kubelet, sock), 60), daemon.log_text()
        assert poll(lambda: _published(apiserver, WHOLE, ONE_G), 60), daemon.log_text()
        refs = {}
        for name, pod, req in (("train", "trainer", WHOLE), ("infer", "server", ONE_G)):
            claim = apiserver.create(claim_object("team-a", name, [req]))
            allocate(apiserver, claim, DRIVER, "node-m", [req])
            reserve(apiserver, claim, pod, str(uuid.uuid4()))
            refs[name] = ClaimRef("team-a", name, claim["metadata"]["uid"])
        assert _claim_gpu_series(port) == {}, "allocated but not prepared: no series yet"

        results = kubelet.prepare(list(refs.values()))
        assert all(r.error == "" for r in results.values()), results
        (mig,) = sim_nvml.read_state(state).gpus[1].mig_devices  # the partition made at prepare
        sim_nvml.set_usage(state, profile.gpus[0].uuid, utilization=80, memory_used=30 * GIB)
        sim_nvml.set_usage(state, mig.uuid, memory_used=2 * GIB)

        trainer = {"namespace": "team-a", "pod": "trainer", "claim": "train", "device": "gpu-0",
                   "uuid": profile.gpus[0].uuid}  # fmt: skip
        server = {"namespace": "team-a", "pod": "server", "claim": "infer", "uuid": mig.uuid,
                  "device": results[refs["infer"].uid].devices[0].device_name}  # fmt: skip
        key = lambda name, labels: (name, frozenset(labels.items()))  # noqa: E731
        assert _claim_gpu_series(port) == {
            key("tandem_claim_gpu_utilization_ratio", trainer): 0.8,
            key("tandem_claim_gpu_memory_used_bytes", trainer): 30 * GIB,
            key("tandem_claim_gpu_memory_total_bytes", trainer): profile.gpus[0].memory_bytes,
            key("tandem_claim_gpu_memory_used_bytes", server): 2 * GIB,  # MIG: memory only
            key("tandem_claim_gpu_memory_total_bytes", server): mig.memory_bytes,
        }, daemon.log_text()

        assert kubelet.unprepare([refs["train"]]) == {refs["train"].uid: ""}  # the trainer pod went
        assert {dict(labels)["pod"] for _, labels in _claim_gpu_series(port)} == {"server"}
        assert kubelet.unprepare([refs["infer"]]) == {refs["infer"].uid: ""}
        assert _claim_gpu_series(port) == {}
    finally:
        kubelet.close()


def _published(apiserver, *requests: Request) -> bool:
    """Every slice of the node's pool is there (the allocator refuses an incomplete pool), and a
    device for each request."""
    slices = [s["spec"] for s in apiserver.list("resourceslices") if s["spec"].get("nodeName") == "node-m"]
    if not slices or len(slices) != slices[0]["pool"]["resourceSliceCount"]:
        return False
    devices = published_devices(apiserver, DRIVER, "node-m")
    return all(any(r.match(d) for d in devices) for r in requests)
