"""The JSON documents of the status socket (`driver.status.server`): a device and who holds it,
and one claim's whole story for `tandemctl claim`.

Apart from the socket's serving and routing, so that each stays small. What a device's holders
are is the checkpoint's word: the claims whose records name it, and the pods those claims were
reserved for when they were prepared (a record of an older release names no pods: then the
claim alone is shown).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cdi import is_dns_label, is_dns_subdomain
from driver.claims.checkpoint import ClaimRecord
from driver.claims.files import ClaimFiles
from driver.claims.vocabulary import PrepareState
from driver.config import is_uid
from driver.errors import EndpointError
from driver.events import ClaimFailure
from driver.model import NUMA_NODE, PCI_BUS_ID, PCIE_ROOT, AttrValue, Device, Version
from driver.resource_api import rfc3339
from driver.untrusted import shown

NOT_PREPARED = "NotPrepared"  # `state` of a claim with no record, only a remembered failure


class UnknownClaim(EndpointError):
    """No record and no remembered failure for the claim asked about."""


class BadClaimKey(EndpointError):
    """What was asked for is neither a claim UID nor NAMESPACE/NAME."""


@dataclass(frozen=True)
class Holders:
    """Who holds a device: its claims (NAMESPACE/NAME) and their pods (NAMESPACE/NAME)."""

    claims: list[str]
    pods: list[str]


def _json_value(value: AttrValue | None) -> Any:
    if isinstance(value, Version):
        return value.value
    if isinstance(value, tuple):
        return [_json_value(v) for v in value]
    return value


def device_json(device: Device, holders: Holders) -> dict[str, Any]:
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

    def report(self, key: str) -> dict[str, Any]:
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
            doc = _record_json(uid, record)
        elif failure is not None:
            doc = {"uid": uid, "namespace": failure.namespace, "name": failure.name, "state": NOT_PREPARED}
            doc |= {"pods": [], "devices": [], "status": []}
        else:
            raise UnknownClaim(f"claim {key} is not prepared on this node, and no failed prepare of it is remembered")
        doc["files"] = self._files.present(uid) if is_uid(uid) else {}  # a failure may be of a bad reference
        doc["lastError"] = {"at": rfc3339(failure.at), "error": failure.error} if failure is not None else None
        return doc


def _record_json(uid: str, record: ClaimRecord) -> dict[str, Any]:
    """A prepared claim's record. Prepare completes a record only after the API server took the
    claim's status: what `status` says was applied then (Ready, the NIC's network data)."""
    ready = record.state == PrepareState.COMPLETED
    status = [{"device": d.device, "ready": ready} for d in record.devices]
    for entry, d in zip(status, record.devices, strict=True):
        if d.network_data:
            entry["networkData"] = d.network_data
    return {
        "uid": uid,
        "namespace": record.namespace,
        "name": record.name,
        "state": str(record.state),
        "pods": [f"{record.namespace}/{p}" for p in record.pods],
        "devices": [d.to_json() for d in record.devices],
        "status": status,
    }
