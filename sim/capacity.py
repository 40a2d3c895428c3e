"""Consumable capacity as the real API server and allocator treat it, for the simulated ones.

The API server accepts a capacity's request policy only on a device with `allowMultipleAllocations`
and checks it (`request_policy_problems`, from pkg/apis/resource/validation, validateRequestPolicy).

A device with `allowMultipleAllocations` may be allocated to many requests while its capacities
last (k8s.io/dynamic-resource-allocation `structured`, consumable_capacity.go): each allocation
consumes, of every capacity of the device, what the request asks rounded up by the capacity's
request policy (a request above the policy's maximum does not fit), or the policy's default when
it asks nothing, or the whole capacity when there is no policy; a request naming a capacity the
device lacks does not fit. Every such allocation gets a share ID of its own (a lowercase UUID) and
records what it consumed (`consumedCapacity`) as the allocator writes it: an amount rounded up
to a step in the step's format (`20Gi` for a `1Mi` step), anything else as the policy or the
request wrote it (`_consumption`).
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Mapping
from decimal import Decimal
from typing import Any

from sim import apiquantity

Consumed = dict[str, dict[str, Decimal]]  # device name -> capacity -> amount


def request_policy_problems(path: str, capacity: Mapping[str, Any]) -> list[str]:
    """A consumable capacity's requestPolicy (validation.go, validateRequestPolicy): one of
    validValues and validRange, a default within it, every bound at most the capacity's value,
    whole steps (integer arithmetic, as without DRAFractionalCapacityRange values)."""
    policy = capacity["requestPolicy"]
    if not isinstance(policy, dict):
        return [f"{path}: Invalid value: must be an object"]
    try:
        value = apiquantity.parse(capacity.get("value"))[0]
        q = {k: apiquantity.parse(policy[k])[0] for k in ("default",) if policy.get(k) is not None}
        values = [apiquantity.parse(v)[0] for v in policy.get("validValues") or []]
        rng = policy.get("validRange")
        bounds = {k: apiquantity.parse(v)[0] for k, v in (rng or {}).items() if v is not None}
    except (ValueError, TypeError) as e:
        return [f"{path}: Invalid value: {e}"]
    if values and rng is not None:
        return [
            f'{path}: Forbidden: exactly one policy can be specified, cannot specify "validValues" and "validRange" at the same time'
        ]
    if (values or rng is not None) and "default" not in q:
        return [f"{path}.default: Required value: required when {'validValues' if values else 'validRange'} is defined"]
    problems = []
    default = q.get("default")
    if values:
        if values != sorted(values):
            problems.append(f"{path}.validValues: Invalid value: values must be sorted in ascending order")
        if any(v > value for v in values):
            problems.append(f"{path}.validValues: Invalid value: option is larger than capacity value")
        if default not in values:
            problems.append(
                f"{path}.validValues: Invalid value: default value is not valid according to the requestPolicy"
            )
    if rng is not None and default is not None:
        low, high, step = bounds.get("min"), bounds.get("max"), bounds.get("step")
        if low is None:
            return [f"{path}.validRange.min: Required value: required when validRange is defined"]
        if low > value:
            problems.append(f"{path}.validRange.min: Invalid value: min is larger than capacity value")
        if default < low:
            problems.append(f"{path}.validRange.default: Invalid value: default is less than min")
        if high is not None and (low > high or high > value or default > high):
            problems.append(
                f"{path}.validRange.max: Invalid value: must be at least min and default and at most the capacity value"
            )
        if step is not None:
            if step <= 0:
                problems.append(f"{path}.validRange.step: Invalid value: must be greater than zero")
            elif low + step > value:
                problems.append(f"{path}.validRange.step: Invalid value: one step is larger than capacity value")
            elif (default - low) % step or (high is not None and (high - low) % step):
                problems.append(f"{path}.validRange.step: Invalid value: value is not a multiple of a given step")
    return problems


def consumed_by_claims(srv: Any, driver: str) -> Consumed:
    """What the allocated claims consume of this driver's multi-allocatable devices."""
    out: Consumed = {}
    for c in srv.list("resourceclaims"):
        for r in ((((c.get("status") or {}).get("allocation") or {}).get("devices") or {}).get("results")) or []:
            if r.get("driver") != driver:
                continue
            for k, v in (r.get("consumedCapacity") or {}).items():
                per = out.setdefault(r["device"], {})
                per[k] = per.get(k, Decimal(0)) + apiquantity.parse(v)[0]
    return out


def take(device: Mapping[str, Any], asked: Mapping[str, str], consumed: Consumed) -> dict[str, str] | None:
    """Allocate `device` once more for a request asking `asked`: what it consumes of each capacity,
    as the allocator writes it into `consumedCapacity` (added to `consumed`), {} for a device
    allocated only once, None when it does not fit."""
    if not device.get("allowMultipleAllocations"):
        return {}
    capacity = device.get("capacity") or {}
    if any(k not in capacity for k in asked):
        return None
    out = {}
    for name, cap in capacity.items():
        total = apiquantity.parse(cap["value"])[0]
        policy = cap.get("requestPolicy") or {}
        text = _consumption(asked.get(name), cap["value"], policy)
        amount = apiquantity.parse(text)[0] if text is not None else None
        if amount is None or consumed.get(device["name"], {}).get(name, Decimal(0)) + amount > total:
            return None
        out[name] = text
    per = consumed.setdefault(device["name"], {})
    for name, text in out.items():
        per[name] = per.get(name, Decimal(0)) + apiquantity.parse(text)[0]
    return out


def _consumption(asked: str | None, value: str, policy: Mapping[str, Any]) -> str | None:
    """What one allocation consumes of a capacity, in the form the allocator writes it
    (consumable_capacity.go, calculateConsumedCapacity): nothing asked, the policy's default (or
    the whole value without one), as written; asked below a range's minimum, the minimum; rounded
    up to a step, `min + n * step` in the step's format (`NewQuantity(..., step.Format)`: `20Gi`
    for a `1Mi` step); the first valid value at least the request, as written. None where the
    result breaks the policy (violatesPolicy: above the maximum, off the valid values)."""
    if asked is None:
        return apiquantity.canonical(policy.get("default") or value)
    if not policy:
        return apiquantity.canonical(asked)
    want = apiquantity.parse(asked)[0]
    values = policy.get("validValues") or []
    if values:
        return next((apiquantity.canonical(v) for v in values if want <= apiquantity.parse(v)[0]), None)
    rng = policy.get("validRange") or {}
    if not rng.get("min"):
        return apiquantity.canonical(asked)
    low = apiquantity.parse(rng["min"])[0]
    if want < low:
        text = apiquantity.canonical(rng["min"])
    elif not rng.get("step"):
        text = apiquantity.canonical(asked)
    else:  # the integer path (no DRAFractionalCapacityRange): Value() rounds each up to a whole number
        step, fmt = apiquantity.parse(rng["step"])
        whole_low, whole_step = math.ceil(low), math.ceil(step)
        n = math.ceil((math.ceil(want) - whole_low) / whole_step)
        text = apiquantity.formatted(Decimal(whole_low + whole_step * n), fmt)
    if rng.get("max") and apiquantity.parse(text)[0] > apiquantity.parse(rng["max"])[0]:
        return None
    return text


def share_fields(device: Mapping[str, Any], amounts: Mapping[str, str]) -> dict[str, Any]:
    """What an allocation result of a multi-allocatable device carries besides the device."""
    if not device.get("allowMultipleAllocations"):
        return {}
    return {"shareID": str(uuid.uuid4()), "consumedCapacity": dict(amounts)}
