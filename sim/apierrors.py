"""Errors of the simulated API server and their metav1.Status form.

The same exception travels from the store to both doors: the HTTP handler turns it into a Status
body with the matching HTTP code (so the `kubernetes` client raises ApiException with that status),
and in-process callers catch it directly.
"""

from __future__ import annotations

from typing import Any

_REASONS = {
    400: "BadRequest",
    401: "Unauthorized",
    403: "Forbidden",
    404: "NotFound",
    405: "MethodNotAllowed",
    409: "Conflict",
    410: "Expired",
    415: "UnsupportedMediaType",
    422: "Invalid",
    429: "TooManyRequests",
    500: "InternalError",
    503: "ServiceUnavailable",
    504: "Timeout",
}


def reason_for(code: int) -> str:
    """The metav1 StatusReason a real API server uses for an HTTP code."""
    return _REASONS.get(code, "InternalError" if code >= 500 else "BadRequest")


class ApiError(Exception):
    """A request the API server answers with a failure Status."""

    def __init__(self, code: int, message: str, reason: str | None = None, details: dict | None = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.reason = reason or reason_for(code)
        self.details = details or {}

    def status(self) -> dict[str, Any]:
        """The metav1.Status body of this error."""
        body: dict[str, Any] = {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        }
        if self.details:
            body["details"] = self.details
        return body

    def __str__(self) -> str:
        return f"{self.code} {self.reason}: {self.message}"


class NotFoundError(ApiError, KeyError):
    """404 NotFound; also a KeyError so that `srv.get` reads like a mapping lookup."""

    def __init__(self, message: str, details: dict | None = None):
        ApiError.__init__(self, 404, message, "NotFound", details)

    def __str__(self) -> str:
        return ApiError.__str__(self)


def not_found(group_resource: str, name: str, details: dict) -> NotFoundError:
    return NotFoundError(f'{group_resource} "{name}" not found', details)


def conflict(group_resource: str, name: str, why: str, details: dict) -> ApiError:
    return ApiError(409, f'Operation cannot be fulfilled on {group_resource} "{name}": {why}', "Conflict", details)


def already_exists(group_resource: str, name: str, details: dict) -> ApiError:
    return ApiError(409, f'{group_resource} "{name}" already exists', "AlreadyExists", details)


def invalid(kind_group: str, name: str, problems: list[str], details: dict) -> ApiError:
    """422 Invalid in the API server's wording: one problem plain, several in brackets."""
    text = problems[0] if len(problems) == 1 else "[" + ", ".join(problems) + "]"
    causes = [{"reason": "FieldValueInvalid", "message": p} for p in problems]
    return ApiError(422, f'{kind_group} "{name}" is invalid: {text}', "Invalid", {**details, "causes": causes})


def bad_request(message: str) -> ApiError:
    return ApiError(400, message, "BadRequest")
