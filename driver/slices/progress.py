"""Whether this node's ResourceSlices are published, and if not, why: what `tandemctl health`, the
readiness probe, `/metrics` and the log say while the API server is out of reach or refuses Tandem.

Every failed attempt of the publisher (the Node lookup, a list, the watch, a write) is counted under
one of a few reasons (`REASONS`), so that an alert can tell an unreachable API server from an RBAC
fault without a series per error message. Consecutive failures make one outage: the log gets one
ERROR line when it begins, a reminder at most every `REMIND_EVERY` seconds while it lasts (each
retry only at debug level: a retry every 30 s would bury the log), and one INFO line when it ends.

An outage ends only when the publisher confirms the slices (its writes done, or a sync that found
nothing to write) against a cache the watch keeps current. A list or watch that succeeds while
writes are refused (RBAC that lets Tandem read but not write) does not end it, and a sync against
a cache whose watch failed confirms nothing: it compared with a copy that may be stale.

Until the first confirmation the node's devices may be invisible to the scheduler: the node is
unhealthy and not ready ("no ResourceSlices published"). An outage after it is a degraded node:
the scheduler still works from the slices last published, which no longer follow health changes.
The reason's text repeats the API server's message only as the door escaped it (`driver.kube.api`,
`driver.untrusted.shown`); any other failure is escaped here.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from driver.kube.api import ApiError
from driver.resource_api import rfc3339
from driver.untrusted import shown

log = logging.getLogger(__name__)

# Why an attempt failed, as counted (the `reason` label of tandem_slice_errors_total): no server
# answered; it refused Tandem's credentials (401); RBAC forbids the request (403); anything else.
REASONS = ("unreachable", "unauthorized", "forbidden", "other")
# Seconds between the ERROR lines of one outage.
REMIND_EVERY = 300.0
# Characters of a failure that is not the API door's shown (its messages are bounded there).
_SHOWN = 300

_CAUSES = {
    "unreachable": "the API server at {server} cannot be reached: {error}",
    "unauthorized": "the API server at {server} does not accept Tandem's credentials: {error}",
    "forbidden": "the API server at {server} forbids it (RBAC): {error}",
    "other": "{error}",
}


def reason_of(exc: BaseException) -> str:
    """The reason a failed attempt is counted under, one of `REASONS`."""
    if isinstance(exc, ApiError):
        if exc.unreachable:
            return "unreachable"
        if exc.status in (401, 403):
            return "unauthorized" if exc.status == 401 else "forbidden"
    return "other"


@dataclass(frozen=True)
class Outage:
    """Consecutive failed attempts, from the first (`since`, Unix time) to the last (`reason`,
    `cause`: what failed, in words fit to show)."""

    since: float
    attempts: int
    reason: str
    cause: str

    def told(self) -> str:
        """The cause, since when and how often: what health and the reminders say."""
        return f"{self.cause} (since {rfc3339(self.since)}, {self.attempts} failed attempt(s))"


class PublishProgress:
    """The publisher's failures and confirmations, for health, metrics and the log; thread-safe
    (the publisher's worker and its watch thread report, the status socket and metrics read)."""

    def __init__(
        self,
        server: str,
        *,
        remind_every: float = REMIND_EVERY,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._server = server
        self._remind_every = remind_every
        self._clock = clock
        self._monotonic = monotonic
        self._lock = threading.Lock()
        # Guarded by _lock:
        self._errors = dict.fromkeys(REASONS, 0)
        self._outage: Outage | None = None
        self._logged = 0.0  # monotonic time of the outage's last ERROR line
        self._published_at: float | None = None

    def failed(self, exc: BaseException) -> None:
        """One failed attempt: counted by its reason, and part of the outage it begins or continues."""
        reason = reason_of(exc)
        error = str(exc) if isinstance(exc, ApiError) else f"{type(exc).__name__}: {shown(str(exc), _SHOWN)}"
        cause = _CAUSES[reason].format(server=self._server, error=error)
        now = self._monotonic()
        with self._lock:
            self._errors[reason] += 1
            last = self._outage
            self._outage = outage = Outage(
                since=self._clock() if last is None else last.since,
                attempts=1 if last is None else last.attempts + 1,
                reason=reason,
                cause=cause,
            )
            remind = last is None or now - self._logged >= self._remind_every
            if remind:
                self._logged = now
        if last is None:
            log.error("ResourceSlices cannot be published: %s; retrying with backoff", cause)
        elif remind:
            log.error("ResourceSlices still cannot be published: %s", outage.told())
        else:
            log.debug("publishing ResourceSlices failed again: %s", cause)

    def published(self) -> None:
        """The live slices were confirmed equal to the desired ones, against a current cache."""
        with self._lock:
            outage, self._outage = self._outage, None
            self._published_at = self._clock()
        if outage is not None:
            log.info(
                "ResourceSlices published again, after %d failed attempt(s) since %s",
                outage.attempts,
                rfc3339(outage.since),
            )

    @property
    def published_at(self) -> float | None:
        """Unix time of the last confirmation; None before the first."""
        with self._lock:
            return self._published_at

    def errors(self) -> dict[str, int]:
        """Failed attempts so far by reason, every one of `REASONS` (0 when none)."""
        with self._lock:
            return dict(self._errors)

    def unready(self) -> list[str]:
        """Why the node's devices may be invisible to the scheduler: nothing confirmed yet."""
        with self._lock:
            published, outage = self._published_at, self._outage
        if published is not None:
            return []
        return [f"no ResourceSlices published: {outage.told()}" if outage else "no ResourceSlices published yet"]

    def problems(self) -> list[str]:
        """An outage after the first confirmation: the scheduler works from the slices last published."""
        with self._lock:
            published, outage = self._published_at, self._outage
        if published is None or outage is None:
            return []
        return [f"ResourceSlices not confirmed since {rfc3339(published)}: {outage.told()}"]

    def summary(self) -> dict[str, Any]:
        """The facts behind `unready` and `problems`, for `tandemctl health --json`."""
        with self._lock:
            published, outage, errors = self._published_at, self._outage, dict(self._errors)
        out: dict[str, Any] = {"publishedAt": rfc3339(published) if published is not None else None}
        if outage is not None:
            out.update(
                failingSince=rfc3339(outage.since),
                failedAttempts=outage.attempts,
                failureReason=outage.reason,
                failure=outage.cause,
            )
        return {**out, "errorsByReason": errors}
