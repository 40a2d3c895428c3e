"""Typed model of a CDI spec and its exact JSON form.

Serialisation emits the camelCase keys of the Go ``specs-go`` types and omits every empty or unset
optional field, because runtimes vendoring an older library reject keys they do not know and an
empty key costs nothing to leave out.

Parsing (`Spec.from_dict` / `Spec.from_json`) is strict everywhere, like the Go loader, which
decodes with unknown fields disallowed: an unknown key anywhere, at the top level or inside a
device, containerEdits, deviceNode, mount, hook, intelRdt or netDevice, makes the whole file
fail, so there is no place where a runtime tolerates an unknown key and none where we do.
Two deliberate differences from Go: keys must match their exact camelCase spelling (Go's JSON
decoder matches case-insensitively, which would hide a misspelt writer), and ``null`` is read as
"absent" for every field (as Go reads it) but a present value must have the right JSON type
(no floats for integers, no booleans for integers, integers within the Go type's range).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from cdi.decode import (
    INT64,
    UINT32,
    boolean,
    integer,
    items,
    object_fields,
    string,
    string_list,
    string_map,
    uint32_item,
)
from cdi.errors import SpecError, join


def _freeze(obj: object, **fields: Any) -> None:
    """Store normalised values on a frozen dataclass, so that equality does not depend on whether the
    caller passed lists or tuples (a round-tripped spec must compare equal to the one written)."""
    for name, value in fields.items():
        object.__setattr__(obj, name, value)


@dataclass(frozen=True)
class DeviceNode:
    """``hostPath`` (0.5.0) defaults to ``path``; ``permissions`` empty means ``rwm`` to the runtime."""

    path: str
    host_path: str = ""
    type: str = ""
    major: int | None = None
    minor: int | None = None
    file_mode: int | None = None
    permissions: str = ""
    uid: int | None = None
    gid: int | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"path": self.path}
        _put(out, "hostPath", self.host_path)
        _put(out, "type", self.type)
        _put_int(out, "major", self.major)
        _put_int(out, "minor", self.minor)
        _put_int(out, "fileMode", self.file_mode)
        _put(out, "permissions", self.permissions)
        _put_int(out, "uid", self.uid)
        _put_int(out, "gid", self.gid)
        return out

    @classmethod
    def from_dict(cls, raw: object, path: str = "") -> DeviceNode:
        obj = object_fields(
            raw, path, ("path", "hostPath", "type", "major", "minor", "fileMode", "permissions", "uid", "gid")
        )
        return cls(
            path=string(obj, "path", path, required=True),
            host_path=string(obj, "hostPath", path),
            type=string(obj, "type", path),
            major=integer(obj, "major", path, INT64),
            minor=integer(obj, "minor", path, INT64),
            file_mode=integer(obj, "fileMode", path, UINT32),
            permissions=string(obj, "permissions", path),
            uid=integer(obj, "uid", path, UINT32),
            gid=integer(obj, "gid", path, UINT32),
        )


@dataclass(frozen=True)
class Mount:
    """``type`` (0.4.0) is the filesystem type; bind mounts use ``bind`` or leave it empty and pass ``bind`` as option."""

    host_path: str
    container_path: str
    options: tuple[str, ...] = ()
    type: str = ""

    def __post_init__(self) -> None:
        _freeze(self, options=tuple(self.options))

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"hostPath": self.host_path, "containerPath": self.container_path}
        _put(out, "options", list(self.options))
        _put(out, "type", self.type)
        return out

    @classmethod
    def from_dict(cls, raw: object, path: str = "") -> Mount:
        obj = object_fields(raw, path, ("hostPath", "containerPath", "options", "type"))
        return cls(
            host_path=string(obj, "hostPath", path, required=True),
            container_path=string(obj, "containerPath", path, required=True),
            options=string_list(obj, "options", path),
            type=string(obj, "type", path),
        )


@dataclass(frozen=True)
class Hook:
    """An OCI hook; ``args`` is the full argv including argv[0]."""

    hook_name: str
    path: str
    args: tuple[str, ...] = ()
    env: tuple[str, ...] = ()
    timeout: int | None = None

    def __post_init__(self) -> None:
        _freeze(self, args=tuple(self.args), env=tuple(self.env))

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"hookName": self.hook_name, "path": self.path}
        _put(out, "args", list(self.args))
        _put(out, "env", list(self.env))
        _put_int(out, "timeout", self.timeout)
        return out

    @classmethod
    def from_dict(cls, raw: object, path: str = "") -> Hook:
        obj = object_fields(raw, path, ("hookName", "path", "args", "env", "timeout"))
        return cls(
            hook_name=string(obj, "hookName", path, required=True),
            path=string(obj, "path", path, required=True),
            args=string_list(obj, "args", path),
            env=string_list(obj, "env", path),
            timeout=integer(obj, "timeout", path, INT64),
        )


@dataclass(frozen=True)
class IntelRdt:
    """Intel RDT class of service (0.7.0).

    ``schemata`` keeps ``None`` (absent) apart from ``()`` (present but empty) because Go raises
    the minimum version to 1.1.0 for any non-nil list, so the distinction survives a round trip.
    """

    clos_id: str = ""
    l3_cache_schema: str = ""
    mem_bw_schema: str = ""
    schemata: tuple[str, ...] | None = None
    enable_monitoring: bool = False

    def __post_init__(self) -> None:
        _freeze(self, schemata=None if self.schemata is None else tuple(self.schemata))

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        _put(out, "closID", self.clos_id)
        _put(out, "l3CacheSchema", self.l3_cache_schema)
        _put(out, "memBwSchema", self.mem_bw_schema)
        if self.schemata is not None:
            out["schemata"] = list(self.schemata)
        _put(out, "enableMonitoring", self.enable_monitoring)
        return out

    @classmethod
    def from_dict(cls, raw: object, path: str = "") -> IntelRdt:
        obj = object_fields(raw, path, ("closID", "l3CacheSchema", "memBwSchema", "schemata", "enableMonitoring"))
        return cls(
            clos_id=string(obj, "closID", path),
            l3_cache_schema=string(obj, "l3CacheSchema", path),
            mem_bw_schema=string(obj, "memBwSchema", path),
            schemata=string_list(obj, "schemata", path) if "schemata" in obj else None,
            enable_monitoring=boolean(obj, "enableMonitoring", path),
        )


@dataclass(frozen=True)
class NetDevice:
    """A host network interface the OCI runtime moves into the container and renames (1.1.0)."""

    host_interface_name: str
    name: str

    def to_dict(self) -> dict[str, Any]:
        return {"hostInterfaceName": self.host_interface_name, "name": self.name}

    @classmethod
    def from_dict(cls, raw: object, path: str = "") -> NetDevice:
        obj = object_fields(raw, path, ("hostInterfaceName", "name"))
        return cls(
            host_interface_name=string(obj, "hostInterfaceName", path, required=True),
            name=string(obj, "name", path, required=True),
        )


@dataclass(frozen=True)
class ContainerEdits:
    env: tuple[str, ...] = ()
    device_nodes: tuple[DeviceNode, ...] = ()
    mounts: tuple[Mount, ...] = ()
    hooks: tuple[Hook, ...] = ()
    net_devices: tuple[NetDevice, ...] = ()
    intel_rdt: IntelRdt | None = None
    additional_gids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        _freeze(
            self,
            env=tuple(self.env),
            device_nodes=tuple(self.device_nodes),
            mounts=tuple(self.mounts),
            hooks=tuple(self.hooks),
            net_devices=tuple(self.net_devices),
            additional_gids=tuple(self.additional_gids),
        )

    def is_empty(self) -> bool:
        """Go's rule: no entry in any list and no intelRdt. A list holding only gid 0 still counts as an edit."""
        return self.intel_rdt is None and not (
            self.env or self.device_nodes or self.mounts or self.hooks or self.net_devices or self.additional_gids
        )

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        _put(out, "env", list(self.env))
        _put(out, "deviceNodes", [d.to_dict() for d in self.device_nodes])
        _put(out, "netDevices", [n.to_dict() for n in self.net_devices])
        _put(out, "hooks", [h.to_dict() for h in self.hooks])
        _put(out, "mounts", [m.to_dict() for m in self.mounts])
        if self.intel_rdt is not None:
            out["intelRdt"] = self.intel_rdt.to_dict()
        _put(out, "additionalGids", list(self.additional_gids))
        return out

    @classmethod
    def from_dict(cls, raw: object, path: str = "") -> ContainerEdits:
        obj = object_fields(
            raw, path, ("env", "deviceNodes", "mounts", "hooks", "netDevices", "intelRdt", "additionalGids")
        )
        rdt = obj.get("intelRdt")
        return cls(
            env=string_list(obj, "env", path),
            device_nodes=items(obj, "deviceNodes", path, DeviceNode.from_dict),
            mounts=items(obj, "mounts", path, Mount.from_dict),
            hooks=items(obj, "hooks", path, Hook.from_dict),
            net_devices=items(obj, "netDevices", path, NetDevice.from_dict),
            intel_rdt=None if rdt is None else IntelRdt.from_dict(rdt, join(path, "intelRdt")),
            additional_gids=items(obj, "additionalGids", path, uint32_item),
        )


