"""CDI model and names: exact camelCase JSON with empties omitted, strict parsing, Go parser name rules."""

from __future__ import annotations

import json

import pytest

from cdi import (
    ContainerEdits,
    Device,
    DeviceNode,
    Hook,
    IntelRdt,
    Mount,
    NetDevice,
    Spec,
    SpecError,
    parse_qualified_name,
    qualified_name,
    validate_class_name,
    validate_device_name,
    validate_kind,
    validate_vendor_name,
)

FULL_EDITS = ContainerEdits(
    env=["A=1"],
    device_nodes=[
        DeviceNode(
            path="/dev/nvidia0", host_path="/dev/nvidia0", type="c", major=195, minor=0,
            file_mode=0o666, permissions="rw", uid=0, gid=0,
        )
    ],
    mounts=[Mount(host_path="/usr/lib/x", container_path="/usr/lib/x", options=["ro", "bind"], type="bind")],
    hooks=[Hook(hook_name="createContainer", path="/usr/bin/hook", args=["hook", "-v"], env=["B=2"], timeout=5)],
    net_devices=[NetDevice(host_interface_name="ens5f0v2", name="net1")],
    intel_rdt=IntelRdt(clos_id="c1", l3_cache_schema="L3:0=f", mem_bw_schema="MB:0=50", schemata=["L2:0=3"], enable_monitoring=True),
    additional_gids=[44],
)  # fmt: skip

FULL_EDITS_JSON = {
    "env": ["A=1"],
    "deviceNodes": [
        {"path": "/dev/nvidia0", "hostPath": "/dev/nvidia0", "type": "c", "major": 195, "minor": 0,
         "fileMode": 0o666, "permissions": "rw", "uid": 0, "gid": 0}
    ],
    "netDevices": [{"hostInterfaceName": "ens5f0v2", "name": "net1"}],
    "hooks": [{"hookName": "createContainer", "path": "/usr/bin/hook", "args": ["hook", "-v"], "env": ["B=2"], "timeout": 5}],
    "mounts": [{"hostPath": "/usr/lib/x", "containerPath": "/usr/lib/x", "options": ["ro", "bind"], "type": "bind"}],
    "intelRdt": {"closID": "c1", "l3CacheSchema": "L3:0=f", "memBwSchema": "MB:0=50", "schemata": ["L2:0=3"],
                 "enableMonitoring": True},
    "additionalGids": [44],
}  # fmt: skip


def _full_spec() -> Spec:
    return Spec(
        cdi_version="1.1.0",
        kind="vendor.example.com/gpu",
        devices=[Device(name="gpu0", container_edits=FULL_EDITS, annotations={"a.example.com/x": "y"})],
        container_edits=ContainerEdits(env=["COMMON=1"]),
        annotations={"owner": "tandem"},
    )


def test_every_field_has_its_exact_camelcase_key():
    assert _full_spec().to_dict() == {
        "cdiVersion": "1.1.0",
        "kind": "vendor.example.com/gpu",
        "annotations": {"owner": "tandem"},
        "devices": [{"name": "gpu0", "annotations": {"a.example.com/x": "y"}, "containerEdits": FULL_EDITS_JSON}],
        "containerEdits": {"env": ["COMMON=1"]},
    }


def test_round_trip_is_exact():
    spec = _full_spec()
    text = spec.to_json()
    assert Spec.from_json(text) == spec
    assert Spec.from_json(text).to_json() == text


def test_compact_json_is_the_dict_encoded_whatever_the_spec_level_edits():
    """The compact form splices in the spec-level edits' JSON, remembered by value: a spec with
    other edits (or none) never gets the JSON of edits seen before."""
    base = _full_spec()
    variants = [
        base,
        Spec(cdi_version=base.cdi_version, kind=base.kind, devices=base.devices),
        Spec(cdi_version=base.cdi_version, kind=base.kind, devices=base.devices, container_edits=FULL_EDITS),
        Spec(
            cdi_version=base.cdi_version,
            kind=base.kind,
            devices=base.devices,
            container_edits=ContainerEdits(env=["Ü=ü"]),
        ),
        base,
    ]
    for spec in variants:
        text = spec.to_json(compact=True)
        assert text == json.dumps(spec.to_dict(), separators=(",", ":"), ensure_ascii=False) + "\n"
        assert Spec.from_json(text) == spec


def test_empty_and_unset_fields_are_omitted():
    spec = Spec(
        cdi_version="0.3.0",
        kind="v/c",
        devices=[Device(name="d", container_edits=ContainerEdits(device_nodes=[DeviceNode(path="/dev/x")]))],
    )
    assert spec.to_dict() == {
        "cdiVersion": "0.3.0",
        "kind": "v/c",
        "devices": [{"name": "d", "containerEdits": {"deviceNodes": [{"path": "/dev/x"}]}}],
    }


