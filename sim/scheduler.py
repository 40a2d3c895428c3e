"""A minimal stand-in for the scheduler's DRA allocator, for the demo and tests.

It reads the published ResourceSlices from the simulated API server, picks devices the way a
claim's constraints would (same attribute value across requests), and writes
`status.allocation` exactly where the real scheduler does. It is deliberately small: the
allocator's CEL evaluation is not Tandem's job, the shape of what it writes is.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from sim.apistore import now_rfc3339

Published = dict[str, Any]  # one device of a slice, plus "pool" and "driver" keys


@dataclass
class Request:
    name: str
    device_class: str
    match: Callable[[Published], bool]
    count: int = 1


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
    spec: dict[str, Any] = {
        "devices": {
            "requests": [
                {"name": r.name, "exactly": {"deviceClassName": r.device_class, "count": r.count}} for r in requests
            ]
        }
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
    """Allocates every request (all or nothing) and writes status.allocation; returns the claim."""
    devices = [d for d in published_devices(srv, driver, node) if d["name"] not in (taken or set())]
    groups: dict[object, list[Published]] = {None: devices}
    if match_attribute:
        groups = {}
        for d in devices:
            groups.setdefault(attribute(d, match_attribute), []).append(d)
        groups.pop(None, None)
    for _, candidates in sorted(groups.items(), key=lambda kv: str(kv[0])):
        picked: list[tuple[Request, Published]] = []
        free = list(candidates)
        for r in requests:
            fits = [d for d in free if r.match(d)][: r.count]
            if len(fits) < r.count:
                break
            picked += [(r, d) for d in fits]
            free = [d for d in free if d not in fits]
        else:
            claim = srv.get("resourceclaims", claim["metadata"]["name"], claim["metadata"]["namespace"])
            claim.setdefault("status", {})["allocation"] = {
                "devices": {
                    "results": [
                        {"request": r.name, "driver": driver, "pool": d["pool"], "device": d["name"]} for r, d in picked
                    ]
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
