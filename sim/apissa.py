"""Server-side apply of ResourceClaim status, reduced to what a DRA driver relies on.

`status.devices` is a list-map keyed by (driver, pool, device, shareID). Each field manager owns
the entries it applied; an apply by manager M replaces exactly M's set: entries M applied before
but omits now are removed, entries of other managers are kept, and an entry applied by two
managers belongs to the last applier. Other top-level status fields (allocation, reservedFor) are
owned whole by whoever applied them and are untouched by an apply that does not mention them.
Ownership is recorded, as on a real server, in `metadata.managedFields` (operation Apply,
subresource status, FieldsV1 with `k:{...}` keys), and that record is the only state kept.

A non-apply write (PUT or merge patch of /status) that changes an applied entry takes it away
from its applier, as a real server moves ownership to the updating manager.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from sim.apierrors import ApiError
from sim.apivalidate import device_status_key

Key = tuple[str, str, str, str]


def _fields_key(entry: dict[str, Any]) -> str:
    driver, pool, device, share = device_status_key(entry)
    key = {"device": device, "driver": driver, "pool": pool}
    if share:
        key["shareID"] = share
    return "k:" + json.dumps(key, sort_keys=True, separators=(",", ":"))


def _key_of_fields_key(text: str) -> Key:
    return device_status_key(json.loads(text[2:]))


def _is_status_apply(entry: dict[str, Any]) -> bool:
    return entry.get("operation") == "Apply" and entry.get("subresource") == "status"


def owned(managed_fields: list[dict[str, Any]], manager: str) -> tuple[set[Key], set[str]]:
    """(device keys, other top-level status fields) that `manager` owns through status applies."""
    keys: set[Key] = set()
    fields: set[str] = set()
    for entry in managed_fields:
        if _is_status_apply(entry) and entry.get("manager") == manager:
            k, f = _parse(entry)
            keys |= k
            fields |= f
    return keys, fields


def _parse(entry: dict[str, Any]) -> tuple[set[Key], set[str]]:
    status = ((entry.get("fieldsV1") or {}).get("f:status")) or {}
    keys = {_key_of_fields_key(k) for k in (status.get("f:devices") or {}) if k.startswith("k:")}
    fields = {f[2:] for f in status if f.startswith("f:") and f != "f:devices"}
    return keys, fields


def _render(keys_entries: list[dict[str, Any]], fields: set[str]) -> dict[str, Any]:
    status: dict[str, Any] = {f"f:{f}": {} for f in sorted(fields)}
    if keys_entries:
        status["f:devices"] = {_fields_key(e): {".": {}} for e in keys_entries}
    return {"f:status": status}


def apply_status(
    current: dict[str, Any], applied: dict[str, Any], manager: str, force: bool, now: str
) -> dict[str, Any]:
    """The object after `manager` applies `applied` (the status part of the apply body) to `current`."""
    result = copy.deepcopy(current)
    status = result.setdefault("status", {})
    managed = list(result["metadata"].get("managedFields") or [])
    entries = list(applied.get("devices") or [])
    applied_keys = [device_status_key(e) for e in entries]
    if len(set(applied_keys)) != len(applied_keys):
        raise ApiError(422, "status.devices: Duplicate value: the applied configuration has duplicate keys")
    applied_fields = {f for f in applied if f != "devices"}
    prev_keys, prev_fields = owned(managed, manager)

    if not force:
        _check_conflicts(status, managed, manager, entries, applied, applied_fields)

    keep = set(applied_keys)
    devices = [d for d in status.get("devices") or [] if device_status_key(d) not in prev_keys - keep]
    index = {device_status_key(d): i for i, d in enumerate(devices)}
    for key, entry in zip(applied_keys, entries, strict=True):
        if key in index:
            devices[index[key]] = copy.deepcopy(entry)
        else:
            devices.append(copy.deepcopy(entry))
    if devices:
        status["devices"] = devices
    else:
        status.pop("devices", None)
    for field in applied_fields:
        status[field] = copy.deepcopy(applied[field])
    for field in prev_fields - applied_fields:
        status.pop(field, None)
    if not status:
        result.pop("status")

    new_managed = []
    for entry in managed:
        if _is_status_apply(entry) and entry.get("manager") == manager:
            continue
        if _is_status_apply(entry):
            keys, fields = _parse(entry)
            entry = _with_ownership(entry, devices, keys - keep, fields - applied_fields)
            if entry is None:
                continue
        new_managed.append(entry)
    if entries or applied_fields:
        new_managed.append(
            {
                "manager": manager,
                "operation": "Apply",
                "apiVersion": current.get("apiVersion", "resource.k8s.io/v1"),
                "time": now,
                "fieldsType": "FieldsV1",
                "fieldsV1": _render(entries, applied_fields),
                "subresource": "status",
            }
        )
    result["metadata"]["managedFields"] = new_managed
    return result


def _check_conflicts(
    status: dict[str, Any],
    managed: list[dict[str, Any]],
    manager: str,
    entries: list[dict[str, Any]],
    applied: dict[str, Any],
    applied_fields: set[str],
) -> None:
    """409 when the apply changes a value another applier owns (what `force=true` overrides)."""
    current = {device_status_key(d): d for d in status.get("devices") or []}
    conflicts = []
    for entry in managed:
        if not _is_status_apply(entry) or entry.get("manager") == manager:
            continue
        keys, fields = _parse(entry)
        for applied_entry in entries:
            key = device_status_key(applied_entry)
            if key in keys and current.get(key) != applied_entry:
                conflicts.append(f'conflict with "{entry["manager"]}": .status.devices[{_fields_key(applied_entry)}]')
        for field in fields & applied_fields:
            if status.get(field) != applied[field]:
                conflicts.append(f'conflict with "{entry["manager"]}": .status.{field}')
    if conflicts:
        raise ApiError(409, f"Apply failed with {len(conflicts)} conflict(s): " + "; ".join(conflicts), "Conflict")


def _with_ownership(
    entry: dict[str, Any], devices: list[dict[str, Any]], keys: set[Key], fields: set[str]
) -> dict[str, Any] | None:
    """`entry` owning only `keys` and `fields`; None when it owns nothing any more."""
    kept = [d for d in devices if device_status_key(d) in keys]
    if not kept and not fields:
        return None
    return {**entry, "fieldsV1": _render(kept, fields)}


def release_changed(
    old_status: dict[str, Any], new_status: dict[str, Any], managed: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """managedFields after a non-apply status write: appliers lose what that write changed or removed."""
    old_devices = {device_status_key(d): d for d in old_status.get("devices") or []}
    new_devices = {device_status_key(d): d for d in new_status.get("devices") or []}
    result = []
    for entry in managed:
        if _is_status_apply(entry):
            keys, fields = _parse(entry)
            keys = {k for k in keys if k in new_devices and old_devices.get(k) == new_devices[k]}
            fields = {f for f in fields if f in new_status and old_status.get(f) == new_status[f]}
            updated = _with_ownership(entry, list(new_devices.values()), keys, fields)
            if updated is None:
                continue
            entry = updated
        result.append(entry)
    return result