def test_zero_integers_are_kept_because_uid_zero_is_root():
    node = DeviceNode(path="/dev/x", uid=0, gid=0, major=0, minor=0, file_mode=0)
    assert node.to_dict() == {"path": "/dev/x", "uid": 0, "gid": 0, "major": 0, "minor": 0, "fileMode": 0}


def test_empty_schemata_stays_apart_from_absent():
    present = IntelRdt(clos_id="c", schemata=[])
    assert present.to_dict() == {"closID": "c", "schemata": []}
    assert IntelRdt.from_dict({"closID": "c", "schemata": []}) == present
    assert IntelRdt.from_dict({"closID": "c"}).schemata is None


def test_lists_and_tuples_compare_equal():
    assert ContainerEdits(env=["A=1"]) == ContainerEdits(env=("A=1",))


def test_null_reads_as_absent_like_go():
    spec = Spec.from_dict({"cdiVersion": "0.3.0", "kind": "v/c", "annotations": None, "containerEdits": None,
                           "devices": [{"name": "d", "containerEdits": {"env": ["A=1"], "mounts": None}}]})  # fmt: skip
    assert spec.annotations == {} and spec.container_edits == ContainerEdits()
    assert spec.devices[0].container_edits == ContainerEdits(env=["A=1"])


def _doc(**edits: object) -> dict:
    return {"cdiVersion": "0.3.0", "kind": "v/c", "devices": [{"name": "d", "containerEdits": edits}]}


@pytest.mark.parametrize(
    ("doc", "field", "words"),
    [
        ([], "", "expected a JSON object, got array"),
        ({"cdiVersion": "0.3.0", "kind": "v/c"}, "devices", "required"),
        ({"kind": "v/c", "devices": []}, "cdiVersion", "required"),
        ({"cdiVersion": "0.3.0", "kind": "v/c", "devices": [], "extra": 1}, "extra", "unknown field"),
        ({"cdiVersion": "0.3.0", "kind": "v/c", "devices": [{"name": "d"}]}, "devices[0].containerEdits", "required"),
        ({"cdiVersion": "0.3.0", "kind": "v/c", "devices": [{"containerEdits": {}}]}, "devices[0].name", "required"),
        ({"cdiVersion": 3, "kind": "v/c", "devices": []}, "cdiVersion", "expected a string, got integer"),
        (_doc(evn=["A=1"]), "devices[0].containerEdits.evn", "unknown field"),
        (_doc(env="A=1"), "devices[0].containerEdits.env", "expected a JSON array, got string"),
        (_doc(env=["A=1", 2]), "devices[0].containerEdits.env[1]", "expected a string, got integer"),
        (_doc(additionalGIDs=[1]), "devices[0].containerEdits.additionalGIDs", "unknown field"),
        (_doc(additionalGids=[-1]), "devices[0].containerEdits.additionalGids[0]", "out of range"),
        (_doc(additionalGids=[2**32]), "devices[0].containerEdits.additionalGids[0]", "out of range"),
        (_doc(additionalGids=[True]), "devices[0].containerEdits.additionalGids[0]", "got boolean"),
        (_doc(deviceNodes=[{"path": "/dev/x", "major": 1.0}]), "devices[0].containerEdits.deviceNodes[0].major", "got number"),
        (_doc(deviceNodes=[{"path": "/dev/x", "uid": -1}]), "devices[0].containerEdits.deviceNodes[0].uid", "out of range"),
        (_doc(deviceNodes=[{"Path": "/dev/x"}]), "devices[0].containerEdits.deviceNodes[0].Path", "unknown field"),
        (_doc(deviceNodes=[{"hostPath": "/dev/x"}]), "devices[0].containerEdits.deviceNodes[0].path", "required"),
        (_doc(mounts=[{"hostPath": "/a"}]), "devices[0].containerEdits.mounts[0].containerPath", "required"),
        (_doc(hooks=[{"hookName": "prestart", "path": "/x", "timeout": "5"}]), "devices[0].containerEdits.hooks[0].timeout", "got string"),
        (_doc(intelRdt={"closID": "c", "enableCMT": True}), "devices[0].containerEdits.intelRdt.enableCMT", "unknown field"),
        (_doc(intelRdt={"enableMonitoring": "yes"}), "devices[0].containerEdits.intelRdt.enableMonitoring", "expected a boolean"),
        (_doc(netDevices=[{"hostInterfaceName": "eth1"}]), "devices[0].containerEdits.netDevices[0].name", "required"),
        ({"cdiVersion": "0.6.0", "kind": "v/c", "annotations": {"a": 1}, "devices": []}, 'annotations["a"]', "got integer"),
    ],
)  # fmt: skip
def test_parsing_is_strict_and_names_the_field(doc: object, field: str, words: str):
    with pytest.raises(SpecError) as e:
        Spec.from_dict(doc)
    assert e.value.field == field
    assert words in str(e.value)


