"""Dynamic MIG with the daemon as a real process: partitions carved at prepare and destroyed at
unprepare, counters the allocator honours, health on the partitions, and kill -9 at every step of
making and destroying a MIG device, then a restart: nothing half-made or leaked, every claim
prepared once.

The daemon is killed at an exact NVML step without hooks in the product: the fake NVML blocks a
chosen call, before or after it acts, when the GPU's `nvml_hang` names it (`sim.nvml.hung_at` says
it got there), as a GPU whose driver call never returns would."""

from __future__ import annotations

import json
import signal
import uuid
from pathlib import Path

import pytest
from kubelet_calls import call_in_background, registered
from waiting import poll

from demo.node import DRIVER
from sim import nvml as sim_nvml
from sim.kubelet import ClaimRef, KubeletSim
from sim.profile import h100_node
from sim.scheduler import Request, allocate, attribute, claim_object, published_devices, reserve

XID = 0x0000000000000008  # nvmlEventTypeXidCriticalError
ONE_G = "gpu-0-mig-1g-10gb-p3"
ONE_G_STATIC = "gpu-0-mig-1g-10gb-10-0"  # its MIG device by the name a MIG device of no claim has


def placement(name: str) -> Request:
    return Request("mig", "mig.tandem.dev", lambda d: d["name"] == name)


WHOLE = Request("whole", "gpu.tandem.dev", lambda d: d["name"] == "gpu-0")
ONE_G_ANY = Request("small", "mig.tandem.dev", lambda d: attribute(d, "profile") == "1g.10gb")
THREE_G_ANY = Request("big", "mig.tandem.dev", lambda d: attribute(d, "profile") == "3g.40gb")


class Node:
    def __init__(self, apiserver, sim_node, start_daemon):
        profile = h100_node("node-a", gpus=2, nics=0, mig_capable=True)
        profile.gpus[0].mig_mode = True  # the administrator's `nvidia-smi -i 0 -mig 1`
        self.apiserver = apiserver
        self.node = sim_node(profile)
        self.start_daemon = start_daemon
        self.daemon = None
        self.kubelet = KubeletSim(self.node.registry)
        self.state = self.node.root / "nvml-state.json"

    def start(self, partitions: bool = True, dynamic: bool = True) -> None:
        self.daemon = self.start_daemon(self.node, *(("--dynamic-mig", "all") if dynamic else ()))
        sock = self.kubelet.wait_for_registration_socket(DRIVER, timeout=60)
        assert poll(lambda: registered(self.kubelet, sock), 60), self.daemon.log_text()
        if partitions and dynamic:
            assert poll(lambda: "gpu-0-mig-4g-40gb-p0" in self.names() and self.pool_complete(), 60), (
                self.daemon.log_text()
            )

    def pool_complete(self) -> bool:
        slices = [s["spec"] for s in self.apiserver.list("resourceslices") if s["spec"].get("nodeName") == "node-a"]
        return bool(slices) and len(slices) == slices[0]["pool"]["resourceSliceCount"]

    def kill(self) -> None:
        self.daemon.proc.send_signal(signal.SIGKILL)
        self.daemon.proc.wait(timeout=30)

    def drop_slices(self) -> None:
        """The node's ResourceSlices gone, so that what the next start shows is its own publishing."""
        for s in self.apiserver.list("resourceslices"):
            if s["spec"].get("nodeName") == "node-a":
                self.apiserver.delete("resourceslices", s["metadata"]["name"])

    def names(self) -> set[str]:
        return {d["name"] for d in published_devices(self.apiserver, DRIVER, "node-a")}

    def claim(self, name: str, *requests: Request) -> ClaimRef:
        claim = self.apiserver.create(claim_object("default", name, list(requests)))
        allocate(self.apiserver, claim, DRIVER, "node-a", list(requests))
        reserve(self.apiserver, claim, f"pod-{name}", str(uuid.uuid4()))
        return ClaimRef("default", name, claim["metadata"]["uid"])

    def delete(self, ref: ClaimRef) -> None:
        self.apiserver.delete("resourceclaims", ref.name, ref.namespace)

    def instances(self) -> list[tuple[str, int, int | None]]:
        return sorted((m.profile, m.gi_id, m.ci_id) for m in sim_nvml.read_state(self.state).gpus[0].mig_devices)

    def hang(self, step: str) -> None:
        profile = sim_nvml.read_state(self.state)
        profile.gpus[0].nvml_hang = step
        sim_nvml.write_state(profile, self.state)
        self.state.with_name(self.state.name + ".hung").unlink(missing_ok=True)

    def checkpoint(self) -> dict:
        path = self.node.plugins / DRIVER / "checkpoint.json"
        return json.loads(path.read_text())["claims"] if path.exists() else {}

    def specs(self, ref: ClaimRef) -> list[Path]:
        return [p for p in self.node.cdi.iterdir() if ref.uid in p.name and p.name.startswith("k8s.")]


@pytest.fixture
def node(apiserver, sim_node, start_daemon):
    n = Node(apiserver, sim_node, start_daemon)
    yield n
    n.kubelet.close()


