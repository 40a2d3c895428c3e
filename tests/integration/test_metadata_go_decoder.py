"""Tandem's device metadata files, read by the Go library's own decoder as Kubernetes 1.37's consumers read them.

The files are written by the real MetadataWriter for devices discovered on a simulated HGX H100
node; hack/go-reference/cmd/decodemetadata decodes them with k8s.io/dynamic-resource-allocation v0.37.2
(`devicemetadata.DecodeMetadataFromStream`) as a consumer of metadata.resource.k8s.io/v1beta1 and
one of v1alpha1 would, and validates each object of the stream by the rules of its own version.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from driver.claims.cdi_spec import pairing_metadata, pod_pairs
from driver.claims.metadata import MetadataWriter
from driver.claims.metadata_format import MetadataDevice, attributes_json
from driver.claims.opaque_config import RequestConfig
from driver.claims.planned import PlannedDevice
from driver.claims.status import network_data
from driver.discovery.gpu.discover import GpuDiscovery
from driver.discovery.nic.discover import NicDiscovery
from driver.model import Device
from sim import nvml as sim_nvml
from sim.profile import h100_node
from sim.sysfs import render_node

GO_MODULE = Path(__file__).resolve().parents[2] / "hack" / "go-reference"
BUILD_TIMEOUT = 540  # a first build compiles apimachinery: minutes on 2 cores, seconds once cached
pytestmark = pytest.mark.timeout(BUILD_TIMEOUT + 60)

DRIVER, NODE = "tandem.dev", "node-a"
BETA, ALPHA = "metadata.resource.k8s.io/v1beta1", "metadata.resource.k8s.io/v1alpha1"
UID = "3f6c0a52-8d0e-4f3a-9c1e-2b7d5e4a6f10"


@pytest.fixture(scope="session")
def go_decoder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The decoder, built once per session from the benchmark's Go module (its metadata packages only)."""
    go = shutil.which("go")
    if go is None:
        pytest.skip("go is not on PATH: the Go library's metadata decoder cannot be built")
    binary = tmp_path_factory.mktemp("go-decoder") / "decodemetadata"
    proc = subprocess.run(
        [go, "build", "-trimpath", "-buildvcs=false", "-o", str(binary), "./cmd/decodemetadata"],
        cwd=GO_MODULE,
        env={**os.environ, "GOFLAGS": "-mod=mod"},
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT,
    )
    assert proc.returncode == 0, f"go build of hack/go-reference/cmd/decodemetadata failed:\n{proc.stderr[-4000:]}"
    return binary


@pytest.fixture(scope="module")
def devices(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Device]:
    """The devices of a simulated HGX H100 node (2 GPUs, 2 NICs), as discovery publishes them."""
    root = tmp_path_factory.mktemp("node")
    profile = h100_node(NODE, gpus=2, nics=2)
    render_node(profile, root / "sys", root / "dev", root / "proc")
    state = root / "nvml.json"
    with sim_nvml.fake_pynvml_in_process(state):
        sim_nvml.write_state(profile, state)
        found = GpuDiscovery(root / "sys", proc_root=root / "proc").discover()
    found += NicDiscovery(root / "sys", netlink=False).discover()
    return {d.name: d for d in found}


