"""The `DeviceMetadata` object of a device metadata file, and the JSON stream that holds it (pure).

What a container reads (docs/reference/device-metadata.md, 'Document format'): one indented
object per supported version, newest first, each followed by a newline, keys in the order the Go
encoder writes them; read back by the consumer's rules (docs/reference/device-metadata.md,
'Consumer rules'). Where the files and their CDI specs go, and how they are written, is
`driver.claims.metadata`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from driver.errors import NodeError
from driver.kube.types import NetworkDeviceData
from driver.model import Device, attribute_to_api

GROUP = "metadata.resource.k8s.io"
# The versions a file holds, newest first: a consumer takes the first object of a version it
# knows, so readers of either version find theirs (and a reader of both, the newest). In
# k8s.io/dynamic-resource-allocation v0.37.2 v1beta1 has exactly the fields, validation and
# field-by-field conversions of v1alpha1, so the objects differ in `apiVersion` only.
# Files of Tandem 0.1.0 hold v1alpha1 alone; they are read the same and gain v1beta1 when rewritten.
API_VERSIONS = (f"{GROUP}/v1beta1", f"{GROUP}/v1alpha1")
KIND = "DeviceMetadata"


class MetadataError(NodeError):
    """Metadata cannot be written or updated for this claim; the message names what and why."""


@dataclass(frozen=True)
class MetadataDevice:
    request: str  # request reference as allocated (may be "req/sub")
    pool: str
    name: str
    attributes: dict[str, dict[str, Any]]  # API JSON form, e.g. {"type": {"string": "gpu"}}
    network_data: NetworkDeviceData | None = None


def attributes_json(device: Device) -> dict[str, dict[str, Any]]:
    """The device's attributes as the ResourceSlice publishes them, so a container reads the same values."""
    return {k: attribute_to_api(v) for k, v in sorted(device.attributes.items())}


def _device_json(driver: str, d: MetadataDevice) -> dict[str, Any]:
    out: dict[str, Any] = {"driver": driver, "pool": d.pool, "name": d.name}
    if d.attributes:
        out["attributes"] = d.attributes
    if d.network_data is not None:
        out["networkData"] = d.network_data
    return out


def document(
    driver: str,
    namespace: str,
    name: str,
    uid: str,
    generation: int,
    pod_claim_name: str,
    request: str,
    devices: Sequence[MetadataDevice],
) -> dict[str, Any]:
    """One `DeviceMetadata` object of the newest version, keys in the Go encoder's order (TypeMeta
    is kind, apiVersion; ObjectMeta's zero `creationTimestamp` is left out, `omitzero` since
    apimachinery v0.37); `encode_versions` makes the file of it."""
    doc: dict[str, Any] = {
        "kind": KIND,
        "apiVersion": API_VERSIONS[0],
        "metadata": {
            "name": name,
            "namespace": namespace,
            "uid": uid,
            "generation": generation,
        },
    }
    if pod_claim_name:
        doc["podClaimName"] = pod_claim_name
    req: dict[str, Any] = {"name": request}
    if devices:
        req["devices"] = [_device_json(driver, d) for d in devices]
    doc["requests"] = [req]
    return doc


def encode_stream(documents: Sequence[dict[str, Any]]) -> bytes:
    """The stream: each version's object (newest first), indented, each followed by a newline."""
    return "".join(json.dumps(doc, indent=2, ensure_ascii=False) + "\n" for doc in documents).encode()


def encode_versions(doc: dict[str, Any]) -> bytes:
    """A file's content: `doc` once per version of API_VERSIONS, newest first.

    Encoded once: the versions differ only in `apiVersion`, the second key (after the constant
    `kind`), so its first occurrence in the text is that key's. Indented JSON comes from the
    standard library's pure-Python encoder: for a GPU's attributes 0.35 ms once, 0.7 ms per file
    when encoded per version, on every prepare's path."""
    if list(doc)[:2] != ["kind", "apiVersion"]:
        return encode_stream([{**doc, "apiVersion": version} for version in API_VERSIONS])
    text = json.dumps({**doc, "apiVersion": API_VERSIONS[0]}, indent=2, ensure_ascii=False)
    newest = f'"apiVersion": {json.dumps(API_VERSIONS[0])}'
    return "".join(
        text.replace(newest, f'"apiVersion": {json.dumps(version)}', 1) + "\n" for version in API_VERSIONS
    ).encode()


def decode_stream(data: bytes) -> dict[str, Any]:
    """The first object of a version we know, by the consumer's rules (docs/reference/device-metadata.md,
    'Consumer rules'): the v1beta1 one of Tandem's files, the v1alpha1 one of a file of 0.1.0."""
    try:
        text = data.decode()
    except UnicodeDecodeError as e:
        raise MetadataError(f"metadata file is not UTF-8: {e}") from None
    decoder = json.JSONDecoder()
    pos, unknown = 0, []
    while True:
        while pos < len(text) and text[pos].isspace():
            pos += 1
        if pos == len(text):
            break
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except ValueError as e:
            raise MetadataError(f"metadata file is not a JSON stream: {e}") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("apiVersion"), str):
            raise MetadataError("metadata object without apiVersion")
        if obj["apiVersion"] not in API_VERSIONS:
            unknown.append(obj["apiVersion"])
            continue
        if obj.get("kind") != KIND:
            raise MetadataError(f"metadata object of kind {obj.get('kind')!r}, expected {KIND}")
        if not isinstance(obj.get("metadata"), dict) or not isinstance(obj.get("requests", []), list):
            raise MetadataError("metadata object with a malformed metadata or requests field")
        return obj
    if unknown:
        raise MetadataError(f"no compatible metadata version found (unknown versions: {', '.join(unknown)})")
    raise MetadataError("no metadata objects found")
