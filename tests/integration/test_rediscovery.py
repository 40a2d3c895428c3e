"""GPUs that appear or disappear are reflected in the slice without a restart."""

from __future__ import annotations

import dataclasses
import signal

from demo.node import DRIVER
from sim.kubelet import KubeletSim
from sim.nvml import write_driver_unloaded, write_state
from sim.profile import h100_node
from sim.scheduler import published_devices
from sim.sysfs import render_node


def _names(apiserver, node) -> set[str]:
    return {d["name"] for d in published_devices(apiserver, DRIVER, node.profile.name)}


def test_hot_plug_and_driver_reload_on_sighup(apiserver, sim_node, start_daemon):
    full = h100_node("node-r", gpus=3, nics=0)
    node = sim_node(dataclasses.replace(full, gpus=full.gpus[:2]))
    daemon = start_daemon(node, "--device-kinds", "gpu")  # slow period: only SIGHUP triggers rediscovery
    with KubeletSim(node.registry) as kubelet:
        kubelet.register(kubelet.wait_for_registration_socket(DRIVER, timeout=60))
    assert apiserver.wait_for(lambda: _names(apiserver, node) == {"gpu-0", "gpu-1"}, 60), daemon.log_text()

    render_node(full, node.sysfs, node.dev)  # GPU 2 is hot-plugged
    write_state(full, node.root / "nvml-state.json")
    daemon.proc.send_signal(signal.SIGHUP)
    assert apiserver.wait_for(lambda: _names(apiserver, node) == {"gpu-0", "gpu-1", "gpu-2"}, 30), daemon.log_text()

    # The NVIDIA driver is unloaded: no GPUs are published (not stale ones), and the daemon lives on.
    write_driver_unloaded(node.root / "nvml-state.json")
    daemon.proc.send_signal(signal.SIGHUP)
    assert apiserver.wait_for(lambda: _names(apiserver, node) == set(), 30), daemon.log_text()
    assert daemon.proc.poll() is None

    # Loaded again: discovery retries with backoff on its own (no signal) and republishes.
    write_state(full, node.root / "nvml-state.json")
    assert apiserver.wait_for(lambda: len(_names(apiserver, node)) == 3, 30), daemon.log_text()
    assert "discovery unavailable" in daemon.log_text()
