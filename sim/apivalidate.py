"""Validation of objects written to the simulated API server.

Two layers, as in a real server: the published OpenAPI schema of Kubernetes 1.37 (from the
`kubernetes-validate` package, strict: unknown fields are errors) and the hand-written rules the
schema cannot express (docs/reference/resource-api.md, 'Validation the OpenAPI schema cannot
express' and 'Claim status: devices'). Every function returns a list of problems in the API
server's `path: Invalid value: ...` wording; an empty list means valid.

The limits and name patterns below deliberately repeat what the driver has in
`driver.resource_api` and `cdi.names`: this is the API server the driver is tested against, so it
keeps its own copy of Kubernetes' rules, written from the API's source. Sharing the driver's
constants would make a wrong limit in the driver pass every test against its own mistake.

Schema loading is the costly part (a 1.8 MB definitions file), so validators are built once per
process and kind and shared by every server instance.
"""

from __future__ import annotations

import functools
import ipaddress
import json
import re
from collections.abc import Callable
from typing import Any

import jsonschema
from referencing import Registry, Resource

from sim import apiquantity
from sim.capacity import request_policy_problems

SCHEMA_VERSION = "v1.37.0-local-strict"

# Kubernetes' own numbers and patterns (resource/v1 validation, apimachinery), independent of the
# driver's on purpose: see the module docstring.
MAX_DEVICES = 128
MAX_DEVICES_ADVANCED = 64
MAX_ATTRIBUTES_AND_CAPACITIES = 32
MAX_ATTRIBUTE_VALUES = 48
MAX_VALUE_LENGTH = 64
MAX_TAINTS = 16
MAX_COUNTER_SETS = 8
MAX_COUNTERS_PER_SET = 32
MAX_COUNTER_CONSUMPTIONS = 2
MAX_COUNTERS_PER_CONSUMPTION = 32
MAX_DEVICE_CONDITIONS = 8
MAX_NETWORK_IPS = 16
MAX_BINDING_CONDITIONS = 4  # BindingConditionsMaxSize, and BindingFailureConditionsMaxSize
MAX_CONDITION_REASON = 1024
MAX_CONDITION_MESSAGE = 32 * 1024
LIST_VALUE_FIELDS = ("ints", "bools", "strings", "versions")
SCALAR_VALUE_FIELDS = ("int", "bool", "string", "version")
TAINT_EFFECTS = ("None", "NoSchedule", "NoExecute")

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_UID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
_C_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_CONDITION_REASON = re.compile(r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$")
_LABEL_NAME = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
_SEMVER = re.compile(
    r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)"
    r"(?:-((?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*)(?:\.(?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*))*))?"
    r"(?:\+([0-9a-zA-Z-]+(?:\.[0-9a-zA-Z-]+)*))?$"
)


# --- schema -------------------------------------------------------------------------------------


@functools.cache
def _registry() -> Registry:
    import kubernetes_validate  # the package's data directory holds the schemas

    base = _schema_dir(kubernetes_validate.__file__)
    with open(f"{base}/_definitions.json", encoding="utf-8") as f:
        definitions = json.load(f)
    return Resource.from_contents(definitions) @ Registry()


def _schema_dir(package_file: str) -> str:
    return package_file.rsplit("/", 1)[0] + f"/kubernetes-json-schema/{SCHEMA_VERSION}"


@functools.cache
def _validator(api_version: str, kind: str) -> jsonschema.Draft202012Validator | None:
    import kubernetes_validate

    group_version = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", api_version)
    path = f"{_schema_dir(kubernetes_validate.__file__)}/{kind.lower()}-{group_version}.json"
    try:
        with open(path, encoding="utf-8") as f:
            schema = json.load(f)
    except FileNotFoundError:
        return None
    registry = Resource.from_contents(schema) @ _registry()
    return jsonschema.Draft202012Validator(schema, registry=registry)


def warm_up() -> None:
    """Load the schemas of the kinds the simulator serves now rather than on the first write."""
    for api_version, kind in (
        ("resource.k8s.io/v1", "ResourceSlice"),
        ("resource.k8s.io/v1", "ResourceClaim"),
        ("resource.k8s.io/v1", "DeviceClass"),
        ("v1", "Node"),
    ):
        _validator(api_version, kind)


