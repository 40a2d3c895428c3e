"""The daemon as a real process, over real Unix sockets, against the simulated cluster and node."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from waiting import poll

from demo.node import DRIVER
from driver.kubelet.registration import registration_socket_path
from sim.kubelet import ClaimRef, KubeletSim
from sim.scheduler import Request, allocate, attribute, claim_object, published_devices

GPU = Request("gpu", "gpu.tandem.dev", lambda d: attribute(d, "type") == "gpu")
NIC = Request("nic", "nic.tandem.dev", lambda d: attribute(d, "type") == "nic")


def _listening(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX) as s:
        try:
            s.connect(str(path))
        except OSError:
            return False
        return True


def _registered(kubelet: KubeletSim, timeout: float = 60):
    sock = kubelet.wait_for_registration_socket(DRIVER, timeout=timeout)
    return sock, kubelet.register(sock)


def _wait_published(apiserver, node, count: int) -> list[dict]:
    ok = apiserver.wait_for(lambda: len(published_devices(apiserver, DRIVER, node.profile.name)) >= count, 60)
    devices = published_devices(apiserver, DRIVER, node.profile.name)
    assert ok, f"only {len(devices)} of {count} devices published"
    return devices


def _allocated_claim(apiserver, node, name: str, *requests: Request, match: str = "", taken=None) -> ClaimRef:
    claim = apiserver.create(claim_object("default", name, list(requests), match))
    allocate(apiserver, claim, DRIVER, node.profile.name, list(requests), match, taken=taken)
    return ClaimRef("default", name, claim["metadata"]["uid"])


def test_registers_with_the_kubelet_and_serves_both_dra_versions(start_daemon, sim_node_default, kubelet):
    daemon = start_daemon(sim_node_default)
    sock, info = _registered(kubelet)
    assert sock == sim_node_default.registry / f"{DRIVER}-reg.sock"
    assert info.name == DRIVER
    assert info.endpoint == str(daemon.data_dir / "dra.sock")
    assert os.path.isabs(info.endpoint)
    assert list(info.supported_versions[:2]) == ["v1.DRAPlugin", "v1beta1.DRAPlugin"]
    assert info.dra_version == "v1.DRAPlugin"
    # A kubelet restart registers again: GetInfo and NotifyRegistrationStatus must keep working.
    again = kubelet.register(sock)
    assert again.endpoint == info.endpoint
    assert kubelet.prepare([], version="v1") == {}
    assert kubelet.prepare([], version="v1beta1") == {}


@pytest.mark.parametrize("version", ["v1", "v1beta1"])
def test_prepare_and_unprepare_an_allocated_claim(version, start_daemon, apiserver, sim_node_default, kubelet):
    node = sim_node_default
    start_daemon(node)
    _registered(kubelet)
    devices = _wait_published(apiserver, node, 4)
    ref = _allocated_claim(apiserver, node, "pair", GPU, NIC, match="resource.kubernetes.io/pcieRoot")

    result = kubelet.prepare([ref], version=version)[ref.uid]
    assert result.error == ""
    got = {(tuple(d.request_names), d.pool_name, d.device_name) for d in result.devices}
    claim = apiserver.get("resourceclaims", "pair", "default")
    want = {((r["request"],), r["pool"], r["device"]) for r in claim["status"]["allocation"]["devices"]["results"]}
    assert got == want
    roots = {attribute(d, "resource.kubernetes.io/pcieRoot") for d in devices if d["name"] in {g[2] for g in got}}
    assert len(roots) == 1, "GPU and NIC must share one PCIe root"

    # Idempotent: the kubelet may ask again and must get the same answer.
    assert kubelet.prepare([ref], version=version)[ref.uid] == result
    assert kubelet.unprepare([ref], version=version) == {ref.uid: ""}
    # Unpreparing again (or a claim never seen) succeeds.
    assert kubelet.unprepare([ref, ClaimRef("default", "ghost", "0000-ghost")], version=version) == {
        ref.uid: "",
        "0000-ghost": "",
    }


def test_bad_claims_fail_alone(start_daemon, apiserver, sim_node_default, kubelet):
    node = sim_node_default
    start_daemon(node)
    _registered(kubelet)
    _wait_published(apiserver, node, 4)
    good = _allocated_claim(apiserver, node, "good", GPU)
    unallocated = apiserver.create(claim_object("default", "pending", [GPU]))
    _allocated_claim(apiserver, node, "replaced", NIC)

    refs = [
        good,
        ClaimRef("default", "pending", unallocated["metadata"]["uid"]),
        ClaimRef("default", "replaced", "11111111-2222-3333-4444-555555555555"),
        ClaimRef("default", "missing", "22222222-2222-3333-4444-555555555555"),
        ClaimRef("../../etc", "passwd", "33333333-2222-3333-4444-555555555555"),
        ClaimRef("default", "x", "../../evil"),
    ]
    results = kubelet.prepare(refs)
    assert set(results) == {r.uid for r in refs}
    assert results[good.uid].error == "" and len(results[good.uid].devices) == 1
    assert "not allocated" in results[refs[1].uid].error
    assert "replaced" in results[refs[2].uid].error
    assert "missing" in results[refs[3].uid].error or "not found" in results[refs[3].uid].error.lower()
    assert "invalid claim namespace" in results[refs[4].uid].error
    assert "invalid claim UID" in results[refs[5].uid].error


def test_a_refused_status_apply_fails_the_claim_until_a_retry_succeeds(
    start_daemon, apiserver, sim_node_default, kubelet
):
    """The status apply is sent before the files are written and answered after them: an error
    answer still reaches the kubelet for that claim (which retries), and a failed withdrawal at
    unprepare does not keep the claim prepared."""
    node = sim_node_default
    start_daemon(node)
    _registered(kubelet)
    _wait_published(apiserver, node, 4)
    ref = _allocated_claim(apiserver, node, "flaky", GPU)

    apiserver.faults.inject(method="PATCH", path="/resourceclaims/flaky/status", status=500, count=1)
    error = kubelet.prepare([ref])[ref.uid].error
    assert "apply status of claim default/flaky" in error and "500" in error
    assert not apiserver.get("resourceclaims", "flaky", "default")["status"].get("devices")

    retried = kubelet.prepare([ref])[ref.uid]
    assert retried.error == "" and len(retried.devices) == 1
    (entry,) = apiserver.get("resourceclaims", "flaky", "default")["status"]["devices"]
    assert entry["conditions"][0]["type"] == "Ready" and entry["conditions"][0]["status"] == "True"

    withdrawal = apiserver.faults.inject(method="PATCH", path="/resourceclaims/flaky/status", status=500, count=1)
    assert kubelet.unprepare([ref]) == {ref.uid: ""}
    assert withdrawal.is_set(), "unprepare sent no status withdrawal"
    assert apiserver.get("resourceclaims", "flaky", "default")["status"]["devices"], (
        "the refused withdrawal changed nothing"
    )
    assert not [p for p in node.cdi.iterdir() if ref.uid in p.name], "the claim's specs are gone all the same"


def test_a_device_prepared_for_one_claim_is_refused_to_another(start_daemon, apiserver, sim_node_default, kubelet):
    node = sim_node_default
    start_daemon(node)
    _registered(kubelet)
    _wait_published(apiserver, node, 4)
    first = _allocated_claim(apiserver, node, "first", GPU)
    # A scheduler race: the second claim gets the same GPU.
    second = apiserver.create(claim_object("default", "second", [GPU]))
    taken_device = apiserver.get("resourceclaims", "first", "default")["status"]["allocation"]
    second["status"] = {"allocation": taken_device}
    second = apiserver.update(second)
    assert kubelet.prepare([first])[first.uid].error == ""
    ref2 = ClaimRef("default", "second", second["metadata"]["uid"])
    err = kubelet.prepare([ref2])[ref2.uid].error
    assert "already prepared for claim default/first" in err


def test_sigterm_removes_own_sockets_and_exits_cleanly(start_daemon, sim_node_default, kubelet):
    daemon = start_daemon(sim_node_default)
    sock, info = _registered(kubelet)
    daemon.proc.send_signal(signal.SIGTERM)
    assert daemon.proc.wait(timeout=20) == 0
    assert not sock.exists()
    assert not Path(info.endpoint).exists()


def test_stale_sockets_are_replaced(start_daemon, sim_node_default, kubelet):
    node = sim_node_default
    stale = node.registry / f"{DRIVER}-reg.sock"
    # The registration socket is bound under a hidden name first and renamed into place once
    # DRA is served; a daemon killed in between leaves that name behind too.
    stale_hidden = stale.with_name("." + stale.name[1:])
    for path in (stale, stale_hidden):
        s = socket.socket(socket.AF_UNIX)
        s.bind(str(path))
        s.close()  # a socket file nobody listens on, as a killed daemon leaves behind
    daemon = start_daemon(node)
    assert poll(lambda: _listening(stale), 30), daemon.log_text()
    sock, info = _registered(kubelet)
    assert sock == stale and info.name == DRIVER
    assert [p.name for p in node.registry.iterdir() if p.name.startswith(".")] == []


def test_rolling_update_instances_use_their_own_sockets(start_daemon, apiserver, sim_node_default, kubelet):
    node = sim_node_default
    old_uid, new_uid = "aaaaaaaa-0000-4000-8000-000000000001", "bbbbbbbb-0000-4000-8000-000000000002"
    old = start_daemon(node, "--pod-uid", old_uid)
    new = start_daemon(node, env={"POD_UID": new_uid})
    old_sock = registration_socket_path(node.registry, DRIVER, old_uid)
    new_sock = registration_socket_path(node.registry, DRIVER, new_uid)
    assert kubelet.wait_for_registration_socket(DRIVER, 30)
    assert apiserver.wait_for(lambda: old_sock.exists() and new_sock.exists(), 30)
    assert kubelet.register(old_sock).endpoint == str(old.data_dir / f"dra-{old_uid}.sock")
    assert kubelet.register(new_sock).endpoint == str(new.data_dir / f"dra-{new_uid}.sock")

    _wait_published(apiserver, node, 4)
    ref = _allocated_claim(apiserver, node, "rolling", GPU)
    kubelet.register(old_sock)
    assert kubelet.prepare([ref])[ref.uid].error == ""
    assert old.stop() == 0
    assert not old_sock.exists() and new_sock.exists()
    kubelet.register(new_sock)
    # The new instance must see what the old one prepared (shared checkpoint in the data dir).
    assert kubelet.prepare([ref])[ref.uid].error == ""
    assert kubelet.unprepare([ref]) == {ref.uid: ""}


def test_excluded_nics_are_withdrawn_at_restart(start_daemon, apiserver, sim_node_default, kubelet):
    """A restart with EXCLUDE_NICS takes the NICs it names out of the slice, a prepared one too;
    the claim on it still unprepares."""
    node = sim_node_default
    daemon = start_daemon(node)
    _registered(kubelet)
    nics = {d["name"]: d for d in _wait_published(apiserver, node, 4) if attribute(d, "type") == "nic"}
    assert len(nics) == 2
    ref = _allocated_claim(apiserver, node, "net", NIC)
    assert kubelet.prepare([ref])[ref.uid].error == ""
    claim = apiserver.get("resourceclaims", "net", "default")
    (prepared,) = [r["device"] for r in claim["status"]["allocation"]["devices"]["results"]]
    (other,) = nics.keys() - {prepared}
    assert daemon.stop() == 0

    # The prepared NIC by a netdev-name glob, the other by its PCI address (upper case is fine).
    glob = attribute(nics[prepared], "ifName")[:4] + "*"
    pci = attribute(nics[other], "resource.kubernetes.io/pciBusID").upper()
    restarted = start_daemon(node, env={"EXCLUDE_NICS": f"{glob},{pci}"})
    _registered(kubelet)

    def published_nics() -> set[str]:
        return {
            d["name"] for d in published_devices(apiserver, DRIVER, node.profile.name) if attribute(d, "type") == "nic"
        }

    assert poll(lambda: not published_nics(), 60), restarted.log_text()
    assert len(published_devices(apiserver, DRIVER, node.profile.name)) == 2, "the GPUs stay"
    assert kubelet.unprepare([ref]) == {ref.uid: ""}


@pytest.mark.parametrize("candidate_1_bytes", [107, 108])
def test_rolling_update_socket_at_the_grpc_limit_is_served(
    candidate_1_bytes, start_daemon, sim_node_default, short_tmp
):
    """Candidate 1 of exactly 107 bytes is Go's choice and must bind; at 108 Go would take it too,
    but gRPC core cannot bind it, so the daemon takes candidate 2 and serves there."""
    uid = "cccccccc-0000-4000-8000-000000000003"
    tail = len(f"/{DRIVER}-{uid}-reg.sock")
    registry = short_tmp / ("r" * (candidate_1_bytes - tail - len(str(short_tmp)) - 1))
    assert len(f"{registry}/{DRIVER}-{uid}-reg.sock".encode()) == candidate_1_bytes
    daemon = start_daemon(sim_node_default, "--pod-uid", uid, "--kubelet-registrar-dir", str(registry))
    sock = registration_socket_path(registry, DRIVER, uid)
    assert (sock.name == f"{DRIVER}-{uid}-reg.sock") is (candidate_1_bytes == 107)
    assert poll(lambda: _listening(sock) or daemon.proc.poll() is not None, 60), daemon.log_text()
    assert daemon.proc.poll() is None, daemon.log_text()
    with KubeletSim(registry) as kubelet:
        assert kubelet.register(sock).name == DRIVER


@pytest.mark.parametrize(
    ("args", "environment", "message"),
    [
        ([], {}, "--node-name (NODE_NAME) is required"),
        (["--node-name", "Bad_Name"], {}, "is not a valid node name"),
        (["--node-name", "n", "--driver-name", "nodomain"], {}, "--driver-name"),
        (["--node-name", "n", "--device-kinds", "gpu,tpu"], {}, "unknown kind 'tpu'"),
        (["--node-name", "n", "--cdi-root", "relative/dir"], {}, "must be an absolute path"),
        (["--node-name", "n", "--log-format", "xml"], {}, "'xml' is not one of: text, json"),
        (["--node-name", "n", "--rediscover-period", "abc"], {}, "'abc' is not a number"),
        (["--node-name", "n"], {"REDISCOVER_PERIOD": "abc"}, "REDISCOVER_PERIOD='abc'"),
        (["--node-name", "n"], {"REDISCOVER_PERIOD": "nan"}, "REDISCOVER_PERIOD='nan'"),
        (["--node-name", "n"], {"VERBOSITY": "x"}, "VERBOSITY='x'"),
        (["--node-name", "n"], {"EXCLUDE_NICS": "0000:zz:00.0"}, "--exclude-nics: '0000:zz:00.0'"),
    ],
)
def test_bad_flags_are_one_line_errors(args, environment, message):
    env = {k: v for k, v in os.environ.items() if k not in ("NODE_NAME", "KUBECONFIG")} | environment
    proc = subprocess.run([sys.executable, "-m", "driver", "run", *args], capture_output=True, text=True, env=env,
                          timeout=60)  # fmt: skip
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert message in lines[0]


def test_liveness_probe_goes_through_the_kubelet_sockets(start_daemon, sim_node_default, kubelet):
    node = sim_node_default
    daemon = start_daemon(node)
    _registered(kubelet)
    probe = [sys.executable, "-m", "driver", "liveness", "--kubelet-registrar-dir", str(node.registry)]
    alive = subprocess.run(probe, capture_output=True, text=True, timeout=60)
    assert alive.returncode == 0, alive.stderr
    assert str(daemon.data_dir / "dra.sock") in alive.stdout
    assert daemon.stop() == 0
    dead = subprocess.run(probe, capture_output=True, text=True, timeout=60)
    assert dead.returncode == 1
    assert "GetInfo" in dead.stderr
