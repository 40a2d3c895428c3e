"""The one exception of the library: every rejection names the field it is about."""

from __future__ import annotations


class SpecError(ValueError):
    """A CDI spec, name or file name that a runtime would refuse (or that we refuse to write).

    `field` is the JSON path of the offending value (``devices[2].containerEdits.env[0]``), empty
    when the error is about a bare string such as a qualified device name; `source` is the file it
    came from, if any. Callers turn it into a claim-level error message, so it must say where to
    look without a stack trace.
    """

    def __init__(self, field: str, message: str, source: str = "") -> None:
        self.field = field
        self.message = message
        self.source = source
        super().__init__(": ".join(part for part in (source, field, message) if part))


def join(path: str, key: str) -> str:
    """Extend a JSON field path; list indexes are passed as ``[i]`` and attach without a dot."""
    if not path:
        return key
    return f"{path}{key}" if key.startswith("[") else f"{path}.{key}"
