"""Runs shellcheck on every tracked shell script; hack/test.sh calls it, so CI does.

The list is computed, not written down, so a new script is checked from its first commit: every
tracked `*.sh` (the sourced libraries of hack/cluster/ have no shebang) and every tracked file
whose shebang names a POSIX shell or bash (`.ci/run` has no extension). Sources are followed
relative to each script's own directory, as the scripts themselves resolve them, so a variable
set in one file of hack/cluster/ and used in another is not reported as unset or unused.

`python hack/shellcheck_all.py [SHELLCHECK-ARGS...]` (run from anywhere in the checkout).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import NoReturn

REPO = Path(__file__).resolve().parent.parent
SHELLCHECK_FLAGS = ("--external-sources", "--source-path=SCRIPTDIR")
# `#!/bin/sh`, `#!/usr/bin/bash`, `#!/usr/bin/env bash`, `#!/usr/bin/env -S bash -e`, ...
_SHELL_SHEBANG = re.compile(rb"^#!\s*\S*/(?:env\s+(?:-\S+\s+)*)?(?:ba)?sh(?:\s|$)")


def shell_scripts(root: Path, tracked: Iterable[str]) -> list[str]:
    """The scripts among `tracked` (paths relative to `root`), sorted."""
    return sorted(path for path in tracked if _is_shell_script(root / path))


def _is_shell_script(path: Path) -> bool:
    # Not a file: a submodule, or a script deleted in the work tree but not yet in the index, which
    # shellcheck would fail on. A tracked symlink is checked where it points, if that is tracked.
    if path.is_symlink() or not path.is_file():
        return False
    if path.suffix == ".sh":
        return True
    with path.open("rb") as f:
        return bool(_SHELL_SHEBANG.match(f.readline(256)))


def tracked_files(root: Path) -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=root, check=True, capture_output=True).stdout
    return [p for p in out.decode().split("\0") if p]


def main(argv: list[str]) -> NoReturn:
    scripts = shell_scripts(REPO, tracked_files(REPO))
    os.chdir(REPO)
    os.execvp("shellcheck", ["shellcheck", *SHELLCHECK_FLAGS, *argv, *scripts])


if __name__ == "__main__":
    main(sys.argv[1:])
