"""URL paths of the simulated API server: which resource a path names, the request's verb, and the
discovery documents (`/api`, `/apis`, `/version`, resource lists) the official client reads first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sim.apierrors import ApiError
from sim.apistore import now_rfc3339
from sim.apitypes import BY_PATH, BY_PLURAL, RESOURCE_TYPES, ResourceType

KUBERNETES_VERSION = "v1.37.0"


@dataclass
class Route:
    """Where a URL path points: a resource request, or a discovery document when `discovery` is set."""

    rtype: ResourceType | None = None
    namespace: str = ""
    name: str = ""
    subresource: str = ""
    discovery: dict[str, Any] | None = None
    group: str = ""
    plural: str = ""


def resource_type(plural: str) -> ResourceType:
    rtype = BY_PLURAL.get(plural)
    if rtype is None:
        raise ApiError(404, f"the server could not find the requested resource ({plural})", "NotFound")
    return rtype


def verb(method: str, route: Route, query: dict[str, str]) -> str:
    if route.rtype is None:
        return "get"
    if method == "GET":
        if route.name:
            return "get"
        return "watch" if query.get("watch") in ("true", "1") else "list"
    if method == "DELETE":
        return "delete" if route.name else "deletecollection"
    return {"POST": "create", "PUT": "update", "PATCH": "patch"}.get(method, method.lower())


def route(path: str, address: tuple[Any, ...]) -> Route:
    parts = [p for p in path.split("/") if p]
    if parts == ["version"]:
        return Route(discovery=_version())
    if parts == ["api"]:
        server = f"{address[0]}:{address[1]}"
        return Route(
            discovery={
                "kind": "APIVersions",
                "versions": ["v1"],
                "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": server}],
            }
        )
    if parts == ["apis"]:
        return Route(
            discovery={"kind": "APIGroupList", "apiVersion": "v1", "groups": [_group_doc(g) for g in _groups()]}
        )
    if len(parts) == 2 and parts[0] == "apis" and parts[1] in _groups():
        return Route(discovery={"kind": "APIGroup", "apiVersion": "v1", **_group_doc(parts[1])})
    if parts[:1] == ["api"]:
        group, rest = "", parts[1:]
    elif parts[:1] == ["apis"] and len(parts) >= 2:
        group, rest = parts[1], parts[2:]
    else:
        return Route()
    if not rest:
        return Route()
    version, rest = rest[0], rest[1:]
    if not rest:
        if any(t.group == group and t.version == version for t in RESOURCE_TYPES):
            return Route(discovery=_resource_list(group, version))
        return Route()
    namespace = ""
    if rest[0] == "namespaces" and len(rest) >= 3:
        namespace, rest = rest[1], rest[2:]
    plural, name, sub = rest[0], (rest[1] if len(rest) > 1 else ""), (rest[2] if len(rest) > 2 else "")
    rtype = BY_PATH.get((group, version, plural))
    route = Route(namespace=namespace, name=name, subresource=sub, group=group, plural=plural)
    valid = (
        rtype is not None
        and len(rest) <= 3
        and (not namespace or rtype.namespaced)
        and (not sub or sub in rtype.subresources)
        and not (rtype.namespaced and name and not namespace)  # a named namespaced object needs its namespace
    )
    if valid:
        route.rtype = rtype
    return route


def _groups() -> list[str]:
    return sorted({t.group for t in RESOURCE_TYPES if t.group})


def _group_doc(group: str) -> dict[str, Any]:
    versions = sorted({t.version for t in RESOURCE_TYPES if t.group == group})
    docs = [{"groupVersion": f"{group}/{v}", "version": v} for v in versions]
    return {"name": group, "versions": docs, "preferredVersion": docs[0]}


def _resource_list(group: str, version: str) -> dict[str, Any]:
    resources = []
    for t in RESOURCE_TYPES:
        if (t.group, t.version) != (group, version):
            continue
        verbs = ["create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"]
        resources.append(
            {
                "name": t.plural,
                "singularName": t.kind.lower(),
                "namespaced": t.namespaced,
                "kind": t.kind,
                "verbs": verbs,
                **({"shortNames": list(t.short_names)} if t.short_names else {}),
            }
        )
        for sub in t.subresources:
            resources.append(
                {
                    "name": f"{t.plural}/{sub}",
                    "singularName": "",
                    "namespaced": t.namespaced,
                    "kind": t.kind,
                    "verbs": ["get", "patch", "update"],
                }
            )
    group_version = f"{group}/{version}" if group else version
    return {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": group_version, "resources": resources}


def _version() -> dict[str, str]:
    return {
        "major": "1",
        "minor": "37",
        "gitVersion": KUBERNETES_VERSION,
        "gitCommit": "simulated",
        "gitTreeState": "clean",
        "buildDate": now_rfc3339(),
        "goVersion": "go1.25.0",
        "compiler": "gc",
        "platform": "linux/amd64",
    }
