"""The generated kubelet APIs match the wire contract (docs/reference/kubelet-plugin.md, 'Wire protocol') field by field.

hack/verify-proto.sh only proves that the generated code matches proto/; these tests prove that
proto/ matches upstream, so an edited proto (renamed package, renumbered field) fails here. The
expected tables are written out by hand from the contract on purpose.
"""

from __future__ import annotations

from types import ModuleType

import pytest
from google.protobuf.descriptor import Descriptor, FieldDescriptor, FileDescriptor

from driver.kubelet.api.dra.v1 import api_pb2 as dra_v1
from driver.kubelet.api.dra.v1beta1 import api_pb2 as dra_v1beta1
from driver.kubelet.api.dra_health.v1 import api_pb2 as health_v1
from driver.kubelet.api.dra_health.v1alpha1 import api_pb2 as health_v1alpha1
from driver.kubelet.api.pluginregistration.v1 import api_pb2 as reg_v1

_SCALARS = {
    FieldDescriptor.TYPE_STRING: "string",
    FieldDescriptor.TYPE_BOOL: "bool",
    FieldDescriptor.TYPE_INT64: "int64",
}

# message -> field -> (number, type as the contract table writes it)
DRA_V1_MESSAGES: dict[str, dict[str, tuple[int, str]]] = {
    "NodePrepareResourcesRequest": {"claims": (1, "repeated Claim")},
    "NodePrepareResourcesResponse": {"claims": (1, "map<string, NodePrepareResourceResponse>")},
    "NodePrepareResourceResponse": {"devices": (1, "repeated Device"), "error": (2, "string")},
    "Device": {
        "request_names": (1, "repeated string"),
        "pool_name": (2, "string"),
        "device_name": (3, "string"),
        "cdi_device_ids": (4, "repeated string"),
        "share_id": (5, "optional string"),
    },
    "NodeUnprepareResourcesRequest": {"claims": (1, "repeated Claim")},
    "NodeUnprepareResourcesResponse": {"claims": (1, "map<string, NodeUnprepareResourceResponse>")},
    "NodeUnprepareResourceResponse": {"error": (1, "string")},
    "Claim": {"namespace": (1, "string"), "uid": (2, "string"), "name": (3, "string")},
}
DRA_V1BETA1_MESSAGES = {
    **DRA_V1_MESSAGES,
    "Device": {k: v for k, v in DRA_V1_MESSAGES["Device"].items() if k != "share_id"},
}
REGISTRATION_MESSAGES: dict[str, dict[str, tuple[int, str]]] = {
    "InfoRequest": {},
    "PluginInfo": {
        "type": (1, "string"),
        "name": (2, "string"),
        "endpoint": (3, "string"),
        "supported_versions": (4, "repeated string"),
    },
    "RegistrationStatus": {"plugin_registered": (1, "bool"), "error": (2, "string")},
    "RegistrationStatusResponse": {},
}
HEALTH_MESSAGES: dict[str, dict[str, tuple[int, str]]] = {
    "NodeWatchResourcesRequest": {},
    "DeviceIdentifier": {"pool_name": (1, "string"), "device_name": (2, "string")},
    "DeviceHealth": {
        "device": (1, "DeviceIdentifier"),
        "health": (2, "HealthStatus"),
        "last_updated_time": (3, "int64"),
        "health_check_timeout_seconds": (4, "int64"),
        "message": (5, "string"),
    },
    "NodeWatchResourcesResponse": {"devices": (1, "repeated DeviceHealth")},
}

# (package, messages, service, {method: (input, output, server_streaming)})
API_CASES = {
    "dra v1": (
        dra_v1,
        "k8s.io.kubelet.pkg.apis.dra.v1",
        DRA_V1_MESSAGES,
        "DRAPlugin",
        {
            "NodePrepareResources": ("NodePrepareResourcesRequest", "NodePrepareResourcesResponse", False),
            "NodeUnprepareResources": (
                "NodeUnprepareResourcesRequest",
                "NodeUnprepareResourcesResponse",
                False,
            ),
        },
    ),
    "dra v1beta1": (
        dra_v1beta1,
        "k8s.io.kubelet.pkg.apis.dra.v1beta1",
        DRA_V1BETA1_MESSAGES,
        "DRAPlugin",
        {
            "NodePrepareResources": ("NodePrepareResourcesRequest", "NodePrepareResourcesResponse", False),
            "NodeUnprepareResources": (
                "NodeUnprepareResourcesRequest",
                "NodeUnprepareResourcesResponse",
                False,
            ),
        },
    ),
    "pluginregistration v1": (
        reg_v1,
        "pluginregistration",
        REGISTRATION_MESSAGES,
        "Registration",
        {
            "GetInfo": ("InfoRequest", "PluginInfo", False),
            "NotifyRegistrationStatus": ("RegistrationStatus", "RegistrationStatusResponse", False),
        },
    ),
    "dra-health v1": (
        health_v1,
        "v1",
        HEALTH_MESSAGES,
        "DRAResourceHealth",
        {"NodeWatchResources": ("NodeWatchResourcesRequest", "NodeWatchResourcesResponse", True)},
    ),
    "dra-health v1alpha1": (
        health_v1alpha1,
        "v1alpha1",
        HEALTH_MESSAGES,
        "DRAResourceHealth",
        {"NodeWatchResources": ("NodeWatchResourcesRequest", "NodeWatchResourcesResponse", True)},
    ),
}


