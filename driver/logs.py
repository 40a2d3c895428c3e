"""Logging set-up: human text or one JSON object per line, with claim/device context fields.

Callers add context with `extra={"claim": uid, "device": name, "op": "prepare"}`; the JSON form
carries those as fields so that an SRE can filter a node's log by claim UID.
"""

from __future__ import annotations

import json
import logging
import sys
import time

CONTEXT_FIELDS = ("claim", "claim_namespace", "claim_name", "device", "op")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, object] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key in CONTEXT_FIELDS:
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
        ctx = " ".join(f"{k}={getattr(record, k)}" for k in CONTEXT_FIELDS if hasattr(record, k))
        return f"{base} [{ctx}]" if ctx else base


def setup(verbosity: int, fmt: str) -> None:
    """-v gives debug for the driver; -vv also debug for libraries (grpc, urllib3, pyroute2)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if verbosity >= 2 else logging.INFO)
    logging.getLogger("driver").setLevel(logging.DEBUG if verbosity >= 1 else logging.INFO)
    if verbosity < 2:
        for noisy in ("urllib3", "kubernetes", "pyroute2"):
            logging.getLogger(noisy).setLevel(logging.WARNING)
