"""A minimal stand-in for the scheduler's DRA allocator, for the demo and tests.

It reads the published ResourceSlices from the simulated API server, picks devices the way a
claim's constraints would (same attribute value across requests), and writes
`status.allocation` exactly where the real scheduler does. It is deliberately small: the
allocator's CEL evaluation is not Tandem's job, the shape of what it writes is.

Partitionable devices as the real allocator treats them (k8s.io/dynamic-resource-allocation,
`structured`): a device that consumes counters is allocatable only while its counter sets have
enough left after what the pool's allocated devices (in any claim) and this allocation consume,
and a pool in which a device names a counter set or counter that no slice of it defines is
invalid: nothing of it is allocated; nor of a pool whose newest generation lacks slices yet.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from sim import apiquantity, capacity
from sim.apistore import now_rfc3339

Published = dict[str, Any]  # one device of a slice, plus "pool" and "driver" keys


@dataclass
class Request:
    name: str
    device_class: str
    match: Callable[[Published], bool]
    count: int = 1
    # What the request asks of each capacity of a multi-allocatable device (`sim.capacity`).
    capacity: dict[str, str] = field(default_factory=dict)


@dataclass
class Allocation:
    results: list[dict[str, Any]] = field(default_factory=list)


def attribute(device: Published, key: str) -> object:
    """The single value of an attribute (first element for list-typed ones)."""
    raw = device.get("attributes", {}).get(key, {})
    for kind in ("string", "int", "bool", "version"):
        if kind in raw:
            return raw[kind]
    for kind in ("strings", "ints", "bools", "versions"):
        if raw.get(kind):
            return raw[kind][0]
    return None


def published_devices(srv: Any, driver: str, node: str) -> list[Published]:
    out = []
    for s in srv.list("resourceslices"):
        spec = s["spec"]
        if spec.get("driver") != driver or spec.get("nodeName") != node:
            continue
        for d in spec.get("devices") or []:
            out.append({**d, "pool": spec["pool"]["name"], "driver": driver})
    return sorted(out, key=lambda d: d["name"])


def claim_object(namespace: str, name: str, requests: Sequence[Request], match_attribute: str = "") -> dict:
    exact: list[dict[str, Any]] = [{"deviceClassName": r.device_class, "count": r.count} for r in requests]
    for r, e in zip(requests, exact, strict=True):
        if r.capacity:
            e["capacity"] = {"requests": dict(r.capacity)}
    spec: dict[str, Any] = {
        "devices": {"requests": [{"name": r.name, "exactly": e} for r, e in zip(requests, exact, strict=True)]}
    }
    if match_attribute and len(requests) > 1:
        spec["devices"]["constraints"] = [{"requests": [r.name for r in requests], "matchAttribute": match_attribute}]
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": namespace},
        "spec": spec,
    }


def allocate(
    srv: Any,
    claim: dict,
    driver: str,
    node: str,
    requests: Sequence[Request],
    match_attribute: str = "",
    taken: set[str] | None = None,
) -> dict:
    """Allocates every request (all or nothing) and writes status.allocation; returns the claim.
    A multi-allocatable device is free while its capacities last (`sim.capacity`), others unless
    named in `taken`."""
    published = published_devices(srv, driver, node)
    available = _counters_left(srv, driver, node, published, taken or set())
    used = capacity.consumed_by_claims(srv, driver)
    devices = [d for d in published if d.get("allowMultipleAllocations") or d["name"] not in (taken or set())]
    groups: dict[object, list[Published]] = {None: devices}
    if match_attribute:
        groups = {}
        for d in devices:
            groups.setdefault(attribute(d, match_attribute), []).append(d)
        groups.pop(None, None)
    for _, candidates in sorted(groups.items(), key=lambda kv: str(kv[0])):
        picked: list[tuple[Request, Published, dict[str, Any]]] = []
        free = list(candidates)
        left = {name: dict(counters) for name, counters in available.items()}
        consumed = {name: dict(amounts) for name, amounts in used.items()}
        for r in requests:
            fits = []
            for d in free:
                if len(fits) < r.count and r.match(d) and _consume(left, d):
                    amounts = capacity.take(d, r.capacity, consumed)
                    if amounts is not None:
                        fits.append((d, capacity.share_fields(d, amounts)))
            if len(fits) < r.count:
                break
            picked += [(r, d, share) for d, share in fits]
            free = [d for d in free if d.get("allowMultipleAllocations") or all(d is not f for f, _ in fits)]
        else:
            claim = srv.get("resourceclaims", claim["metadata"]["name"], claim["metadata"]["namespace"])
            # The claim's own opaque config goes with the allocation, as the allocator copies it.
            config = [
                {"source": "FromClaim", **c} for c in (claim.get("spec") or {}).get("devices", {}).get("config") or []
            ]
            claim.setdefault("status", {})["allocation"] = {
                "devices": {
                    "results": [
                        {
                            "request": r.name,
                            "driver": driver,
                            "pool": d["pool"],
                            "device": d["name"],
                            **share,
                            **_binding(d),
                        }
                        for r, d, share in picked
                    ],
                    **({"config": config} if config else {}),
                },
                "nodeSelector": {
                    "nodeSelectorTerms": [
                        {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}
                    ]
                },
                "allocationTimestamp": now_rfc3339(),
            }
            return srv.update(claim)
    raise LookupError(f"no devices satisfy the claim's requests {[r.name for r in requests]}")


def _binding(device: Published) -> dict[str, list[str]]:
    """A device's binding conditions, copied into its allocation result as the allocator copies
    them (structured allocator: `BindingConditions`, `BindingFailureConditions`); the scheduler
    then waits in PreBind for them, which this stand-in does not."""
    return {k: list(device[k]) for k in ("bindingConditions", "bindingFailureConditions") if device.get(k)}


def nominate(srv: Any, namespace: str, pod_name: str, node: str) -> dict:
    """Sets `status.nominatedNodeName`, as the scheduler does before PreBind (the gate
    NominatedNodeNameForExpectation, on by default since 1.35): how a node's driver learns of a
    pod, and so of its claims, that waits for binding on that node."""
    pod = srv.get("pods", pod_name, namespace)
    pod.setdefault("status", {})["nominatedNodeName"] = node
    return srv.update(pod)


def _counters_left(
    srv: Any, driver: str, node: str, published: list[Published], taken: set[str]
) -> dict[str, dict[str, Decimal]]:
    """The pool's counter sets less what its allocated devices (and `taken`) consume; LookupError
    for an invalid pool (a consumption naming a counter set or counter no slice defines)."""
    sets: dict[str, dict[str, Decimal]] = {}
    pool = [
        s["spec"]
        for s in srv.list("resourceslices")
        if (s["spec"].get("driver"), s["spec"].get("nodeName")) == (driver, node)
    ]
    newest = max((s["pool"]["generation"] for s in pool), default=0)
    pool = [s for s in pool if s["pool"]["generation"] == newest]
    if pool and len(pool) < pool[0]["pool"]["resourceSliceCount"]:
        raise LookupError(f"pool {node} is incomplete: {len(pool)} of {pool[0]['pool']['resourceSliceCount']} slices")
    for spec in pool:
        for c in spec.get("sharedCounters") or []:
            sets[c["name"]] = {k: apiquantity.parse(v["value"])[0] for k, v in c["counters"].items()}
    for d in published:
        for use in d.get("consumesCounters") or []:
            missing = [k for k in use["counters"] if k not in sets.get(use["counterSet"], {})]
            if use["counterSet"] not in sets or missing:
                raise LookupError(f"pool {node} is invalid: device {d['name']} consumes {use['counterSet']}/{missing}")
    allocated = set(taken)
    for claim in srv.list("resourceclaims"):
        for r in (((claim.get("status") or {}).get("allocation") or {}).get("devices") or {}).get("results") or []:
            if r.get("driver") == driver and r.get("pool") == node:
                allocated.add(r["device"])
    for d in published:
        if d["name"] in allocated:  # may go below zero: then nothing more fits, as in the allocator
            for s, k, amount in _uses(d):
                sets[s][k] -= amount
    return sets


def _uses(device: Published) -> list[tuple[str, str, Decimal]]:
    return [
        (u["counterSet"], k, apiquantity.parse(v["value"])[0])
        for u in device.get("consumesCounters") or []
        for k, v in u["counters"].items()
    ]


def _consume(left: dict[str, dict[str, Decimal]], device: Published) -> bool:
    """Take the device's counters from `left` if all of them fit; whether they did."""
    uses = _uses(device)
    if any(left[s][k] < amount for s, k, amount in uses):
        return False
    for s, k, amount in uses:
        left[s][k] -= amount
    return True


