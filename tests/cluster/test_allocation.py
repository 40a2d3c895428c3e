"""The real scheduler allocates what Tandem publishes, the real kubelet prepares it through Tandem,
and the real containerd applies Tandem's CDI specs: what a container of the pod then sees.

Each test applies one of examples/ as a user would (only the image and the command differ)."""

from __future__ import annotations

import json

from kube import Cluster, attribute, claim_template, example, pod, report_script, request, wait_for, wait_report

PCIE_ROOT = "resource.kubernetes.io/pcieRoot"
NUMA = "resource.kubernetes.io/numaNode"
GPU = 'device.attributes["tandem.dev"].type == "gpu"'
METADATA_ROOT = "/var/run/kubernetes.io/dra-device-attributes"
# What a container reports, one section per fact, separated by lines of "---".
REPORT = "ls /dev | grep -E '^nvidia[0-9]+$'; echo ---; env | sort; echo ---; find {root} -type f -exec cat {{}} +"


def report(text: str) -> tuple[list[str], dict[str, str], list[dict]]:
    """GPU device nodes, environment, and the device-metadata documents the container sees."""
    nodes, env, metadata = text.split("---\n", 2)
    docs, decoder, pos = [], json.JSONDecoder(), 0
    while metadata[pos:].strip():
        doc, end = decoder.raw_decode(metadata[pos:].lstrip())
        pos = len(metadata) - len(metadata[pos:].lstrip()) + end
        docs.append(doc)
    return nodes.split(), dict(line.split("=", 1) for line in env.splitlines() if "=" in line), docs


REPORT_SCRIPT = report_script(REPORT.format(root=METADATA_ROOT))


def allocated(cluster: Cluster, namespace: str, pod_name: str) -> tuple[list[dict], list[dict]]:
    """The allocation results and the status.devices of the pod's claims."""
    pod_status = cluster.get("pod", pod_name, namespace)["status"]
    # Claims from templates, and the one the scheduler made for an extended-resource request.
    names = [s["resourceClaimName"] for s in pod_status.get("resourceClaimStatuses") or []]
    if "extendedResourceClaimStatus" in pod_status:
        names.append(pod_status["extendedResourceClaimStatus"]["resourceClaimName"])
    results, status = [], []
    for name in names:
        claim = cluster.get("resourceclaim", name, namespace)
        results += claim["status"]["allocation"]["devices"]["results"]
        status += claim["status"].get("devices") or []
    return results, status


def minor(device_name: str) -> int:
    return int(device_name.removeprefix("gpu-"))  # GPUs are published as gpu-<minor>


def test_gpu_claim_gives_the_container_its_gpu_and_no_other(cluster: Cluster, tandem, namespace: str) -> None:
    cluster.apply(example(cluster, "gpu", REPORT_SCRIPT), namespace=namespace)
    text = wait_report(cluster, namespace, "gpu-pod")
    (result,), status = allocated(cluster, namespace, "gpu-pod")
    device = cluster.devices()[result["device"]]
    nodes, env, metadata = report(text)
    assert nodes == [f"nvidia{minor(result['device'])}"]
    assert env[f"TANDEM_DEVICE_{result['device'].upper().replace('-', '_')}"] == attribute(device, "uuid")
    doc, older = metadata  # one file: the object in each version, newest first
    assert [d["apiVersion"] for d in metadata] == [
        "metadata.resource.k8s.io/v1beta1",
        "metadata.resource.k8s.io/v1alpha1",
    ]
    assert doc["kind"] == "DeviceMetadata" and {**doc, "apiVersion": older["apiVersion"]} == older
    assert [d["name"] for r in doc["requests"] for d in r["devices"]] == [result["device"]]
    assert [(s["device"], s["conditions"][0]["type"], s["conditions"][0]["status"]) for s in status] == [
        (result["device"], "Ready", "True")
    ]


def test_gpu_and_nic_on_one_pcie_root(cluster: Cluster, tandem, namespace: str) -> None:
    cluster.apply(example(cluster, "gpu-nic-pair", REPORT_SCRIPT), namespace=namespace)
    text = wait_report(cluster, namespace, "gpu-nic-pod")
    results, status = allocated(cluster, namespace, "gpu-nic-pod")
    by_request = {r["request"]: cluster.devices()[r["device"]] for r in results}
    gpu, nic = by_request["gpu"], by_request["nic"]
    assert attribute(gpu, PCIE_ROOT) == attribute(nic, PCIE_ROOT)
    nodes, env, _ = report(text)
    assert nodes == [f"nvidia{minor(gpu['name'])}"]
    rdma = attribute(nic, "rdmaDevice")
    assert env["TANDEM_GPU_NIC_PAIRS"] == f"0:{rdma}"
    assert env["NCCL_IB_HCA"] == f"={rdma}"
    (nic_status,) = [s for s in status if s["device"] == nic["name"]]
    assert nic_status["networkData"] == {
        "interfaceName": attribute(nic, "ifName"),
        "hardwareAddress": attribute(nic, "mac"),
        "ips": [attribute(nic, "ipv4"), attribute(nic, "ipv6")],
    }


def test_extended_resource_pod_gets_a_gpu_through_dra(cluster: Cluster, tandem, namespace: str) -> None:
    """`nvidia.com/gpu: 1` and no claim: the scheduler makes the claim from the DeviceClass."""
    cluster.apply(example(cluster, "extended-resource", REPORT_SCRIPT), namespace=namespace)
    text = wait_report(cluster, namespace, "legacy-gpu-pod")
    (result,), _ = allocated(cluster, namespace, "legacy-gpu-pod")
    assert result["driver"] == "tandem.dev"
    nodes, _, _ = report(text)
    assert nodes == [f"nvidia{minor(result['device'])}"]


def test_cel_selector_on_a_list_typed_attribute(cluster: Cluster, tandem, namespace: str) -> None:
    """With --list-attributes (and the DRAListTypeAttributes gate) numaNode is a list, and the real
    scheduler evaluates `includes()` on it."""
    tandem.ensure("--list-attributes")
    wait_for(
        "numaNode published as a list",
        lambda: (
            (numa := [d["attributes"][NUMA] for d in cluster.devices().values() if NUMA in d["attributes"]])
            and all("ints" in a for a in numa)
        ),
    )
    selector = f'{GPU} && device.attributes["resource.kubernetes.io"].numaNode.includes(1)'
    cluster.apply(
        claim_template("numa-1-gpu", [request("gpu", "gpu.tandem.dev", selector)]),
        pod(cluster, "numa", report_script("true"), {"gpu": "numa-1-gpu"}),
        namespace=namespace,
    )
    wait_report(cluster, namespace, "numa")
    (result,), _ = allocated(cluster, namespace, "numa")
    assert cluster.devices()[result["device"]]["attributes"][NUMA] == {"ints": [1]}
