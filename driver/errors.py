"""The root of Tandem's errors.

Every error Tandem raises on purpose derives from `TandemError`, so a caller at a boundary (a
gRPC handler, a thread's loop, the CLI) can tell Tandem's own, expected failures from a bug.
"""

from __future__ import annotations


class TandemError(Exception):
    """An expected failure, with a message fit for a log line, an Event or a claim's status."""
