"""Device health end to end, with the daemon as a real process.

An XID injected through the simulated NVML, a NIC link taken down in the simulated sysfs and a
manual cordon each turn into a taint in the published ResourceSlice, a health-stream snapshot
for the kubelet and `tandemctl` output, and each clears again. The operations procedures of
docs/deployment.md (a GPU reset, a driver upgrade) run against the daemon with `tandemctl
release`/`reacquire`, and the simulated NVML tells whether the daemon really let go.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import urllib.request

import pytest
from waiting import poll

from demo.node import DRIVER
from sim.kubelet import ClaimRef, KubeletSim
from sim.nvml import DeviceInUse, append_event, nvml_clients, reset_gpu, unload_driver, write_state
from sim.profile import h100_node
from sim.scheduler import Request, allocate, attribute, claim_object, published_devices

XID_EVENT = 0x8  # nvmlEventTypeXidCriticalError


def _taints(apiserver, node, device: str) -> list[dict]:
    for d in published_devices(apiserver, DRIVER, node.profile.name):
        if d["name"] == device:
            return d.get("taints") or []
    return []


def _ctl(node, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-c", "import sys; from driver.cli import ctl_main; sys.exit(ctl_main())"]
    cmd += ["--kubelet-plugins-dir", str(node.plugins), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def running(apiserver, sim_node, start_daemon):
    node = sim_node(h100_node("node-h", gpus=2, nics=2))
    port = _free_port()
    # The quiet period must outlast every check a test makes while the taint stands (two tandemctl
    # processes among them), also on a loaded CI machine: 3 s was not enough there.
    daemon = start_daemon(
        node, "--health-quiet-period", "10", "--link-debounce", "0.3", "--metrics-address", f"127.0.0.1:{port}"
    )
    kubelet = KubeletSim(node.registry)
    kubelet.register(kubelet.wait_for_registration_socket(DRIVER, timeout=60))
    assert apiserver.wait_for(lambda: len(published_devices(apiserver, DRIVER, node.profile.name)) >= 4, 60)
    yield node, daemon, kubelet, port
    kubelet.close()


def test_xid_taints_the_gpu_everywhere_and_clears_after_the_quiet_period(apiserver, running):
    node, daemon, kubelet, _ = running
    gpu = node.profile.gpus[1]
    watch = kubelet.watch_health("v1")
    first = watch.next(timeout=30)
    assert {r.device for r in first} >= {"gpu-0", "gpu-1"} and all(r.health == "HEALTHY" for r in first)

    append_event(node.root / "nvml-state.json", gpu.uuid, XID_EVENT, 79)  # fallen off the bus: reset needed
    assert poll(lambda: any(t["key"] == "tandem.dev/xid" for t in _taints(apiserver, node, "gpu-1"))), daemon.log_text()
    taint = next(t for t in _taints(apiserver, node, "gpu-1") if t["key"] == "tandem.dev/xid")
    assert (taint["value"], taint["effect"]) == ("79", "NoExecute")
    assert _taints(apiserver, node, "gpu-0") == [], "one GPU's XID must not taint the others"

    snap = watch.wait_for(lambda s: any(r.device == "gpu-1" and r.health == "UNHEALTHY" for r in s), timeout=30)
    bad = next(r for r in snap if r.device == "gpu-1")
    assert "79" in bad.message
    health = _ctl(node, "health")
    assert health.returncode == 1 and "gpu-1" in health.stdout
    devices = json.loads(_ctl(node, "devices", "--json").stdout)["devices"]
    assert any(t["key"] == "tandem.dev/xid" for d in devices if d["name"] == "gpu-1" for t in d["taints"])

    # No new XID for the quiet period: the taint and the unhealthy status go away without a restart.
    assert poll(lambda: _taints(apiserver, node, "gpu-1") == [], timeout=30), daemon.log_text()
    watch.wait_for(lambda s: all(r.health == "HEALTHY" for r in s), timeout=30)
    assert _ctl(node, "health").returncode == 0
    watch.cancel()


def test_application_xid_is_informational(apiserver, running):
    node, daemon, _, _ = running
    append_event(node.root / "nvml-state.json", node.profile.gpus[0].uuid, XID_EVENT, 13)
    assert poll(lambda: _taints(apiserver, node, "gpu-0") != []), daemon.log_text()
    assert _taints(apiserver, node, "gpu-0")[0]["effect"] == "None"
    assert _ctl(node, "health").returncode == 0, "an application error leaves the GPU healthy"


def test_nic_link_down_in_sysfs_taints_and_recovers(apiserver, running):
    node, daemon, _, _ = running
    nic = node.profile.nics[0]
    name = "pci-" + nic.pci_address.replace(":", "-").replace(".", "-")
    operstate = node.sysfs / "class/net" / nic.ifname / "operstate"
    carrier = node.sysfs / "class/net" / nic.ifname / "carrier"
    operstate.write_text("down\n")
    carrier.write_text("0\n")
    assert poll(lambda: any(t["key"] == "tandem.dev/link-down" for t in _taints(apiserver, node, name)), 30), (
        daemon.log_text()
    )
    operstate.write_text("up\n")
    carrier.write_text("1\n")
    assert poll(lambda: _taints(apiserver, node, name) == [], 30), daemon.log_text()


def test_cordon_survives_a_restart_and_uncordon_clears_it(apiserver, running, start_daemon):
    node, daemon, kubelet, _ = running
    out = _ctl(node, "cordon", "gpu-0", "--reason", "fan replacement")
    assert out.returncode == 0, out.stderr
    assert poll(lambda: any(t["key"] == "tandem.dev/cordoned" for t in _taints(apiserver, node, "gpu-0")))
    assert daemon.stop() == 0
    restarted = start_daemon(node)
    kubelet.register(kubelet.wait_for_registration_socket(DRIVER, timeout=60))
    assert poll(lambda: _ctl(node, "devices").returncode == 0, 60), restarted.log_text()
    devices = json.loads(_ctl(node, "devices", "--json").stdout)["devices"]
    assert [t["key"] for d in devices if d["name"] == "gpu-0" for t in d["taints"]] == ["tandem.dev/cordoned"]
    assert _ctl(node, "uncordon", "gpu-0").returncode == 0
    assert poll(lambda: _taints(apiserver, node, "gpu-0") == [])


def test_metrics_count_prepares_and_show_device_health(apiserver, running):
    node, _, kubelet, port = running
    req = Request("gpu", "gpu.tandem.dev", lambda d: attribute(d, "type") == "gpu")
    claim = apiserver.create(claim_object("default", "m1", [req]))
    allocate(apiserver, claim, DRIVER, node.profile.name, [req])
    ref = ClaimRef("default", "m1", claim["metadata"]["uid"])
    assert kubelet.prepare([ref])[ref.uid].error == ""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    assert 'tandem_node_calls_total{op="prepare"} 1.0' in text
    assert 'tandem_device_health{device="gpu-0",kind="gpu",state="Healthy"} 1.0' in text
    assert "tandem_slice_writes_total" in text
    assert "tandem_prepared_claims 1.0" in text and 'tandem_node_calls_in_flight{op="prepare"} 0.0' in text
    assert 'tandem_claim_errors_total{error_type="config",op="prepare"} 0.0' in text and "tandem_build_info{" in text
    assert "_created" not in text
    claims = json.loads(_ctl(node, "claims", "--json").stdout)
    assert ref.uid in json.dumps(claims)


GPU_RESET = 1  # NVML_GPU_RECOVERY_ACTION_GPU_RESET


def _taint_set(apiserver, node, device: str) -> set[tuple[str, str, str]]:
    return {(t["key"], t.get("value", ""), t["effect"]) for t in _taints(apiserver, node, device)}


def test_gpu_reset_procedure_release_reset_reacquire(apiserver, running):
    """docs/deployment.md, 'Operations': the driver asks for a reset; release, reset, reacquire."""
    node, daemon, kubelet, _ = running
    state = node.root / "nvml-state.json"
    gpu0, gpu1 = node.profile.gpus
    watch = kubelet.watch_health("v1")
    watch.next(timeout=30)
    gpu1.recovery_action = GPU_RESET  # the driver reports it with the XID
    write_state(node.profile, state)
    append_event(state, gpu1.uuid, XID_EVENT, 94)  # contained ECC: NoSchedule by the Xid catalog alone
    wanted = {("tandem.dev/xid", "94", "NoExecute"), ("tandem.dev/recovery-action", "gpu-reset", "NoExecute")}
    assert poll(lambda: _taint_set(apiserver, node, "gpu-1") >= wanted, 30), daemon.log_text()
    with pytest.raises(DeviceInUse):
        reset_gpu(node.profile, state, 1)  # the daemon holds the GPU: nvidia-smi -r would fail

    out = _ctl(node, "release", "gpu-1", "--reason", "nvidia-smi -r after XID 94")
    assert out.returncode == 0, out.stderr + daemon.log_text()
    assert "reacquire gpu-1" in out.stdout
    held = nvml_clients(state)[daemon.proc.pid]
    assert (held.initialised, held.attached) == (0, frozenset()), held  # NVML opens every GPU: all let go
    assert poll(lambda: ("tandem.dev/released", "gpu", "NoSchedule") in _taint_set(apiserver, node, "gpu-1"), 30)
    snap = watch.wait_for(lambda s: any(r.device == "gpu-1" and "released" in r.message for r in s), timeout=30)
    assert "nvidia-smi -r after XID 94" in next(r.message for r in snap if r.device == "gpu-1")
    # The other GPU stays schedulable and says why it is not watched.
    assert poll(lambda: _taint_set(apiserver, node, "gpu-0") == {("tandem.dev/unmonitored", "", "None")}, 30)
    health = _ctl(node, "health")
    assert health.returncode == 1 and "released" in health.stdout
    reset_gpu(node.profile, state, 1)  # nothing holds it now; the reset clears the recovery action

    out = _ctl(node, "reacquire", "gpu-1")
    assert out.returncode == 0 and "gpu-1 reacquired" in out.stdout and "resume" in out.stdout, out.stderr
    # Watched again; the driver asks for nothing: every taint goes (gpu-1's XID after its quiet period).
    assert poll(lambda: _taints(apiserver, node, "gpu-1") == [] == _taints(apiserver, node, "gpu-0"), 30), (
        daemon.log_text()
    )
    assert nvml_clients(state)[daemon.proc.pid].attached == {gpu0.uuid, gpu1.uuid}
    assert _ctl(node, "reacquire", "gpu-1").stdout.strip() == "gpu-1 was not released"
    watch.cancel()


def test_driver_upgrade_release_all_survives_a_restart_and_reacquire_rediscovers(apiserver, running, start_daemon):
    node, daemon, kubelet, _ = running
    state = node.root / "nvml-state.json"
    out = _ctl(node, "release", "--all", "--reason", "driver upgrade to 590")
    assert out.returncode == 0, out.stderr + daemon.log_text()
    held = nvml_clients(state)[daemon.proc.pid]
    assert (held.initialised, held.attached) == (0, frozenset()), held  # every nvmlInit was shut down
    for gpu in ("gpu-0", "gpu-1"):
        assert poll(lambda g=gpu: ("tandem.dev/released", "nvml", "NoSchedule") in _taint_set(apiserver, node, g))
    unload_driver(state)  # rmmod nvidia succeeds: nothing has NVML open
    node.profile.driver_version = "590.10.01"  # the new driver is installed and loaded
    write_state(node.profile, state)

    # The pod is restarted to load the new library (the old process keeps its old one); released
    # before, the new daemon does not take NVML back behind the SRE's back.
    assert daemon.stop() == 0
    restarted = start_daemon(node)
    kubelet.register(kubelet.wait_for_registration_socket(DRIVER, timeout=60))
    health = _ctl(node, "health")
    assert health.returncode == 1 and "driver upgrade to 590" in health.stdout, health.stdout
    assert restarted.proc.pid not in nvml_clients(state), "the restarted daemon called nvmlInit"

    out = _ctl(node, "reacquire", "--all")
    assert out.returncode == 0 and "reacquired" in out.stdout, out.stderr

    def upgraded() -> bool:
        gpus = [d for d in published_devices(apiserver, DRIVER, node.profile.name) if d["name"].startswith("gpu-")]
        return len(gpus) == 2 and all(attribute(d, "driverVersion") == "590.10.1" and not d.get("taints") for d in gpus)

    assert poll(upgraded, 30), restarted.log_text()
    assert nvml_clients(state)[restarted.proc.pid].initialised >= 1  # monitoring again
    assert _ctl(node, "health").returncode == 0


def test_release_refuses_what_it_cannot_do(running):
    node, _, _, _ = running
    nic = "pci-" + node.profile.nics[0].pci_address.replace(":", "-").replace(".", "-")
    for args, error in [
        (["release", nic, "--reason", "x"], "not a GPU"),
        (["release", "gpu-9", "--reason", "x"], "unknown device"),
        (["release", "gpu-0", "--all", "--reason", "x"], "name one GPU device, or --all"),
        (["reacquire"], "name one GPU device, or --all"),
    ]:
        out = _ctl(node, *args)
        assert out.returncode in (1, 2) and error in out.stderr, (args, out.stderr)
