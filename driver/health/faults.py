"""What is wrong with one health signal, in the two forms a condition needs: a taint value (a
label value) and words for the message. Shared by every health source that judges signals (the
NIC's link state, the grey-failure rules), so a taint value is made one way everywhere.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

MAX_VALUE = 63  # a taint value is a label value

_NOT_LABEL = re.compile(r"[^A-Za-z0-9_.-]+")


@dataclass(frozen=True)
class Fault:
    """What is wrong with one signal: `value` for the taint, `reason` in words for the message."""

    value: str
    reason: str


def label(text: str) -> str:
    """A taint value: at most 63 characters of [A-Za-z0-9_.-], alphanumeric at both ends."""
    return _NOT_LABEL.sub("-", text)[:MAX_VALUE].strip("-_.")
