"""Server-side apply of ResourceClaim status, field by field, as structured-merge-diff does it.

Ownership is per field, as on a real server: a manager owns the leaf fields it applied and the
list-map elements it named. The status' list-maps are those of the resource.k8s.io/v1 types:
`devices` keyed by (driver, device, pool, shareID), a device's `conditions` keyed by `type`,
`reservedFor` keyed by `uid`; every other list is atomic, every object is merged key by key. So
two managers may apply different conditions of one device entry and both stay; an apply by
manager M replaces exactly M's set: a field (or element) M applied before but omits now is
removed unless another manager owns it (an element another manager owns fields of stays with
those fields). Applying a value another applier owns is a 409 conflict, unless `force`, which
takes that field from the other applier. Ownership is recorded in `metadata.managedFields`
(operation Apply, subresource status, FieldsV1 with `f:` and `k:{...}` keys, `.` for a member
that also has children), and that record is the only state kept.

A non-apply write (PUT or merge patch of /status) that changes or removes an applied field takes
it away from its applier, as a real server moves ownership to the updating manager.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from typing import Any

from sim.apierrors import ApiError

Path = tuple[str, ...]  # FieldsV1 keys below `f:status`: "f:<field>" and "k:<json key of a list-map element>"
_MISSING = object()

# The list-maps of ResourceClaimStatus (k8s.io/api resource/v1 types.go, +listType=map): where
# they are (a `*` for any element of an enclosing list-map) and their keys.
_LIST_MAPS: dict[Path, tuple[str, ...]] = {
    ("f:devices",): ("driver", "device", "pool", "shareID"),
    ("f:devices", "*", "f:conditions"): ("type",),
    ("f:reservedFor",): ("uid",),
}


def _keys_at(path: Path) -> tuple[str, ...] | None:
    return _LIST_MAPS.get(tuple("*" if p.startswith("k:") else p for p in path))


def _element_key(item: Any, keys: tuple[str, ...]) -> str:
    """`k:{...}` of a list-map element: its key fields that are set, as structured-merge-diff writes them."""
    fields = item if isinstance(item, dict) else {}
    present = {k: fields[k] for k in keys if fields.get(k) not in (None, "")}
    return "k:" + json.dumps(present, sort_keys=True, separators=(",", ":"))


def _fields(value: Any, path: Path = ()) -> set[Path]:
    """The field set of an applied value: its leaves (scalars, atomic lists, empty objects) and
    its list-map elements; 422 for two elements of one key, as the real server refuses them."""
    if isinstance(value, dict) and value:
        out: set[Path] = set()
        for name, child in value.items():
            out |= _fields(child, (*path, f"f:{name}"))
        return out
    keys = _keys_at(path)
    if isinstance(value, list) and keys is not None:
        out = set()
        for item in value:
            element = (*path, _element_key(item, keys))
            if element in out:
                raise ApiError(422, f"{_dotted(path)}: duplicate entries for key {_dotted(element[-1:])}", "Invalid")
            out.add(element)
            if isinstance(item, dict):
                out |= {p for p in _fields(item, element) if p != element}
        return out
    return {path} if path else set()


def _dotted(path: Path) -> str:
    """`.status.devices[device="gpu-0",...].conditions`: a path as the real server's messages write it."""
    out = "" if path[:1] and path[0].startswith("k:") else ".status"
    for part in path:
        if part.startswith("f:"):
            out += f".{part[2:]}"
        else:
            out += "[" + ",".join(f"{k}={json.dumps(v)}" for k, v in json.loads(part[2:]).items()) + "]"
    return out


def _get(node: Any, path: Path) -> Any:
    """The value at `path` in a status, `_MISSING` when absent."""
    for i, part in enumerate(path):
        if part.startswith("f:"):
            if not isinstance(node, dict) or part[2:] not in node:
                return _MISSING
            node = node[part[2:]]
        else:
            keys = _keys_at(path[:i]) or ()
            node = next((e for e in node or [] if _element_key(e, keys) == part), _MISSING)
            if node is _MISSING:
                return _MISSING
    return node


def _merge(current: Any, applied: Any, path: Path = ()) -> Any:
    """`applied` laid over `current`: objects key by key, list-map elements by key, the rest replaced."""
    if isinstance(current, dict) and isinstance(applied, dict):
        merged = dict(current)
        for name, child in applied.items():
            merged[name] = _merge(current.get(name, _MISSING), child, (*path, f"f:{name}"))
        return merged
    keys = _keys_at(path)
    if keys is not None and isinstance(current, list) and isinstance(applied, list):
        result = list(current)
        index = {_element_key(e, keys): i for i, e in enumerate(result)}
        for item in applied:
            key = _element_key(item, keys)
            element = (*path, key)
            if key in index:
                result[index[key]] = _merge(result[index[key]], item, element)
            else:
                result.append(copy.deepcopy(item))
        return result
    return copy.deepcopy(applied)