def _type_name(field: FieldDescriptor) -> str:
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        return field.message_type.name
    if field.type == FieldDescriptor.TYPE_ENUM:
        return field.enum_type.name
    return _SCALARS[field.type]


def _describe(field: FieldDescriptor) -> tuple[int, str]:
    """A field written the way the contract table (and a .proto file) writes it."""
    message = field.message_type
    if message is not None and message.GetOptions().map_entry:
        key, value = message.fields_by_name["key"], message.fields_by_name["value"]
        return field.number, f"map<{_type_name(key)}, {_type_name(value)}>"
    if field.is_repeated:
        return field.number, f"repeated {_type_name(field)}"
    if message is None and field.has_presence:
        return field.number, f"optional {_type_name(field)}"
    return field.number, _type_name(field)


def _fields(message: Descriptor) -> dict[str, tuple[int, str]]:
    return {f.name: _describe(f) for f in message.fields}


@pytest.mark.parametrize("api", API_CASES)
def test_package_messages_and_fields_match_contract(api: str) -> None:
    module, package, messages, _, _ = API_CASES[api]
    file: FileDescriptor = module.DESCRIPTOR
    assert file.package == package
    assert set(file.message_types_by_name) == set(messages)
    for name, fields in messages.items():
        assert _fields(file.message_types_by_name[name]) == fields, name


@pytest.mark.parametrize("api", API_CASES)
def test_service_and_methods_match_contract(api: str) -> None:
    module, package, _, service_name, methods = API_CASES[api]
    file: FileDescriptor = module.DESCRIPTOR
    assert list(file.services_by_name) == [service_name]
    service = file.services_by_name[service_name]
    assert service.full_name == f"{package}.{service_name}"
    actual = {
        m.name: (m.input_type.full_name, m.output_type.full_name, m.client_streaming, m.server_streaming)
        for m in service.methods
    }
    expected = {
        name: (f"{package}.{req}", f"{package}.{resp}", False, streaming)
        for name, (req, resp, streaming) in methods.items()
    }
    assert actual == expected


def test_wire_paths() -> None:
    """The strings the kubelet actually puts on the wire (and advertises, for health)."""
    paths = {
        f"/{m.containing_service.full_name}/{m.name}"
        for module in (dra_v1, dra_v1beta1, reg_v1, health_v1, health_v1alpha1)
        for service in module.DESCRIPTOR.services_by_name.values()
        for m in service.methods
    }
    assert paths == {
        "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources",
        "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodeUnprepareResources",
        "/k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin/NodePrepareResources",
        "/k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin/NodeUnprepareResources",
        "/pluginregistration.Registration/GetInfo",
        "/pluginregistration.Registration/NotifyRegistrationStatus",
        "/v1.DRAResourceHealth/NodeWatchResources",
        "/v1alpha1.DRAResourceHealth/NodeWatchResources",
    }


@pytest.mark.parametrize("module", [health_v1, health_v1alpha1], ids=["v1", "v1alpha1"])
def test_health_status_enum(module: ModuleType) -> None:
    enum = module.DESCRIPTOR.enum_types_by_name["HealthStatus"]
    assert {v.name: v.number for v in enum.values} == {"UNKNOWN": 0, "HEALTHY": 1, "UNHEALTHY": 2}


def test_share_id_has_presence_in_v1_only() -> None:
    device = dra_v1.Device(pool_name="p", device_name="d")
    assert not device.HasField("share_id")
    device.share_id = ""
    assert device.HasField("share_id"), "an empty share ID must still be distinguishable from none"
    assert "share_id" not in dra_v1beta1.Device.DESCRIPTOR.fields_by_name


def test_descriptor_file_names_are_distinct_and_path_qualified() -> None:
    names = [m.DESCRIPTOR.name for m in (dra_v1, dra_v1beta1, reg_v1, health_v1, health_v1alpha1)]
    assert len(set(names)) == len(names)
    assert all(name.startswith("driver/kubelet/api/") for name in names), names
