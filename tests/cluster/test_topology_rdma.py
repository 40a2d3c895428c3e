"""Topology and RDMA for AI fabrics in the real cluster: a GPU and a NIC behind one PCIe switch
(and the fallback when the switch has no free NIC), RoCE NICs shared under the real scheduler's
consumable capacity, an exclusive NIC moved into a pod by runc (CDI netDevices) and given back
afterwards, and the Kubernetes Events users find with `kubectl describe`.

The NICs have real netdevs here (veths, demo/cluster_nics.py), and containerd runs the runc of
hack/cluster/go.mod, which implements OCI linux.netDevices.
"""

from __future__ import annotations

import json
import subprocess
from typing import Any

from kube import (
    Cluster,
    attribute,
    claim_template,
    example,
    host_link,
    logs,
    pod,
    pod_phase,
    report_script,
    request,
    wait_for,
    wait_report,
)

from sim.nvml import append_event

SWITCH = "pcieSwitch"
ROOT = "resource.kubernetes.io/pcieRoot"
METADATA = "/var/run/kubernetes.io/dra-device-attributes/resourceclaimtemplates/pair/gpu/tandem.dev-metadata.json"
PAIR_REPORT = report_script(f"env | grep -E '^(TANDEM_GPU_NIC_PAIRS|NCCL_IB_HCA)='; echo ---; cat {METADATA}")
XID_EVENT, XID_NO_SCHEDULE, QUIET = 0x8, 92, 6