def _remove(status: dict[str, Any], path: Path) -> None:
    """Delete the field or element at `path`; an object or list left empty goes with it."""
    parents: list[tuple[Any, str]] = []
    node: Any = status
    for i, part in enumerate(path):
        if part.startswith("f:"):
            if not isinstance(node, dict) or part[2:] not in node:
                return
            parents.append((node, part[2:]))
            node = node[part[2:]]
        else:
            keys = _keys_at(path[:i]) or ()
            at = next((j for j, e in enumerate(node or []) if _element_key(e, keys) == part), None)
            if at is None:
                return
            parents.append((node, at))
            node = node[at]
    for container, slot in reversed(parents):
        del container[slot]
        if container or container is status:
            return


def _is_status_apply(entry: dict[str, Any]) -> bool:
    return entry.get("operation") == "Apply" and entry.get("subresource") == "status"


def _parse(entry: dict[str, Any]) -> set[Path]:
    """The paths a managedFields entry's FieldsV1 names below `f:status`."""
    out: set[Path] = set()

    def walk(node: dict[str, Any], path: Path) -> None:
        children = {k: v for k, v in node.items() if k != "."}
        if path and ("." in node or not children):
            out.add(path)
        for key, child in children.items():
            walk(child if isinstance(child, dict) else {}, (*path, key))

    walk(((entry.get("fieldsV1") or {}).get("f:status")) or {}, ())
    return out


def _render(paths: set[Path]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for path in sorted(paths):
        node = tree
        for part in path:
            node = node.setdefault(part, {})
    for path in paths:
        node = tree
        for part in path:
            node = node[part]
        if node:
            node["."] = {}
    return {"f:status": tree}


def _with_ownership(entry: dict[str, Any], paths: set[Path]) -> dict[str, Any] | None:
    """`entry` owning only `paths`; None when it owns nothing any more."""
    return {**entry, "fieldsV1": _render(paths)} if paths else None


def _rewrite(
    managed: list[dict[str, Any]], keep: Callable[[dict[str, Any], set[Path]], set[Path]]
) -> list[dict[str, Any]]:
    """managedFields with each status applier's paths narrowed by `keep`; an applier left with none goes."""
    result = []
    for entry in managed:
        if _is_status_apply(entry):
            updated = _with_ownership(entry, keep(entry, _parse(entry)))
            if updated is None:
                continue
            entry = updated
        result.append(entry)
    return result


def apply_status(
    current: dict[str, Any], applied: dict[str, Any], manager: str, force: bool, now: str
) -> dict[str, Any]:
    """The object after `manager` applies `applied` (the status part of the apply body) to `current`."""
    result = copy.deepcopy(current)
    status = result.get("status") or {}
    managed = list(result["metadata"].get("managedFields") or [])
    new_set = _fields(applied)
    mine = [e for e in managed if _is_status_apply(e) and e.get("manager") == manager]
    others = [e for e in managed if not (_is_status_apply(e) and e.get("manager") == manager)]
    previous = set().union(*(_parse(e) for e in mine))
    # A leaf whose applied value differs from the stored one: another applier's value overridden.
    changed = {p for p in new_set if not p[-1].startswith("k:") and _get(status, p) != _get(applied, p)}
    conflicts = [
        f'conflict with "{e["manager"]}": {_dotted(p)}'
        for e in others
        if _is_status_apply(e)
        for p in sorted(_parse(e) & changed)
    ]
    if conflicts and not force:
        raise ApiError(409, f"Apply failed with {len(conflicts)} conflict(s): " + "; ".join(conflicts), "Conflict")
    others = _rewrite(others, lambda _e, paths: paths - changed)
    status = _merge(status, applied)
    kept = new_set | set().union(*(_parse(e) for e in others if _is_status_apply(e)))
    # Shortest first: an element goes whole, and the fields inside it are then gone already; one
    # that stays keeps its key fields, owned by whoever else applied the element.
    for path in sorted(previous - kept, key=len):
        _remove(status, path)
    if status:
        result["status"] = status
    else:
        result.pop("status", None)
    if new_set:
        others.append(
            {
                "manager": manager,
                "operation": "Apply",
                "apiVersion": current.get("apiVersion", "resource.k8s.io/v1"),
                "time": now,
                "fieldsType": "FieldsV1",
                "fieldsV1": _render(new_set),
                "subresource": "status",
            }
        )
    result["metadata"]["managedFields"] = others
    return result


def release_changed(
    old_status: dict[str, Any], new_status: dict[str, Any], managed: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """managedFields after a non-apply status write: appliers lose what that write changed or removed."""

    def unchanged(_entry: dict[str, Any], paths: set[Path]) -> set[Path]:
        return {
            p
            for p in paths
            if (now := _get(new_status, p)) is not _MISSING and (p[-1].startswith("k:") or now == _get(old_status, p))
        }

    return _rewrite(managed, unchanged)
