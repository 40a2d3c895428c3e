"""The status socket's documents as TypedDicts: what `driver.status.server` answers and
`tandemctl` (`driver.ctl`) reads, camelCase as on the wire.

The daemon builds them (`driver.status.documents`, the server's endpoints); tandemctl, another
process, decodes them from JSON and takes them in through `checked`, the one place where a decoded
value becomes a typed document: it walks the value against its TypedDict and says where it does
not fit (a key missing, a value of another type), so a daemon that answers something else is a
clear message, not a KeyError deep in a table. Keys a document does not name (a newer daemon's,
or the checkpoint's own in a claim's record) are allowed and left unchecked.

A leaf: it imports only the typing of the API objects it shares (`driver.kube.types`), so the
command line does not load the claim flow and the inventory to read an answer.
"""

from __future__ import annotations

import types
from typing import (
    Any,
    Literal,
    NotRequired,
    Required,
    TypedDict,
    TypeVar,
    Union,
    cast,
    get_args,
    get_origin,
    get_type_hints,
)

from driver.kube.types import NetworkDeviceData

NOT_PREPARED = "NotPrepared"  # `state` of a claim with no record, only a remembered failure

# An attribute's value as JSON (`driver.model.AttrValue`: a version is its string, a list a list).
AttrJson = bool | int | str | list[bool | int | str] | None


class TaintDoc(TypedDict):
    key: str
    value: str
    effect: str


class DeviceDoc(TypedDict):
    """One device of /devices: what it is, where it sits, its health and who holds it."""

    name: str
    kind: str
    model: AttrJson  # productName of a GPU, ifName of a NIC
    uuid: AttrJson
    rdmaDevice: AttrJson
    numaNode: AttrJson
    pcieRoot: AttrJson
    pciBusID: AttrJson
    health: str
    healthMessage: str
    taints: list[TaintDoc]
    claims: list[str]  # NAMESPACE/NAME
    pods: list[str]  # NAMESPACE/NAME


class DevicesDoc(TypedDict):
    """GET /devices."""

    devices: list[DeviceDoc]


class PreparedDeviceDoc(TypedDict):
    """A prepared device as the checkpoint records it (`DeviceRecord.to_json`); its other keys
    (shareID, migPlacement, consumedCapacity, ...) pass through unnamed."""

    requestNames: list[str]
    pool: str
    device: str
    cdiDeviceIDs: NotRequired[list[str]]
    networkData: NotRequired[NetworkDeviceData]


class ClaimRecordDoc(TypedDict):
    """One entry of GET /claims: the checkpoint's record (`ClaimRecord.to_json`) and its UID.
    Its `pods` are bare pod names in the claim's namespace, and absent in a record of 0.1.0."""

    uid: str
    namespace: str
    name: str
    state: str
    devices: list[PreparedDeviceDoc]
    owner: NotRequired[str]
    pods: NotRequired[list[str]]


class ClaimsDoc(TypedDict):
    """GET /claims."""

    claims: list[ClaimRecordDoc]


class DeviceStatusDoc(TypedDict):
    """A device's entry of the claim status that prepare applied."""

    device: str
    ready: bool
    networkData: NotRequired[NetworkDeviceData]


class LastErrorDoc(TypedDict):
    at: str  # RFC 3339
    error: str


class ClaimDoc(TypedDict):
    """GET /claims/<uid or namespace/name>: one claim's record, files, status and last error."""

    uid: str
    namespace: str
    name: str
    state: str  # a PrepareState, or NOT_PREPARED
    pods: list[str]  # NAMESPACE/NAME
    devices: list[PreparedDeviceDoc]
    status: list[DeviceStatusDoc]
    files: dict[str, bool]  # which of the claim's files are on the node (`ClaimFiles.present`)
    lastError: LastErrorDoc | None


class DeviceCountsDoc(TypedDict):
    """/health's devices: how many, and how many of each health (`driver.model.Health`)."""

    total: int
    Healthy: int
    Unhealthy: int
    Unknown: int


class UnhealthyDoc(TypedDict):
    device: str
    reason: str


class CordonDoc(TypedDict):
    device: str
    reason: str
    by: str
    since: str  # RFC 3339


class CordonedDoc(CordonDoc):
    present: bool  # false: the device is gone from the node, its cordon kept for when it is back


class ReleaseDoc(TypedDict):
    """A GPU (`gpu` its UUID, `device` its device) or, with `gpu` empty, NVML as a whole."""

    gpu: str
    device: str
    reason: str
    by: str
    since: str  # RFC 3339


HealthStatus = Literal["healthy", "degraded", "unhealthy"]


class HealthDoc(TypedDict):
    """GET /health (`driver.status.server`'s docstring says what each status means)."""

    status: HealthStatus
    ready: bool
    reasons: list[str]
    devices: DeviceCountsDoc
    unhealthy: list[UnhealthyDoc]
    cordoned: list[CordonedDoc]
    released: list[ReleaseDoc]
    daemon: dict[str, Any]  # the daemon's own facts, as it tells them


class CordonAnswer(TypedDict):
    """POST /cordon."""

    cordon: CordonDoc


