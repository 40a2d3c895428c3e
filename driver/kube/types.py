"""The resource.k8s.io/v1 objects of the claim path, as TypedDicts: the ResourceClaim Tandem reads
and the `status.devices` entries it applies, camelCase as on the wire.

A shape for the type checker only: nothing checks a body against it at run time, and a
TypedDict is a plain dict, so fields not listed here stay in the object (a read-modify-write loses
nothing). The API server validated what it sends against the v1 schema (`driver.kube.api` says so
with one cast, where the body is decoded); a field the schema makes optional is optional here too,
and the claim path reads such fields with `.get`. Only the fields Tandem reads or writes are named
(docs/reference/resource-api.md).
"""

from __future__ import annotations

from typing import Any, Literal, Required, TypedDict

# Where an allocation's config entry came from: a DeviceClass (set by cluster admins) or the claim.
ConfigSource = Literal["FromClass", "FromClaim"]


class ObjectMeta(TypedDict, total=False):
    name: str
    namespace: str
    uid: str
    annotations: dict[str, str]


class DeviceRequestAllocationResult(TypedDict, total=False):
    """One allocated device (`status.allocation.devices.results[]`)."""

    request: Required[str]  # the request's name, "<request>/<subrequest>" for a subrequest
    driver: Required[str]
    pool: Required[str]
    device: Required[str]
    adminAccess: bool
    shareID: str  # a multi-allocatable device: this allocation's share
    consumedCapacity: dict[str, str]  # capacity name -> quantity
    bindingConditions: list[str]  # the device's, copied by the scheduler (`driver.claims.binding`)
    bindingFailureConditions: list[str]


class OpaqueDeviceConfiguration(TypedDict):
    driver: str
    parameters: Any  # any JSON: its driver decodes it (`driver.claims.opaque_config`)


class DeviceAllocationConfiguration(TypedDict, total=False):
    """One config entry of an allocation (`status.allocation.devices.config[]`)."""

    source: Required[ConfigSource]
    requests: list[str]  # empty or absent: every request
    opaque: OpaqueDeviceConfiguration


class DeviceAllocationResult(TypedDict, total=False):
    results: list[DeviceRequestAllocationResult]
    config: list[DeviceAllocationConfiguration]


class AllocationResult(TypedDict, total=False):
    devices: DeviceAllocationResult


class ResourceClaimConsumerReference(TypedDict, total=False):
    """One of `status.reservedFor`: a pod (or other consumer) the claim is reserved for."""

    resource: str
    name: str
    uid: str


class Condition(TypedDict):
    type: str
    status: Literal["True", "False", "Unknown"]
    reason: str
    message: str
    lastTransitionTime: str  # RFC 3339 (`driver.resource_api.rfc3339`)


class NetworkDeviceData(TypedDict, total=False):
    """A NIC as the pod sees it (`status.devices[].networkData`)."""

    interfaceName: str
    hardwareAddress: str
    ips: list[str]  # CIDRs in canonical form, at most `driver.resource_api.MAX_NETWORK_IPS`


class AllocatedDeviceStatus(TypedDict, total=False):
    """One entry of `status.devices`: a driver's word on one device it prepared."""

    driver: Required[str]
    pool: Required[str]
    device: Required[str]
    shareID: str
    conditions: list[Condition]
    networkData: NetworkDeviceData


class ResourceClaimStatus(TypedDict, total=False):
    allocation: AllocationResult
    reservedFor: list[ResourceClaimConsumerReference]
    devices: list[AllocatedDeviceStatus]


class ResourceClaim(TypedDict, total=False):
    apiVersion: str
    kind: str
    metadata: ObjectMeta
    status: ResourceClaimStatus
