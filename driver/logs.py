"""Logging set-up: human text or one JSON object per line, with claim/device context fields.

Context comes from `log_context(claim=uid, op="prepare")`, which tags every line logged in that
thread while it is active (library code on the prepare path included), or from
`extra={"device": name}` on one call. The JSON form carries them as fields, so an SRE can filter a
node's log by claim UID.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import sys
import time
from collections.abc import Iterator

CONTEXT_FIELDS = ("claim", "claim_namespace", "claim_name", "device", "op")
# A record's structured payload (the start-up configuration): a JSON object of its own in JSON
# logs, never a string escaped inside `msg` that a log pipeline cannot query.
CONFIG_FIELD = "configuration"
_context: contextvars.ContextVar[tuple[tuple[str, str], ...]] = contextvars.ContextVar("tandem_log_context", default=())


@contextlib.contextmanager
def log_context(**fields: str) -> Iterator[None]:
    token = _context.set(tuple({**dict(_context.get()), **fields}.items()))
    try:
        yield
    finally:
        _context.reset(token)


class _ContextFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        for key, value in _context.get():
            if not hasattr(record, key):
                setattr(record, key, value)
        return True


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, object] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key in (*CONTEXT_FIELDS, CONFIG_FIELD):
            if hasattr(record, key):
                out[key] = getattr(record, key)
        if record.exc_info:
            out["error"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname).1s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        base = super().format(record)
        if hasattr(record, CONFIG_FIELD):
            base += f", {CONFIG_FIELD} {json.dumps(getattr(record, CONFIG_FIELD))}"
        ctx = " ".join(f"{k}={getattr(record, k)}" for k in CONTEXT_FIELDS if hasattr(record, k))
        return f"{base} [{ctx}]" if ctx else base


def setup(verbosity: int, fmt: str) -> None:
    """-v gives debug for the driver; -vv also debug for libraries (grpc, pyroute2)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    handler.addFilter(_ContextFilter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if verbosity >= 2 else logging.INFO)
    logging.getLogger("driver").setLevel(logging.DEBUG if verbosity >= 1 else logging.INFO)
    if verbosity < 2:
        for noisy in ("kubernetes", "pyroute2"):
            logging.getLogger(noisy).setLevel(logging.WARNING)
