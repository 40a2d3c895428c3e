"""One error tree: every exception class defined under driver/ derives from `TandemError`, and the
tree drawn in driver/errors.py's docstring is the tree the code has (names, parents, kinds)."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re

import pytest

import driver
from driver import errors
from driver.errors import TandemError, error_kind, translating

# One line of the drawing: the tree's box characters, a name, then `kind "x"` on a branch's line.
LINE = re.compile(r"^    (?P<indent>[│├└─ ]*)(?P<name>[A-Za-z_.]+)(?:\s+kind \"(?P<kind>\w+)\")?")
SKIP = ("driver.kubelet.api", "driver.__main__")  # generated gRPC code; the entry point runs the CLI


def defined_exceptions() -> dict[str, type[BaseException]]:
    """Every exception class defined in a module of driver/, by its name as the drawing spells it
    (its module under driver/ and the class; the branches in driver.errors by the class alone)."""
    found: dict[str, type[BaseException]] = {}
    for info in pkgutil.walk_packages(driver.__path__, "driver."):
        if info.name.startswith(SKIP):
            continue
        module = importlib.import_module(info.name)
        for cls in vars(module).values():
            if inspect.isclass(cls) and issubclass(cls, BaseException) and cls.__module__ == module.__name__:
                where = module.__name__.removeprefix("driver.")
                found[cls.__name__ if where == "errors" else f"{where}.{cls.__name__}"] = cls
    return found


def drawn_tree() -> dict[str, tuple[str | None, str | None]]:
    """The docstring's tree: name -> (parent's name, kind written on its line)."""
    assert errors.__doc__ is not None
    tree: dict[str, tuple[str | None, str | None]] = {}
    parents: list[str] = []  # the chain of names above the current line, one per depth
    for line in errors.__doc__.splitlines():
        m = LINE.match(line)
        if m is None or (not m["indent"] and m["name"] != "TandemError"):
            continue
        depth = len(m["indent"]) // 4
        del parents[depth:]
        assert m["name"] not in tree, f"{m['name']} is drawn twice"
        tree[m["name"]] = (parents[-1] if parents else None, m["kind"])
        parents.append(m["name"])
    return tree


def tandem_parent(cls: type[BaseException]) -> type[BaseException] | None:
    return next((b for b in cls.__bases__ if issubclass(b, TandemError)), None)


def test_the_drawing_names_every_error_class_and_no_other() -> None:
    drawn, defined = set(drawn_tree()), set(defined_exceptions())
    assert sorted(defined - drawn) == [], "draw these in driver/errors.py's docstring"
    assert sorted(drawn - defined) == [], "the drawing names classes that do not exist (any more)"


def test_every_error_class_has_the_root() -> None:
    assert [n for n, cls in defined_exceptions().items() if not issubclass(cls, TandemError)] == []


def test_the_drawing_shows_each_class_under_its_parent_with_its_kind() -> None:
    defined = defined_exceptions()
    for name, (parent, kind) in drawn_tree().items():
        cls = defined[name]
        assert tandem_parent(cls) is (defined[parent] if parent else None), name
        if kind is not None:
            assert getattr(cls, "kind", None) == kind, name


def test_each_branch_has_a_kind_of_its_own() -> None:
    """What metrics count errors by: each branch is one kind, and no branch is the root's."""
    kinds = [getattr(errors, name).kind for name, (parent, _) in drawn_tree().items() if parent == "TandemError"]
    assert sorted(kinds) == ["api", "config", "device", "endpoint", "node"]
    assert TandemError.kind not in kinds


def test_a_translated_call_raises_tandems_error_chained_to_the_librarys() -> None:
    class LibraryError(Exception):
        pass

    def library_call(x: int) -> int:
        if x < 0:
            raise LibraryError("negative")
        return x * 2

    call = translating(library_call, LibraryError, lambda e: errors.NodeError(f"door: {e}"))
    assert call(2) == 4
    assert call.__name__ == "library_call"
    with pytest.raises(errors.NodeError, match="door: negative") as caught:
        call(-1)
    assert isinstance(caught.value.__cause__, LibraryError)


def test_an_error_counts_by_its_causes_kind_where_that_is_tandems() -> None:
    """Prepare wraps a broken device in a ClaimError (kind config): counted as config, a failed
    GPU would read as a tenant's typo and never page on-call."""
    from driver.claims.allocation import ClaimError

    try:
        try:
            raise errors.DeviceError("MIG device not made")
        except errors.DeviceError as e:
            raise ClaimError("claim ns/c cannot be prepared") from e
    except ClaimError as wrapped:
        assert error_kind(wrapped) == "device"
    try:
        try:
            raise ValueError("not Tandem's")
        except ValueError as e:
            raise ClaimError("bad spec") from e
    except ClaimError as wrapped:
        assert error_kind(wrapped) == "config", "a foreign cause leaves the error's own kind"
    assert error_kind(ClaimError("typo")) == "config"
    assert error_kind(KeyError("a bug")) == "other"
