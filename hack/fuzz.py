"""The long fuzz run: tests/unit/fuzz with Hypothesis's `long` profile, then, per target, the
examples it ran and what it found.

CI runs the same tests with the `ci` profile (200 examples per target, about half a minute for the
folder); this runs `--examples` per target (20,000 unless told) under one seed (`--seed`, else a
random one, printed), for a search that is worth leaving running. A finding is printed with the
falsifying example Hypothesis found and the seed that repeats the run; the exit status is pytest's.

`python hack/fuzz.py [--examples N] [--seed S] [PYTEST-ARGS...]` (from anywhere in the checkout).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FOLDER = "tests/unit/fuzz"


def _finding(failure: str) -> str:
    """The lines of a failure's report that say what broke and on which input."""
    keep = [line for line in failure.splitlines() if line.startswith("E ") or "Falsifying" in line]
    return "\n".join(line[:300] for line in keep[:12]) or failure[-2000:]


def report(results: dict[str, object]) -> str:
    """Examples and outcome per test, then each finding, from the JSON the fuzz conftest writes."""
    tests = results.get("tests")
    if not isinstance(tests, dict):
        return "no fuzz test ran"
    lines = [f"seed {results.get('seed')} (TANDEM_FUZZ_SEED repeats the run)", ""]
    width = max(len(name) for name in tests)
    findings = []
    for name, result in sorted(tests.items()):
        examples, outcome = result.get("examples", 0), result.get("outcome", "?")
        lines.append(f"{name:<{width}}  {examples:>7} examples  {outcome}")
        if outcome == "failed":
            findings.append(f"--- {name}\n{_finding(str(result.get('failure', '')))}")
    lines += ["", f"{len(findings)} finding(s)", *findings]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--examples", type=int, default=20_000, help="examples per target (default 20000)")
    parser.add_argument("--seed", type=int, default=None, help="repeat the run of this seed")
    args, pytest_args = parser.parse_known_args(argv)
    with tempfile.TemporaryDirectory(prefix="tandem-fuzz-") as scratch:
        out = Path(scratch) / "report.json"
        env = {
            **os.environ,
            "TANDEM_FUZZ_PROFILE": "long",
            "TANDEM_FUZZ_EXAMPLES": str(args.examples),
            "TANDEM_FUZZ_REPORT": str(out),
        }
        if args.seed is not None:
            env["TANDEM_FUZZ_SEED"] = str(args.seed)
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", FOLDER, *pytest_args]
        status = subprocess.run(command, cwd=REPO, env=env, check=False).returncode
        print(report(json.loads(out.read_text())) if out.exists() else "no report: the fuzz tests did not run")
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