def schema_problems(obj: dict[str, Any]) -> list[str]:
    """Problems of `obj` against the strict 1.37 OpenAPI schema of its kind (at most 10 reported)."""
    validator = _validator(str(obj.get("apiVersion", "")), str(obj.get("kind", "")))
    if validator is None:
        return [f"kind: Invalid value: {obj.get('kind')!r}: no schema for {obj.get('apiVersion')}"]
    problems = []
    for error in sorted(validator.iter_errors(obj), key=lambda e: list(map(str, e.absolute_path)))[:10]:
        problems.append(f"{_path(error.absolute_path)}: Invalid value: {error.message}")
    return problems


def _path(parts: Any) -> str:
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "<root>"


# --- names --------------------------------------------------------------------------------------


def dns_subdomain_problems(path: str, value: Any) -> list[str]:
    if not isinstance(value, str) or len(value) > 253 or not _DNS_SUBDOMAIN.match(value):
        return [
            f"{path}: Invalid value: {value!r}: a lowercase RFC 1123 subdomain must consist of lower case "
            "alphanumeric characters, '-' or '.', and must start and end with an alphanumeric character"
        ]
    return []


def dns_label_problems(path: str, value: Any) -> list[str]:
    if not isinstance(value, str) or len(value) > 63 or not _DNS_LABEL.match(value):
        return [
            f"{path}: Invalid value: {value!r}: a lowercase RFC 1123 label must consist of lower case "
            "alphanumeric characters or '-', start and end with an alphanumeric character, at most 63 characters"
        ]
    return []


def qualified_name_problems(path: str, key: str) -> list[str]:
    """An attribute or capacity key: C identifier <=32, optionally prefixed by `<DNS subdomain <=63>/`."""
    domain, sep, ident = key.rpartition("/")
    problems = []
    if sep and (len(domain) > 63 or not _DNS_SUBDOMAIN.match(domain) or "/" in domain):
        problems.append(f"{path}: Invalid value: {key!r}: the domain must be a DNS subdomain of at most 63 characters")
    if len(ident) > 32 or not _C_IDENTIFIER.match(ident):
        problems.append(f"{path}: Invalid value: {key!r}: the name must be a C identifier of at most 32 characters")
    return problems


def label_key_problems(path: str, key: Any) -> list[str]:
    if not isinstance(key, str) or not key:
        return [f"{path}: Required value"]
    prefix, sep, name = key.rpartition("/")
    if (
        (sep and (len(prefix) > 253 or not _DNS_SUBDOMAIN.match(prefix)))
        or len(name) > 63
        or not _LABEL_NAME.match(name)
    ):
        return [f"{path}: Invalid value: {key!r}: must be a qualified name (optional DNS prefix and '/')"]
    return []


# --- ResourceSlice ------------------------------------------------------------------------------


def uses_advanced_features(device: dict[str, Any]) -> bool:
    """Whether a device lowers its slice's limit to 64 devices (taints, counters, list attributes)."""
    if device.get("taints") or device.get("consumesCounters"):
        return True
    return any(
        isinstance(attr, dict) and any(attr.get(f) is not None for f in LIST_VALUE_FIELDS)
        for attr in (device.get("attributes") or {}).values()
    )