def reserve(srv: Any, claim: dict, pod_name: str, pod_uid: str) -> dict:
    """Reserves an allocated claim for a pod (`status.reservedFor`), as the scheduler does before
    it binds the pod; the kubelet prepares a claim only for a pod it is reserved for."""
    claim = srv.get("resourceclaims", claim["metadata"]["name"], claim["metadata"]["namespace"])
    claim["status"].setdefault("reservedFor", []).append({"resource": "pods", "name": pod_name, "uid": pod_uid})
    return srv.update(claim)


def unreserve(srv: Any, claim: dict) -> dict:
    """Drops every reservation, as the claim controller does once the claim's pods are gone."""
    claim = srv.get("resourceclaims", claim["metadata"]["name"], claim["metadata"]["namespace"])
    claim["status"].pop("reservedFor", None)
    return srv.update(claim)


def deallocate(srv: Any, claim: dict) -> dict:
    """Drops the claim's allocation and reservations, as the scheduler does when a pod's binding
    ends without it (its pod deleted while PreBind waits: Unreserve clears what it wrote): the
    devices are free for the next allocation at once, to this claim or another, and the API server
    drops the device status entries with the allocation. The claim keeps its UID."""
    claim = srv.get("resourceclaims", claim["metadata"]["name"], claim["metadata"]["namespace"])
    status = claim.get("status") or {}
    status.pop("allocation", None)
    status.pop("reservedFor", None)
    return srv.update(claim)
