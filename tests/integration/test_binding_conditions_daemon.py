"""Binding conditions with the daemon as a real process (`driver.claims.binding`): a dynamic-MIG
partition is made before the pod binds, as soon as the scheduler nominates the pod to the node and
allocates its claim, and its condition set True; a partition that cannot be made sets the failure
condition, leaves nothing behind and taints its GPU; a claim that goes before binding takes its
partition with it, and one allocated another partition before binding gives the first back; and a kill -9 after the partition is made recovers with one partition.

The scheduler's side is played by the simulated API server and `sim.scheduler.allocate`, which
copies the device's binding conditions into the allocation as the real allocator does; the pod is
a Pod object with `status.nominatedNodeName`, as the real scheduler writes it before PreBind."""

from __future__ import annotations

import signal
import uuid

import pytest
from test_dynamic_mig_daemon import Node, placement
from waiting import poll

from demo.node import DRIVER
from sim import nvml as sim_nvml
from sim.apierrors import ApiError
from sim.kubelet import ClaimRef
from sim.scheduler import allocate, claim_object, deallocate, published_devices, reserve

ONE_G = "gpu-0-mig-1g-10gb-p3"
THREE_G = "gpu-0-mig-3g-40gb-p4"  # memory slices 4-7, beside ONE_G
READY, FAILED = f"{DRIVER}/partition-ready", f"{DRIVER}/partition-failed"
ERROR_UNKNOWN = 999  # NVML_ERROR_UNKNOWN


@pytest.fixture
def node(apiserver, sim_node, start_daemon):
    n = Node(apiserver, sim_node, start_daemon)
    yield n
    n.kubelet.close()


def nominated(node: Node, name: str, device: str = ONE_G, pod: str = "") -> ClaimRef:
    """A claim allocated to `device` for a pod (`pod`, else `pod-<name>`) the scheduler nominated
    to the node, not yet bound; a claim that exists already (deallocated) keeps its UID."""
    request = placement(device)
    pod = pod or f"pod-{name}"
    try:
        claim = node.apiserver.get("resourceclaims", name, "default")
    except ApiError:
        claim = node.apiserver.create(claim_object("default", name, [request]))
    allocate(node.apiserver, claim, DRIVER, "node-a", [request])
    pod_uid = str(uuid.uuid4())
    reserve(node.apiserver, claim, pod, pod_uid)
    node.apiserver.create({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": pod, "namespace": "default", "uid": pod_uid},
        "spec": {"containers": [{"name": "c", "image": "x"}], "resourceClaims": [{"name": "mig", "resourceClaimName": name}]},
        "status": {"nominatedNodeName": "node-a"},
    })  # fmt: skip
    return ClaimRef("default", name, claim["metadata"]["uid"])


def conditions(node: Node, ref: ClaimRef) -> dict[str, str]:
    claim = node.apiserver.get("resourceclaims", ref.name, ref.namespace)
    return {c["type"]: c["status"] for e in claim["status"].get("devices") or [] for c in e.get("conditions") or []}


def test_partitions_carry_binding_conditions_and_plain_gpus_none(node: Node) -> None:
    node.start()
    devices = {d["name"]: d for d in published_devices(node.apiserver, DRIVER, "node-a")}
    assert devices[ONE_G]["bindingConditions"] == [READY]
    assert devices[ONE_G]["bindingFailureConditions"] == [FAILED]
    assert devices[ONE_G]["bindsToNode"] is True
    assert devices["gpu-0"]["bindingConditions"] == [READY]  # the whole MIG GPU: made as its one GPU instance
    assert "bindingConditions" not in devices["gpu-1"] and "bindsToNode" not in devices["gpu-1"]  # not MIG


def test_without_binding_conditions_nothing_carries_them(node: Node, start_daemon) -> None:
    node.daemon = start_daemon(node.node, "--dynamic-mig", "all", "--no-binding-conditions")
    assert poll(lambda: ONE_G in node.names() and node.pool_complete(), 60), node.daemon.log_text()
    assert not any("bindingConditions" in d for d in published_devices(node.apiserver, DRIVER, "node-a"))


