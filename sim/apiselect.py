"""Field and label selectors of list, watch and deletecollection requests.

Field selectors are limited, as on a real server, to the fields a resource declares (anything else
is a 400); label selectors support the set-based grammar (`a=b`, `a!=b`, `a`, `!a`, `a in (x,y)`,
`a notin (x,y)`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

from sim.apierrors import bad_request

Predicate = Callable[[dict[str, Any]], bool]
FieldGetter = Callable[[dict[str, Any]], str]

_FIELD_TERM = re.compile(r"^\s*([^=!\s]+)\s*(==|=|!=)\s*(.*?)\s*$")
_SET_TERM = re.compile(r"^\s*(!?)\s*([A-Za-z0-9_./-]+)\s*(?:(in|notin)\s*\((.*)\)\s*)?$")
_EQ_TERM = re.compile(r"^\s*([A-Za-z0-9_./-]+)\s*(==|=|!=)\s*([A-Za-z0-9_.-]*)\s*$")


def everything(_obj: dict[str, Any]) -> bool:
    return True


def field_selector(text: str | None, fields: Mapping[str, FieldGetter]) -> Predicate:
    """A predicate for a comma-separated AND of `field=value` / `field!=value` terms."""
    if not text:
        return everything
    terms: list[tuple[FieldGetter, bool, str]] = []
    for raw in text.split(","):
        match = _FIELD_TERM.match(raw)
        if not match:
            raise bad_request(f"invalid field selector term {raw!r}")
        name, op, value = match.groups()
        getter = fields.get(name)
        if getter is None:
            known = ", ".join(f'"{f}"' for f in sorted(fields))
            raise bad_request(f'"{name}" is not a known field selector: only {known}')
        terms.append((getter, op != "!=", value))

    def matches(obj: dict[str, Any]) -> bool:
        return all((getter(obj) == value) == equal for getter, equal, value in terms)

    return matches


def label_selector(text: str | None) -> Predicate:
    """A predicate for a Kubernetes label selector string."""
    if not text:
        return everything
    checks: list[Predicate] = [_label_term(term) for term in _split_terms(text)]

    def matches(obj: dict[str, Any]) -> bool:
        labels = (obj.get("metadata") or {}).get("labels") or {}
        return all(check(labels) for check in checks)

    return matches


def _split_terms(text: str) -> list[str]:
    """Split on commas that are not inside `( )`."""
    terms, depth, current = [], 0, ""
    for ch in text:
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            terms.append(current)
            current = ""
        else:
            current += ch
    terms.append(current)
    return terms


def _label_term(term: str) -> Predicate:
    eq = _EQ_TERM.match(term)
    if eq:
        key, op, value = eq.groups()
        if op == "!=":
            return lambda labels: labels.get(key) != value
        return lambda labels: labels.get(key) == value
    match = _SET_TERM.match(term)
    if not match:
        raise bad_request(f"unable to parse label selector term {term!r}")
    negate, key, op, values_text = match.groups()
    if op is None:
        if negate:
            return lambda labels: key not in labels
        return lambda labels: key in labels
    if negate:
        raise bad_request(f"unable to parse label selector term {term!r}")
    values = {v.strip() for v in values_text.split(",") if v.strip()}
    if op == "in":
        return lambda labels: labels.get(key) in values
    return lambda labels: labels.get(key) not in values


def path_getter(*path: str) -> FieldGetter:
    """A field getter for a nested path; a missing field reads as the empty string, as on a real server."""

    def get(obj: dict[str, Any]) -> str:
        node: Any = obj
        for part in path:
            node = node.get(part) if isinstance(node, dict) else None
        return "" if node is None else str(node)

    return get
