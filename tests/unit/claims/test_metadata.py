"""Device metadata files: paths, modes, stream format, CDI spec, in-place update, removal (docs/reference/device-metadata.md)."""

from __future__ import annotations

import json
import os
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import cdi
from driver.claims.metadata import MetadataWriter, assign_metadata_ids
from driver.claims.metadata_format import (
    API_VERSIONS,
    MetadataDevice,
    MetadataError,
    attributes_json,
    decode_stream,
    document,
    encode_stream,
    encode_versions,
)
from driver.model import NUMA_NODE, Device, DeviceKind, Version

DRIVER = "tandem.example.org"
UID = "7f1c9e2a-51d3-4c3e-9b61-0c2f3a5d8e11"
NS, NAME = "team-a", "train-gpus"
GPU_ATTRS = {"type": {"string": "gpu"}, "resource.kubernetes.io/numaNode": {"int": 0}}
NET = {"interfaceName": "net1", "ips": ["10.0.0.10/24"], "hardwareAddress": "b8:3f:d2:00:00:01"}
BETA, ALPHA = "metadata.resource.k8s.io/v1beta1", "metadata.resource.k8s.io/v1alpha1"


@pytest.fixture
def dirs(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """Plugin data dir and CDI dir, under a strict umask so the modes must be set on purpose."""
    old = os.umask(0o077)
    try:
        yield tmp_path / "plugins" / DRIVER, tmp_path / "cdi"
    finally:
        os.umask(old)


@pytest.fixture
def writer(dirs: tuple[Path, Path]) -> MetadataWriter:
    return MetadataWriter(dirs[0], dirs[1], DRIVER)


def gpu(request: str = "gpu", name: str = "gpu-0", attrs: dict[str, dict] | None = None) -> MetadataDevice:
    return MetadataDevice(request, "node-a", name, GPU_ATTRS if attrs is None else attrs)


def host_file(dirs: tuple[Path, Path], request: str = "gpu", uid: str = UID) -> Path:
    return dirs[0] / "dra-device-metadata" / uid / request / "metadata.json"


def objects(path: Path) -> list[dict[str, Any]]:
    text, out, pos = path.read_text(), [], 0
    decoder = json.JSONDecoder()
    while pos < len(text):
        obj, pos = decoder.raw_decode(text, pos)
        assert text[pos] == "\n"
        pos += 1
        out.append(obj)
    return out


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_write_creates_the_files_keyed_by_claim_uid_with_the_go_library_modes(
    writer: MetadataWriter, dirs: tuple[Path, Path]
) -> None:
    ids = writer.write(NS, NAME, UID, "", [gpu("gpu/large"), gpu("nic", "pci-0000-17-00-0", {})])
    assert ids == {"gpu": f"{DRIVER}/metadata={UID}_gpu", "nic": f"{DRIVER}/metadata={UID}_nic"}
    data_dir, cdi_dir = dirs
    f = host_file(dirs)
    assert mode(f) == 0o644
    for d in (data_dir / "dra-device-metadata", f.parent.parent, f.parent):
        assert mode(d) == 0o755
    spec_file = cdi_dir / f"{DRIVER}_metadata_{UID}_gpu.json"
    assert mode(spec_file) == 0o644
    assert spec_file.read_text().startswith('{\n  "cdiVersion": "0.5.0",\n')  # JSON indented by 2
    assert (cdi_dir / f"{DRIVER}_metadata_{UID}_nic.json").exists()


def test_host_file_is_the_go_stream_of_the_object_in_each_version_newest_first(
    writer: MetadataWriter, dirs: tuple[Path, Path]
) -> None:
    """v1beta1 then v1alpha1, as Kubernetes 1.37 serves them: the same fields (the two versions'
    types are the same), kind and apiVersion first as Go encodes TypeMeta."""
    writer.write(NS, NAME, UID, "", [gpu("gpu/large"), gpu("gpu/large", "gpu-1", {}), gpu("", "gpu-7")])
    text = host_file(dirs).read_text()
    assert text.startswith(f'{{\n  "kind": "DeviceMetadata",\n  "apiVersion": "{BETA}",\n') and text.endswith("}\n")
    assert f'}}\n{{\n  "kind": "DeviceMetadata",\n  "apiVersion": "{ALPHA}",\n' in text
    body = {
        "metadata": {"name": NAME, "namespace": NS, "uid": UID, "generation": 1},
        "requests": [
            {
                "name": "gpu/large",
                "devices": [
                    {"driver": DRIVER, "pool": "node-a", "name": "gpu-0", "attributes": GPU_ATTRS},
                    {"driver": DRIVER, "pool": "node-a", "name": "gpu-1"},
                ],
            }
        ],
    }
    docs = objects(host_file(dirs))
    assert docs == [
        {"kind": "DeviceMetadata", "apiVersion": BETA, **body},
        {"kind": "DeviceMetadata", "apiVersion": ALPHA, **body},
    ]
    assert [list(doc) for doc in docs] == [["kind", "apiVersion", "metadata", "requests"]] * 2


def test_a_file_of_the_previous_release_is_read_and_gains_the_newer_version_in_place(
    writer: MetadataWriter, dirs: tuple[Path, Path]
) -> None:
    """0.1.0 wrote v1alpha1 alone: its files name their claim, are updated (the NIC address
    refresh), and are rewritten on the next prepare with both versions, keeping their inode."""
    writer.write(NS, NAME, UID, "gpus", [gpu()])
    f = host_file(dirs)
    old = objects(f)[1]
    assert old["apiVersion"] == ALPHA
    for rewrite in (
        lambda: writer.write(NS, NAME, UID, "gpus", [gpu()]),
        lambda: writer.update(NS, NAME, UID, "gpu", [gpu()]),
    ):
        f.write_text(json.dumps(old, indent=2) + "\n")  # what 0.1.0 left
        inode = f.stat().st_ino
        assert writer.claim_names(UID) == {(NS, NAME)}
        rewrite()
        beta, alpha = objects(f)
        assert f.stat().st_ino == inode
        assert (beta["apiVersion"], alpha["apiVersion"]) == (BETA, ALPHA)
        assert beta["metadata"]["generation"] == alpha["metadata"]["generation"] == 2
        assert beta["podClaimName"] == alpha["podClaimName"] == "gpus"
        assert {**beta, "apiVersion": ALPHA} == alpha


def test_a_rewrite_that_stopped_after_the_first_version_is_completed(
    writer: MetadataWriter, dirs: tuple[Path, Path]
) -> None:
    """A crash in an in-place rewrite can leave the v1beta1 object alone: it decodes like the
    whole file, but v1alpha1 consumers would find nothing, so the next prepare writes it again."""
    writer.write(NS, NAME, UID, "", [gpu()])
    f = host_file(dirs)
    f.write_bytes(encode_stream(objects(f)[:1]))
    writer.write(NS, NAME, UID, "", [gpu()])
    assert [doc["apiVersion"] for doc in objects(f)] == [BETA, ALPHA]


def test_devices_without_a_request_get_no_metadata(writer: MetadataWriter, dirs: tuple[Path, Path]) -> None:
    assert writer.write(NS, NAME, UID, "", [gpu("")]) == {}
    assert not (dirs[0] / "dra-device-metadata").exists() and not dirs[1].exists()


def test_cdi_spec_mounts_the_host_file_read_only(writer: MetadataWriter, dirs: tuple[Path, Path]) -> None:
    writer.write(NS, NAME, UID, "", [gpu()])
    spec = cdi.read_spec(dirs[1] / f"{DRIVER}_metadata_{UID}_gpu.json")
    assert (spec.cdi_version, spec.kind, spec.container_edits) == ("0.5.0", f"{DRIVER}/metadata", cdi.ContainerEdits())
    (device,) = spec.devices
    assert device.name == f"{UID}_gpu"
    assert device.container_edits == cdi.ContainerEdits(
        mounts=(
            cdi.Mount(
                host_path=str(host_file(dirs)),
                container_path=f"/var/run/kubernetes.io/dra-device-attributes/resourceclaims/{NAME}/gpu/{DRIVER}-metadata.json",
                options=("ro", "bind"),
            ),
        )
    )


def test_claim_from_a_template_uses_the_pod_claim_name(writer: MetadataWriter, dirs: tuple[Path, Path]) -> None:
    writer.write(NS, NAME, UID, "gpus", [gpu()])
    (device,) = cdi.read_spec(dirs[1] / f"{DRIVER}_metadata_{UID}_gpu.json").devices
    assert device.container_edits.mounts[0].container_path == (
        f"/var/run/kubernetes.io/dra-device-attributes/resourceclaimtemplates/gpus/gpu/{DRIVER}-metadata.json"
    )
    assert objects(host_file(dirs))[0]["podClaimName"] == "gpus"


def test_metadata_id_goes_to_the_first_device_of_its_request() -> None:
    names = [("nic",), ("gpu",), ("gpu", "nic"), ("other",)]
    ids = {"gpu": "G", "nic": "N", "unused": "U"}
    assert assign_metadata_ids(names, ids) == [["N"], ["G"], [], []]


def test_write_again_with_the_same_content_touches_nothing(writer: MetadataWriter, dirs: tuple[Path, Path]) -> None:
    writer.write(NS, NAME, UID, "", [gpu()])
    spec_file = dirs[1] / f"{DRIVER}_metadata_{UID}_gpu.json"
    before = [(p.stat().st_ino, p.stat().st_mtime_ns) for p in (host_file(dirs), spec_file)]
    writer.write(NS, NAME, UID, "", [gpu()])
    assert [(p.stat().st_ino, p.stat().st_mtime_ns) for p in (host_file(dirs), spec_file)] == before
    assert objects(host_file(dirs))[0]["metadata"]["generation"] == 1


def test_write_with_new_content_rewrites_in_place_with_the_next_generation(
    writer: MetadataWriter, dirs: tuple[Path, Path]
) -> None:
    writer.write(NS, NAME, UID, "", [gpu()])
    inode = host_file(dirs).stat().st_ino
    writer.write(NS, NAME, UID, "", [gpu(name="gpu-1")])
    doc = objects(host_file(dirs))[0]
    assert host_file(dirs).stat().st_ino == inode
    assert doc["metadata"]["generation"] == 2 and doc["requests"][0]["devices"][0]["name"] == "gpu-1"


def test_a_claim_recreated_under_the_same_name_gets_files_of_its_own(
    writer: MetadataWriter, dirs: tuple[Path, Path]
) -> None:
    old_uid = "11111111-2222-4333-8444-555555555555"
    writer.write(NS, NAME, old_uid, "", [gpu()])
    writer.update(NS, NAME, old_uid, "gpu", [gpu(name="gpu-3")])
    writer.write(NS, NAME, UID, "", [gpu()])
    assert objects(host_file(dirs))[0]["metadata"] == {
        "name": NAME,
        "namespace": NS,
        "uid": UID,
        "generation": 1,
    }
    writer.remove(old_uid)  # the old claim's late Unprepare
    assert objects(host_file(dirs))[0]["metadata"]["uid"] == UID
    assert (dirs[1] / f"{DRIVER}_metadata_{UID}_gpu.json").exists()
    assert writer.claim_names(UID) == {(NS, NAME)} and writer.claim_names(old_uid) == set()


def test_unreadable_leftover_is_replaced(writer: MetadataWriter, dirs: tuple[Path, Path]) -> None:
    writer.write(NS, NAME, UID, "", [gpu()])
    host_file(dirs).write_text("")  # an in-place rewrite torn by a crash
    writer.write(NS, NAME, UID, "", [gpu()])
    assert objects(host_file(dirs))[0]["metadata"]["generation"] == 1


def test_update_rewrites_the_same_inode_and_keeps_pod_claim_name(
    writer: MetadataWriter, dirs: tuple[Path, Path]
) -> None:
    writer.write(NS, NAME, UID, "gpus", [gpu("gpu/large")])
    f = host_file(dirs)
    inode = f.stat().st_ino
    with open(f, "rb") as held:  # stands in for a container's bind mount of the inode
        writer.update(NS, NAME, UID, "gpu", [MetadataDevice("gpu/large", "node-a", "gpu-0", GPU_ATTRS, NET)])
        doc = decode_stream(held.read())
    assert f.stat().st_ino == inode and mode(f) == 0o644
    assert doc["metadata"]["generation"] == 2
    assert doc["podClaimName"] == "gpus"
    assert doc["requests"] == [
        {
            "name": "gpu/large",
            "devices": [
                {"driver": DRIVER, "pool": "node-a", "name": "gpu-0", "attributes": GPU_ATTRS, "networkData": NET}
            ],
        }
    ]
    writer.update(NS, NAME, UID, "gpu", [])
    doc = objects(f)[0]
    assert doc["metadata"]["generation"] == 3 and doc["requests"] == [{"name": "gpu/large"}]


def test_update_of_an_unprepared_request_or_another_claim_fails(writer: MetadataWriter) -> None:
    with pytest.raises(MetadataError, match="not found in prepared claim"):
        writer.update(NS, NAME, UID, "gpu", [gpu()])
    writer.write(NS, NAME, UID, "", [gpu()])
    with pytest.raises(MetadataError, match="not found in prepared claim"):
        writer.update(NS, NAME, UID, "nic", [gpu()])
    with pytest.raises(MetadataError, match="not found in prepared claim"):  # another claim of the same name
        writer.update(NS, NAME, "11111111-2222-4333-8444-555555555555", "gpu", [gpu()])


def test_a_request_name_in_an_error_is_shown_escaped_and_bounded(writer: MetadataWriter) -> None:
    request = "gpu/\x1b[2J" + "x" * 200
    with pytest.raises(MetadataError) as e:
        writer.update(NS, NAME, UID, request, [gpu()])
    assert str(e.value).startswith(r"request 'gpu/\x1b[2Jxxx")
    assert f"... ({len(request)} characters) not found in prepared claim" in str(e.value)
    assert str(e.value).isprintable()


def test_remove_deletes_the_claim_dir_and_its_specs_only(writer: MetadataWriter, dirs: tuple[Path, Path]) -> None:
    other_uid = "11111111-2222-4333-8444-555555555555"
    writer.write(NS, NAME, UID, "", [gpu(), gpu("nic", "pci-0000-17-00-0")])
    writer.write(NS, "other", other_uid, "", [gpu()])
    (dirs[1] / "k8s.tandem.example.org-claim_x.json").write_text("{}")  # not a metadata spec
    assert writer.owned_claim_dirs() == {UID, other_uid}
    assert writer.owned_spec_uids() == {UID, other_uid}
    writer.remove(UID)
    assert not host_file(dirs).parent.parent.exists()
    assert sorted(p.name for p in dirs[1].iterdir()) == [
        "k8s.tandem.example.org-claim_x.json",
        f"{DRIVER}_metadata_{other_uid}_gpu.json",
    ]
    assert writer.owned_claim_dirs() == {other_uid} and writer.owned_spec_uids() == {other_uid}
    writer.remove(UID)  # again: nothing left is fine


def test_nothing_to_list_before_the_first_write(writer: MetadataWriter) -> None:
    assert writer.owned_claim_dirs() == set() and writer.owned_spec_uids() == set()
    assert writer.claim_names(UID) == set() and writer.remove_temp_files() == []
    writer.remove(UID)


def test_leftover_temporary_files_are_removed(writer: MetadataWriter, dirs: tuple[Path, Path]) -> None:
    """What a writer killed between write and rename leaves, beside the host file and the spec."""
    writer.write(NS, NAME, UID, "", [gpu()])
    leftovers = []
    for target in (host_file(dirs), dirs[1] / f"{DRIVER}_metadata_{UID}_gpu.json"):
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
        os.close(fd)
        leftovers.append(Path(tmp))
    foreign = dirs[1] / ".vendor.example.com-gpu.json.abcd1234.tmp"
    foreign.write_text("{}")
    assert sorted(writer.remove_temp_files()) == sorted(leftovers)
    assert foreign.exists() and host_file(dirs).exists()


@pytest.mark.parametrize(
    ("namespace", "name", "pod_claim_name", "req"),
    [
        ("..", NAME, "", "gpu"),
        ("a_b", NAME, "", "gpu"),
        (NS, "a/../../b", "", "gpu"),
        (NS, NAME, "../../etc", "gpu"),
        (NS, NAME, "", "../x"),
        (NS, NAME, "", "GPU"),
    ],
)
def test_claim_data_cannot_leave_the_base_directories(
    writer: MetadataWriter, dirs: tuple[Path, Path], namespace: str, name: str, pod_claim_name: str, req: str
) -> None:
    with pytest.raises(MetadataError):
        writer.write(namespace, name, UID, pod_claim_name, [gpu(req)])
    assert not dirs[1].exists()
    assert not (dirs[0] / "dra-device-metadata").exists() or list((dirs[0] / "dra-device-metadata").iterdir()) == []


def test_consumer_decoding_takes_the_first_known_version() -> None:
    known = {"kind": "DeviceMetadata", "apiVersion": ALPHA, "metadata": {}, "requests": []}
    beta = {**known, "apiVersion": BETA, "metadata": {"generation": 2}}
    newer = {"kind": "DeviceMetadata", "apiVersion": "metadata.resource.k8s.io/v1", "whatever": 1}
    assert decode_stream(encode_stream([newer, known])) == known
    assert decode_stream(encode_stream([newer, beta, known])) == beta
    with pytest.raises(MetadataError, match="no compatible metadata version"):
        decode_stream(encode_stream([newer]))
    with pytest.raises(MetadataError, match="no metadata objects"):
        decode_stream(b"\n")
    with pytest.raises(MetadataError, match="not a JSON stream"):
        decode_stream(b"{")


def test_attributes_json_matches_the_slice_form() -> None:
    device = Device(
        "gpu-0",
        DeviceKind.GPU,
        {"type": "gpu", NUMA_NODE: (0, 1), "cudaComputeCapability": Version("9.0.0"), "mig": False, "memory": 80},
    )
    assert attributes_json(device) == {
        "type": {"string": "gpu"},
        NUMA_NODE: {"ints": [0, 1]},
        "cudaComputeCapability": {"version": "9.0.0"},
        "mig": {"bool": False},
        "memory": {"int": 80},
    }


def test_the_versions_of_a_file_are_one_object_each_whatever_its_strings_hold() -> None:
    """encode_versions encodes once and swaps the apiVersion: a device string naming an
    apiVersion, or a key order it does not expect, changes nothing in what it writes."""
    tricky = gpu(attrs={"note": {"string": f'"apiVersion": "{BETA}"'}})
    doc = document("tandem.example", "ns", "claim", UID, 1, "", "gpu", [tricky])
    expected = encode_stream([{**doc, "apiVersion": version} for version in API_VERSIONS])
    assert encode_versions(doc) == expected
    reordered = {"apiVersion": BETA, **doc}
    assert encode_versions(reordered) == encode_stream([{**reordered, "apiVersion": v} for v in API_VERSIONS])