def slice_problems(spec: dict[str, Any]) -> list[str]:
    """The ResourceSlice rules that the OpenAPI schema cannot express (docs/reference/resource-api.md, 'Validation the OpenAPI schema cannot express')."""
    problems: list[str] = []
    problems += dns_subdomain_problems("spec.driver", spec.get("driver"))
    if isinstance(spec.get("driver"), str) and len(spec["driver"]) > 63:
        problems.append("spec.driver: Too long: may not be more than 63 bytes")
    problems += _pool_problems(spec.get("pool"))
    problems += _node_selection_problems(spec)
    devices = spec.get("devices") or []
    if spec.get("devices") is not None and spec.get("sharedCounters") is not None:
        problems.append('spec: Invalid value: "": only one of `sharedCounters` or `devices` is allowed')
    shared = spec.get("sharedCounters") or []
    if len(shared) > MAX_COUNTER_SETS:
        problems.append(f"spec.sharedCounters: Too many: {len(shared)}: must have at most {MAX_COUNTER_SETS} items")
    set_names: set[str] = set()
    for i, counter_set in enumerate(shared):
        path = f"spec.sharedCounters[{i}]"
        problems += dns_label_problems(f"{path}.name", counter_set.get("name"))
        if counter_set.get("name") in set_names:
            problems.append(f"{path}.name: Duplicate value: {counter_set.get('name')!r}")
        set_names.add(counter_set.get("name"))
        problems += _counters_problems(f"{path}.counters", counter_set.get("counters"), MAX_COUNTERS_PER_SET)
    limit = MAX_DEVICES_ADVANCED if any(uses_advanced_features(d) for d in devices) else MAX_DEVICES
    if len(devices) > limit:
        problems.append(f"spec.devices: Too many: {len(devices)}: must have at most {limit} items")
    seen: set[str] = set()
    for i, device in enumerate(devices):
        path = f"spec.devices[{i}]"
        name = device.get("name")
        problems += dns_label_problems(f"{path}.name", name)
        if name in seen:
            problems.append(f"{path}.name: Duplicate value: {name!r}")
        seen.add(name)
        problems += _device_problems(path, device, bool(spec.get("perDeviceNodeSelection")))
    return problems


def _pool_problems(pool: Any) -> list[str]:
    if not isinstance(pool, dict):
        return ["spec.pool: Required value"]
    problems = []
    name = pool.get("name")
    if not isinstance(name, str) or not name:
        problems.append("spec.pool.name: Required value")
    elif len(name) > 253 or any(not _DNS_SUBDOMAIN.match(part) for part in name.split("/")):
        problems.append(f"spec.pool.name: Invalid value: {name!r}: must be DNS subdomains separated by '/'")
    generation = pool.get("generation")
    if not isinstance(generation, int) or generation < 0:
        problems.append(f"spec.pool.generation: Invalid value: {generation!r}: must be greater than or equal to 0")
    count = pool.get("resourceSliceCount")
    if not isinstance(count, int) or count <= 0:
        problems.append(f"spec.pool.resourceSliceCount: Invalid value: {count!r}: must be greater than zero")
    return problems


def _node_selection_problems(spec: dict[str, Any]) -> list[str]:
    chosen = [
        key
        for key in ("nodeName", "nodeSelector", "allNodes", "perDeviceNodeSelection")
        if spec.get(key) not in (None, False)
    ]
    problems = []
    if len(chosen) != 1:
        problems.append(
            "spec: Invalid value: exactly one of `nodeName`, `nodeSelector`, `allNodes`, "
            f"`perDeviceNodeSelection` is required, got {chosen or 'none'}"
        )
    if spec.get("nodeName") is not None:
        problems += dns_subdomain_problems("spec.nodeName", spec["nodeName"])
    selector = spec.get("nodeSelector")
    if selector is not None and len(selector.get("nodeSelectorTerms") or []) != 1:
        problems.append("spec.nodeSelector.nodeSelectorTerms: Invalid value: must have exactly one node selector term")
    for key in ("allNodes", "perDeviceNodeSelection"):
        if spec.get(key) is False:
            problems.append(f"spec.{key}: Invalid value: false: must be either unset or set to true")
    return problems