class UncordonAnswer(TypedDict):
    """POST /uncordon: `changed` is false when the device was not cordoned."""

    device: str
    changed: bool


class ReleaseAnswer(TypedDict):
    """POST /release: what was released (a device, or "nvml") and the devices now tainted."""

    released: str
    devices: list[str]


class ReacquireAnswer(TypedDict):
    """POST /reacquire: the releases it ended, and those still in force."""

    reacquired: list[ReleaseDoc]
    released: list[ReleaseDoc]


class ClearAnswer(TypedDict):
    """POST /clear: the device cleared and the devices whose reset conditions lifted."""

    cleared: str
    devices: list[str]


class ErrorDoc(TypedDict):
    """Any refused request, with a 4xx or 5xx status."""

    error: str


Document = (
    DevicesDoc
    | ClaimsDoc
    | ClaimDoc
    | HealthDoc
    | CordonAnswer
    | UncordonAnswer
    | ReleaseAnswer
    | ReacquireAnswer
    | ClearAnswer
    | ErrorDoc
)

D = TypeVar("D")


def checked(shape: type[D], value: object) -> D:
    """`value`, decoded JSON, as `shape` (a TypedDict of this module) once it is seen to fit;
    TypeError saying where it does not ("devices[2].taints: not a list")."""
    _check(shape, value, "")
    return cast(D, value)


def _check(shape: Any, value: object, where: str) -> None:
    origin = get_origin(shape)
    if shape is Any or shape is object:
        return
    if _is_typeddict(shape):
        _check_fields(shape, value, where)
    elif origin in (Union, types.UnionType):
        errors: list[tuple[Any, TypeError]] = []
        for option in get_args(shape):
            try:
                _check(option, value, where)
                return
            except TypeError as e:
                errors.append((option, e))
        # A list or an object that the one option of its kind refused: that option says where.
        deeper = [e for option, e in errors if _container(option) is type(value)]
        if len(deeper) == 1:
            raise deeper[0]
        raise TypeError(f"{_at(where)}: {_what(value)}, not {_name(shape)}")
    elif origin is Literal:
        if value not in get_args(shape):
            raise TypeError(f"{_at(where)}: {_what(value)}, not {_name(shape)}")
    elif origin is list:
        if not isinstance(value, list):
            raise TypeError(f"{_at(where)}: {_what(value)}, not a list")
        for i, item in enumerate(value):
            _check(get_args(shape)[0], item, f"{where}[{i}]")
    elif origin is dict:
        if not isinstance(value, dict):
            raise TypeError(f"{_at(where)}: {_what(value)}, not an object")
        for key, item in value.items():
            _check(get_args(shape)[1], item, f"{where}.{key}" if where else str(key))
    elif shape is type(None):
        if value is not None:
            raise TypeError(f"{_at(where)}: {_what(value)}, not null")
    elif shape in (str, bool, int, float):
        # Python's bool is an int, JSON's true is no number: told apart here.
        number = isinstance(value, int | float) and not isinstance(value, bool)
        fits = number if shape is float else isinstance(value, shape) and (shape is bool or not isinstance(value, bool))
        if not fits:
            raise TypeError(f"{_at(where)}: {_what(value)}, not {_name(shape)}")
    else:
        raise AssertionError(f"no check for {shape!r}")  # a shape of this module names a new type


def _check_fields(shape: type, value: object, where: str) -> None:
    if not isinstance(value, dict):
        raise TypeError(f"{_at(where)}: {_what(value)}, not an object")
    optional: frozenset[str] = getattr(shape, "__optional_keys__", frozenset())
    for key, hint in get_type_hints(shape, include_extras=True).items():
        # Under `from __future__ import annotations` Python 3.11 counts a NotRequired key as
        # required (__required_keys__): the annotation itself says.
        marker = get_origin(hint)
        if marker in (Required, NotRequired):
            hint = get_args(hint)[0]
        required = marker is Required or (marker is not NotRequired and key not in optional)
        if key in value:
            _check(hint, value[key], f"{where}.{key}" if where else key)
        elif required:
            raise TypeError(f"{_at(where)}: no {key!r}")


def _is_typeddict(shape: Any) -> bool:
    return isinstance(shape, type) and issubclass(shape, dict) and hasattr(shape, "__required_keys__")


def _container(shape: Any) -> type | None:
    if _is_typeddict(shape) or get_origin(shape) is dict:
        return dict
    return list if get_origin(shape) is list else None


def _at(where: str) -> str:
    return where or "the document"


def _what(value: object) -> str:
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}
    return names.get(type(value), "a number")


def _name(shape: Any) -> str:
    """What `shape` expects, in words: "a string", "a boolean or null", "'healthy' or 'degraded'"."""
    if get_origin(shape) in (Union, types.UnionType, Literal):
        options = [repr(a) for a in get_args(shape)] if get_origin(shape) is Literal else map(_name, get_args(shape))
        *first, last = options
        return f"{', '.join(first)} or {last}" if first else last
    if _container(shape) is not None:
        return "a list" if _container(shape) is list else "an object"
    names = {str: "a string", bool: "a boolean", int: "an integer", float: "a number", type(None): "null"}
    return names[shape]
