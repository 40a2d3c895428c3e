"""The test suite's own layout. pytest's default import mode puts each test directory (they are
not packages) on sys.path and imports its modules by basename, so two modules of one name in
different test directories break collection of the whole run, which a run of one directory
never shows (it once failed CI this way)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_module_basenames_are_unique_across_test_directories() -> None:
    names = Counter(p.name for p in TESTS.rglob("*.py") if p.name not in ("conftest.py", "__init__.py"))
    assert [n for n, count in names.items() if count > 1] == []
