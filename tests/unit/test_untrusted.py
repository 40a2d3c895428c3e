"""driver.untrusted.shown: a string someone else chose, fit for a terminal, a log line or an Event."""

from __future__ import annotations

import pytest

from driver.untrusted import LIMIT, shown

# Each would change what a reader sees: escapes a terminal runs, line breaks that forge a log
# line, bidi and zero-width format characters that reorder or hide text, C1 controls (the
# one-byte CSI), a lone surrogate (an undecodable byte of a file name) that UTF-8 cannot encode.
DANGEROUS = [
    "\x1b[2J",
    "\x1b]8;;http://x\x07",
    "a\nb",
    "a\rb",
    "\x00",
    "\x7f",
    "\x9b31m",
    "\x85",
    "\u2028",
    "\u2029",
    "\u202e",
    "\u2066",
    "\u200b",
    "\u200f",
    "\ufeff",
    "\udcff",
]


@pytest.mark.parametrize("text", DANGEROUS)
def test_every_character_that_changes_what_a_reader_sees_is_escaped(text: str) -> None:
    out = shown(text)
    assert out == repr(text)
    assert out.isprintable() and out.isascii()
    out.encode()  # encodable: an Event's note is UTF-8


def test_printable_text_is_kept_readable() -> None:
    assert shown("mdoe") == "'mdoe'"
    assert shown("Grüße, 世界") == "'Grüße, 世界'"


def test_a_long_string_is_cut_and_its_length_told() -> None:
    out = shown("\x1b" + "k" * 5000)
    assert out == repr("\x1b" + "k" * (LIMIT - 1)) + "... (5001 characters)"
    assert shown("k" * LIMIT) == repr("k" * LIMIT)  # at the limit: whole


def test_the_limit_can_be_chosen() -> None:
    assert shown("abcdef", 3) == "'abc'... (6 characters)"
