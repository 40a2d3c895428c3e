"""Tandem's opaque claim configuration: `apiVersion: tandem.dev/v1alpha1`, kinds GpuConfig and NicConfig.

Users put these in a DeviceClass or a ResourceClaim (`spec.devices.config[].opaque`); the
scheduler copies them into the allocation. Decoding is strict - an unknown or mistyped field is
an error naming the field, because a silently ignored `mode: exclusiv` is worse than a failed pod;
so are values: an address, route or MTU the kernel would refuse fails the claim at prepare, not
the container later.
Class configs apply before claim configs, in list order; later entries win field by field.
An error names the field as its author wrote it (`spec.devices.config[0].opaque.parameters.sharing`,
counting the claim's own entries, not the classes' the allocation puts first) and its JSON types
("must be a string"); the API server refuses most of these mistakes earlier, when the claim is
written (the ValidatingAdmissionPolicy `tandem-opaque-config` in daemonset.yaml), and prepare
keeps these checks for what that policy cannot see (a server without it, a DeviceClass's entries).

Some fields grant more than a device: `NicConfig.mad` exposes `umad`/`issm`, with which a pod
can act as an InfiniBand subnet manager and undo partition isolation for the whole fabric. Any
namespace user writes claims, only cluster admins write DeviceClasses, so such fields are accepted
only from class configuration (allocation config `source: FromClass`); in any other entry they
fail the claim.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from driver.claims.vocabulary import NicMode, Sharing, TimeSliceInterval, case_hint, member_of
from driver.errors import InvalidInput
from driver.kube.types import AllocationResult
from driver.resource_api import MAX_OPAQUE_PARAMETERS
from driver.untrusted import shown

API_VERSION = "tandem.dev/v1alpha1"
# Linux interface names: at most 15 bytes, no '/', no whitespace, not "." or "..". Used with
# fullmatch: `$` would also accept a trailing newline.
_IFNAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:-]{0,14}")
# Characters of an address, network or gateway: the longest of any use (IPv6 with a prefix
# length) has 49. Longer text is refused before `ipaddress`, whose errors repeat it whole.
_MAX_ADDRESS_TEXT = 64


class ConfigDecodeError(InvalidInput):
    pass


@dataclass(frozen=True)
class GpuConfig:
    # Export per-GPU NIC pairing (NCCL_IB_HCA order etc.) when the claims prepared with it hold NICs.
    pair_nics: bool = True
    # MPS or TimeSlicing; None = the claim must hold the whole GPU (driver.claims.gpu.sharing).
    sharing: Sharing | None = None
    # TimeSlicing only: the GPU's time slice; None = Default.
    time_slice_interval: TimeSliceInterval | None = None


@dataclass(frozen=True)
class Route:
    """A route the pod's interface gets: to `destination` (a network), through `via` (or on-link)."""

    destination: str
    via: str = ""


@dataclass(frozen=True)
class NicConfig:
    mode: NicMode = NicMode.SHARED
    interface_name: str = ""
    # Also expose umad/issm (management datagrams: needed by ibstat, subnet tools; not by NCCL).
    mad: bool = False
    # Exclusive mode only: the interface's settings in the pod (`driver.claims.nic.setup`). Addresses
    # replace those it brought from the host; mtu 0 keeps its MTU.
    addresses: tuple[str, ...] = ()
    routes: tuple[Route, ...] = ()
    mtu: int = 0

    @property
    def exclusive(self) -> bool:
        return self.mode == NicMode.EXCLUSIVE


# Field -> (attribute, JSON type); a StrEnum's field is a string, one of its members.
_FIELDS: dict[str, dict[str, tuple[str, type]]] = {
    "GpuConfig": {
        "pairNics": ("pair_nics", bool),
        "sharing": ("sharing", Sharing),
        "timeSliceInterval": ("time_slice_interval", TimeSliceInterval),
    },
    "NicConfig": {
        "mode": ("mode", NicMode),
        "interfaceName": ("interface_name", str),
        "mad": ("mad", bool),
        "addresses": ("addresses", list),
        "routes": ("routes", list),
        "mtu": ("mtu", int),
    },
}
MAX_ADDRESSES = 16  # what networkData.ips can report
MAX_ROUTES = 16
MIN_MTU, MIN_MTU_IPV6, MAX_MTU = 68, 1280, 65535
_IP_SETTINGS = ("addresses", "routes", "mtu")
# Fields only a DeviceClass may set, and why (see the module docstring).
_CLASS_ONLY: dict[tuple[str, str], str] = {
    ("NicConfig", "mad"): "umad/issm let a pod act as an InfiniBand subnet manager for the whole fabric",
}
FROM_CLASS = "FromClass"