def _device_problems(path: str, device: dict[str, Any], per_device_nodes: bool) -> list[str]:
    problems: list[str] = []
    attributes = device.get("attributes") or {}
    capacity = device.get("capacity") or {}
    if len(attributes) + len(capacity) > MAX_ATTRIBUTES_AND_CAPACITIES:
        problems.append(
            f"{path}: Too many: {len(attributes) + len(capacity)}: the total number of attributes and "
            f"capacities must not exceed {MAX_ATTRIBUTES_AND_CAPACITIES}"
        )
    values = 0
    for key, attr in attributes.items():
        problems += qualified_name_problems(f"{path}.attributes[{key}]", key)
        count, attr_problems = _attribute_problems(f"{path}.attributes[{key}]", attr)
        values += count
        problems += attr_problems
    if values > MAX_ATTRIBUTE_VALUES:
        problems.append(
            f"{path}.attributes: Too many: {values}: the total number of attribute values must not exceed "
            f"{MAX_ATTRIBUTE_VALUES}"
        )
    for key, cap in capacity.items():
        problems += qualified_name_problems(f"{path}.capacity[{key}]", key)
        if not isinstance(cap, dict) or cap.get("requestPolicy") is None:
            continue
        if not device.get("allowMultipleAllocations"):
            problems.append(
                f"{path}.capacity[{key}].requestPolicy: Forbidden: allowed only with allowMultipleAllocations"
            )
        else:
            problems += request_policy_problems(f"{path}.capacity[{key}].requestPolicy", cap)
    consumes = device.get("consumesCounters") or []
    if len(consumes) > MAX_COUNTER_CONSUMPTIONS:
        problems.append(
            f"{path}.consumesCounters: Too many: {len(consumes)}: must have at most {MAX_COUNTER_CONSUMPTIONS} items"
        )
    consumed: set[str] = set()
    for j, use in enumerate(consumes):
        problems += dns_label_problems(f"{path}.consumesCounters[{j}].counterSet", use.get("counterSet"))
        if use.get("counterSet") in consumed:
            problems.append(f"{path}.consumesCounters[{j}].counterSet: Duplicate value: {use.get('counterSet')!r}")
        consumed.add(use.get("counterSet"))
        problems += _counters_problems(
            f"{path}.consumesCounters[{j}].counters", use.get("counters"), MAX_COUNTERS_PER_CONSUMPTION
        )
    taints = device.get("taints") or []
    if len(taints) > MAX_TAINTS:
        problems.append(f"{path}.taints: Too many: {len(taints)}: must have at most {MAX_TAINTS} items")
    for j, taint in enumerate(taints):
        problems += label_key_problems(f"{path}.taints[{j}].key", taint.get("key"))
        if taint.get("effect") not in TAINT_EFFECTS:
            problems.append(
                f"{path}.taints[{j}].effect: Unsupported value: {taint.get('effect')!r}: supported values: "
                + ", ".join(f'"{e}"' for e in TAINT_EFFECTS)
            )
        value = taint.get("value")
        if value and (len(value) > 63 or not _LABEL_NAME.match(value)):
            problems.append(f"{path}.taints[{j}].value: Invalid value: {value!r}: must be a valid label value")
    problems += binding_problems(path, device)
    own = [k for k in ("nodeName", "nodeSelector", "allNodes") if device.get(k) not in (None, False)]
    if per_device_nodes and len(own) != 1:
        problems.append(f"{path}: Invalid value: exactly one of `nodeName`, `nodeSelector`, `allNodes` is required")
    if not per_device_nodes and own:
        problems.append(f"{path}.{own[0]}: Forbidden: only allowed when spec.perDeviceNodeSelection is true")
    return problems


def _counters_problems(path: str, counters: Any, limit: int) -> list[str]:
    """A counter map: 1 to `limit` entries, each named by a DNS label."""
    if not isinstance(counters, dict) or not counters:
        return [f"{path}: Required value"]
    problems = []
    if len(counters) > limit:
        problems.append(f"{path}: Too many: {len(counters)}: must have at most {limit} items")
    for name in counters:
        problems += dns_label_problems(f"{path}[{name}]", name)
    return problems


def _attribute_problems(path: str, attr: Any) -> tuple[int, list[str]]:
    """(number of values, problems) of one DeviceAttribute."""
    if not isinstance(attr, dict):
        return 0, [f"{path}: Invalid value: must be an object"]
    set_fields = [f for f in (*SCALAR_VALUE_FIELDS, *LIST_VALUE_FIELDS) if attr.get(f) is not None]
    if len(set_fields) != 1:
        return 0, [f"{path}: Invalid value: exactly one value must be specified"]
    field = set_fields[0]
    value = attr[field]
    problems: list[str] = []
    items = value if field in LIST_VALUE_FIELDS else [value]
    if field in LIST_VALUE_FIELDS and not items:
        problems.append(f"{path}.{field}: Required value: must not be empty")
    for item in items:
        if field in ("string", "strings", "version", "versions") and len(str(item).encode()) > MAX_VALUE_LENGTH:
            problems.append(f"{path}.{field}: Too long: may not be more than {MAX_VALUE_LENGTH} bytes")
        if field in ("version", "versions") and not _SEMVER.match(str(item)):
            problems.append(
                f"{path}.{field}: Invalid value: {item!r}: must be a string compatible with semver.org spec 2.0.0"
            )
    return len(items), problems


