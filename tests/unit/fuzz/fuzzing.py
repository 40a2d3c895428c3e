"""What every fuzz test of this folder shares: its Hypothesis profile, its seed and its count.

`fuzz(*strategies)` is `given` with the profile `TANDEM_FUZZ_PROFILE` names (`ci` unless told,
registered in conftest.py), under one seed for the whole run (`TANDEM_FUZZ_SEED`, else a random
one, which conftest.py prints beside any failure so that the run can be repeated), and counts the
examples each test ran (`EXAMPLES`), which `hack/fuzz.py` reports per target.

`raises_only(allowed, call)` is the property every target holds: the call returns, or raises one
of `allowed` (the parser's own error, or what its callers catch), never anything else.
"""

from __future__ import annotations

import functools
import json
import os
import random
from collections import Counter
from collections.abc import Callable
from typing import Any, TypeVar

from hypothesis import given, seed, settings
from hypothesis import strategies as st

PROFILE = os.environ.get("TANDEM_FUZZ_PROFILE", "ci")
SEED = int(os.environ.get("TANDEM_FUZZ_SEED") or random.SystemRandom().getrandbits(32))
EXAMPLES: Counter[str] = Counter()

T = TypeVar("T")


def fuzz(*strategies: st.SearchStrategy[Any]) -> Callable[[Callable[..., None]], Callable[..., None]]:
    def decorate(test: Callable[..., None]) -> Callable[..., None]:
        @functools.wraps(test)
        def counted(*args: Any, **kwargs: Any) -> None:
            EXAMPLES[test.__name__] += 1
            test(*args, **kwargs)

        return seed(SEED)(settings(settings.get_profile(PROFILE))(given(*strategies)(counted)))

    return decorate


def raises_only(allowed: tuple[type[BaseException], ...], call: Callable[[], T]) -> T | None:
    """`call()`, or None when it raised one of `allowed`; anything else propagates (a finding)."""
    try:
        return call()
    except allowed:
        return None


# JSON values of every type, nested a little: what a mutated document's fields are replaced with.
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=2**63, max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)

# The values that break readers most often: numbers no integer holds, empty and wrong containers.
# The containers are made afresh for each draw: a mutation may add to them.
special_values = (
    st.sampled_from([float("inf"), float("-inf"), float("nan"), 2**64, -1, 0, "", None, True])
    | st.builds(list)
    | st.builds(dict)
)
replacements = special_values | json_values

# JSON nested deeper than Python's parser goes: it raises RecursionError, which is no ValueError.
deep_json = st.sampled_from([b"[" * 3000, b'{"a":' * 3000])
# JSON text no parser of ours can take as it is: huge numbers, bad encodings, trailing junk.
hostile_json = st.sampled_from([b"1" * 5000, b"1e999", b"-Infinity", b"NaN", b"\xff\xfe{}", b'"\\ud800"', b"{}  x"])


def _paths(document: Any, here: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every place in a JSON document: the keys and indexes that lead to each value."""
    out = [here]
    if isinstance(document, dict):
        for key, value in document.items():
            out += _paths(value, (*here, key))
    elif isinstance(document, list):
        for index, value in enumerate(document):
            out += _paths(value, (*here, index))
    return out


def mutated(document: Any, data: st.DataObject) -> Any:
    """`document` with one to three of its values, at any depth, replaced (by a value of another
    type, a number no integer holds, an empty container), dropped, or given a sibling: the rest
    stays valid, so that the reader gets as far as the mutated value."""
    document = json.loads(json.dumps(document))  # a copy to change
    for _ in range(data.draw(st.integers(1, 3))):
        path = data.draw(st.sampled_from(_paths(document)))
        if not path:
            return data.draw(replacements)
        parent = document
        for step in path[:-1]:
            parent = parent[step]
        action = data.draw(st.sampled_from(["replace", "replace", "drop", "add"]))
        if action == "replace":
            parent[path[-1]] = data.draw(replacements)
        elif action == "drop":
            del parent[path[-1]]
        elif isinstance(parent, dict):
            parent[data.draw(st.text(max_size=8))] = data.draw(replacements)
        else:
            parent.append(data.draw(replacements))
    return document