@dataclass(frozen=True)
class OpaqueEntry:
    """One `config[]` entry of an allocation, already filtered to this driver."""

    # FromClass | FromClaim; anything but FromClass counts as a claim's (`_CLASS_ONLY`).
    source: str
    requests: tuple[str, ...]
    parameters: object  # any JSON; `_decode` takes only an object
    # Its place among the entries of its own source, every driver's: a claim's entry is the
    # claim's `spec.devices.config[index]`.
    index: int

    @property
    def where(self) -> str:
        """The entry's parameters as their author wrote them, for an error message."""
        config = "DeviceClass config" if self.source == FROM_CLASS else "spec.devices.config"
        return f"{config}[{self.index}].opaque.parameters"


@dataclass
class RequestConfig:
    gpu: GpuConfig = field(default_factory=GpuConfig)
    nic: NicConfig = field(default_factory=NicConfig)


def _size(parameters: dict[str, Any]) -> int:
    """Bytes of `parameters` as compact JSON, as the API server measures them; a nesting too
    deep to serialise counts as too large."""
    try:
        text = json.dumps(parameters, separators=(",", ":"), ensure_ascii=False)
    except (RecursionError, TypeError, ValueError):
        return MAX_OPAQUE_PARAMETERS + 1
    return len(text.encode(errors="surrogatepass"))


# A JSON value's type as its author would name it.
_JSON_TYPES: dict[type, str] = {
    bool: "a boolean",
    int: "an integer",
    float: "a number",
    str: "a string",
    list: "a list",
    dict: "an object",
    type(None): "null",
}


def _json_type(value: object) -> str:
    return _JSON_TYPES.get(type(value), f"a {type(value).__name__}")


def _got(value: object) -> str:
    """What a field held, for an error message: a string shown (`driver.untrusted`), anything
    else by its type alone."""
    return shown(value) if isinstance(value, str) else _json_type(value)


def _decode(entry: OpaqueEntry) -> tuple[str, dict[str, Any]]:
    where = entry.where
    p = entry.parameters
    if not isinstance(p, dict):
        raise ConfigDecodeError(f"{where} must be an object, got {_json_type(p)}")
    # Before anything of it is looked at: the API server holds parameters to this size, so more
    # comes from a server that does not, and is refused without being repeated.
    if (size := _size(p)) > MAX_OPAQUE_PARAMETERS:
        raise ConfigDecodeError(f"{where} is {size} bytes, at most {MAX_OPAQUE_PARAMETERS}")
    if p.get("apiVersion") != API_VERSION:
        raise ConfigDecodeError(f"{where}.apiVersion must be {API_VERSION!r}, got {_got(p.get('apiVersion'))}")
    kind = p.get("kind")
    if not isinstance(kind, str) or kind not in _FIELDS:  # a list or object is no key of _FIELDS
        hint = case_hint(kind, _FIELDS) if isinstance(kind, str) else ""
        raise ConfigDecodeError(f"{where}.kind must be one of {sorted(_FIELDS)}, got {_got(kind)}{hint}")
    out: dict[str, Any] = {}
    for key, value in p.items():
        if key in ("apiVersion", "kind"):
            continue
        if key not in _FIELDS[kind]:
            raise ConfigDecodeError(f"{where}: unknown {kind} field {shown(key)}{case_hint(key, _FIELDS[kind])}")
        attr, typ = _FIELDS[kind][key]
        json_type = str if issubclass(typ, StrEnum) else typ
        if type(value) is not json_type:
            raise ConfigDecodeError(f"{where}.{key} must be {_JSON_TYPES[json_type]}, got {_json_type(value)}")
        why = _CLASS_ONLY.get((kind, key))
        if why and entry.source != FROM_CLASS:
            raise ConfigDecodeError(
                f"{where}.{key} is accepted only from DeviceClass configuration, not a claim: {why}"
            )
        if issubclass(typ, StrEnum):
            try:
                value = member_of(typ, str(value), f"{where}.{key}")
            except ValueError as e:
                raise ConfigDecodeError(str(e)) from None
        out[attr] = value
    if kind == "NicConfig":
        if "interface_name" in out and not _IFNAME.fullmatch(out["interface_name"]):
            raise ConfigDecodeError(
                f"{where}.interfaceName {shown(out['interface_name'])} is not a valid interface name"
            )
        out.update(_ip_settings(where, out))
    return kind, out