# --- quantities ---------------------------------------------------------------------------------


def rewrite_quantities(node: Any, path: str, problems: list[str], is_quantity: Callable[[str], bool]) -> Any:
    """Canonicalise every quantity string in `node` (a copy is returned); bad ones are added to `problems`.

    `is_quantity(path)` says which paths hold quantities (paths use `[]` for list items and `{}` for map values).
    """
    if isinstance(node, dict):
        return {
            k: rewrite_quantities(v, f"{path}.{{}}" if _is_map(path) else f"{path}.{k}", problems, is_quantity)
            for k, v in node.items()
        }
    if isinstance(node, list):
        return [rewrite_quantities(v, f"{path}[]", problems, is_quantity) for v in node]
    if is_quantity(path):
        if isinstance(node, (int, float)) and not isinstance(node, bool):
            node = str(node)  # a JSON number is a valid quantity too
        try:
            return apiquantity.canonical(node)
        except ValueError as e:
            problems.append(f"{path}: Invalid value: {e}")
    return node


_MAP_PATHS = (".attributes", ".capacity", ".counters", ".consumedCapacity", ".requests")


def _is_map(path: str) -> bool:
    return path.endswith(_MAP_PATHS)


_SLICE_QUANTITY_PATHS = re.compile(
    r"^spec\.(devices\[\]\.capacity\.\{\}\.(value|requestPolicy\.(default|validValues\[\]|validRange\.(min|max|step)))"
    r"|devices\[\]\.consumesCounters\[\]\.counters\.\{\}\.value"
    r"|sharedCounters\[\]\.counters\.\{\}\.value)$"
)


def slice_quantity_path(path: str) -> bool:
    return bool(_SLICE_QUANTITY_PATHS.match(path))


_CLAIM_QUANTITY_PATHS = re.compile(
    r"^(spec\.devices\.requests\[\]\.(exactly|firstAvailable\[\])\.capacity\.requests\.\{\}"
    r"|status\.allocation\.devices\.results\[\]\.consumedCapacity\.\{\})$"
)


def claim_quantity_path(path: str) -> bool:
    """Capacity requests of a claim and what its allocation consumed (consumable capacity)."""
    return bool(_CLAIM_QUANTITY_PATHS.match(path))


# --- ResourceClaim ------------------------------------------------------------------------------


def device_status_key(entry: dict[str, Any]) -> tuple[str, str, str, str]:
    """The list-map key of status.devices (and of allocation results): driver, pool, device, shareID."""
    return (
        str(entry.get("driver", "")),
        str(entry.get("pool", "")),
        str(entry.get("device", "")),
        str(entry.get("shareID") or ""),
    )


def claim_status_problems(status: dict[str, Any]) -> list[str]:
    """status.devices rules (docs/reference/resource-api.md, 'Claim status: devices'): unique keys, allocated devices only, conditions, IPs."""
    problems: list[str] = []
    results = ((status.get("allocation") or {}).get("devices") or {}).get("results") or []
    allocated = {device_status_key(r) for r in results}
    for i, result in enumerate(results):
        problems += binding_problems(f"status.allocation.devices.results[{i}]", result)
        share = result.get("shareID")
        if share is not None and not _UID.match(str(share)):
            problems.append(
                f"status.allocation.devices.results[{i}].shareID: Invalid value: {share!r}: must be a lowercase UUID"
            )
    seen: set[tuple[str, str, str, str]] = set()
    for i, entry in enumerate(status.get("devices") or []):
        path = f"status.devices[{i}]"
        key = device_status_key(entry)
        if key in seen:
            problems.append(f"{path}: Duplicate value: {key}")
        seen.add(key)
        if key not in allocated:
            problems.append(f"{path}: Invalid value: {key}: must be an allocated device in the claim")
        conditions = entry.get("conditions") or []
        if len(conditions) > MAX_DEVICE_CONDITIONS:
            problems.append(f"{path}.conditions: Too many: must have at most {MAX_DEVICE_CONDITIONS} items")
        problems += condition_problems(f"{path}.conditions", conditions)
        data = entry.get("data")
        if data is not None and not isinstance(data, dict):
            problems.append(f"{path}.data: Invalid value: must be a JSON object")
        ips = ((entry.get("networkData") or {}).get("ips")) or []
        if len(ips) > MAX_NETWORK_IPS:
            problems.append(f"{path}.networkData.ips: Too many: must have at most {MAX_NETWORK_IPS} items")
        for ip in ips:
            try:
                if str(ipaddress.ip_interface(ip)) != ip:
                    raise ValueError("not canonical")
            except ValueError:
                problems.append(
                    f"{path}.networkData.ips: Invalid value: {ip!r}: must be an IP address in canonical CIDR form"
                )
    return problems


