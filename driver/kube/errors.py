"""The vocabulary of failed API calls: `ApiError` and its kin, and turning a failure without an
answer into one.

Apart from `driver.kube.api` so that the watch stream (`driver.kube.watch`), which the door opens
and which raises the same errors, needs no import of the door; callers import them from
`driver.kube.api`, the door they call.
"""

from __future__ import annotations

from driver.errors import ApiServerError
from driver.kube.connection import failure, unreachable

# HTTP statuses worth retrying: throttling, server-side trouble, and 0 for "no response at all"
# (connection refused/reset, timeout).
_RETRYABLE = frozenset({0, 408, 429, 500, 502, 503, 504})

# Characters of a server's text (an error message, a malformed event) repeated in our messages.
DETAIL = 512


class ApiError(ApiServerError):
    """A failed API call. `status` is the HTTP status, 0 when no response came back (`unreachable`:
    no server answered at all); `retry_after` the seconds the server asked to wait before the next
    try (Retry-After of a 429 or 503, bounded by `Response.retry_after`), 0 when it asked nothing."""

    def __init__(
        self,
        message: str,
        status: int = 0,
        retryable: bool | None = None,
        retry_after: float = 0.0,
        unreachable: bool = False,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.retryable = status in _RETRYABLE if retryable is None else retryable
        self.retry_after = retry_after
        self.unreachable = unreachable


class Conflict(ApiError):
    """409: the object changed since it was read (optimistic concurrency) or already exists.

    Retryable once the caller has re-read the object.
    """


class NotFound(ApiError):
    """404: the object (or the API itself) does not exist."""


def retry_after(exc: BaseException) -> float:
    """The seconds the API server asked to wait before the next try, 0 for any other failure:
    what a retry loop waits at least (`driver.backoff.Retry.next`)."""
    return exc.retry_after if isinstance(exc, ApiError) else 0.0


def error_from(exc: BaseException, what: str) -> ApiError:
    """No answer, or none that can be read (refused, reset, timed out, TLS failure, a broken HTTP
    answer, an unreadable token): retryable, saying what failed (`failure`)."""
    if isinstance(exc, ApiError):
        return exc
    return ApiError(f"{what}: {failure(exc)}", 0, retryable=True, unreachable=unreachable(exc))
