"""An open watch stream of the API server: newline-delimited JSON events, read as a stranger's.

Generic over the kind watched (slices, pods): the caller gives the stream and the bound of one
event, and gets (type, object) pairs or an `ApiError`, never a socket's or a parser's exception.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import Any

from driver.kube.connection import Response
from driver.kube.errors import DETAIL, ApiError, error_from
from driver.untrusted import shown


class Watch(Iterator[tuple[str, dict[str, Any]]]):
    """An open watch stream. `stop()` may be called from another thread to end it at once.

    Without it a stopping watcher would wait for the server-side watch timeout, because a
    blocked socket read cannot be interrupted any other way.
    """

    def __init__(self, resp: Response, what: str, event_limit: int) -> None:
        self._resp = resp
        self._what = what
        self._events = self._read(event_limit)

    def stop(self) -> None:
        # OSError: already ended, the connection closed.
        with contextlib.suppress(OSError):
            self._resp.shutdown()

    def __next__(self) -> tuple[str, dict[str, Any]]:
        return next(self._events)

    def _read(self, event_limit: int) -> Iterator[tuple[str, dict[str, Any]]]:
        what = self._what
        try:
            for line in _lines(self._resp, what, event_limit):
                try:
                    event = json.loads(line)
                    etype, obj = event["type"], event["object"]
                except (ValueError, KeyError, TypeError) as exc:
                    raise ApiError(f"{what}: malformed event: {shown(line, DETAIL)}", retryable=True) from exc
                if not isinstance(obj, dict) or not isinstance(etype, str):
                    raise ApiError(f"{what}: malformed event: {shown(line, DETAIL)}", retryable=True)
                if etype == "ERROR":
                    code = obj.get("code")
                    status = code if isinstance(code, int) else 0
                    message = shown(str(obj.get("message", "watch error")), DETAIL)
                    raise ApiError(f"{what}: {message}", status, retryable=True)
                yield etype, obj
        except ApiError:
            raise
        except Exception as exc:
            raise error_from(exc, what) from exc
        finally:
            self._resp.close()  # a half-read stream never goes back to the pool


def _lines(resp: Response, what: str, limit: int) -> Iterator[str]:
    """The non-empty lines of a streamed body, each as soon as its newline arrives; one event
    (line) over `limit` bytes is an ApiError, not a buffer that grows without end."""
    buffer = b""
    for chunk in resp.chunks():
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        if len(buffer) > limit:
            raise ApiError(f"{what}: a watch event over the limit of {limit} bytes", retryable=True)
        yield from (line.decode(errors="replace") for line in lines if line.strip())
