"""Validation of events.k8s.io/v1 Events written to the simulated API server, Kubernetes' rules
kept independently of the driver (pkg/apis/core/validation/events.go, ValidateEventCreate and
ValidateEventUpdate for the events.k8s.io/v1 API)."""

from __future__ import annotations

from typing import Any

from sim.apivalidate import label_key_problems

_EVENT_IMMUTABLE = ("regarding", "related", "reason", "note", "type", "action", "reportingController",
                    "reportingInstance", "eventTime")  # fmt: skip


def event_problems(obj: dict[str, Any], old: dict[str, Any] | None) -> list[str]:
    """events.k8s.io/v1 rules (pkg/apis/core/validation/events.go): eventTime, a qualified
    reportingController, reportingInstance, action and reason of at most 128 characters, note
    of at most 1024, type Normal or Warning, a series counting at least 2, the namespace of what
    it regards (cluster-scoped objects: default or kube-system); on update only the series changes."""
    problems = []
    namespace = obj["metadata"].get("namespace", "")
    regarding = obj.get("regarding") or {}
    if regarding.get("namespace", "") != namespace and (
        regarding.get("namespace") or namespace not in ("default", "kube-system")
    ):
        problems.append(
            f"regarding.namespace: Invalid value: {regarding.get('namespace')!r}: does not match event.namespace"
        )
    if not obj.get("eventTime"):
        problems.append("eventTime: Required value")
    controller = obj.get("reportingController") or ""
    problems += (
        label_key_problems("reportingController", controller) if controller else ["reportingController: Required value"]
    )
    for key, limit in (("reportingInstance", 128), ("action", 128), ("reason", 128)):
        value = obj.get(key) or ""
        if not value:
            problems.append(f"{key}: Required value")
        elif len(value) > limit:
            problems.append(f"{key}: Invalid value: can have at most {limit} characters")
    if len(obj.get("note") or "") > 1024:
        problems.append("note: Invalid value: can have at most 1024 characters")
    if obj.get("type") not in ("Normal", "Warning"):
        problems.append(f"type: Invalid value: has invalid value: {obj.get('type')}")
    series = obj.get("series")
    if series is not None and (int(series.get("count") or 0) < 2 or not series.get("lastObservedTime")):
        problems.append("series: Invalid value: count should be at least 2, lastObservedTime is required")
    if old is not None:
        problems += [f"{k}: Invalid value: field is immutable" for k in _EVENT_IMMUTABLE if obj.get(k) != old.get(k)]
    return problems
