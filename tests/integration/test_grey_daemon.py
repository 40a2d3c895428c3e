"""Grey failures end to end, with the daemon as a real process on the simulated node.

A GPU whose PCIe link trained at x8, a NIC that flaps and a NIC counting symbol errors, each
injected while the daemon runs (`sim.grey`): each becomes a NoSchedule taint in the published
ResourceSlice on that device only, an `Unhealthy` report in the kubelet's health stream, a
`DeviceUnhealthy` Event on the claim that holds the device, its words in `tandemctl devices`, its
counters in `/metrics`; and each clears once the device reads well again. A restart reports
again what was reported. Thresholds are short here (a period of 0.5 s); docs/health.md has the
defaults.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import urllib.request
from typing import Any

import pytest
from waiting import poll, wait_for

from demo.node import DRIVER
from sim.grey import add_port_counter, flap, set_gpu_signals
from sim.kubelet import ClaimRef, KubeletSim
from sim.profile import h100_node
from sim.scheduler import Request, allocate, attribute, claim_object, published_devices, reserve

THRESHOLDS = ("period=0.5", "window=3", "hold=1.5", "recovery=2", "rising-reads=2")


def _flags(*thresholds: str) -> list[str]:
    return [arg for t in thresholds for arg in ("--grey-threshold", t)]


def _taints(apiserver: Any, node: Any, device: str) -> list[dict[str, Any]]:
    return next(
        (d.get("taints") or [] for d in published_devices(apiserver, DRIVER, node.profile.name) if d["name"] == device),
        [],
    )


def _keys(apiserver: Any, node: Any, device: str) -> set[str]:
    return {t["key"] for t in _taints(apiserver, node, device)}


def _ctl(node: Any, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-c", "import sys; from driver.cli import ctl_main; sys.exit(ctl_main())"]
    return subprocess.run(
        [*cmd, "--kubelet-plugins-dir", str(node.plugins), *args], capture_output=True, text=True, timeout=60
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _nic_name(apiserver: Any, node: Any, ifname: str) -> str:
    return next(
        d["name"] for d in published_devices(apiserver, DRIVER, node.profile.name) if attribute(d, "ifName") == ifname
    )


@pytest.fixture
def running(apiserver, sim_node, start_daemon):
    node = sim_node(h100_node("node-grey", gpus=2, nics=2))
    port = _free_port()
    daemon = start_daemon(node, *_flags(*THRESHOLDS), "--metrics-address", f"127.0.0.1:{port}")
    kubelet = KubeletSim(node.registry)
    kubelet.register(kubelet.wait_for_registration_socket(DRIVER, timeout=60))
    assert apiserver.wait_for(lambda: len(published_devices(apiserver, DRIVER, node.profile.name)) >= 4, 60)
    yield node, daemon, kubelet, port
    kubelet.close()


def test_a_gpu_link_trained_at_x8_is_fenced_told_and_given_back(apiserver, running) -> None:
    node, daemon, kubelet, port = running
    gpu = Request("gpu", "gpu.tandem.dev", lambda d: attribute(d, "uuid") == node.profile.gpus[1].uuid)
    claim = apiserver.create(claim_object("ml", "train", [gpu]))
    allocate(apiserver, claim, DRIVER, node.profile.name, [gpu])
    reserve(apiserver, claim, "train-0", "pod-uid-0")
    ref = ClaimRef("ml", "train", claim["metadata"]["uid"])
    assert kubelet.prepare([ref])[ref.uid].error == "", daemon.log_text()
    watch = kubelet.watch_health("v1")
    watch.next(timeout=30)

    set_gpu_signals(node.root / "nvml-state.json", node.profile.gpus[1].uuid, pcie_link_width=8)
    assert poll(lambda: "tandem.dev/pcie-degraded" in _keys(apiserver, node, "gpu-1"), 30), daemon.log_text()
    (taint,) = _taints(apiserver, node, "gpu-1")
    assert (taint["value"], taint["effect"]) == ("x8-of-x16", "NoSchedule")
    assert _taints(apiserver, node, "gpu-0") == [], "one GPU's link must not taint the other"

    snap = watch.wait_for(lambda s: any(r.device == "gpu-1" and r.health == "UNHEALTHY" for r in s), timeout=30)
    assert "PCIe link trained at x8 of x16" in next(r for r in snap if r.device == "gpu-1").message
    events = wait_for(
        "the Event on the claim",
        lambda: [e for e in apiserver.list("events", "ml") if e["reason"] == "DeviceUnhealthy"],
        30,
    )
    assert events[0]["regarding"]["name"] == "train" and "x8 of x16" in events[0]["note"]
    devices = _ctl(node, "devices")
    print(f"$ tandemctl devices\n{devices.stdout}")
    assert "gpu-1: PCIe link trained at x8 of x16 since" in devices.stdout
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    assert 'tandem_device_counter_total{counter="pcie-replays",device="gpu-1"} 0.0' in metrics

    set_gpu_signals(node.root / "nvml-state.json", node.profile.gpus[1].uuid, pcie_link_width=16)
    assert poll(lambda: _taints(apiserver, node, "gpu-1") == [], 30), daemon.log_text()
    watch.wait_for(lambda s: all(r.health == "HEALTHY" for r in s), timeout=30)
    watch.cancel()


def test_a_flapping_nic_and_one_counting_symbol_errors_are_fenced_and_given_back(apiserver, running) -> None:
    node, daemon, _, _ = running
    flapping, erring = node.profile.nics
    flapping_name, erring_name = _nic_name(apiserver, node, flapping.ifname), _nic_name(apiserver, node, erring.ifname)

    flap(node.sysfs, flapping.ifname, times=1)  # one flap: nothing
    flap(node.sysfs, flapping.ifname, times=3)
    assert poll(lambda: "tandem.dev/link-flapping" in _keys(apiserver, node, flapping_name), 30), daemon.log_text()
    assert _keys(apiserver, node, erring_name) == set()

    def rising() -> bool:
        add_port_counter(node.sysfs, erring.rdma_device, 1, "symbol_error", 200)
        return "tandem.dev/rdma-errors" in _keys(apiserver, node, erring_name)

    wait_for("the symbol errors' taint", rising, 30, interval=0.3)
    (taint,) = _taints(apiserver, node, erring_name)
    assert (taint["value"], taint["effect"]) == ("port1-symbol-error", "NoSchedule")
    devices = json.loads(_ctl(node, "devices", "--json").stdout)["devices"]
    assert "symbol errors on port 1" in next(d for d in devices if d["name"] == erring_name)["healthMessage"]

    assert poll(lambda: _keys(apiserver, node, flapping_name) == set(), 30), daemon.log_text()
    assert poll(lambda: _keys(apiserver, node, erring_name) == set(), 30), daemon.log_text()


def test_a_restart_keeps_what_was_reported(apiserver, running, start_daemon) -> None:
    node, daemon, kubelet, _ = running
    set_gpu_signals(node.root / "nvml-state.json", node.profile.gpus[0].uuid, pcie_link_width=4)
    assert poll(lambda: "tandem.dev/pcie-degraded" in _keys(apiserver, node, "gpu-0"), 30), daemon.log_text()
    assert daemon.stop() == 0
    set_gpu_signals(node.root / "nvml-state.json", node.profile.gpus[0].uuid, pcie_link_width=16)
    # The new instance needs 60 s of good reads to clear it: until then it says what the old one said.
    restarted = start_daemon(node, *_flags("period=0.5", "window=3", "hold=1.5", "recovery=60", "rising-reads=2"))
    kubelet.register(kubelet.wait_for_registration_socket(DRIVER, timeout=60))
    assert poll(lambda: _ctl(node, "devices").returncode in (0, 1), 60), restarted.log_text()
    devices = json.loads(_ctl(node, "devices", "--json").stdout)["devices"]
    gpu0 = next(d for d in devices if d["name"] == "gpu-0")
    assert [t["key"] for t in gpu0["taints"]] == ["tandem.dev/pcie-degraded"], restarted.log_text()
    assert "tandem.dev/pcie-degraded" in _keys(apiserver, node, "gpu-0")