def _ip_settings(where: str, values: dict[str, Any]) -> dict[str, Any]:
    """NicConfig.addresses, .routes and .mtu, checked as the kernel would take them: canonical
    addresses (host bits kept, as networkData reports them), routes to networks (no host bits),
    gateways of the same family inside a configured address's network, an MTU IPv6 can use."""
    out: dict[str, Any] = {}
    addresses = []
    for i, text in enumerate(values.get("addresses", ())):
        field_ = f"{where}.addresses[{i}]"
        try:
            fits = isinstance(text, str) and len(text) <= _MAX_ADDRESS_TEXT
            address = ipaddress.ip_interface(text) if fits else None
        except ValueError:
            address = None
        if address is None or "/" not in text:
            raise ConfigDecodeError(f"{field_} {_got(text)} is not an address with a prefix length (10.0.0.5/24)")
        ip = address.ip
        if ip.is_loopback or ip.is_multicast or ip.is_unspecified or ip.is_link_local:
            raise ConfigDecodeError(
                f"{field_} {shown(text)} is a loopback, multicast, unspecified or link-local address"
            )
        if address in addresses:
            raise ConfigDecodeError(f"{field_} {shown(text)} is given twice")
        addresses.append(address)
    if len(addresses) > MAX_ADDRESSES:
        raise ConfigDecodeError(f"{where}.addresses has {len(addresses)} entries, at most {MAX_ADDRESSES}")
    routes = []
    for i, raw in enumerate(values.get("routes", ())):
        field_ = f"{where}.routes[{i}]"
        if not isinstance(raw, dict) or not set(raw) <= {"destination", "via"} or "destination" not in raw:
            raise ConfigDecodeError(f"{field_} must be an object with destination and, optionally, via")
        for key, value in raw.items():
            # ipaddress takes integers too: 0 would become 0.0.0.0/32, true the gateway 0.0.0.1.
            if not isinstance(value, str):
                raise ConfigDecodeError(f"{field_}.{key} must be a string, got {_json_type(value)}")
            if len(value) > _MAX_ADDRESS_TEXT:
                raise ConfigDecodeError(f"{field_}.{key} {shown(value)} is too long for an address or network")
        try:
            destination = ipaddress.ip_network(raw["destination"], strict=True)
            via = ipaddress.ip_address(raw["via"]) if "via" in raw else None
        except ValueError as e:
            raise ConfigDecodeError(f"{field_}: {e}") from None
        if via is not None and via.version != destination.version:
            raise ConfigDecodeError(f"{field_}: via {via} and destination {destination} are of different IP versions")
        if via is not None and addresses and not any(via in a.network for a in addresses):
            raise ConfigDecodeError(f"{field_}: via {via} is in none of the networks of {where}.addresses")
        routes.append(Route(str(destination), str(via) if via is not None else ""))
    if len(routes) > MAX_ROUTES:
        raise ConfigDecodeError(f"{where}.routes has {len(routes)} entries, at most {MAX_ROUTES}")
    if "mtu" in values:
        low = MIN_MTU_IPV6 if any(a.version == 6 for a in addresses) else MIN_MTU
        if not low <= values["mtu"] <= MAX_MTU:
            raise ConfigDecodeError(f"{where}.mtu {values['mtu']} must be {low} to {MAX_MTU}")
        out["mtu"] = values["mtu"]
    if "addresses" in values:
        out["addresses"] = tuple(str(a) for a in addresses)
    if "routes" in values:
        out["routes"] = tuple(routes)
    return out


def _applies(entry: OpaqueEntry, request: str) -> bool:
    """Empty `requests` = every request; a parent request name also matches its subrequests."""
    return not entry.requests or request in entry.requests or request.split("/", 1)[0] in entry.requests


def resolve(entries: Iterable[OpaqueEntry], request: str) -> RequestConfig:
    """The effective config of one request: class configs first, then claim configs, later wins."""
    ordered = sorted(entries, key=lambda e: (e.source != FROM_CLASS, e.index))
    cfg = RequestConfig()
    for entry in ordered:
        kind, values = _decode(entry)  # decode every entry, so a bad one fails even if unused
        if not _applies(entry, request):
            continue
        if kind == "GpuConfig":
            cfg.gpu = dataclasses.replace(cfg.gpu, **values)
        else:
            cfg.nic = dataclasses.replace(cfg.nic, **values)
    if cfg.nic.exclusive and not cfg.nic.interface_name:
        raise ConfigDecodeError(f"request {shown(request)}: NicConfig.mode exclusive needs interfaceName")
    if not cfg.nic.exclusive and (cfg.nic.addresses or cfg.nic.routes or cfg.nic.mtu):
        raise ConfigDecodeError(
            f"request {shown(request)}: NicConfig.{'/'.join(_IP_SETTINGS)} apply to mode exclusive only: in shared mode "
            "the netdev stays the host's"
        )
    return cfg


def opaque_entries(allocation: AllocationResult, driver_name: str) -> list[OpaqueEntry]:
    """This driver's opaque configs of an allocation (other drivers' are none of our business),
    each numbered among its source's entries: the allocation puts the classes' first, then the
    claim's own, all of them, in the claim's order."""
    out = []
    seen = {True: 0, False: 0}  # entries so far, by "from a class"
    for c in (allocation.get("devices") or {}).get("config") or []:
        source = c.get("source", "")
        index, seen[source == FROM_CLASS] = seen[source == FROM_CLASS], seen[source == FROM_CLASS] + 1
        opaque = c.get("opaque")
        if opaque is None or opaque.get("driver") != driver_name:
            continue
        out.append(OpaqueEntry(source, tuple(c.get("requests") or ()), opaque.get("parameters"), index))
    return out
