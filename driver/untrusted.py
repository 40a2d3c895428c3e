"""Strings someone else chose, made fit for a human to read: in an error, an Event, a claim's
status or a log line.

Tandem repeats what it was given to say why it failed: a key of a claim's opaque configuration,
the name a pod gave the netdev it returns, an API server's error message. Those reach terminals
(`kubectl describe`, `kubectl logs`, an SRE's `journalctl`) and log pipelines, which interpret
what they hold: raw, a tenant's newline forges a log line, an ANSI escape rewrites the reader's
terminal, a bidi override reverses what is shown, and a 5 KB key fills every line it is in.
`shown` is the one way such a string goes into a message: quoted and escaped exactly as Python's
`repr` does (every control character, escape, line or paragraph separator, bidi and other
format character, unassigned code point and lone surrogate becomes a `\\x..`/`\\u....` escape, so
the result is printable, one line and encodable as UTF-8), and bounded, with its length told.
"""

from __future__ import annotations

# Characters of the string shown; the rest is counted. A name or key of any use is shorter.
LIMIT = 64


def shown(text: str, limit: int = LIMIT) -> str:
    """`text` quoted and escaped as `repr` quotes it; longer than `limit` characters, its first
    `limit` followed by `...` and its whole length. The result is at most about ten times
    `limit` characters long (the longest escape, `\\U0010ffff`, stands for one)."""
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}... ({len(text)} characters)"