def test_a_nominated_claim_gets_its_partition_before_prepare_and_prepare_adopts_it(node: Node) -> None:
    node.start()
    ref = nominated(node, "early")
    assert poll(lambda: conditions(node, ref).get(READY) == "True", 30), node.daemon.log_text()
    made = node.instances()
    assert [(p, ci) for p, _, ci in made] == [("1g.10gb", 0)]  # made before any kubelet call
    result = node.kubelet.prepare([ref])[ref.uid]
    assert result.error == "", result
    assert node.instances() == made  # adopted, not made again
    # Prepare's Ready entry (another field manager) leaves the binding condition in place.
    assert conditions(node, ref) == {READY: "True", "Ready": "True"}
    assert node.kubelet.unprepare([ref]) == {ref.uid: ""} and node.instances() == []


def test_a_partition_that_cannot_be_made_fails_binding_and_taints_its_gpu(node: Node) -> None:
    node.start()
    profile = sim_nvml.read_state(node.state)
    profile.gpus[0].nvml_errors = {"nvmlDeviceCreateGpuInstanceWithPlacement": ERROR_UNKNOWN}
    sim_nvml.write_state(profile, node.state)
    ref = nominated(node, "doomed")
    assert poll(lambda: conditions(node, ref).get(FAILED) == "True", 30), node.daemon.log_text()
    assert READY not in conditions(node, ref)
    assert node.instances() == []  # nothing half-made left
    taint = f"{DRIVER}/partition-failed"

    def tainted(name: str) -> bool:
        found = next(d for d in published_devices(node.apiserver, DRIVER, "node-a") if d["name"] == name)
        return taint in {t["key"] for t in found.get("taints") or []}

    assert poll(lambda: tainted(ONE_G) and tainted("gpu-0"), 30)  # the scheduler's next try goes elsewhere
    assert not tainted("gpu-1")
    assert poll(lambda: [e for e in node.apiserver.list("events", "default") if e.get("reason") == "BindingFailed"], 30)


def test_a_claim_deleted_before_binding_takes_its_partition_with_it(node: Node) -> None:
    node.start()
    ref = nominated(node, "gone")
    assert poll(lambda: conditions(node, ref).get(READY) == "True", 30), node.daemon.log_text()
    assert len(node.instances()) == 1
    node.delete(ref)
    assert poll(lambda: node.instances() == [], 30), node.daemon.log_text()


def test_kill_after_the_partition_is_made_recovers_with_one_partition(node: Node) -> None:
    node.start()
    node.hang("after:nvmlGpuInstanceCreateComputeInstance")
    ref = nominated(node, "killed")
    assert poll(lambda: sim_nvml.hung_at(node.state) == "after:nvmlGpuInstanceCreateComputeInstance", 30)
    node.daemon.proc.send_signal(signal.SIGKILL)
    node.daemon.proc.wait(timeout=30)
    node.hang("")
    node.start()
    assert poll(lambda: conditions(node, ref).get(READY) == "True", 60), node.daemon.log_text()
    assert [(p, ci) for p, _, ci in node.instances()] == [("1g.10gb", 0)]
    assert node.kubelet.prepare([ref])[ref.uid].error == ""
    assert [(p, ci) for p, _, ci in node.instances()] == [("1g.10gb", 0)]


def test_a_claim_allocated_another_partition_before_binding_gives_the_first_back(node: Node) -> None:
    """Issue 33: a standalone claim's pod deleted before it binds and named again at once; the
    scheduler deallocates the claim and allocates it another partition. Whenever the daemon reads
    it (before or after the new allocation), it ends with the new partition alone, and the next
    claim allocated the first one binds: no GPU is tainted."""
    node.start()
    ref = nominated(node, "again")
    assert poll(lambda: conditions(node, ref).get(READY) == "True", 30), node.daemon.log_text()
    node.apiserver.delete("pods", "pod-again", "default")
    deallocate(node.apiserver, node.apiserver.get("resourceclaims", "again", "default"))
    assert nominated(node, "again", THREE_G, pod="pod-again-2") == ref  # the same claim UID
    assert poll(lambda: conditions(node, ref).get(READY) == "True", 30), node.daemon.log_text()
    assert [p for p, _, _ in node.instances()] == ["3g.40gb"]
    other = nominated(node, "next", ONE_G)
    assert poll(lambda: conditions(node, other).get(READY) == "True", 30), node.daemon.log_text()
    assert sorted(p for p, _, _ in node.instances()) == ["1g.10gb", "3g.40gb"]
    assert FAILED not in conditions(node, ref) | conditions(node, other)