def condition_problems(path: str, conditions: list[Any]) -> list[str]:
    """metav1.Condition rules (apimachinery's ValidateConditions): a qualified-name type, unique
    in the list; a known status; a reason in CamelCase-like form; bounded reason and message."""
    problems: list[str] = []
    types: set[Any] = set()
    for j, cond in enumerate(conditions):
        at = f"{path}[{j}]"
        if not isinstance(cond, dict):
            problems.append(f"{at}: Invalid value: must be an object")
            continue
        kind = cond.get("type")
        if kind in types:
            problems.append(f"{at}: Duplicate value: {kind!r}")
        types.add(kind)
        problems += label_key_problems(f"{at}.type", kind)
        if cond.get("status") not in ("True", "False", "Unknown"):
            problems.append(
                f'{at}.status: Unsupported value: {cond.get("status")!r}: supported values: "False", "True", "Unknown"'
            )
        if not isinstance(cond.get("observedGeneration", 0), int) or cond.get("observedGeneration", 0) < 0:
            problems.append(f"{at}.observedGeneration: Invalid value: must be greater than or equal to zero")
        if not cond.get("lastTransitionTime"):
            problems.append(f"{at}.lastTransitionTime: Required value")
        reason = str(cond.get("reason") or "")
        if not reason:
            problems.append(f"{at}.reason: Required value")
        elif not _CONDITION_REASON.match(reason):
            problems.append(
                f"{at}.reason: Invalid value: {reason!r}: a condition reason must start with alphabetic "
                "character, optionally followed by a string of alphanumeric characters or '_,:', and must "
                "end with an alphanumeric character or '_'"
            )
        if len(reason) > MAX_CONDITION_REASON:
            problems.append(f"{at}.reason: Too long: may not be more than {MAX_CONDITION_REASON} bytes")
        if len(str(cond.get("message") or "")) > MAX_CONDITION_MESSAGE:
            problems.append(f"{at}.message: Too long: may not be more than {MAX_CONDITION_MESSAGE} bytes")
    return problems


def binding_problems(path: str, entry: dict[str, Any]) -> list[str]:
    """validateDeviceBindingParameters, for a slice's device and for an allocation result alike:
    at most 4 of each, qualified names, no duplicates, no overlap, and each list only with the
    other (bindsToNode is free of rules)."""
    conditions = entry.get("bindingConditions") or []
    failures = entry.get("bindingFailureConditions") or []
    problems: list[str] = []
    for name, values in (("bindingConditions", conditions), ("bindingFailureConditions", failures)):
        if len(values) > MAX_BINDING_CONDITIONS:
            problems.append(f"{path}.{name}: Too many: {len(values)}: must have at most {MAX_BINDING_CONDITIONS} items")
        seen: set[Any] = set()
        for i, value in enumerate(values):
            problems += label_key_problems(f"{path}.{name}[{i}]", value)
            if value in seen:
                problems.append(f"{path}.{name}[{i}]: Duplicate value: {value!r}")
            seen.add(value)
    for i, value in enumerate(failures):
        if value in conditions:
            problems.append(
                f"{path}.bindingFailureConditions[{i}]: Invalid value: {value!r}: "
                "bindingFailureConditions must not overlap with bindingConditions"
            )
    if failures and not conditions:
        problems.append(
            f"{path}.bindingConditions: Invalid value: []: bindingConditions are required to use bindingFailureConditions"
        )
    if conditions and not failures:
        problems.append(
            f"{path}.bindingFailureConditions: Invalid value: []: "
            "bindingFailureConditions are required to use bindingConditions"
        )
    return problems
