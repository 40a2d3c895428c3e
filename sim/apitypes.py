"""The resources the simulated API server serves, described as data.

One entry per REST resource: where it lives (group, version, plural, scope), which subresources and
field selectors it has, and whether `metadata.generation` tracks its spec. The store and the HTTP
layer are generic over these descriptions.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from sim.apiselect import FieldGetter, path_getter


@dataclass(frozen=True)
class ResourceType:
    plural: str
    kind: str
    group: str  # "" for core
    version: str
    namespaced: bool
    subresources: tuple[str, ...] = ()
    has_generation: bool = False
    short_names: tuple[str, ...] = ()
    extra_fields: Mapping[str, FieldGetter] = field(default_factory=dict)

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def group_resource(self) -> str:
        """`resourceslices.resource.k8s.io` (or `nodes`), as API error messages name a resource."""
        return f"{self.plural}.{self.group}" if self.group else self.plural

    @property
    def kind_group(self) -> str:
        """`ResourceSlice.resource.k8s.io` (or `Node`), as Invalid messages name a kind."""
        return f"{self.kind}.{self.group}" if self.group else self.kind

    @property
    def fields(self) -> dict[str, FieldGetter]:
        """Field selectors: metadata.name (and metadata.namespace) on every resource, plus its own."""
        base = {"metadata.name": path_getter("metadata", "name")}
        if self.namespaced:
            base["metadata.namespace"] = path_getter("metadata", "namespace")
        return {**base, **self.extra_fields}

    def details(self, name: str) -> dict[str, str]:
        """StatusDetails of an error about object `name` of this resource."""
        out = {"name": name, "kind": self.plural}
        if self.group:
            out["group"] = self.group
        return out


RESOURCE_GROUP = "resource.k8s.io"

RESOURCE_TYPES: tuple[ResourceType, ...] = (
    ResourceType("nodes", "Node", "", "v1", namespaced=False, subresources=("status",), short_names=("no",)),
    # Pods, for what a DRA driver watches of them: the ones nominated to (or bound to) its node.
    ResourceType(
        "pods",
        "Pod",
        "",
        "v1",
        namespaced=True,
        subresources=("status",),
        short_names=("po",),
        extra_fields={
            "spec.nodeName": path_getter("spec", "nodeName"),
            "status.nominatedNodeName": path_getter("status", "nominatedNodeName"),
        },
    ),
    # The events.k8s.io/v1 view of Events, the one the driver writes (a real server also serves the
    # core v1 view of the same objects; nothing here reads that).
    ResourceType(
        "events",
        "Event",
        "events.k8s.io",
        "v1",
        namespaced=True,
        short_names=("ev",),
        extra_fields={
            "regarding.kind": path_getter("regarding", "kind"),
            "regarding.name": path_getter("regarding", "name"),
            "reason": path_getter("reason"),
        },
    ),
    ResourceType(
        "resourceslices",
        "ResourceSlice",
        RESOURCE_GROUP,
        "v1",
        namespaced=False,
        has_generation=True,
        extra_fields={
            "spec.nodeName": path_getter("spec", "nodeName"),
            "spec.driver": path_getter("spec", "driver"),
            "spec.pool.name": path_getter("spec", "pool", "name"),
        },
    ),
    ResourceType(
        "resourceclaims",
        "ResourceClaim",
        RESOURCE_GROUP,
        "v1",
        namespaced=True,
        subresources=("status",),
        has_generation=True,
    ),
    ResourceType("deviceclasses", "DeviceClass", RESOURCE_GROUP, "v1", namespaced=False, has_generation=True),
)

BY_PATH: dict[tuple[str, str, str], ResourceType] = {(t.group, t.version, t.plural): t for t in RESOURCE_TYPES}
BY_KIND: dict[tuple[str, str], ResourceType] = {(t.api_version, t.kind): t for t in RESOURCE_TYPES}
BY_PLURAL: dict[str, ResourceType] = {t.plural: t for t in RESOURCE_TYPES}
