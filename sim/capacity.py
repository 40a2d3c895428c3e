"""Consumable capacity as the real API server and allocator treat it, for the simulated ones.

The API server accepts a capacity's request policy only on a device with `allowMultipleAllocations`
and checks it (`request_policy_problems`, from pkg/apis/resource/validation, validateRequestPolicy).

A device with `allowMultipleAllocations` may be allocated to many requests while its capacities
last (k8s.io/dynamic-resource-allocation `structured`, consumable_capacity.go): each allocation
consumes, of every capacity of the device, what the request asks rounded up by the capacity's
request policy (a request above the policy's maximum does not fit), or the policy's default when
it asks nothing, or the whole capacity when there is no policy; a request naming a capacity the
device lacks does not fit. Every such allocation gets a share ID of its own (a lowercase UUID) and
records what it consumed (`consumedCapacity`).
"""

from __future__ import annotations

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


def take(device: Mapping[str, Any], asked: Mapping[str, str], consumed: Consumed) -> dict[str, Decimal] | None:
    """Allocate `device` once more for a request asking `asked`: what it consumes (added to
    `consumed`), {} for a device allocated only once, None when it does not fit."""
    if not device.get("allowMultipleAllocations"):
        return {}
    capacity = device.get("capacity") or {}
    if any(k not in capacity for k in asked):
        return None
    out = {}
    for name, cap in capacity.items():
        total = apiquantity.parse(cap["value"])[0]
        policy = cap.get("requestPolicy") or {}
        if name in asked:
            amount = _rounded(apiquantity.parse(asked[name])[0], policy)
        else:
            amount = apiquantity.parse(policy["default"])[0] if policy.get("default") else total
        if amount is None or consumed.get(device["name"], {}).get(name, Decimal(0)) + amount > total:
            return None
        out[name] = amount
    per = consumed.setdefault(device["name"], {})
    for name, amount in out.items():
        per[name] = per.get(name, Decimal(0)) + amount
    return out


def _rounded(asked: Decimal, policy: Mapping[str, Any]) -> Decimal | None:
    """A request rounded up by a validRange or validValues policy; None above its maximum."""
    values = [apiquantity.parse(v)[0] for v in policy.get("validValues") or []]
    if values:
        return next((v for v in values if asked <= v), None)
    rng = policy.get("validRange")
    if not rng:
        return asked
    low = apiquantity.parse(rng["min"])[0]
    amount = max(asked, low)
    if rng.get("step"):
        step = apiquantity.parse(rng["step"])[0]
        amount = low + step * -((low - amount) // step)
    if rng.get("max") and amount > apiquantity.parse(rng["max"])[0]:
        return None
    return amount


def share_fields(device: Mapping[str, Any], amounts: Mapping[str, Decimal]) -> dict[str, Any]:
    """What an allocation result of a multi-allocatable device carries besides the device."""
    if not device.get("allowMultipleAllocations"):
        return {}
    return {
        "shareID": str(uuid.uuid4()),
        "consumedCapacity": {k: apiquantity.canonical(str(v)) for k, v in amounts.items()},
    }
