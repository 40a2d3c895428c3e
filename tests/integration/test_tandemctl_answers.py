"""`tandemctl`'s answers to the questions asked at 3 a.m., from the daemon as a real process.

Which pod holds this GPU or NIC, its UUID or RDMA device name (`devices -o wide`); what happened
to a claim (`claim NAMESPACE/NAME`: its record, files, status, last failed prepare); exit codes
that tell the daemon unreachable (3) from a usage error (2); and an XID on a held GPU told on
the claim, in the pod's namespace, where the pod's owner reads events.
"""

from __future__ import annotations

import json
import subprocess
import sys

from waiting import wait_for

from demo.node import DRIVER
from sim.kubelet import ClaimRef, KubeletSim
from sim.nvml import append_event
from sim.profile import h100_node
from sim.scheduler import Request, allocate, attribute, claim_object, published_devices, reserve

GPU = Request("gpu", "gpu.tandem.dev", lambda d: attribute(d, "type") == "gpu")
NIC = Request("nic", "nic.tandem.dev", lambda d: attribute(d, "type") == "nic")
XID_EVENT = 0x8  # nvmlEventTypeXidCriticalError


def _ctl(plugins, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-c", "import sys; from driver.cli import ctl_main; sys.exit(ctl_main())"]
    return subprocess.run(
        [*cmd, "--kubelet-plugins-dir", str(plugins), *args], capture_output=True, text=True, timeout=60
    )


def test_tandemctl_answers_who_holds_a_device_and_what_happened_to_a_claim(apiserver, sim_node, start_daemon):
    node = sim_node(h100_node("node-3am", gpus=2, nics=2))
    daemon = start_daemon(node)
    kubelet = KubeletSim(node.registry)
    kubelet.register(kubelet.wait_for_registration_socket(DRIVER, timeout=60))
    assert apiserver.wait_for(lambda: len(published_devices(apiserver, DRIVER, node.profile.name)) >= 4, 60)
    claim = apiserver.create(claim_object("ml", "pair", [GPU, NIC], "resource.kubernetes.io/pcieRoot"))
    allocate(apiserver, claim, DRIVER, node.profile.name, [GPU, NIC], "resource.kubernetes.io/pcieRoot")
    reserve(apiserver, claim, "train-0", "pod-uid-0")
    pair = ClaimRef("ml", "pair", claim["metadata"]["uid"])
    broken = apiserver.create(claim_object("ml", "broken", [GPU]))  # never allocated: its prepare fails
    stuck = ClaimRef("ml", "broken", broken["metadata"]["uid"])
    results = kubelet.prepare([pair, stuck])
    assert results[pair.uid].error == "" and results[stuck.uid].error, daemon.log_text()
    try:
        wide = _ctl(node.plugins, "devices", "-o", "wide")
        print(f"$ tandemctl devices -o wide\n{wide.stdout}")
        assert wide.returncode == 0, wide.stderr
        held = [line.split() for line in wide.stdout.splitlines() if "ml/pair" in line]
        assert len(held) == 2 and all(row[-4:-2] == ["ml/pair", "ml/train-0"] for row in held)
        gpu_row = next(row for row in held if row[0].startswith("gpu-"))
        gpu = next(g for g in node.profile.gpus if g.uuid == gpu_row[-2])  # the UUID nvidia-smi shows
        assert any(row[-2].startswith("mlx5_") for row in held), "the NIC's RDMA device name"

        answer = _ctl(node.plugins, "claim", "ml/pair")
        print(f"$ tandemctl claim ml/pair\n{answer.stdout}")
        assert answer.returncode == 0, answer.stderr
        lines = answer.stdout.splitlines()
        assert lines[1:3] == ["state: PrepareCompleted", "pods: ml/train-0"]
        assert "files: cdiSpec present" in answer.stdout and "last error: -" in lines
        doc = json.loads(_ctl(node.plugins, "claim", pair.uid, "-o", "json").stdout)
        assert doc["files"]["cdiSpec"] and all(s["ready"] for s in doc["status"])

        failed = _ctl(node.plugins, "claim", "ml/broken")
        print(f"$ tandemctl claim ml/broken\n{failed.stdout}")
        assert failed.returncode == 0, failed.stderr
        assert "state: NotPrepared" in failed.stdout and "not allocated" in failed.stdout
        assert "files: cdiSpec absent" in failed.stdout

        assert _ctl(node.plugins, "devices", "-o", "yaml").returncode == 2
        unreachable = _ctl(node.plugins / "elsewhere", "health")
        assert unreachable.returncode == 3 and unreachable.stderr.count("\n") == 1

        append_event(node.root / "nvml-state.json", gpu.uuid, XID_EVENT, 79)
        events = wait_for(
            "the XID told on the claim",
            lambda: [e for e in apiserver.list("events", "ml") if e["reason"] == "DeviceUnhealthy"],
            timeout=60,
        )
        assert events[0]["regarding"]["kind"] == "ResourceClaim" and events[0]["regarding"]["name"] == "pair"
        print(f"event in ml: {events[0]['type']} {events[0]['reason']} on claim pair: {events[0]['note']}")
    finally:
        kubelet.close()