@dataclass(frozen=True)
class Device:
    name: str
    container_edits: ContainerEdits
    annotations: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _freeze(self, annotations=dict(self.annotations))

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name}
        _put(out, "annotations", dict(self.annotations))
        out["containerEdits"] = self.container_edits.to_dict()
        return out

    @classmethod
    def from_dict(cls, raw: object, path: str = "") -> Device:
        obj = object_fields(raw, path, ("name", "annotations", "containerEdits"))
        if obj.get("containerEdits") is None:
            raise SpecError(join(path, "containerEdits"), "required field is missing")
        return cls(
            name=string(obj, "name", path, required=True),
            container_edits=ContainerEdits.from_dict(obj["containerEdits"], join(path, "containerEdits")),
            annotations=string_map(obj, "annotations", path),
        )


@dataclass(frozen=True)
class Spec:
    """One CDI spec file: a ``vendor/class`` kind, its devices and edits shared by all of them.

    Spec-level ``container_edits`` are applied once when any device of the spec is injected.
    """

    cdi_version: str
    kind: str
    devices: tuple[Device, ...]
    container_edits: ContainerEdits = field(default_factory=ContainerEdits)
    annotations: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _freeze(self, devices=tuple(self.devices), annotations=dict(self.annotations))

    def qualified_names(self) -> list[str]:
        """The IDs a runtime resolves against this spec, in device order."""
        return [f"{self.kind}={d.name}" for d in self.devices]

    def to_dict(self, *, edits: bool = True) -> dict[str, Any]:
        """The spec as its JSON file holds it; without `edits`, all but the spec-level edits
        (they come last), for callers that deal with those apart (they are shared by a driver's
        specs, and the costliest part to encode or check)."""
        out: dict[str, Any] = {"cdiVersion": self.cdi_version, "kind": self.kind}
        _put(out, "annotations", dict(self.annotations))
        out["devices"] = [d.to_dict() for d in self.devices]
        if edits:
            _put(out, "containerEdits", self.container_edits.to_dict())
        return out

    def to_json(self, *, compact: bool = False) -> str:
        """Indented by 2, or `compact` as the Go library's ``json.Marshal`` writes it (and several
        times faster: Python's JSON encoder runs in C only without indentation)."""
        if compact:
            head = _compact_json(self.to_dict(edits=False))
            edits = _compact_edits_json(self.container_edits)
            return (f'{head[:-1]},"containerEdits":{edits}}}' if edits != "{}" else head) + "\n"
        return json.dumps(self.to_dict(), indent=2, ensure_ascii=False) + "\n"

    @classmethod
    def from_dict(cls, raw: object) -> Spec:
        obj = object_fields(raw, "", ("cdiVersion", "kind", "annotations", "devices", "containerEdits"))
        edits = obj.get("containerEdits")
        if obj.get("devices") is None:
            raise SpecError("devices", "required field is missing")
        return cls(
            cdi_version=string(obj, "cdiVersion", "", required=True),
            kind=string(obj, "kind", "", required=True),
            devices=items(obj, "devices", "", Device.from_dict),
            container_edits=ContainerEdits() if edits is None else ContainerEdits.from_dict(edits, "containerEdits"),
            annotations=string_map(obj, "annotations", ""),
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> Spec:
        try:
            raw = json.loads(text)
        except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            raise SpecError("", f"not valid JSON: {e}") from None
        return cls.from_dict(raw)


def _compact_json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


@functools.lru_cache(maxsize=16)
def _compact_edits_json_cached(edits: ContainerEdits) -> str:
    return _compact_json(edits.to_dict())


def _compact_edits_json(edits: ContainerEdits) -> str:
    """Spec-level edits as compact JSON, remembered by value for the last few seen: a driver's
    specs share them (control device nodes, dozens of driver-file mounts), and encoding them is
    most of the cost of encoding a spec."""
    try:
        return _compact_edits_json_cached(edits)
    except TypeError:  # a value of the wrong type can be unhashable: encode it uncached
        return _compact_json(edits.to_dict())


def _put(out: dict[str, Any], key: str, value: Any) -> None:
    """Omit empty strings, lists, maps and false: the Go writer's ``omitempty``."""
    if value:
        out[key] = value


def _put_int(out: dict[str, Any], key: str, value: int | None) -> None:
    """Integers are pointers or meaningful at zero (uid 0 is root), so only ``None`` is omitted."""
    if value is not None:
        out[key] = value