def test_partitions_share_a_gpu_and_the_whole_gpu_waits_for_them(node: Node, apiserver) -> None:
    node.start()
    small, big = node.claim("small", ONE_G_ANY), node.claim("big", THREE_G_ANY)
    with pytest.raises(LookupError):
        node.claim("early", WHOLE)  # its counters are taken: the allocator has no answer
    results = node.kubelet.prepare([small, big])
    assert all(r.error == "" for r in results.values()), results
    assert node.instances() == [("1g.10gb", 7, 0), ("3g.40gb", 2, 0)]

    # An XID the driver attributes to the 1g partition's instances taints that partition only.
    sim_nvml.append_event(node.state, sim_nvml.read_state(node.state).gpus[0].uuid, XID, 79, gi=7, ci=0)
    assert poll(lambda: _taints(apiserver, "gpu-0-mig-1g-10gb-p0") == ["tandem.dev/xid"], 30)
    assert _taints(apiserver, "gpu-0-mig-3g-40gb-p4") == []

    for ref in (small, big):
        assert node.kubelet.unprepare([ref]) == {ref.uid: ""}
        node.delete(ref)
    assert node.instances() == []
    whole = node.claim("whole", WHOLE)
    assert node.kubelet.prepare([whole])[whole.uid].error == ""
    assert node.instances() == [("7g.80gb", 0, 0)]
    assert node.kubelet.unprepare([whole]) == {whole.uid: ""} and node.instances() == []


def _taints(apiserver, device: str) -> list[str]:
    found = next(d for d in published_devices(apiserver, DRIVER, "node-a") if d["name"] == device)
    return sorted(t["key"] for t in found.get("taints") or [])


@pytest.mark.parametrize(
    "step",
    [
        "before:nvmlDeviceCreateGpuInstanceWithPlacement",
        "after:nvmlDeviceCreateGpuInstanceWithPlacement",
        "after:nvmlGpuInstanceCreateComputeInstance",
    ],
)
def test_kill_while_making_a_partition(node: Node, step: str) -> None:
    node.start()
    ref = node.claim("c", placement(ONE_G))
    node.hang(step)
    call_in_background(node.kubelet, "prepare", ref)
    assert poll(lambda: sim_nvml.hung_at(node.state) == step, 30), node.daemon.log_text()
    node.kill()
    node.hang("")

    node.start()  # the dead instance's PrepareStarted is rolled back, its partition destroyed
    assert node.instances() == [] and ref.uid not in node.checkpoint()
    result = node.kubelet.prepare([ref])[ref.uid]  # the kubelet retries
    assert result.error == ""
    assert node.instances() == [("1g.10gb", 10, 0)]  # made once, complete
    assert node.checkpoint()[ref.uid]["state"] == "PrepareCompleted" and len(node.specs(ref)) == 1
    assert node.kubelet.unprepare([ref]) == {ref.uid: ""}
    assert node.instances() == [] and node.checkpoint() == {}


@pytest.mark.parametrize(
    "step",
    [
        "before:nvmlComputeInstanceDestroy",
        "after:nvmlComputeInstanceDestroy",
        "after:nvmlGpuInstanceDestroy",
    ],
)
def test_kill_while_destroying_a_partition(node: Node, step: str) -> None:
    node.start()
    ref = node.claim("c", placement(ONE_G))
    assert node.kubelet.prepare([ref])[ref.uid].error == ""
    node.hang(step)
    call_in_background(node.kubelet, "unprepare", ref)
    assert poll(lambda: sim_nvml.hung_at(node.state) == step, 30), node.daemon.log_text()
    node.kill()
    node.hang("")

    node.start()  # the unprepare that lost its files is finished: no partition, no record
    assert node.instances() == [] and node.checkpoint() == {} and node.specs(ref) == []
    assert node.kubelet.unprepare([ref]) == {ref.uid: ""}  # the kubelet's retry finds nothing to do


def test_a_lost_checkpoint_and_a_restart_without_dynamic_mig_keep_tandems_gpu_instance_its_claims(node: Node) -> None:
    """The daemon dies and its checkpoint is lost: the next start publishes the claim's GPU instance
    as its partition (never as a free MIG device) and rebuilds the claim's record. Restarted without
    `--dynamic-mig`, it publishes no MIG device of GPU 0 (its one GPU instance is Tandem's), and the
    kubelet's unprepare destroys it."""
    node.start()
    ref = node.claim("c", placement(ONE_G))
    assert node.kubelet.prepare([ref])[ref.uid].error == ""
    node.kill()
    (node.node.plugins / DRIVER / "checkpoint.json").unlink()
    node.drop_slices()

    node.start()  # waits for its partitions: with 1g.10gb taken by a stranger, 4g.40gb-p0 is withheld
    assert ONE_G_STATIC not in node.names()
    assert node.checkpoint()[ref.uid]["state"] == "PrepareCompleted", node.daemon.log_text()
    assert node.instances() == [("1g.10gb", 10, 0)]
    node.kill()

    node.start(dynamic=False)
    assert poll(lambda: node.names() == {"gpu-1"} and node.pool_complete(), 60), (node.names(), node.daemon.log_text())
    assert node.kubelet.unprepare([ref]) == {ref.uid: ""}
    assert node.instances() == [] and node.checkpoint() == {}


def test_a_server_that_drops_counters_gets_no_unguarded_partitions(node: Node, apiserver) -> None:
    apiserver.partitionable_devices_enabled = False  # DRAPartitionableDevices off: counters dropped
    node.start(partitions=False)
    assert poll(lambda: "gpu-1" in node.names() and not any(n.startswith("gpu-0") for n in node.names()), 60)
    assert "does not store shared counters" in node.daemon.log_text()
