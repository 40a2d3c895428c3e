"""What the writer emits satisfies an independent, strict JSON schema of the CDI 1.1.0 format.

The upstream schema (docs/reference/cdi.md, 'JSON schema') is too weak to catch a writer's mistakes (no
``additionalProperties: false``, no name patterns, a broken ``env`` item), so, as docs/reference/cdi.md advises,
this is a stricter one written from the reference tables. It checks the Python model from the
outside: a misspelt key, a wrong type or an unknown version in the emitted JSON fails it.
"""

from __future__ import annotations

import copy

import jsonschema
import pytest

from cdi import KNOWN_VERSIONS, ContainerEdits, Device, DeviceNode, Hook, IntelRdt, Mount, NetDevice, make_spec

UINT32 = {"type": "integer", "minimum": 0, "maximum": 2**32 - 1}
INT64 = {"type": "integer", "minimum": -(2**63), "maximum": 2**63 - 1}
STRINGS = {"type": "array", "items": {"type": "string"}}
ENV = {"type": "array", "items": {"type": "string", "pattern": "^[^=]+="}}
ANNOTATIONS = {"type": "object", "additionalProperties": {"type": "string"}}
NAME = "^[A-Za-z]([A-Za-z0-9_.-]*[A-Za-z0-9])?"


def _object(required: list[str], **properties: object) -> dict:
    return {"type": "object", "required": required, "properties": properties, "additionalProperties": False}


EDITS = _object(
    [],
    env=ENV,
    deviceNodes={"type": "array", "items": _object(
        ["path"], path={"type": "string", "pattern": "^/"}, hostPath={"type": "string", "pattern": "^/"},
        type={"enum": ["b", "c", "u", "p"]}, major=INT64, minor=INT64, fileMode=UINT32,
        permissions={"type": "string", "pattern": "^[rwm]+$"}, uid=UINT32, gid=UINT32,
    )},
    mounts={"type": "array", "items": _object(
        ["hostPath", "containerPath"], hostPath={"type": "string", "minLength": 1},
        containerPath={"type": "string", "pattern": "^/"}, options=STRINGS, type={"type": "string", "minLength": 1},
    )},
    hooks={"type": "array", "items": _object(
        ["hookName", "path"],
        hookName={"enum": ["prestart", "createRuntime", "createContainer", "startContainer", "poststart", "poststop"]},
        path={"type": "string", "pattern": "^/"}, args=STRINGS, env=ENV, timeout={"type": "integer", "minimum": 1},
    )},
    netDevices={"type": "array", "items": _object(
        ["hostInterfaceName", "name"], hostInterfaceName={"type": "string", "minLength": 1},
        name={"type": "string", "minLength": 1},
    )},
    intelRdt=_object(
        [], closID={"type": "string"}, l3CacheSchema={"type": "string"}, memBwSchema={"type": "string"},
        schemata=STRINGS, enableMonitoring={"type": "boolean"},
    ),
    additionalGids={"type": "array", "items": UINT32},
)  # fmt: skip

SCHEMA = {
    "$schema": "http://json-schema.org/draft-07/schema#",
    **_object(
        ["cdiVersion", "kind", "devices"],
        cdiVersion={"enum": list(KNOWN_VERSIONS)},
        kind={"type": "string", "pattern": f"{NAME}/{NAME[1:]}$"},
        annotations=ANNOTATIONS,
        devices={"type": "array", "minItems": 1, "items": _object(
            ["name", "containerEdits"],
            name={"type": "string", "pattern": "^[A-Za-z0-9]([A-Za-z0-9_.:-]*[A-Za-z0-9])?$"},
            annotations=ANNOTATIONS,
            containerEdits={**EDITS, "minProperties": 1},
        )},
        containerEdits={**EDITS, "minProperties": 1},
    ),
}  # fmt: skip

FULL = ContainerEdits(
    env=["A=1"],
    device_nodes=[DeviceNode("/dev/nvidia0", "/dev/nvidia0", "c", 195, 0, 0o666, "rw", 0, 0)],
    mounts=[Mount("/usr/lib/x", "/usr/lib/x", ["ro", "bind"], "bind")],
    hooks=[Hook("createContainer", "/usr/bin/hook", ["hook"], ["B=2"], 5)],
    net_devices=[NetDevice("ens5f0v2", "net1")],
    intel_rdt=IntelRdt("c1", "L3:0=f", "MB:0=50", ["L2:0=3"], True),
    additional_gids=[44],
)

SPECS = {
    "rdma-claim": make_spec("k8s.tandem.example.org/claim", [Device(
        "7f1c9e2a-51d3-4c3e-9b61-0c2f3a5d8e11-pci-0000-8a-00-0",
        ContainerEdits(env=["TANDEM_RDMA_DEVICE=mlx5_3"], device_nodes=[
            DeviceNode("/dev/infiniband/uverbs3", type="c", permissions="rw"),
            DeviceNode("/dev/infiniband/rdma_cm", type="c", permissions="rw"),
        ]),
    )]),
    "every-field": make_spec(
        "k8s.tandem.example.org/claim", [Device("gpu0", FULL, {"tandem.example.org/x": "y"})],
        container_edits=ContainerEdits(env=["COMMON=1"]), annotations={"owner": "tandem"},
    ),
}  # fmt: skip


@pytest.fixture(scope="module")
def validator() -> jsonschema.Draft7Validator:
    jsonschema.Draft7Validator.check_schema(SCHEMA)
    return jsonschema.Draft7Validator(SCHEMA)


@pytest.mark.parametrize("name", SPECS)
def test_written_specs_satisfy_the_strict_schema(validator: jsonschema.Draft7Validator, name: str):
    validator.validate(SPECS[name].to_dict())


def test_the_schema_catches_a_misspelt_key(validator: jsonschema.Draft7Validator):
    """Guards the guard: if the schema accepted anything, the test above would prove nothing."""
    doc = copy.deepcopy(SPECS["every-field"].to_dict())
    doc["devices"][0]["containerEdits"]["additionalGIDs"] = doc["devices"][0]["containerEdits"].pop("additionalGids")
    assert not validator.is_valid(doc)
