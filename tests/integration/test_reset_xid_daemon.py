"""A reset-class XID on a driver without NVML's recovery-action field, with the daemon as a real
process: the taint outlives the quiet period and clears only on evidence of a reset, the SRE's
`tandemctl release`/`reacquire` around the reset, or `tandemctl clear` (recorded in the data dir).
"""

from __future__ import annotations

import json
import subprocess
import sys

from waiting import poll

from demo.node import DRIVER
from sim.kubelet import KubeletSim
from sim.nvml import append_event, reset_gpu
from sim.profile import h100_node
from sim.scheduler import published_devices

XID_EVENT = 0x8  # nvmlEventTypeXidCriticalError


def _taints(apiserver, node, device: str) -> set[tuple[str, str, str]]:
    for d in published_devices(apiserver, DRIVER, node.profile.name):
        if d["name"] == device:
            return {(t["key"], t.get("value", ""), t["effect"]) for t in d.get("taints") or []}
    return set()


def _ctl(node, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-c", "import sys; from driver.cli import ctl_main; sys.exit(ctl_main())"]
    cmd += ["--kubelet-plugins-dir", str(node.plugins), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


def test_a_reset_xid_without_a_recovery_action_stays_until_a_reset_or_a_clear(apiserver, sim_node, start_daemon):
    profile = h100_node("node-x", gpus=2, nics=0)
    for gpu in profile.gpus:
        gpu.recovery_action = None  # NVML answers NOT_SUPPORTED for the field: an older driver
    node = sim_node(profile)
    daemon = start_daemon(node, "--health-quiet-period", "1")
    kubelet = KubeletSim(node.registry)
    try:
        kubelet.register(kubelet.wait_for_registration_socket(DRIVER, timeout=60))
        assert apiserver.wait_for(lambda: len(published_devices(apiserver, DRIVER, profile.name)) >= 2, 60)
        state = node.root / "nvml-state.json"
        gpu0, gpu1 = profile.gpus
        watch = kubelet.watch_health("v1")
        watch.next(timeout=30)

        append_event(state, gpu1.uuid, XID_EVENT, 79)  # fallen off the bus
        watch.wait_for(lambda s: any(r.device == "gpu-1" and r.health == "UNHEALTHY" for r in s), timeout=30)
        append_event(state, gpu0.uuid, XID_EVENT, 94)  # not reset-class: it clears after the quiet period
        watch.wait_for(lambda s: any(r.device == "gpu-0" and r.health == "UNHEALTHY" for r in s), timeout=30)
        # The XID 94 came later: once gpu-0 is healthy again, the quiet period (1 s) has passed for both.
        snap = watch.wait_for(lambda s: any(r.device == "gpu-0" and r.health == "HEALTHY" for r in s), timeout=30)
        bad = next(r for r in snap if r.device == "gpu-1")
        assert bad.health == "UNHEALTHY" and "tandemctl clear" in bad.message, bad.message
        held = ("tandem.dev/xid", "79", "NoExecute")
        assert poll(lambda: _taints(apiserver, node, "gpu-1") == {held}, 30), daemon.log_text()
        devices = json.loads(_ctl(node, "devices", "--json").stdout)["devices"]
        assert "nvidia-smi -r" in next(d["healthMessage"] for d in devices if d["name"] == "gpu-1")

        # The reset path through Tandem: release, nvidia-smi -r, reacquire.
        out = _ctl(node, "release", "gpu-1", "--reason", "nvidia-smi -r after XID 79", "--by", "sre")
        assert out.returncode == 0, out.stderr + daemon.log_text()
        reset_gpu(profile, state, 1)
        out = _ctl(node, "reacquire", "gpu-1")
        assert out.returncode == 0, out.stderr
        assert poll(lambda: _taints(apiserver, node, "gpu-1") == set(), 30), daemon.log_text()

        # The operator's word: tandemctl clear, recorded with who, why and when.
        append_event(state, gpu1.uuid, XID_EVENT, 48)  # double-bit ECC
        assert poll(lambda: ("tandem.dev/xid", "48", "NoExecute") in _taints(apiserver, node, "gpu-1"), 30)
        out = _ctl(node, "clear", "gpu-1", "--reason", "reset out of band, gpu-burn passed", "--by", "sre")
        assert out.returncode == 0 and "gpu-1 cleared" in out.stdout, out.stderr
        assert poll(lambda: _taints(apiserver, node, "gpu-1") == set(), 30), daemon.log_text()
        (record,) = json.loads((node.plugins / DRIVER / "cleared.json").read_text())["clears"]
        assert (record["device"], record["gpu"]) == ("gpu-1", gpu1.uuid)
        assert record["by"].startswith("sre (uid 0, pid "), record  # the name and the socket's peer
        again = _ctl(node, "clear", "gpu-1", "--reason", "once more", "--by", "sre")
        assert again.returncode == 1 and "nothing to clear" in again.stderr, again.stdout + again.stderr
        assert len(json.loads((node.plugins / DRIVER / "cleared.json").read_text())["clears"]) == 1
        bad_clear = _ctl(node, "clear", "gpu-9", "--reason", "typo")
        assert bad_clear.returncode == 1 and "gpu-9" in bad_clear.stderr
        watch.cancel()
    finally:
        kubelet.close()


def test_a_held_reset_xid_outlives_a_restart_of_the_daemon(apiserver, sim_node, start_daemon):
    """The hold is kept in the data dir: the restarted daemon offers the GPU tainted, from its own
    inventory, until the evidence (here the operator's `tandemctl clear`)."""
    profile = h100_node("node-r", gpus=2, nics=0)
    for gpu in profile.gpus:
        gpu.recovery_action = None
    node = sim_node(profile)
    held = ("tandem.dev/xid", "79", "NoExecute")
    first = start_daemon(node, "--health-quiet-period", "1")
    assert apiserver.wait_for(lambda: len(published_devices(apiserver, DRIVER, profile.name)) >= 2, 60)
    append_event(node.root / "nvml-state.json", profile.gpus[1].uuid, XID_EVENT, 79)
    assert poll(lambda: _taints(apiserver, node, "gpu-1") == {held}, 30), first.log_text()
    assert first.stop() == 0

    second = start_daemon(node, "--health-quiet-period", "1")
    kubelet = KubeletSim(node.registry)
    try:
        kubelet.register(kubelet.wait_for_registration_socket(DRIVER, timeout=60))
        watch = kubelet.watch_health("v1")  # the new process's own verdict, not the old slices
        snap = watch.wait_for(lambda s: {r.device for r in s} >= {"gpu-0", "gpu-1"}, timeout=30)
        states = {r.device: (r.health, r.message) for r in snap}
        assert states["gpu-0"][0] == "HEALTHY" and states["gpu-1"][0] == "UNHEALTHY", states
        assert "XID 79" in states["gpu-1"][1] and "tandemctl clear" in states["gpu-1"][1]
        assert "still held from before this start" in second.log_text()
        assert poll(lambda: _published(node), 30), second.log_text()
        assert _taints(apiserver, node, "gpu-1") == {held}  # published by the restarted daemon

        out = _ctl(node, "clear", "gpu-1", "--reason", "reset out of band", "--by", "sre")
        assert out.returncode == 0, out.stderr
        assert poll(lambda: _taints(apiserver, node, "gpu-1") == set(), 30), second.log_text()
        watch.cancel()
    finally:
        kubelet.close()
    assert second.stop() == 0
    third = start_daemon(node, "--health-quiet-period", "1")  # the evidence outlives a restart too
    assert poll(lambda: _published(node), 60), third.log_text()
    assert _taints(apiserver, node, "gpu-1") == set() and "still held" not in third.log_text()
    assert third.stop() == 0


def _published(node) -> bool:
    """Whether the daemon that answers `tandemctl` now has published its node's slices."""
    out = _ctl(node, "health", "--json")
    return out.returncode in (0, 1) and json.loads(out.stdout)["daemon"]["slices"]["publishedAt"] is not None
