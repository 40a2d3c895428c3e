"""The checks a runtime applies when it loads a spec (Go ``pkg/cdi``), plus the SPEC's stricter rules.

``strict=False`` is exactly what a runtime enforces: a spec that passes loads, one that fails is
skipped whole and its devices become unresolvable. ``strict=True`` (the default, used before
writing) adds rules the SPEC states but the Go code leaves to the OCI runtime, where breaking them
fails later and less clearly: bare version strings, absolute container paths, hook timeouts > 0,
kernel-valid interface names, and permissions drawn only from ``rwm`` (the literal ``none`` is
accepted by the reference library but is not needed by Tandem, and libraries older than that
rule would reject it).
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable, Iterator, Mapping

from cdi.errors import SpecError, join
from cdi.names import is_dns_subdomain, split_kind, validate_class_name, validate_device_name, validate_vendor_name
from cdi.spec import ContainerEdits, Spec
from cdi.version import minimum_version, version_key

HOOK_NAMES = frozenset({"prestart", "createRuntime", "createContainer", "startContainer", "poststart", "poststop"})
DEVICE_TYPES = frozenset({"", "b", "c", "u", "p"})
ANNOTATIONS_MAX_BYTES = 256 * 1024

_QUALIFIED_NAME_PART = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")
_IFNAMSIZ = 16


def validate(spec: Spec, *, strict: bool = True) -> None:
    """Raise `SpecError` for the first problem, naming its field path; see the module docstring for `strict`."""
    for problem in problems(spec, strict=strict):
        raise problem


def problems(spec: Spec, *, strict: bool = True) -> Iterator[SpecError]:
    """Every problem in load order; a bad type stops the walk because nothing after it can be trusted."""
    raw = spec.to_dict(edits=False)  # the spec-level edits' round trip is `_spec_edits`'
    try:
        Spec.from_dict(raw)
    except SpecError as e:
        yield e
        return
    bad_type, edit_problems = _spec_edits(spec.container_edits, strict)
    if bad_type is not None:
        yield SpecError(*bad_type)
        return
    yield from _version(spec, strict)
    yield from _kind(spec.kind)
    yield from _annotations("annotations", spec.annotations)
    yield from (SpecError(*p) for p in edit_problems)
    if not spec.devices:
        yield SpecError("devices", "a spec needs at least one device")
    seen: set[str] = set()
    for i, device in enumerate(spec.devices):
        path = f"devices[{i}]"
        yield from _wrap(join(path, "name"), validate_device_name, device.name)
        if device.name in seen:
            yield SpecError(join(path, "name"), f"duplicate device name {device.name!r}")
        seen.add(device.name)
        yield from _annotations(join(path, "annotations"), device.annotations)
        if device.container_edits.is_empty():
            yield SpecError(
                join(path, "containerEdits"),
                "a device needs at least one edit (env, deviceNodes, mounts, hooks, netDevices, intelRdt or additionalGids)",
            )
        yield from _edits(join(path, "containerEdits"), device.container_edits, strict)


_Problem = tuple[str, str]  # (field, message) of a SpecError


def _spec_edits(edits: ContainerEdits, strict: bool) -> tuple[_Problem | None, tuple[_Problem, ...]]:
    """The spec-level edits' type problem (their round trip through JSON) and other problems.

    Remembered by value for the last few edits seen: a driver's specs share their spec-level
    edits (its control device nodes and driver files, dozens of mounts), and checking them costs
    more than the rest of a spec. Problems are kept as plain values, never as exception objects
    (a re-raised exception grows its traceback)."""
    try:
        return _spec_edits_cached(edits, strict)
    except TypeError:  # a value of the wrong type can be unhashable: check it uncached
        return _spec_edits_uncached(edits, strict)


def _spec_edits_uncached(edits: ContainerEdits, strict: bool) -> tuple[_Problem | None, tuple[_Problem, ...]]:
    try:
        ContainerEdits.from_dict(edits.to_dict(), "containerEdits")
    except SpecError as e:
        return (e.field, e.message), ()
    return None, tuple((e.field, e.message) for e in _edits("containerEdits", edits, strict))


_spec_edits_cached = functools.lru_cache(maxsize=16)(_spec_edits_uncached)


def _wrap(path: str, check: Callable[[str], None], value: str) -> Iterator[SpecError]:
    try:
        check(value)
    except SpecError as e:
        yield SpecError(path, e.message)


def _version(spec: Spec, strict: bool) -> Iterator[SpecError]:
    try:
        declared = version_key(spec.cdi_version)
    except SpecError as e:
        yield e
        return
    if strict and spec.cdi_version.startswith("v"):
        yield SpecError(
            "cdiVersion", f"write the bare version {spec.cdi_version[1:]!r}; old runtimes know no 'v' prefix"
        )
    needed = minimum_version(spec)
    if declared < version_key(needed):
        yield SpecError("cdiVersion", f"the spec uses features of {needed} but declares {spec.cdi_version}")


def _kind(kind: str) -> Iterator[SpecError]:
    try:
        vendor, class_ = split_kind(kind)
    except SpecError as e:
        yield SpecError("kind", e.message)
        return
    yield from _wrap("kind", validate_vendor_name, vendor)
    yield from _wrap("kind", validate_class_name, class_)


def _annotations(path: str, annotations: Mapping[str, str]) -> Iterator[SpecError]:
    """Kubernetes qualified-name rules on the lower-cased key, and a size limit on keys plus values."""
    for key in annotations:
        reason = _qualified_name_problem(key.lower())
        if reason:
            yield SpecError(f"{path}[{json.dumps(key)}]", f"invalid annotation key: {reason}")
    size = sum(len(k.encode()) + len(v.encode()) for k, v in annotations.items())
    if size > ANNOTATIONS_MAX_BYTES:
        yield SpecError(path, f"annotations take {size} bytes, more than the limit of {ANNOTATIONS_MAX_BYTES}")


def _qualified_name_problem(key: str) -> str:
    parts = key.split("/")
    if len(parts) > 2:
        return "at most one '/' is allowed"
    name = parts[-1]
    if len(parts) == 2:
        prefix = parts[0]
        if not prefix:
            return "the prefix before '/' must be non-empty"
        if not is_dns_subdomain(prefix):
            return "the prefix must be a DNS subdomain (lower-case labels joined by '.', at most 253 characters)"
    if not name:
        return "the name part must be non-empty"
    if len(name) > 63:
        return "the name part must be at most 63 characters"
    if not _QUALIFIED_NAME_PART.fullmatch(name):
        return "the name part must start and end with a letter or digit and contain only [-A-Za-z0-9_.]"
    return ""


def _env(path: str, env: tuple[str, ...]) -> Iterator[SpecError]:
    for i, entry in enumerate(env):
        if entry.find("=") <= 0:
            yield SpecError(f"{path}[{i}]", f"invalid environment variable {entry!r}: expected NAME=value")


def _edits(path: str, edits: ContainerEdits, strict: bool) -> Iterator[SpecError]:
    yield from _env(join(path, "env"), edits.env)
    for i, node in enumerate(edits.device_nodes):
        where = f"{join(path, 'deviceNodes')}[{i}]"
        if not node.path:
            yield SpecError(join(where, "path"), "must not be empty")
        elif strict and not node.path.startswith("/"):
            yield SpecError(join(where, "path"), f"{node.path!r} must be an absolute path in the container")
        if strict and node.host_path and not node.host_path.startswith("/"):
            yield SpecError(join(where, "hostPath"), f"{node.host_path!r} must be an absolute path on the host")
        if node.type not in DEVICE_TYPES:
            yield SpecError(join(where, "type"), f"invalid device type {node.type!r}: expected b, c, u, p or empty")
        allowed_none = not strict and node.permissions == "none"
        if not allowed_none and set(node.permissions) - set("rwm"):
            yield SpecError(join(where, "permissions"), f"invalid permissions {node.permissions!r}: only r, w and m")
    for i, hook in enumerate(edits.hooks):
        where = f"{join(path, 'hooks')}[{i}]"
        if hook.hook_name not in HOOK_NAMES:
            yield SpecError(
                join(where, "hookName"),
                f"unknown hook {hook.hook_name!r}: expected one of {', '.join(sorted(HOOK_NAMES))}",
            )
        if not hook.path:
            yield SpecError(join(where, "path"), "must not be empty")
        elif strict and not hook.path.startswith("/"):
            yield SpecError(join(where, "path"), f"{hook.path!r} must be an absolute path")
        yield from _env(join(where, "env"), hook.env)
        if strict and hook.timeout is not None and hook.timeout <= 0:
            yield SpecError(join(where, "timeout"), "must be greater than zero when set")
    for i, mount in enumerate(edits.mounts):
        where = f"{join(path, 'mounts')}[{i}]"
        if not mount.host_path:
            yield SpecError(join(where, "hostPath"), "must not be empty")
        if not mount.container_path:
            yield SpecError(join(where, "containerPath"), "must not be empty")
        elif strict and not mount.container_path.startswith("/"):
            yield SpecError(join(where, "containerPath"), f"{mount.container_path!r} must be an absolute path")
    if edits.intel_rdt is not None:
        clos = edits.intel_rdt.clos_id
        if clos != "/" and (len(clos) >= 4096 or clos in (".", "..") or "/" in clos or "\n" in clos):
            yield SpecError(join(path, "intelRdt.closID"), f"invalid closID {clos!r}: must be a valid file name")
    yield from _net_devices(join(path, "netDevices"), edits, strict)


def _net_devices(path: str, edits: ContainerEdits, strict: bool) -> Iterator[SpecError]:
    hosts: set[str] = set()
    names: set[str] = set()
    for i, dev in enumerate(edits.net_devices):
        where = f"{path}[{i}]"
        for key, value, seen in (("hostInterfaceName", dev.host_interface_name, hosts), ("name", dev.name, names)):
            if not value:
                yield SpecError(join(where, key), "must not be empty")
                continue
            if value in seen:
                yield SpecError(join(where, key), f"duplicate interface name {value!r}")
            seen.add(value)
            if strict and not _valid_ifname(value):
                yield SpecError(
                    join(where, key),
                    f"invalid interface name {value!r}: 1-15 bytes, no '/', ':' or space, not '.' or '..'",
                )


def _valid_ifname(name: str) -> bool:
    """The kernel's ``dev_valid_name``: the OCI runtime's rename fails for anything else."""
    return (
        0 < len(name.encode()) < _IFNAMSIZ
        and name not in (".", "..")
        and not any(c in "/:" or c.isspace() for c in name)
    )