def decode(go_decoder: Path, path: Path) -> dict[str, Any]:
    proc = subprocess.run([str(go_decoder), str(path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    result: dict[str, Any] = json.loads(proc.stdout)
    return result


def stream(path: Path) -> list[dict[str, Any]]:
    text, out, pos = path.read_text(), [], 0
    decoder = json.JSONDecoder()
    while text[pos:].strip():
        obj, end = decoder.raw_decode(text[pos:].lstrip())
        pos = len(text) - len(text[pos:].lstrip()) + end
        out.append(obj)
    return out


def assert_both_versions_decode_to(result: dict[str, Any], written: list[dict[str, Any]], expected: dict) -> None:
    """Each consumer gets the file's v1beta1 object (the first it knows), in its own version; each
    object of the stream is valid for its version; and all carry `expected` (the fields past TypeMeta)."""
    assert [d["apiVersion"] for d in written] == [BETA, ALPHA]
    consumers = result["consumers"]
    assert {v: c["decodedFrom"] for v, c in consumers.items()} == {BETA: BETA, ALPHA: BETA}
    assert consumers[BETA]["object"] == written[0] == {"kind": "DeviceMetadata", "apiVersion": BETA, **expected}
    assert consumers[ALPHA]["object"] == written[1] == {"kind": "DeviceMetadata", "apiVersion": ALPHA, **expected}
    assert [(o["decodedFrom"], o["validation"], o["object"]) for o in result["objects"]] == [
        (BETA, "valid", written[0]),
        (ALPHA, "valid", written[1]),
    ]


def test_gpu_claim_from_a_template_decodes_in_both_versions(
    go_decoder: Path, devices: dict[str, Device], tmp_path: Path
) -> None:
    """A GPU of a subrequest, with every attribute its slice publishes and the NIC it was paired with."""
    gpu, nic = devices["gpu-0"], devices["pci-0000-1a-00-0"]
    pod = [PlannedDevice(gpu, ("gpu",), RequestConfig()), PlannedDevice(nic, ("nic",), RequestConfig())]
    paired = pairing_metadata(pod_pairs(pod))[gpu.name]
    writer = MetadataWriter(tmp_path / "plugins", tmp_path / "cdi", DRIVER)
    attributes = {**attributes_json(gpu), **paired}
    writer.write("ml", "train-0-gpu-x7k2p", UID, "gpu", [MetadataDevice("gpu/h100", NODE, gpu.name, attributes)])

    path = writer.host_file(UID, "gpu")
    result = decode(go_decoder, path)
    meta = {"name": "train-0-gpu-x7k2p", "namespace": "ml", "uid": UID, "generation": 1}
    device = {"driver": DRIVER, "pool": NODE, "name": "gpu-0", "attributes": attributes}
    expected = {"metadata": meta, "podClaimName": "gpu", "requests": [{"name": "gpu/h100", "devices": [device]}]}
    assert_both_versions_decode_to(result, stream(path), expected)
    decoded = result["consumers"][ALPHA]["object"]["requests"][0]["devices"][0]["attributes"]
    assert decoded["uuid"] == {"string": "GPU-00000001-0000-4000-8000-000000000001"}
    assert decoded["cudaComputeCapability"] == {"version": "9.0.0"}
    assert decoded["resource.kubernetes.io/numaNode"] == {"int": 0}
    assert decoded["gpuDirectRDMA"] == {"bool": True}
    assert (decoded["pairedRdmaDevice"], decoded["pairedBy"]) == ({"string": "mlx5_0"}, {"string": "pcieSwitch"})


def test_nic_claim_with_network_data_decodes_in_both_versions_also_after_an_address_refresh(
    go_decoder: Path, devices: dict[str, Device], tmp_path: Path
) -> None:
    """A shared NIC's networkData as prepare writes it, then as the address refresh rewrites it."""
    nic = devices["pci-0000-1a-00-0"]
    writer = MetadataWriter(tmp_path / "plugins", tmp_path / "cdi", DRIVER)

    def metadata(device: Device) -> MetadataDevice:
        nd = network_data(PlannedDevice(device, ("nic",), RequestConfig()))
        return MetadataDevice("nic", NODE, device.name, attributes_json(device), nd)

    writer.write("ml", "fabric", UID, "", [metadata(nic)])
    path = writer.host_file(UID, "nic")
    meta = {"name": "fabric", "namespace": "ml", "uid": UID, "generation": 1}
    net = {"interfaceName": "ens1f0np0", "ips": ["10.0.0.10/24", "fd00::10/64"], "hardwareAddress": "b8:3f:d2:00:00:01"}
    device = {"driver": DRIVER, "pool": NODE, "name": nic.name, "attributes": attributes_json(nic), "networkData": net}
    expected: dict[str, Any] = {"metadata": meta, "requests": [{"name": "nic", "devices": [device]}]}
    assert_both_versions_decode_to(decode(go_decoder, path), stream(path), expected)

    assert nic.nic is not None
    renumbered = dataclasses.replace(nic, nic=dataclasses.replace(nic.nic, ipv4=("10.0.9.10/24",), ipv6=()))
    writer.update("ml", "fabric", UID, "nic", [metadata(renumbered)])
    meta["generation"] = 2
    device["networkData"] = {**net, "ips": ["10.0.9.10/24"]}
    assert_both_versions_decode_to(decode(go_decoder, path), stream(path), expected)


def test_the_decoder_reports_what_its_version_forbids(go_decoder: Path, tmp_path: Path) -> None:
    """The check has teeth: both versions allow a device 32 attributes at most."""
    writer = MetadataWriter(tmp_path / "plugins", tmp_path / "cdi", DRIVER)
    attributes = {f"a{i}": {"int": i} for i in range(33)}
    writer.write("ml", "big", UID, "", [MetadataDevice("gpu", NODE, "gpu-1", attributes)])
    objects = decode(go_decoder, writer.host_file(UID, "gpu"))["objects"]
    assert [o["decodedFrom"] for o in objects] == [BETA, ALPHA]
    assert all(o["validation"].startswith("requests[0].devices[0].attributes: Too many") for o in objects), objects