def test_invalid_json_is_a_spec_error():
    with pytest.raises(SpecError, match="not valid JSON"):
        Spec.from_json('{"cdiVersion": ')
    with pytest.raises(SpecError, match="not valid JSON"):
        Spec.from_json(b"\xff\xfe")


def test_qualified_names():
    assert qualified_name("k8s.tandem.example.org", "claim", "uid-gpu-0") == "k8s.tandem.example.org/claim=uid-gpu-0"
    q = parse_qualified_name("nvidia.com/gpu=0")
    assert (q.vendor, q.class_, q.name, q.kind, str(q)) == (
        "nvidia.com",
        "gpu",
        "0",
        "nvidia.com/gpu",
        "nvidia.com/gpu=0",
    )


VENDOR_OR_CLASS_VALID = ["a", "Z", "a1", "a-b", "a_b", "a.b", "k8s.tandem.example.org", "A.b-c_d9", "aB"]
VENDOR_OR_CLASS_INVALID = [
    "",
    "1a",
    "-a",
    "_a",
    ".a",
    "a-",
    "a_",
    "a.",
    "a/b",
    "a b",
    "a=b",
    "a:b",
    "é",
    "a\n",
    "a\u0131",
]
DEVICE_VALID = ["0", "a", "gpu0", "0a", "a:b", "a.b", "a-b", "a_b", "7f1c9e2a-51d3-pci-0000:8a:00.0", "A9"]
DEVICE_INVALID = ["", "-a", "a-", ":a", "a:", "_a", "a_", ".a", "a.", "a/b", "a=b", "a b", "a\n", "ä"]


@pytest.mark.parametrize("name", VENDOR_OR_CLASS_VALID)
def test_valid_vendor_and_class(name: str):
    validate_vendor_name(name)
    validate_class_name(name)


@pytest.mark.parametrize("name", VENDOR_OR_CLASS_INVALID)
def test_invalid_vendor_and_class(name: str):
    with pytest.raises(SpecError):
        validate_vendor_name(name)
    with pytest.raises(SpecError):
        validate_class_name(name)


@pytest.mark.parametrize("name", DEVICE_VALID)
def test_valid_device_name(name: str):
    validate_device_name(name)


@pytest.mark.parametrize("name", DEVICE_INVALID)
def test_invalid_device_name(name: str):
    with pytest.raises(SpecError):
        validate_device_name(name)


@pytest.mark.parametrize(
    ("device", "words"),
    [
        ("/dev/nvidia0", "device path"),
        ("nvidia.com/gpu", "expected vendor/class=name"),
        ("=0", "expected vendor/class=name"),
        ("nvidia.com/gpu=", "expected vendor/class=name"),
        ("nvidia.com=0", "missing '/' between vendor and class"),
        ("/gpu=0", "device path"),
        ("nvidia.com/=0", "missing class"),
        ("nvidia.com/gpu/device=0", "invalid class 'gpu/device'"),
        ("v/c=a=b", "invalid device name 'a=b'"),
        ("1v/c=0", "invalid vendor"),
    ],
)
def test_parse_rejects_what_the_go_parser_rejects(device: str, words: str):
    with pytest.raises(SpecError, match=words):
        parse_qualified_name(device)


def test_a_spec_names_its_devices_for_the_runtime():
    spec = Spec("0.3.0", "k8s.tandem.example.org/claim", [Device("a", ContainerEdits()), Device("b", ContainerEdits())])
    assert spec.qualified_names() == ["k8s.tandem.example.org/claim=a", "k8s.tandem.example.org/claim=b"]
    assert [str(parse_qualified_name(n)) for n in spec.qualified_names()] == spec.qualified_names()


@pytest.mark.parametrize(
    ("kind", "ok"),
    [
        ("nvidia.com/gpu", True),
        ("v/c.d", True),
        ("v", False),
        ("v/", False),
        ("/c", False),
        ("v/c/d", False),
        ("v-/c", False),
    ],
)
def test_validate_kind(kind: str, ok: bool):
    if ok:
        validate_kind(kind)
    else:
        with pytest.raises(SpecError):
            validate_kind(kind)


def test_qualified_name_validates_its_parts():
    with pytest.raises(SpecError, match="invalid device name"):
        qualified_name("v", "c", "-x")
    with pytest.raises(SpecError, match="invalid class"):
        qualified_name("v", "gpu/x", "x")


def test_json_output_is_plain_utf8_json():
    spec = _full_spec()
    assert json.loads(spec.to_json()) == spec.to_dict()
    assert spec.to_json().endswith("}\n")
