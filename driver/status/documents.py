"""The JSON documents of the status socket (`driver.status.server`), built: a device and who
holds it, and one claim's whole story for `tandemctl claim`. Their shapes, which `tandemctl` reads
them as, are `driver.status.shapes`.

Apart from the socket's serving and routing, so that each stays small. What a device's holders
are is the checkpoint's word: the claims whose records name it, and the pods those claims were
reserved for when they were prepared (a record of an older release names no pods: then the
claim alone is shown).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

from cdi import is_dns_label, is_dns_subdomain
from driver.claims.checkpoint import ClaimRecord, DeviceRecord
from driver.claims.files import ClaimFiles
from driver.claims.vocabulary import PrepareState
from driver.config import is_uid
from driver.errors import EndpointError
from driver.events import ClaimFailure
from driver.health.cordon import Cordon
from driver.health.gpu.release import Release
from driver.model import NUMA_NODE, PCI_BUS_ID, PCIE_ROOT, AttrValue, Device, Version
from driver.resource_api import rfc3339
from driver.status.shapes import (
    NOT_PREPARED,
    AttrJson,
    ClaimDoc,
    ClaimRecordDoc,
    CordonDoc,
    DeviceDoc,
    DeviceStatusDoc,
    LastErrorDoc,
    PreparedDeviceDoc,
    ReleaseDoc,
)
from driver.untrusted import shown


class UnknownClaim(EndpointError):
    """No record and no remembered failure for the claim asked about."""


class BadClaimKey(EndpointError):
    """What was asked for is neither a claim UID nor NAMESPACE/NAME."""


@dataclass(frozen=True)
class Holders:
    """Who holds a device: its claims (NAMESPACE/NAME) and their pods (NAMESPACE/NAME)."""

    claims: list[str]
    pods: list[str]


def _json_value(value: AttrValue | None) -> AttrJson:
    if isinstance(value, Version):
        return value.value
    if isinstance(value, tuple):
        return [v.value if isinstance(v, Version) else v for v in value]
    return value


def device_doc(device: Device, holders: Holders) -> DeviceDoc:
    attrs = device.attributes
    return {
        "name": device.name,
        "kind": str(device.kind),
        "model": _json_value(attrs.get("productName") or attrs.get("ifName") or ""),
        "uuid": _json_value(attrs.get("uuid")),
        "rdmaDevice": _json_value(attrs.get("rdmaDevice")),
        "numaNode": _json_value(attrs.get(NUMA_NODE)),
        "pcieRoot": _json_value(attrs.get(PCIE_ROOT)),
        "pciBusID": _json_value(attrs.get(PCI_BUS_ID)),
        "health": str(device.health),
        "healthMessage": device.health_message,
        "taints": [{"key": t.key, "value": t.value, "effect": str(t.effect)} for t in device.taints],
        "claims": holders.claims,
        "pods": holders.pods,
    }


def holders_by_device(prepared: dict[str, ClaimRecord]) -> dict[str, Holders]:
    out: dict[str, Holders] = {}
    for claim in sorted(prepared.values(), key=lambda c: (c.namespace, c.name)):
        for d in claim.devices:
            holders = out.setdefault(d.device, Holders([], []))
            if f"{claim.namespace}/{claim.name}" not in holders.claims:
                holders.claims.append(f"{claim.namespace}/{claim.name}")
                holders.pods.extend(f"{claim.namespace}/{pod}" for pod in claim.pods)
    return out


class ClaimFacts:
    """The claims as the status socket tells them: the checkpoint's records, the files on the
    node, and the last failed prepare the event recorder remembers (`driver.events`)."""

    def __init__(
        self,
        prepared: Callable[[], dict[str, ClaimRecord]],
        files: ClaimFiles,
        last_failure: Callable[[str], ClaimFailure | None],
        failures: Callable[[], list[ClaimFailure]],
    ) -> None:
        self.prepared = prepared
        self._files = files
        self._last_failure = last_failure
        self._failures = failures

    def report(self, key: str) -> ClaimDoc:
        """Claim `key` (its UID, or NAMESPACE/NAME): record, files, status as applied, last error."""
        prepared = self.prepared()
        namespace, slash, name = key.partition("/")
        if slash and is_dns_label(namespace) and is_dns_subdomain(name):
            uids = [uid for uid, c in prepared.items() if (c.namespace, c.name) == (namespace, name)]
            failed = [f.uid for f in self._failures() if (f.namespace, f.name) == (namespace, name)]
            uid = (uids or failed[-1:] or [""])[0]
        elif is_uid(key):
            uid = key
        else:
            raise BadClaimKey(f"{shown(key)} is neither a claim UID nor NAMESPACE/NAME")
        record, failure = prepared.get(uid), self._last_failure(uid) if uid else None
        if record is not None:
            return _record_doc(uid, record, self._present(uid), _last_error(failure))
        if failure is not None:
            return {
                "uid": uid,
                "namespace": failure.namespace,
                "name": failure.name,
                "state": NOT_PREPARED,
                "pods": [],
                "devices": [],
                "status": [],
                "files": self._present(uid),
                "lastError": _last_error(failure),
            }
        raise UnknownClaim(f"claim {key} is not prepared on this node, and no failed prepare of it is remembered")

    def _present(self, uid: str) -> dict[str, bool]:
        return self._files.present(uid) if is_uid(uid) else {}  # a failure may be of a bad reference


def _last_error(failure: ClaimFailure | None) -> LastErrorDoc | None:
    return {"at": rfc3339(failure.at), "error": failure.error} if failure is not None else None


def _record_doc(uid: str, record: ClaimRecord, files: dict[str, bool], error: LastErrorDoc | None) -> ClaimDoc:
    """A prepared claim's record. Prepare completes a record only after the API server took the
    claim's status: what `status` says was applied then (Ready, the NIC's network data)."""
    ready = record.state == PrepareState.COMPLETED
    status: list[DeviceStatusDoc] = []
    for d in record.devices:
        entry: DeviceStatusDoc = {"device": d.device, "ready": ready}
        if d.network_data:
            entry["networkData"] = d.network_data
        status.append(entry)
    return {
        "uid": uid,
        "namespace": record.namespace,
        "name": record.name,
        "state": str(record.state),
        "pods": [f"{record.namespace}/{p}" for p in record.pods],
        "devices": [_prepared_device(d) for d in record.devices],
        "status": status,
        "files": files,
        "lastError": error,
    }


def record_doc(uid: str, record: ClaimRecord) -> ClaimRecordDoc:
    """A claim of /claims: the checkpoint's record as it stores it, and its UID."""
    return cast(ClaimRecordDoc, {"uid": uid, **record.to_json()})  # ClaimRecord.to_json is a dict[str, Any]


def _prepared_device(d: DeviceRecord) -> PreparedDeviceDoc:
    return cast(PreparedDeviceDoc, d.to_json())  # DeviceRecord.to_json is a dict[str, Any]


def cordon_doc(c: Cordon) -> CordonDoc:
    return {"device": c.device, "reason": c.reason, "by": c.by, "since": c.since}


def release_doc(r: Release) -> ReleaseDoc:
    return {"gpu": r.gpu, "device": r.device, "reason": r.reason, "by": r.by, "since": r.since}
