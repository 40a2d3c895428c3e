"""Hostile tenants in the real cluster: each test runs an attacking pod against one surface a tenant
reaches (docs/security.md), then checks what a neighbour and an SRE would: another tenant's pod
starts within 60 s, `tandemctl health` stays healthy, a restart of Tandem comes back healthy, and
once the attacker is gone nothing of it is left (no MPS daemon, no prepared claim, no netdev away
from home). `hack/test.sh` then takes the cluster down and fails if anything at all is left.

The attacker's container runs as root, as a pod does unless the cluster says otherwise, and gets
NET_ADMIN where the attack needs it: a cluster without Pod Security admission allows both.
"""

from __future__ import annotations

import json
import secrets
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kube import (
    REPO,
    Cluster,
    KubectlError,
    attribute,
    claim_template,
    host_link,
    pod,
    pod_phase,
    report_script,
    request,
    wait_for,
    wait_pod,
    wait_report,
)

from sim.nvml import read_state, set_compute_policy_fault

GPU, OTHER_GPU = 6, 5
SHARING = ("--gpu-sharing", f"{OTHER_GPU},{GPU}")
PIPE = "/tmp/nvidia-mps"
NEIGHBOUR_STARTS = 60.0


@pytest.fixture
def neighbour_ns(cluster: Cluster) -> Iterator[str]:
    """Another tenant's namespace, beside the attacker's (the `namespace` fixture)."""
    name = f"e2e-neighbour-{secrets.token_hex(2)}"
    cluster.kubectl("create", "namespace", name)
    yield name
    for kind in ("pods", "resourceclaims"):
        cluster.kubectl("delete", kind, "--all", "-n", name, "--wait=true", "--timeout=120s", check=False, timeout=150)
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


def gpu_uuid(tandem, gpu: int) -> str:
    return read_state(tandem.node.nvml_state).gpus[gpu].uuid


def gpu_share(name: str, uuid: str, memory: str = "10Gi", percent: str = "10") -> dict[str, Any]:
    """A claim template for an MPS share of the GPU of this UUID."""
    share = request("gpu", "gpu.tandem.dev", f'device.attributes["tandem.dev"].uuid == "{uuid}"')
    share["exactly"]["capacity"] = {"requests": {"memory": memory, "computePercent": percent}}
    mps = {"apiVersion": "tandem.dev/v1alpha1", "kind": "GpuConfig", "sharing": "MPS"}
    return claim_template(
        name, [share], config=[{"requests": ["gpu"], "opaque": {"driver": "tandem.dev", "parameters": mps}}]
    )


def with_capability(spec: dict[str, Any], capability: str) -> dict[str, Any]:
    spec["spec"]["containers"][0]["securityContext"] = {"capabilities": {"add": [capability]}}
    return spec


def neighbour_runs(cluster: Cluster, namespace: str, templates: dict[str, Any], name: str = "neighbour") -> None:
    """Another tenant's pod, with the claims of `templates`, is Running within NEIGHBOUR_STARTS."""
    cluster.apply(*templates.values(), namespace=namespace)
    claims = {n: t["metadata"]["name"] for n, t in templates.items()}
    cluster.apply(pod(cluster, name, report_script("true"), claims), namespace=namespace)
    wait_pod(cluster, namespace, name, ("Running",), timeout=NEIGHBOUR_STARTS)


def survives_restart(tandem) -> None:
    """Tandem, restarted with the same flags, registers and reports healthy within 60 s."""
    tandem.restart(*tandem.flags)
    assert tandem.healthy()


