"""The fuzz tests' Hypothesis profiles, and the seed of a failing run beside its failure.

`ci` (the default) keeps the whole folder within about a minute on a 2-core machine: 200 examples
per target, each within 500 ms. `long` is for `hack/fuzz.py`: `TANDEM_FUZZ_EXAMPLES` examples per
target (20,000 unless told). `TANDEM_FUZZ_PROFILE` picks one. Both are applied per test by
`fuzzing.fuzz`, never loaded as the session's default, so the suite's other Hypothesis tests keep
theirs (tests/conftest.py). A run is random (`derandomize` off): every failure's report carries
the seed that repeats it, `TANDEM_FUZZ_SEED=<seed>`, besides Hypothesis's own falsifying example.
`TANDEM_FUZZ_REPORT`, when set, is where the examples run and the outcome of each test are
written as JSON at the end of the run (`hack/fuzz.py` reads it).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from fuzzing import EXAMPLES, SEED
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    max_examples=200,
    deadline=timedelta(milliseconds=500),
    derandomize=False,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "long",
    parent=settings.get_profile("ci"),
    max_examples=int(os.environ.get("TANDEM_FUZZ_EXAMPLES", "20000")),
)

_OUTCOMES: dict[str, dict[str, str]] = {}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    if report.when == "call":
        _OUTCOMES[item.name] = {"outcome": report.outcome, "failure": report.longreprtext if report.failed else ""}
        if report.failed:
            report.sections.append(("fuzz seed", f"TANDEM_FUZZ_SEED={SEED} repeats this run"))


def pytest_sessionfinish(session: pytest.Session) -> None:
    target = os.environ.get("TANDEM_FUZZ_REPORT")
    if target and _OUTCOMES:
        tests = {name: {**result, "examples": EXAMPLES[name.split("[")[0]]} for name, result in _OUTCOMES.items()}
        partial = Path(f"{target}.partial")  # whole or not at all, as every file Tandem writes
        partial.write_text(json.dumps({"seed": SEED, "tests": tests}, indent=1))
        os.replace(partial, target)
