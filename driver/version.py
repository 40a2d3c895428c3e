"""What this build of Tandem is: its version and the commit it was built from, one line for
`--version` and for the daemon's first log line, so an SRE comparing nodes or filing a bug names
the exact build.

The version is the installed package's (pyproject.toml's `version`, read through
importlib.metadata), so it cannot drift from what pip installed. The commit has two sources,
because the image has no `.git`: the Dockerfile bakes its build args into the image's environment
(`TANDEM_COMMIT`, `TANDEM_CREATED`; hack/cluster/build.sh passes `git rev-parse HEAD` and the
build time), and that wins, being what the artifact says of itself; otherwise, in a checkout (a
`.git` beside `driver/`), `git rev-parse HEAD` is asked, once per line, with a timeout. git
missing, a tree that is no checkout, or a git that refuses (a checkout another user owns, read as
root) leave the commit `unknown` and never stop the program. Both values are printed as they are
only when they look like a commit and a date; anything else is shown escaped and bounded, so a
stray build arg cannot split the log line.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
from collections.abc import Mapping, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

from driver.untrusted import shown

PACKAGE = "tandem-dra"
COMMIT_ENV = "TANDEM_COMMIT"  # the Dockerfile's build arg of the same name, baked in by ENV
CREATED_ENV = "TANDEM_CREATED"  # the build time, RFC 3339 (the image's `created` label)
CHECKOUT = Path(__file__).resolve().parents[1]  # a checkout's root: driver/ sits in it
GIT_TIMEOUT = 5.0
SHORT_COMMIT = 12

_COMMIT = re.compile(r"[0-9a-f]{7,64}")
_DATE = re.compile(r"\d{4}-\d{2}-\d{2}")


def describe(
    program: str = "tandem-driver", *, environ: Mapping[str, str] = os.environ, checkout: Path = CHECKOUT
) -> str:
    """`tandem-driver 0.2.0 (commit 1a2b3c4d5e6f, built 2026-12-01)`; `built` only where the build
    said when, `commit unknown` where neither the build nor git says which."""
    version, commit = build(environ=environ, checkout=checkout)
    details = [f"commit {commit}"]
    created = environ.get(CREATED_ENV, "").strip()
    if created:
        date = _DATE.match(created)
        details.append(f"built {date.group() if date else shown(created, 40)}")
    return f"{program} {version} ({', '.join(details)})"


def build(*, environ: Mapping[str, str] = os.environ, checkout: Path = CHECKOUT) -> tuple[str, str]:
    """(version, commit) as `describe` shows them, for `tandem_build_info`: the commit shortened,
    `unknown` where neither the build nor git says which."""
    commit = environ.get(COMMIT_ENV, "").strip() or _git_commit(checkout)
    return _package_version(), _commit_shown(commit)


def _package_version() -> str:
    """Unknown only when the package is imported without being installed (a bare PYTHONPATH)."""
    try:
        return metadata.version(PACKAGE)
    except metadata.PackageNotFoundError:
        return "unknown"


def _commit_shown(commit: str | None) -> str:
    if not commit:
        return "unknown"
    if _COMMIT.fullmatch(commit):
        return commit[:SHORT_COMMIT]
    return shown(commit, 40)


def _git_commit(checkout: Path) -> str | None:
    """HEAD of the checkout `driver/` sits in; None without one, or without a git that answers.
    Only a `.git` right there counts: an installed package inside some other repository (a venv
    in a checkout) must not report that repository's commit."""
    if not (checkout / ".git").exists():
        return None
    try:
        done = subprocess.run(
            ["git", "-C", str(checkout), "rev-parse", "--verify", "--quiet", "HEAD"],
            capture_output=True,
            timeout=GIT_TIMEOUT,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    head = done.stdout.decode(errors="replace").strip()
    return head if done.returncode == 0 and _COMMIT.fullmatch(head) else None


class _PrintVersion(argparse.Action):
    """`--version`: prints `describe`'s line and exits 0. Worked out only when asked, since it may
    run git, unlike argparse's own version action, which takes the text when the parser is built."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(
            option_strings,
            dest=argparse.SUPPRESS,
            default=argparse.SUPPRESS,
            nargs=0,
            help="print the version and the commit it was built from, and exit",
        )

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        print(describe(parser.prog))
        parser.exit()


def add_version_flag(parser: argparse.ArgumentParser) -> None:
    """`--version` on a command line (`tandem-driver`, `tandemctl`), named by the parser's prog."""
    parser.add_argument("--version", action=_PrintVersion)