def mps_daemons() -> list[int]:
    """PIDs of MPS control daemons running on the node (the simulated driver root's program)."""
    out = subprocess.run(["pgrep", "-f", "nvidia-cuda-mps-control -[df]"], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def mps_daemon_of(gpu: int) -> int:
    """The PID of the MPS control daemon serving `gpu`, found from the host by its environment."""
    for pid in mps_daemons():
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(e.startswith(b"CUDA_MPS_PIPE_DIRECTORY=") and f"gpu-{gpu}".encode() in e for e in env):
            return pid
    raise AssertionError(f"no MPS daemon for GPU {gpu}: {mps_daemons()}")


def all_gone(cluster: Cluster, tandem, namespaces: tuple[str, ...]) -> None:
    """The pods and claims of `namespaces` deleted; nothing Tandem prepared for them is left."""
    for ns in namespaces:
        cluster.kubectl("delete", "pods", "--all", "-n", ns, "--wait=true", "--timeout=120s", timeout=150)
    wait_for("every claim unprepared", lambda: not tandem.prepared_claims(), timeout=120)
    assert not [f for f in tandem.files() if "claim_" in f], tandem.files()


MPS_ATTACKS = {
    # Every file the MPS daemon keeps in the pipe directory (its PID file) replaced by a FIFO: a
    # reader that opens it blocks until a writer comes, forever.
    "fifo": f"for f in {PIPE}/*.pid; do rm -f $f; mkfifo $f; done",
    # ... by a link to /dev/zero: a reader that follows it reads without end.
    "zero": f"for f in {PIPE}/*.pid; do rm -f $f; ln -s /dev/zero $f; done",
    # ... by the PID of another tenant's MPS daemon (filled in by the test) and of the node's init.
    "foreign-pid": f"for f in {PIPE}/*.pid; do echo OTHER > $f; done; echo 1 > {PIPE}/init.pid",
    # The daemon's control socket removed: nobody can ask it to quit any more.
    "no-control": f"rm -f {PIPE}/control",
}


@pytest.mark.parametrize("attack", sorted(MPS_ATTACKS))
def test_an_mps_tenant_attacking_its_pipe_directory_hurts_no_one(
    cluster: Cluster, tandem, namespace: str, neighbour_ns: str, attack: str
) -> None:
    tandem.ensure(*SHARING)
    wait_for("GPU 6 published for sharing", lambda: (cluster.devices().get(f"gpu-{GPU}") or {}).get(
        "allowMultipleAllocations"))  # fmt: skip
    # A neighbour on the other shared GPU first, so there is another tenant's daemon to aim at.
    neighbour_runs(cluster, neighbour_ns, {"gpu": gpu_share("other-gpu", gpu_uuid(tandem, OTHER_GPU))}, "on-gpu-5")
    other_daemon = mps_daemon_of(OTHER_GPU)
    script = MPS_ATTACKS[attack].replace("OTHER", str(other_daemon))
    cluster.apply(gpu_share("attack", gpu_uuid(tandem, GPU)), pod(cluster, "attacker", report_script(script), {"gpu": "attack"}),
                  namespace=namespace)  # fmt: skip
    wait_report(cluster, namespace, "attacker")

    # Another tenant's share of the attacked GPU prepares; health and a restart are unharmed.
    neighbour_runs(cluster, neighbour_ns, {"gpu": gpu_share("same-gpu", gpu_uuid(tandem, GPU))}, "on-gpu-6")
    assert tandem.healthy()
    survives_restart(tandem)
    assert other_daemon in mps_daemons(), "the other GPU's MPS daemon was killed"
    neighbour_runs(cluster, neighbour_ns, {"gpu": gpu_share("after-restart", gpu_uuid(tandem, GPU))}, "after-restart")

    all_gone(cluster, tandem, (namespace, neighbour_ns))
    wait_for("no MPS daemon left", lambda: not mps_daemons(), timeout=60)
    assert not (tandem.node.data_dir / "mps" / f"gpu-{GPU}").exists()


def test_an_exclusive_nic_renamed_readdressed_and_abandoned_comes_home(
    cluster: Cluster, tandem, namespace: str, neighbour_ns: str
) -> None:
    """The pod renames its netdev to a name `--exclude-nics` excludes, gives it an address and an
    MTU of its own, and dies: the NIC comes back under its host name with exactly its host
    addresses, and is published again."""
    tandem.ensure("--exclude-nics", "stor*")
    exclusive = {"apiVersion": "tandem.dev/v1alpha1", "kind": "NicConfig", "mode": "exclusive", "interfaceName": "net1"}
    config = [{"requests": ["nic"], "opaque": {"driver": "tandem.dev", "parameters": exclusive}}]
    script = report_script(
        "ip link set net1 down && ip link set net1 name stor0 && ip link set stor0 mtu 1280 && "
        "ip address add 10.66.0.1/24 dev stor0 && ip link set stor0 up && ip address show dev stor0"
    )
    attacker = with_capability(pod(cluster, "attacker", script, {"nic": "whole-nic"}), "NET_ADMIN")
    cluster.apply(claim_template("whole-nic", [request("nic", "nic.tandem.dev")], config=config), attacker,
                  namespace=namespace)  # fmt: skip
    assert "stor0" in wait_report(cluster, namespace, "attacker", timeout=120)
    (status,) = cluster.get("pod", "attacker", namespace)["status"]["resourceClaimStatuses"]
    claim = cluster.get("resourceclaim", status["resourceClaimName"], namespace)
    (result,) = claim["status"]["allocation"]["devices"]["results"]
    nic = cluster.devices()[result["device"]]
    home, addresses = attribute(nic, "ifName"), attribute(nic, "ipv4")
    assert host_link(home) is None, "the netdev is in the pod"

    neighbour_runs(cluster, neighbour_ns, {"gpu": claim_template("gpu", [request("gpu", "gpu.tandem.dev")])})
    cluster.kubectl("delete", "pod", "attacker", "-n", namespace, "--wait=true", "--timeout=60s")

    def home_again() -> dict[str, Any] | None:
        link = host_link(home)
        have = {f"{a['local']}/{a['prefixlen']}" for a in (link or {}).get("addr_info", [])}
        return link if link and addresses in have and "UP" in link["flags"] else None

    link = wait_for(f"{home} back on the host", home_again, timeout=90)
    have = {a["local"] for a in link["addr_info"]}
    assert "10.66.0.1" not in have, f"the tenant's address stayed on the host: {have}"
    assert link["mtu"] != 1280, "the tenant's MTU stayed on the host"
    assert host_link("stor0") is None
    wait_for("published and up again", lambda: attribute(cluster.devices().get(result["device"], {}), "state") == "up")
    assert tandem.healthy()
    survives_restart(tandem)
    all_gone(cluster, tandem, (namespace, neighbour_ns))


def claim_events(cluster: Cluster, namespace: str) -> list[dict[str, Any]]:
    out = cluster.kubectl("get", "events", "-n", namespace, "--field-selector",
                          "involvedObject.kind=ResourceClaim,reason=PrepareFailed", "-o", "json")  # fmt: skip
    return json.loads(out)["items"]


CLAIMS_POLICY = "tandem-opaque-config"


@pytest.fixture
def without_claims_policy(cluster: Cluster) -> Iterator[None]:
    """daemonset.yaml's admission policy on claim configs unbound for one test, as on a cluster
    that lacks it (or where its CEL failed open): Tandem's own checks at prepare must then hold. The
    binding comes back as daemonset.yaml has it."""
    docs = [d for d in yaml.safe_load_all((REPO / "daemonset.yaml").read_text()) if d]
    (binding,) = [d for d in docs if d["kind"] == "ValidatingAdmissionPolicyBinding"
                  and d["metadata"]["name"] == CLAIMS_POLICY]  # fmt: skip
    probe = claim_template(
        "probe",
        [request("gpu", "gpu.tandem.dev")],
        config=[
            {
                "requests": ["gpu"],
                "opaque": {
                    "driver": "tandem.dev",
                    "parameters": {"apiVersion": "tandem.dev/v1alpha1", "kind": "GpuConfig", "sharing": "x"},
                },
            }
        ],
    )

    def admitted() -> bool:
        """Whether a claim the policy refuses is admitted now (a dry run): a binding's change
        reaches the API server's admission chain a moment after it is written."""
        args = ("create", "--dry-run=server", "-n", "default", "-f", "-")
        return cluster.kubectl(*args, stdin=json.dumps(probe), check=False, timeout=60) != ""

    cluster.kubectl("delete", "validatingadmissionpolicybinding", CLAIMS_POLICY, "--ignore-not-found")
    try:
        wait_for("the claims policy out of force", admitted, timeout=60)
        yield
    finally:
        cluster.apply(binding)
        wait_for("the claims policy in force again", lambda: not admitted(), timeout=60)


def test_the_admission_policy_refuses_a_hostile_claim_config_when_it_is_written(
    cluster: Cluster, tandem, namespace: str
) -> None:
    """First the admission policy refuses such claims when they are written; without it (the next
    layer) a 1 MiB key still never reaches Tandem: the API server refuses opaque parameters over
    10 KiB (the limit Tandem enforces again at prepare). The longest key it accepts, and one of
    control characters, reach Tandem and are refused in messages that are escaped and bounded."""
    tandem.ensure()
    bad = {"apiVersion": "tandem.dev/v1alpha1", "kind": "GpuConfig", "\x1b[31mred\nnewline\x07": True}
    config = [{"requests": ["gpu"], "opaque": {"driver": "tandem.dev", "parameters": bad}}]
    refused = claim_template("refused", [request("gpu", "gpu.tandem.dev")], config=config)
    refused["metadata"]["namespace"] = namespace
    with pytest.raises(KubectlError, match=CLAIMS_POLICY):
        cluster.kubectl("create", "-f", "-", stdin=json.dumps(refused), timeout=60)


def test_without_the_admission_policy_hostile_claim_configs_are_refused_plainly_at_prepare(
    cluster: Cluster, tandem, without_claims_policy: None, namespace: str, neighbour_ns: str
) -> None:
    tandem.ensure()
    gpu_config = {"apiVersion": "tandem.dev/v1alpha1", "kind": "GpuConfig"}

    def objects(name: str, key: str) -> list[dict[str, Any]]:
        config = [{"requests": ["gpu"], "opaque": {"driver": "tandem.dev", "parameters": {**gpu_config, key: True}}}]
        return [claim_template(name, [request("gpu", "gpu.tandem.dev")], config=config),
                pod(cluster, name, "true", {"gpu": name})]  # fmt: skip

    def create(o: dict[str, Any]) -> None:
        # `create`, not `apply`: apply would copy the key into an annotation (256 KiB at most).
        o["metadata"]["namespace"] = namespace
        cluster.kubectl("create", "-f", "-", stdin=json.dumps(o), timeout=60)

    with pytest.raises(KubectlError, match="may not be more than 10240 bytes"):
        create(objects("mebibyte", "k" * (1 << 20))[0])
    hostile = {"escapes": "\x1b[31mred\nnewline\x07", "long": "k" * 10_000}
    for name, key in hostile.items():
        for o in objects(name, key):
            create(o)
    failed = wait_for("both claims' prepares refused", lambda: len(
        {e["involvedObject"]["name"] for e in claim_events(cluster, namespace)}) == 2 and claim_events(
        cluster, namespace), timeout=120)  # fmt: skip
    for event in failed:
        note = event.get("note") or event.get("message") or ""
        assert len(note.encode()) <= 1024
        assert not any(c in note for c in "\x1b\n\x07"), repr(note)
    # The log is JSON lines: a raw control character would show there as a \u escape.
    log = tandem.node.log_file.read_text(errors="replace")
    assert "\x1b" not in log and "\\u001b" not in log and "\\u0007" not in log
    assert "k" * 4096 not in log
    assert all(pod_phase(cluster, namespace, n) == "Pending" for n in hostile)
    neighbour_runs(cluster, neighbour_ns, {"gpu": claim_template("gpu", [request("gpu", "gpu.tandem.dev")])})
    assert tandem.healthy()
    survives_restart(tandem)
    all_gone(cluster, tandem, (namespace, neighbour_ns))


def sliced(name: str, uuid: str) -> dict[str, Any]:
    whole = request("gpu", "gpu.tandem.dev", f'device.attributes["tandem.dev"].uuid == "{uuid}"')
    config = {"apiVersion": "tandem.dev/v1alpha1", "kind": "GpuConfig", "sharing": "TimeSlicing",
              "timeSliceInterval": "Long"}  # fmt: skip
    return claim_template(
        name, [whole], config=[{"requests": ["gpu"], "opaque": {"driver": "tandem.dev", "parameters": config}}]
    )


def test_a_time_sliced_claim_on_a_gpu_whose_nvidia_smi_fails_fails_alone(
    cluster: Cluster, tandem, namespace: str, neighbour_ns: str
) -> None:
    """nvidia-smi refuses GPU 6: its time-sliced claim waits (and is not recorded as done); a
    time-sliced claim on GPU 5 runs meanwhile; once nvidia-smi works again the first one runs
    with its interval set."""
    tandem.ensure()
    gpus = read_state(tandem.node.nvml_state).gpus
    set_compute_policy_fault(tandem.node.nvml_state, gpus[GPU].uuid, True)
    try:
        cluster.apply(sliced("broken", gpus[GPU].uuid), pod(cluster, "on-broken", report_script("true"),
                      {"gpu": "broken"}), namespace=namespace)  # fmt: skip
        wait_for("the prepare on GPU 6 refused", lambda: claim_events(cluster, namespace), timeout=120)
        neighbour_runs(cluster, neighbour_ns, {"gpu": sliced("fine", gpus[OTHER_GPU].uuid)})
        assert read_state(tandem.node.nvml_state).gpus[OTHER_GPU].time_slice == 3
        assert read_state(tandem.node.nvml_state).gpus[GPU].time_slice == 0
        assert tandem.healthy()
        survives_restart(tandem)
    finally:
        set_compute_policy_fault(tandem.node.nvml_state, gpus[GPU].uuid, False)
    wait_pod(cluster, namespace, "on-broken", ("Running",), timeout=180)  # the kubelet's retry now succeeds
    assert read_state(tandem.node.nvml_state).gpus[GPU].time_slice == 3
    all_gone(cluster, tandem, (namespace, neighbour_ns))
    cluster.kubectl("delete", "resourceclaims", "--all", "-n", namespace, "--wait=true", "--timeout=120s")
    cluster.kubectl("delete", "resourceclaims", "--all", "-n", neighbour_ns, "--wait=true", "--timeout=120s")
    wait_for("the default time slices back", lambda: all(
        g.time_slice == 0 for g in read_state(tandem.node.nvml_state).gpus), timeout=120)  # fmt: skip


def test_a_namespace_churning_fifty_claims_hurts_no_one(
    cluster: Cluster, tandem, namespace: str, neighbour_ns: str
) -> None:
    """50 pods with a NIC share each, created and deleted as fast as the API server takes them,
    while another tenant's GPU pod starts."""
    tandem.ensure()
    share = request("nic", "nic.tandem.dev")
    share["exactly"]["capacity"] = {"requests": {"shares": "1"}}
    cluster.apply(claim_template("share", [share]), namespace=namespace)
    errors: list[Exception] = []

    def churn() -> None:
        try:
            for i in range(50):
                cluster.apply(pod(cluster, f"churn-{i}", "sleep 1", {"nic": "share"}), namespace=namespace)
                if i >= 2:
                    cluster.kubectl("delete", "pod", f"churn-{i - 2}", "-n", namespace, "--wait=false")
        except Exception as e:
            errors.append(e)

    thread = threading.Thread(target=churn, name="churn")
    thread.start()
    try:
        neighbour_runs(cluster, neighbour_ns, {"gpu": claim_template("gpu", [request("gpu", "gpu.tandem.dev")])})
        assert tandem.healthy()
    finally:
        thread.join(timeout=300)
    assert not errors, errors
    survives_restart(tandem)
    all_gone(cluster, tandem, (namespace, neighbour_ns))
    wait_for("no claim of the churn left", lambda: not cluster.get("resourceclaims", namespace=namespace),
             timeout=120)  # fmt: skip
