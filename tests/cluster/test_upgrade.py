"""The upgrade from the previous release under running pods, and the way back, in the real cluster.

The previous release is 0.1.0 (CHANGELOG.md: commit db9db60). It had no chart: it is installed as
its users installed it, its own `daemonset.yaml` applied with kubectl, its image built from that
commit (`hack/cluster.sh image TAG COMMIT`, cached by commit). Then `helm upgrade --install
--take-ownership` moves the node to the current chart and image (docs/deployment.md, 'Upgrade'),
while pods hold each kind of device: a whole GPU, a GPU+NIC pair, an MPS share, a dynamic MIG
partition and an exclusive NIC. Every pod keeps its devices; the claims 0.1.0 prepared (its
checkpoint, read by the new release) unprepare cleanly; new claims prepare. The way back to 0.1.0
works from a drained node, as 'Downgrade' says, and is tested so.

Only the simulated node's paths are patched into both DaemonSets (kube.on_sim_node), with the
flags the pods need: `GPU_SHARING=6`, `DYNAMIC_MIG=7` (GPU 7 in MIG mode) and netlink for NIC
links, which an exclusive NIC's return home needs. One pass of each device kind, to keep it short.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kube import (
    DRIVER_IMAGES,
    DRIVER_NAMESPACE,
    REPO,
    Cluster,
    claim_template,
    driver_pods,
    host_link,
    on_sim_node,
    pod,
    pod_phase,
    report_script,
    request,
    wait_for,
    wait_report,
)

from sim import nvml as sim_nvml

PREVIOUS = "db9db60"  # 0.1.0, CHANGELOG.md
PREVIOUS_IMAGE = "localhost/tandem-driver:0.1.0"
RELEASE = "tandem"
CHART = REPO / "deployments" / "helm" / "tandem"
DATA_DIR = Path("/var/lib/kubelet/plugins/tandem.dev")
SHARED, MIG = 6, 7  # the GPU shared through MPS, the GPU in MIG mode served dynamically
FLAGS = {"GPU_SHARING": str(SHARED), "DYNAMIC_MIG": str(MIG), "NIC_LINK_SOURCE": "netlink"}
PODS = ("whole", "pair", "mps", "mig", "nic")
PCIE_ROOT = "resource.kubernetes.io/pcieRoot"
MPS_PIPE = "tmp/nvidia-mps"  # CUDA_MPS_PIPE_DIRECTORY in the containers, below their root


def previous_manifest(node_root: Path) -> list[dict[str, Any]]:
    """0.1.0's daemonset.yaml as its users applied it, the DaemonSet on the simulated node."""
    text = subprocess.run(
        ["git", "-c", f"safe.directory={REPO}", "-C", str(REPO), "show", f"{PREVIOUS}:daemonset.yaml"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    docs = [d for d in yaml.safe_load_all(text) if d]
    for d in docs:
        if d["kind"] == "DaemonSet":
            d["spec"]["template"]["spec"]["containers"][0]["image"] = PREVIOUS_IMAGE
            on_sim_node(d, node_root, FLAGS)
    return docs


def running_image(cluster: Cluster) -> str | None:
    """The image of the one driver pod, once it alone runs and is Ready; None while a rollout goes on."""
    pods = cluster.get("pods", namespace=DRIVER_NAMESPACE)
    if len(pods) != 1:
        return None
    (p,) = pods
    ready = any(c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions") or [])
    return str(p["spec"]["containers"][0]["image"]) if ready else None


@pytest.fixture(scope="module")
def helm(cluster: Cluster) -> str:
    done = subprocess.run([REPO / "hack" / "helm.sh"], capture_output=True, text=True, timeout=1800, check=False)
    assert done.returncode == 0, f"hack/helm.sh failed: {done.stderr}"
    return done.stdout.strip()


@pytest.fixture(scope="module")
def previous(cluster: Cluster, tandem, helm: str) -> Iterator[Path]:
    """0.1.0 serving the node in place of the cluster's node process, GPU 7 in MIG mode; the node's
    directory yielded. Afterwards the cluster is as `hack/cluster.sh up` made it: the DaemonSet and
    Helm's record of the release gone, the current daemonset.yaml's other objects applied again
    (the node process's token belongs to its service account, which therefore always stays)."""
    cluster.cluster_sh("image", PREVIOUS_IMAGE, PREVIOUS, timeout=1800)
    cluster.cluster_sh("image", DRIVER_IMAGES[0], timeout=1200)
    node_root = tandem.node.root
    shutil.copytree(REPO / "sim" / "fake_pynvml", node_root / "fake_pynvml", dirs_exist_ok=True)
    tandem.node.stop()
    wait_for("Tandem deregistered", lambda: not tandem.healthy())
    cluster.kubectl("delete", "resourceslices", "--field-selector", "spec.driver=tandem.dev", "--wait=true")
    sim_nvml.set_mig_mode(tandem.node.nvml_state, MIG, True)
    # 0.1.0 had no claim admission policy; everything else of its manifest has a current namesake.
    for kind in ("validatingadmissionpolicybinding", "validatingadmissionpolicy"):
        cluster.kubectl("delete", kind, "tandem-opaque-config", "--ignore-not-found")
    try:
        cluster.apply(previous_manifest(node_root))
        wait_for("0.1.0's driver pod Ready", lambda: running_image(cluster) == PREVIOUS_IMAGE, timeout=180)
        wait_for("GPU 6 shared and GPU 7's partitions published", lambda: (d := cluster.devices()).get(
                 f"gpu-{SHARED}", {}).get("allowMultipleAllocations") and any(n.startswith(f"gpu-{MIG}-mig-") for n in d))  # fmt: skip
        yield node_root
    finally:
        cluster.kubectl("delete", "daemonset", "tandem-driver", "-n", DRIVER_NAMESPACE, "--ignore-not-found",
                        "--wait=true", "--timeout=120s", timeout=150)  # fmt: skip
        wait_for("the driver pods gone", lambda: not cluster.get("pods", namespace=DRIVER_NAMESPACE), timeout=120)
        cluster.kubectl("delete", "secrets", "-n", DRIVER_NAMESPACE, "-l", f"owner=helm,name={RELEASE}")
        current = [d for d in yaml.safe_load_all((REPO / "daemonset.yaml").read_text()) if d]
        cluster.apply(d for d in current if d["kind"] != "DaemonSet")
        try:
            sim_nvml.set_mig_mode(tandem.node.nvml_state, MIG, False)
        finally:
            tandem.restart(*tandem.flags)


def workloads(cluster: Cluster, tandem) -> list[dict[str, Any]]:
    """A pod for each kind of device, the GPUs pinned so that no two kinds compete for one."""
    gpus = sim_nvml.read_state(tandem.node.nvml_state).gpus
    uuid = 'device.attributes["tandem.dev"].uuid'
    plain = json.dumps([g.uuid for i, g in enumerate(gpus) if i not in (0, SHARED, MIG)])
    share = request("gpu", "gpu.tandem.dev")
    share["exactly"]["capacity"] = {"requests": {"memory": "20Gi", "computePercent": "25"}}
    mps = {"kind": "GpuConfig", "sharing": "MPS"}
    exclusive = {"kind": "NicConfig", "mode": "exclusive", "interfaceName": "net1", "addresses": ["192.168.100.10/24"]}
    pair = [request("gpu", "gpu.tandem.dev", f"{uuid} in {plain}"), request("nic", "nic.tandem.dev")]
    show = report_script("ls /dev | grep nvidia; ip -o address show dev net1 2>/dev/null; env | grep ^CUDA_MPS_")
    return [
        claim_template("whole", [request("gpu", "gpu.tandem.dev", f'{uuid} == "{gpus[0].uuid}"')]),
        claim_template("pair", pair, [{"requests": ["gpu", "nic"], "matchAttribute": PCIE_ROOT}]),
        claim_template("mps", [share], config=[opaque("gpu", mps)]),
        claim_template(
            "mig", [request("mig", "mig.tandem.dev", 'device.attributes["tandem.dev"].profile == "1g.10gb"')]
        ),
        claim_template("nic", [request("nic", "nic.tandem.dev")], config=[opaque("nic", exclusive)]),
        *(pod(cluster, name, show, {"dev": name}) for name in PODS),
    ]


def opaque(request_name: str, parameters: dict[str, Any]) -> dict[str, Any]:
    parameters = {"apiVersion": "tandem.dev/v1alpha1", **parameters}
    return {"requests": [request_name], "opaque": {"driver": "tandem.dev", "parameters": parameters}}


def container_pid(cluster: Cluster, namespace: str, name: str) -> int:
    """A process of the pod's container on this host (its cgroup names the pod; the sandbox's pause
    process is not it): /proc/<pid>/root and /proc/<pid>/ns/net are the container's."""
    uid = cluster.get("pod", name, namespace)["metadata"]["uid"]
    for entry in Path("/proc").iterdir():
        try:
            mine = entry.name.isdigit() and f"pod{uid}" in (entry / "cgroup").read_text()
            if mine and (entry / "comm").read_text().strip() != "pause":
                return int(entry.name)
        except OSError:
            continue  # gone meanwhile
    raise AssertionError(f"no process of pod {name} on this host")


def mps_daemon(node_root: Path, pid: int) -> str | None:
    """The PID in the pipe directory of the MPS control daemon serving the container, if the daemon
    answers its front end there (`get_server_list`) as the container's CUDA would reach it; None
    while none answers."""
    pipe = Path(f"/proc/{pid}/root/{MPS_PIPE}")
    front_end = subprocess.run(
        [str(node_root / "nvidia" / "usr" / "bin" / "nvidia-cuda-mps-control")],
        input="get_server_list\n", capture_output=True, text=True, timeout=30, check=False,
        env={**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(pipe)},
    )  # fmt: skip
    return (pipe / "nvidia-cuda-mps-control.pid").read_text().strip() if front_end.returncode == 0 else None


def host_mps_daemon(node_root: Path) -> bool:
    """Whether a GPU's MPS control daemon answers through Tandem's own link `<gpu>/pipe` (the path
    the claims' CDI specs name), as a container made now would reach it."""
    for pipe in (DATA_DIR / "mps").glob("*/pipe"):
        front_end = subprocess.run(
            [str(node_root / "nvidia" / "usr" / "bin" / "nvidia-cuda-mps-control")],
            input="get_server_list\n",
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
            env={**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(pipe)},
        )
        if front_end.returncode == 0:
            return True
    return False


def held(cluster: Cluster, namespace: str, node_root: Path) -> dict[str, Any]:
    """What each pod holds, seen from its container: the process, the GPU device nodes in its
    /dev, the addresses of net1 in its network namespace, its MPS daemon; and NVML's MIG devices."""
    seen: dict[str, Any] = {}
    for name in PODS:
        pid = container_pid(cluster, namespace, name)
        dev = Path(f"/proc/{pid}/root/dev")
        nodes = sorted(p.name for p in dev.iterdir() if p.name.startswith("nvidia"))
        caps = sorted(p.name for p in (dev / "nvidia-caps").iterdir()) if (dev / "nvidia-caps").is_dir() else []
        net = subprocess.run(["nsenter", "-t", str(pid), "-n", "ip", "-j", "address", "show", "dev", "net1"],
                             capture_output=True, text=True, check=False)  # fmt: skip
        found = json.loads(net.stdout)[0]["addr_info"] if net.returncode == 0 else []
        # Not the link-local address the kernel gives every netdev.
        addresses = sorted(a["local"] for a in found if a.get("scope") == "global")
        seen[name] = {"pid": pid, "nodes": nodes, "caps": caps, "net1": addresses,
                      "mps": mps_daemon(node_root, pid) if name == "mps" else None}  # fmt: skip
    profile = sim_nvml.read_state(node_root / "nvml-state.json")
    seen["mig"]["instances"] = sorted((m.profile, m.gi_id, m.ci_id) for m in profile.gpus[MIG].mig_devices)
    return seen


def mps_log(cluster: Cluster) -> str:
    """What the running driver logged about MPS daemons: why a daemon was started, adopted or not."""
    (driver,) = driver_pods(cluster)
    log = cluster.kubectl("logs", "-n", DRIVER_NAMESPACE, driver["metadata"]["name"])
    return "\n".join(line for line in log.splitlines() if "MPS" in line)[-4000:]


def checkpoint_claims() -> set[str]:
    return set(json.loads((DATA_DIR / "checkpoint.json").read_text())["claims"])


def restart_pod(cluster: Cluster, tandem, namespace: str, name: str) -> None:
    """The pod deleted (its claim with it) and made again from its workload, Running."""
    cluster.kubectl("delete", "pod", name, "-n", namespace, "--wait=true", timeout=180)
    (again,) = [o for o in workloads(cluster, tandem) if o["kind"] == "Pod" and o["metadata"]["name"] == name]
    cluster.apply(again, namespace=namespace)
    wait_for(f"pod {name} Running", lambda: pod_phase(cluster, namespace, name) == "Running", timeout=120)


def run_pods(cluster: Cluster, tandem, namespace: str) -> None:
    cluster.apply(*workloads(cluster, tandem), namespace=namespace)
    for name in PODS:
        wait_report(cluster, namespace, name, timeout=180)


def drain(cluster: Cluster, tandem, namespace: str, nics: dict[str, list[str]]) -> None:
    """The pods deleted: every claim unprepared by the running driver, whichever release prepared
    it, with nothing left behind: the partition destroyed, the NIC home with its addresses, the MPS
    daemon and its directory gone, no claim file left."""
    cluster.kubectl("delete", "pods", "--all", "-n", namespace, "--wait=true", "--timeout=120s", timeout=150)
    wait_for("every claim unprepared", lambda: not checkpoint_claims(), timeout=120)
    profile = sim_nvml.read_state(tandem.node.nvml_state)
    assert not profile.gpus[MIG].mig_devices, "the partition outlived its claim"
    nics_home(nics, "after the drain")
    wait_for("the MPS daemon's directory gone", lambda: not (DATA_DIR / "mps" / f"gpu-{SHARED}").exists(), timeout=60)
    assert tandem.files() == []  # CDI specs
    metadata = DATA_DIR / "dra-device-metadata"
    assert not (metadata.is_dir() and list(metadata.iterdir()))


def nics_home(nics: dict[str, list[str]], when: str) -> None:
    """Every NIC on the host under its own name with its own addresses."""
    for home, addresses in nics.items():
        wait_for(f"{home} home with {addresses} {when}", lambda h=home, a=addresses: set(a) <= {
            f"{x['local']}/{x['prefixlen']}" for x in (host_link(h) or {}).get("addr_info", [])}, timeout=90)  # fmt: skip


def upgrade(cluster: Cluster, helm: str, node_root: Path) -> None:
    """docs/deployment.md, 'Upgrade': the chart takes over the objects of the plain manifest."""
    repository, tag = DRIVER_IMAGES[0].rsplit(":", 1)
    values = [f"image.repository={repository}", f"image.tag={tag}", f"gpuSharing={{{SHARED}}}",
              f"dynamicMig.gpus={{{MIG}}}"]  # fmt: skip
    renderer = Path(__file__).parent / "sim_post_renderer.py"
    # The post-renderer imports tests/cluster/kube.py, which imports sim/ and tests/waiting.py.
    path = ":".join(str(p) for p in (REPO, REPO / "tests", REPO / "tests" / "cluster"))
    done = subprocess.run(
        [helm, "upgrade", "--install", RELEASE, str(CHART), "--namespace", DRIVER_NAMESPACE, "--take-ownership",
         *[a for v in values for a in ("--set", v)], "--post-renderer", sys.executable,
         *[a for arg in (renderer, node_root, "NIC_LINK_SOURCE=netlink") for a in ("--post-renderer-args", str(arg))],
         "--wait", "--timeout", "240s"],
        capture_output=True, text=True, timeout=300, env={**cluster.env, "PYTHONPATH": path}, check=False,
    )  # fmt: skip
    assert done.returncode == 0, f"helm upgrade failed: {done.stderr}"


def test_upgrade_from_0_1_0_under_running_pods_then_back_from_a_drained_node(
    cluster: Cluster, tandem, helm: str, previous: Path, namespace: str, tmp_path: Path
) -> None:
    node_root = previous
    nics = {n.ifname: n.ipv4 for n in sim_nvml.read_state(tandem.node.nvml_state).nics}
    nics_home(nics, "before the test")  # what the drain checks holds before: no earlier test's NIC away
    run_pods(cluster, tandem, namespace)
    before = held(cluster, namespace, node_root)
    assert before["mps"]["mps"] and before["nic"]["net1"] == ["192.168.100.10"]
    assert [(p, ci is not None) for p, _, ci in before["mig"]["instances"]] == [("1g.10gb", True)]
    (home,) = [n for n in nics if host_link(n) is None]  # the exclusive NIC, in its pod
    prepared = checkpoint_claims()
    assert len(prepared) == len(PODS)
    # What 0.1.0 wrote (tests/unit/claims/checkpoint-0.1.0.json was captured here).
    shutil.copy(DATA_DIR / "checkpoint.json", tmp_path / "checkpoint-0.1.0.json")

    upgrade(cluster, helm, node_root)
    wait_for("the current driver alone and Ready", lambda: running_image(cluster) == DRIVER_IMAGES[0], timeout=240)
    (driver,) = driver_pods(cluster)
    out = cluster.kubectl(
        "exec", "-n", DRIVER_NAMESPACE, driver["metadata"]["name"], "--", "tandemctl", "claims", "--json"
    )
    assert {c["uid"] for c in json.loads(out)["claims"]} == prepared  # 0.1.0's checkpoint, read
    # 0.1.0's MPS daemon ran in its pod's PID namespace and ended with it, and the CUDA contexts of
    # its clients with it. The new driver never starts a root daemon in a directory a tenant has
    # had (docs/security.md): the GPU's next daemon gets a fresh pipe directory, which a container
    # made before does not see. The MPS pod is restarted, as docs/deployment.md ('Upgrade') says.
    wait_for("the new MPS daemon answering through Tandem's link", lambda: host_mps_daemon(node_root), timeout=120)
    after = held(cluster, namespace, node_root)
    assert after["mps"]["mps"] is None, "the new daemon must not run in the directory 0.1.0's pod has"
    restart_pod(cluster, tandem, namespace, "mps")
    try:
        after = wait_for(
            "the restarted MPS client's daemon answering",
            lambda: (h := held(cluster, namespace, node_root))["mps"]["mps"] and h,
            timeout=120,
        )
    except AssertionError as e:
        raise AssertionError(f"{e}\n{mps_log(cluster)}") from None
    others = [name for name in PODS if name != "mps"]
    assert {k: after[k] for k in others} == {k: before[k] for k in others}  # the same processes, nodes, netdev, MIG
    assert host_link(home) is None

    # From now on a restart of the driver's container keeps the daemon (hostPID, its own cgroup).
    settled = held(cluster, namespace, node_root)
    cluster.kubectl("rollout", "restart", "-n", DRIVER_NAMESPACE, "daemonset/tandem-driver")
    wait_for("the restarted driver alone and Ready", lambda: running_image(cluster) == DRIVER_IMAGES[0] and
             driver_pods(cluster)[0]["metadata"]["uid"] != driver["metadata"]["uid"], timeout=240)  # fmt: skip
    assert held(cluster, namespace, node_root) == settled, mps_log(cluster)

    drain(cluster, tandem, namespace, nics)
    run_pods(cluster, tandem, namespace)  # new claims, on the upgraded node
    drain(cluster, tandem, namespace, nics)

    # Back to 0.1.0 from the drained node (docs/deployment.md, 'Downgrade'): Helm forgets the
    # release, 0.1.0's manifest replaces the objects, and the claim policy 0.1.0 lacked goes.
    cluster.kubectl("delete", "secrets", "-n", DRIVER_NAMESPACE, "-l", f"owner=helm,name={RELEASE}")
    cluster.kubectl("replace", "-f", "-", stdin=yaml.safe_dump_all(previous_manifest(node_root)))
    for kind in ("validatingadmissionpolicybinding", "validatingadmissionpolicy"):
        cluster.kubectl("delete", kind, "tandem-opaque-config")
    wait_for("0.1.0 alone and Ready", lambda: running_image(cluster) == PREVIOUS_IMAGE, timeout=240)
    run_pods(cluster, tandem, namespace)
    drain(cluster, tandem, namespace, nics)
