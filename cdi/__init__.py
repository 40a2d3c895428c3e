"""Container Device Interface (CDI) specs: model, names, validation, minimum version, atomic files.

A standalone library (it imports nothing of `driver`) that writes what the Go reference library,
vendored by containerd, CRI-O and podman, loads: exact camelCase JSON, names that pass the Go
parser, the lowest ``cdiVersion`` the content needs (so that old runtimes such as Debian 12's
podman 4.3.1, which knows only up to 0.5.0, still load it) and atomic file replacement.
"""

from cdi.errors import SpecError
from cdi.files import atomic_write, fsync_dir, remove_temp_files
from cdi.names import (
    QualifiedName,
    is_dns_label,
    is_dns_subdomain,
    parse_qualified_name,
    qualified_name,
    validate_class_name,
    validate_device_name,
    validate_kind,
    validate_vendor_name,
)
from cdi.spec import ContainerEdits, Device, DeviceNode, Hook, IntelRdt, Mount, NetDevice, Spec
from cdi.store import list_specs, read_spec, remove_spec, spec_filename, update_spec, write_spec
from cdi.validate import HOOK_NAMES, problems, validate
from cdi.version import CURRENT_VERSION, KNOWN_VERSIONS, make_spec, minimum_version

__all__ = [
    "CURRENT_VERSION",
    "HOOK_NAMES",
    "KNOWN_VERSIONS",
    "ContainerEdits",
    "Device",
    "DeviceNode",
    "Hook",
    "IntelRdt",
    "Mount",
    "NetDevice",
    "QualifiedName",
    "Spec",
    "SpecError",
    "atomic_write",
    "fsync_dir",
    "is_dns_label",
    "is_dns_subdomain",
    "list_specs",
    "make_spec",
    "minimum_version",
    "parse_qualified_name",
    "problems",
    "qualified_name",
    "read_spec",
    "remove_spec",
    "remove_temp_files",
    "spec_filename",
    "update_spec",
    "validate",
    "validate_class_name",
    "validate_device_name",
    "validate_kind",
    "validate_vendor_name",
    "write_spec",
]
