"""Reading untrusted JSON into typed values, each error naming the path of the bad value.

What `cdi.spec` parses with: a spec file is untrusted input (another program may have written
it), so every field is checked for its JSON type and, for integers, the range of its Go type;
`null` reads as absent, as Go reads it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from cdi.errors import SpecError, join

INT64 = (-(2**63), 2**63 - 1)
UINT32 = (0, 2**32 - 1)

T = TypeVar("T")


def object_fields(raw: object, path: str, keys: Sequence[str]) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise SpecError(path, f"expected a JSON object, got {json_type(raw)}")
    for key in raw:
        if key not in keys:
            raise SpecError(join(path, str(key)), "unknown field (runtimes reject the whole file)")
    return {k: v for k, v in raw.items() if v is not None}


def string(obj: Mapping[str, Any], key: str, path: str, *, required: bool = False) -> str:
    value = obj.get(key)
    if value is None:
        if required:
            raise SpecError(join(path, key), "required field is missing")
        return ""
    if not isinstance(value, str):
        raise SpecError(join(path, key), f"expected a string, got {json_type(value)}")
    return value


def boolean(obj: Mapping[str, Any], key: str, path: str) -> bool:
    value = obj.get(key, False)
    if not isinstance(value, bool):
        raise SpecError(join(path, key), f"expected a boolean, got {json_type(value)}")
    return value


def integer(obj: Mapping[str, Any], key: str, path: str, bounds: tuple[int, int]) -> int | None:
    value = obj.get(key)
    return None if value is None else checked_int(value, join(path, key), bounds)


def checked_int(value: object, path: str, bounds: tuple[int, int]) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError(path, f"expected an integer, got {json_type(value)}")
    if not bounds[0] <= value <= bounds[1]:
        raise SpecError(path, f"{value} is out of range [{bounds[0]}, {bounds[1]}]")
    return value


def uint32_item(raw: object, path: str) -> int:
    return checked_int(raw, path, UINT32)


def string_item(raw: object, path: str) -> str:
    if not isinstance(raw, str):
        raise SpecError(path, f"expected a string, got {json_type(raw)}")
    return raw


def items(obj: Mapping[str, Any], key: str, path: str, item: Callable[[object, str], T]) -> tuple[T, ...]:
    value = obj.get(key)
    if value is None:
        return ()
    where = join(path, key)
    if not isinstance(value, list):
        raise SpecError(where, f"expected a JSON array, got {json_type(value)}")
    return tuple(item(v, f"{where}[{i}]") for i, v in enumerate(value))


def string_list(obj: Mapping[str, Any], key: str, path: str) -> tuple[str, ...]:
    return items(obj, key, path, string_item)


def string_map(obj: Mapping[str, Any], key: str, path: str) -> dict[str, str]:
    value = obj.get(key)
    if value is None:
        return {}
    where = join(path, key)
    if not isinstance(value, dict):
        raise SpecError(where, f"expected a JSON object, got {json_type(value)}")
    for k, v in value.items():
        if not isinstance(v, str):
            raise SpecError(f"{where}[{json.dumps(k)}]", f"expected a string, got {json_type(v)}")
    return dict(value)


# In this order: a bool is also an int.
_JSON_TYPES = (
    (bool, "boolean"),
    (int, "integer"),
    (float, "number"),
    (str, "string"),
    (list, "array"),
    (dict, "object"),
)


def json_type(value: object) -> str:
    if value is None:
        return "null"
    return next((name for t, name in _JSON_TYPES if isinstance(value, t)), type(value).__name__)