def results(cluster: Cluster, namespace: str, pod_name: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The allocation results and status.devices of the pod's claims."""
    out, status = [], []
    for s in cluster.get("pod", pod_name, namespace)["status"].get("resourceClaimStatuses") or []:
        claim = cluster.get("resourceclaim", s["resourceClaimName"], namespace)
        out += claim["status"]["allocation"]["devices"]["results"]
        status += claim["status"].get("devices") or []
    return out, status


def paired_by(text: str) -> tuple[dict[str, str], dict[str, Any]]:
    """The container's pairing variables and its GPU's device-metadata attributes."""
    env_text, metadata = text.split("---\n", 1)
    env = dict(line.split("=", 1) for line in env_text.splitlines() if "=" in line)
    doc, _ = json.JSONDecoder().raw_decode(metadata.strip())
    (device,) = doc["requests"][0]["devices"]
    return env, device["attributes"]


def nics(cluster: Cluster) -> list[dict[str, Any]]:
    return [d for d in cluster.devices().values() if attribute(d, "type") == "nic"]


def test_gpu_nic_claim_with_switch_affinity_gets_a_same_switch_pair(cluster: Cluster, tandem, namespace: str) -> None:
    tandem.ensure()
    cluster.apply(example(cluster, "gpu-nic-switch", PAIR_REPORT), namespace=namespace)
    text = wait_report(cluster, namespace, "gpu-nic-switch-pod")
    found, _ = results(cluster, namespace, "gpu-nic-switch-pod")
    by_request = {r["request"]: cluster.devices()[r["device"]] for r in found}
    gpu, nic = by_request["gpu"], by_request["nic/same-switch"]  # the first choice was available
    assert attribute(gpu, SWITCH) == attribute(nic, SWITCH) is not None
    assert attribute(gpu, "gpuDirectRDMA") is True and attribute(nic, "gpuDirectRDMA") is True
    env, attributes = paired_by(text)
    assert env["TANDEM_GPU_NIC_PAIRS"] == f"0:{attribute(nic, 'rdmaDevice')}"
    assert attributes["pairedBy"] == {"string": "pcieSwitch"}


def test_first_available_falls_back_to_the_root_when_the_switch_has_no_free_nic(
    cluster: Cluster, tandem, namespace: str
) -> None:
    tandem.ensure()
    switch = attribute(cluster.devices()["gpu-0"], SWITCH)
    (taken,) = [n for n in nics(cluster) if attribute(n, SWITCH) == switch]
    rdma = attribute(taken, "rdmaDevice")
    cluster.apply(
        claim_template("that-nic", [request("nic", "nic.tandem.dev", f'device.attributes["tandem.dev"].rdmaDevice == "{rdma}"')]),
        pod(cluster, "holder", report_script("true"), {"nic": "that-nic"}),
        namespace=namespace,
    )  # fmt: skip
    wait_report(cluster, namespace, "holder")  # holds the switch's only NIC, whole
    docs = example(cluster, "gpu-nic-switch", PAIR_REPORT)
    (template,) = [d for d in docs if d["kind"] == "ResourceClaimTemplate"]
    (gpu_request,) = [r for r in template["spec"]["spec"]["devices"]["requests"] if r["name"] == "gpu"]
    gpu_request["exactly"]["selectors"].append(
        {"cel": {"expression": f'device.attributes["tandem.dev"].{SWITCH} == "{switch}"'}}
    )
    cluster.apply(docs, namespace=namespace)
    text = wait_report(cluster, namespace, "gpu-nic-switch-pod")
    found, _ = results(cluster, namespace, "gpu-nic-switch-pod")
    by_request = {r["request"]: cluster.devices()[r["device"]] for r in found}
    gpu, nic = by_request["gpu"], by_request["nic/same-root"]
    assert attribute(gpu, SWITCH) == switch != attribute(nic, SWITCH)
    assert attribute(gpu, ROOT) == attribute(nic, ROOT)
    assert paired_by(text)[1]["pairedBy"] == {"string": "pcieRoot"}


def unschedulable(cluster: Cluster, namespace: str, name: str) -> bool:
    conditions = (cluster.get("pod", name, namespace) or {}).get("status", {}).get("conditions") or []
    return any(c["type"] == "PodScheduled" and c.get("reason") == "Unschedulable" for c in conditions)


def test_eight_pods_share_one_roce_nic_and_a_ninth_waits(cluster: Cluster, tandem, namespace: str) -> None:
    tandem.ensure("--nic-shares", "8")
    wait_for("NICs with 8 shares", lambda: {n["capacity"]["shares"]["value"] for n in nics(cluster)} == {"8"})
    docs = example(cluster, "shared-nic")
    (template,) = [d for d in docs if d["kind"] == "ResourceClaimTemplate"]
    template["spec"]["spec"]["devices"]["requests"][0]["exactly"]["selectors"] = [
        {"cel": {"expression": 'device.attributes["tandem.dev"].rdmaDevice == "mlx5_0"'}}
    ]
    cluster.apply(template, namespace=namespace)
    names = [f"share-{i}" for i in range(9)]
    cluster.apply(
        [pod(cluster, n, report_script("ls /dev/infiniband"), {"nic": "nic-share"}) for n in names], namespace=namespace
    )

    def eight_and_one_waiting() -> list[str] | None:
        up = [n for n in names if pod_phase(cluster, namespace, n) == "Running"]
        rest = [n for n in names if n not in up]
        return up if len(up) == 8 and unschedulable(cluster, namespace, rest[0]) else None

    running = wait_for("eight pods Running, the ninth unschedulable", eight_and_one_waiting, timeout=240)
    shares, status = set(), []
    for n in running:
        found, entries = results(cluster, namespace, n)
        shares |= {r["shareID"] for r in found}
        assert [r["consumedCapacity"] for r in found] == [{"shares": "1"}]
        status += entries
        assert "uverbs0" in logs(cluster, namespace, n)
    assert len(shares) == 8
    assert {e["shareID"] for e in status} == shares
    assert {e["networkData"]["interfaceName"] for e in status} == {"ens1f0np0"}  # each claim sees the NIC
    (waiting,) = set(names) - set(running)
    cluster.kubectl("delete", "pod", running[0], "-n", namespace, "--wait=true", "--timeout=60s")
    wait_for("the ninth pod Running once a share is free", lambda: pod_phase(cluster, namespace, waiting) == "Running",
             timeout=120)  # fmt: skip


def test_exclusive_nic_moves_into_the_pod_with_its_settings_and_comes_back(cluster: Cluster, tandem,
                                                                          namespace: str) -> None:  # fmt: skip
    tandem.ensure()
    script = report_script("ip address show dev net1; ip link show dev net1; ip route")
    cluster.apply(example(cluster, "opaque-config", script), namespace=namespace)
    text = wait_report(cluster, namespace, "configured-pod", timeout=120)
    assert "inet 192.168.100.10/24" in text and "mtu 4200" in text
    assert "192.168.0.0/16 via 192.168.100.1" in text
    found, status = results(cluster, namespace, "configured-pod")
    (nic_name,) = [r["device"] for r in found if r["request"] == "nic"]
    (nic_status,) = [s for s in status if s["device"] == nic_name]
    assert nic_status["networkData"]["interfaceName"] == "net1"
    assert nic_status["networkData"]["ips"] == ["192.168.100.10/24"]
    assert "RDMA device is not moved" in nic_status["conditions"][0]["message"]
    nic = cluster.devices()[nic_name]
    home, address = attribute(nic, "ifName"), attribute(nic, "ipv4")
    assert host_link(home) is None, "the netdev is in the pod, not on the host"
    cluster.kubectl("delete", "pod", "configured-pod", "-n", namespace, "--wait=true", "--timeout=60s")

    def back() -> dict[str, Any] | None:
        link = host_link(home)
        addresses = {f"{a['local']}/{a['prefixlen']}" for a in (link or {}).get("addr_info", [])}
        return link if address in addresses else None

    link = wait_for(f"{home} back on the host with {address}", back, timeout=90)
    assert "UP" in link["flags"]
    # Between the unprepare and the netdev's return the NIC may be briefly out of the slice: absent
    # is "not yet", not a failure.
    wait_for("published as present again", lambda: attribute(cluster.devices().get(nic_name, {}), "state") == "up")


def events(cluster: Cluster, namespace: str, selector: str) -> list[dict[str, Any]]:
    out = cluster.kubectl("get", "events", "-n", namespace, "--field-selector", selector, "-o", "json")
    return json.loads(out)["items"]


def test_events_for_a_failed_prepare_and_a_health_change(cluster: Cluster, tandem, namespace: str) -> None:
    tandem.ensure("--health-quiet-period", str(QUIET))
    # Exclusive mode on one share of a NIC: the scheduler allocates it, Tandem refuses to prepare it.
    share = request("nic", "nic.tandem.dev")
    share["exactly"]["capacity"] = {"requests": {"shares": "1"}}
    exclusive = {"apiVersion": "tandem.dev/v1alpha1", "kind": "NicConfig", "mode": "exclusive", "interfaceName": "net1"}
    config = [{"requests": ["nic"], "opaque": {"driver": "tandem.dev", "parameters": exclusive}}]
    cluster.apply(claim_template("bad", [share], config=config), pod(cluster, "stuck", "true", {"nic": "bad"}),
                  namespace=namespace)  # fmt: skip
    failed = "involvedObject.kind=ResourceClaim,reason=PrepareFailed"
    event = wait_for("PrepareFailed on the claim", lambda: events(cluster, namespace, failed), timeout=120)[0]
    assert event["type"] == "Warning" and "needs the whole NIC" in event["message"]
    claim = event["involvedObject"]["name"]
    assert "PrepareFailed" in cluster.kubectl("describe", "resourceclaim", claim, "-n", namespace)
    # A health change on the Node: an XID, then healthy again after the quiet period.
    gpu = cluster.devices()["gpu-5"]
    append_event(tandem.node.nvml_state, attribute(gpu, "uuid"), XID_EVENT, XID_NO_SCHEDULE)

    def on_node(reason: str) -> list[dict[str, Any]]:
        node = f"involvedObject.kind=Node,involvedObject.name={cluster.node_name},reason={reason}"
        return [e for e in events(cluster, "default", node) if "gpu-5" in e["message"]]

    wait_for("DeviceUnhealthy on the Node", lambda: on_node("DeviceUnhealthy"))
    wait_for("DeviceHealthy on the Node", lambda: on_node("DeviceHealthy"), timeout=QUIET * 5)
    assert "DeviceUnhealthy" in cluster.kubectl("describe", "node", cluster.node_name)


def test_an_exclusive_nic_whose_link_just_went_down_is_not_bound_to(cluster: Cluster, tandem, namespace: str) -> None:
    """With --nic-binding-conditions, a NIC is checked as it is at binding time: its link taken
    down (and a debounce long enough that no taint has told the scheduler yet), the exclusive-NIC
    pod's binding fails and the pod is not bound to this node."""
    tandem.restart("--nic-binding-conditions", "--link-debounce", "300")
    nic = wait_for("NICs with binding conditions", lambda: [n for n in nics(cluster) if n.get("bindingConditions")])[0]
    home = attribute(nic, "ifName")
    subprocess.run(["ip", "link", "set", "dev", home, "down"], check=True)
    try:
        assert not [t for t in cluster.devices()[nic["name"]].get("taints") or [] if t["key"].endswith("link-down")]
        exclusive = {
            "apiVersion": "tandem.dev/v1alpha1",
            "kind": "NicConfig",
            "mode": "exclusive",
            "interfaceName": "net1",
        }
        config = [{"requests": ["nic"], "opaque": {"driver": "tandem.dev", "parameters": exclusive}}]
        chosen = request("nic", "nic.tandem.dev", f'device.attributes["tandem.dev"].ifName == "{home}"')
        cluster.apply(claim_template("down", [chosen], config=config), pod(cluster, "unbound", "true", {"nic": "down"}),
                      namespace=namespace)  # fmt: skip
        failed = "involvedObject.kind=ResourceClaim,reason=BindingFailed"
        event = wait_for("BindingFailed on the claim", lambda: events(cluster, namespace, failed), timeout=120)[0]
        assert home in event["message"] or nic["name"] in event["message"], event["message"]
        assert not cluster.get("pod", "unbound", namespace)["spec"].get("nodeName")
    finally:
        # The pod goes first: once the link is up and the taint gone with the restart, it would be
        # bound, and the NIC it moved would come home only when the namespace goes, perhaps under
        # another test's driver.
        cluster.kubectl("delete", "pod", "unbound", "-n", namespace, "--wait=true", "--timeout=60s", check=False)
        subprocess.run(["ip", "link", "set", "dev", home, "up"], check=True)
        tandem.ensure()
