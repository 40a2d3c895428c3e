"""hack/ is held to the product's standard (issue 31): its Python is type-checked and its shell
scripts pass shellcheck. Both lists are easy to fall out of, by a new program that mypy's `files`
does not reach or a new script that the shellcheck step of hack/test.sh never sees, and neither
would fail anything by itself."""

from __future__ import annotations

import importlib.util
import re
import tomllib
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[3]
MYPY = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["mypy"]


def _load_shellcheck_all() -> ModuleType:
    """By its path: hack/ is no package, and putting it on sys.path would let its module names
    shadow the tests' own."""
    spec = importlib.util.spec_from_file_location("shellcheck_all", REPO / "hack" / "shellcheck_all.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


shellcheck_all = _load_shellcheck_all()


def _relaxing_overrides(module: str) -> list[dict[str, object]]:
    """The `[[tool.mypy.overrides]]` for `module` that silence its errors or turn a check off."""
    out = []
    for override in MYPY.get("overrides", []):
        patterns = override["module"] if isinstance(override["module"], list) else [override["module"]]
        parents = [".".join(module.split(".")[:i]) + ".*" for i in range(1, module.count(".") + 2)]
        if module in patterns or any(parent in patterns for parent in parents):
            options = {k: v for k, v in override.items() if k != "module"}
            if options.get("ignore_errors") or False in options.values():
                out.append(override)
    return out


def _mypy_checks(path: Path) -> bool:
    """Whether `mypy` (no arguments, as hack/test.sh runs it) checks `path` strictly. hack/ is a
    package base (`mypy_path`), so hack/scale/api.py is the module `scale.api`."""
    rel = path.relative_to(REPO).as_posix()
    listed = any(rel == f or rel.startswith(f.rstrip("/") + "/") for f in MYPY["files"])
    excluded = any(re.search(pattern, rel) for pattern in MYPY.get("exclude", []))
    module = ".".join(path.relative_to(REPO / "hack").with_suffix("").parts)
    return listed and not excluded and not _relaxing_overrides(module)


def test_mypy_checks_every_python_file_in_hack() -> None:
    files = sorted((REPO / "hack").rglob("*.py"))
    assert files, "no Python in hack/: the test looks in the wrong place"
    assert [f.relative_to(REPO).as_posix() for f in files if not _mypy_checks(f)] == []


def test_mypy_is_strict() -> None:
    assert MYPY["strict"] is True


def _write(root: Path, rel: str, text: str) -> str:
    (root / rel).parent.mkdir(parents=True, exist_ok=True)
    (root / rel).write_text(text)
    return rel


def test_shell_scripts_are_found_by_extension_or_shebang(tmp_path: Path) -> None:
    scripts = [
        _write(tmp_path, "hack/lib/sourced.sh", "helper() { :; }\n"),  # a sourced library: no shebang
        _write(tmp_path, ".ci/run", "#!/usr/bin/env bash\nexec hack/test.sh\n"),
        _write(tmp_path, "hack/tool", "#!/bin/bash\n"),
        _write(tmp_path, "hack/posix", "#!/bin/sh -e\n"),
        _write(tmp_path, "deploy/entry", "#! /usr/bin/env -S bash -eu\n"),
    ]
    others = [
        _write(tmp_path, "hack/prog.py", "#!/usr/bin/env python3\n"),
        _write(tmp_path, "hack/zsh-only", "#!/bin/zsh\n"),
        _write(tmp_path, "hack/notes", "bash is used here\n"),
        _write(tmp_path, "hack/empty", ""),
    ]
    (tmp_path / "hack" / "link.sh").symlink_to(tmp_path / "hack" / "lib" / "sourced.sh")
    tracked = [*scripts, *others, "hack/link.sh", "hack/deleted.sh"]  # deleted from the work tree
    assert shellcheck_all.shell_scripts(tmp_path, tracked) == sorted(scripts)


def test_shellcheck_runs_on_every_listed_script(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _write(tmp_path, "a.sh", "")
    _write(tmp_path, "bin/b", "#!/bin/bash\n")
    monkeypatch.setattr(shellcheck_all, "REPO", tmp_path)
    monkeypatch.setattr(shellcheck_all, "tracked_files", lambda root: ["a.sh", "bin/b", "README.md"])
    monkeypatch.chdir(tmp_path)
    calls: list[list[str]] = []

    def execvp(file: str, args: list[str]) -> None:
        calls.append(args)
        raise SystemExit(0)

    monkeypatch.setattr(shellcheck_all.os, "execvp", execvp)
    with pytest.raises(SystemExit):
        shellcheck_all.main(["--severity=style"])
    assert calls == [["shellcheck", *shellcheck_all.SHELLCHECK_FLAGS, "--severity=style", "a.sh", "bin/b"]]


def test_ci_runs_the_shellcheck_step() -> None:
    """hack/test.sh (what .ci/run runs) runs the checker, not a list of its own."""
    commands = [line.split("#", 1)[0].strip() for line in (REPO / "hack" / "test.sh").read_text().splitlines()]
    assert "python hack/shellcheck_all.py" in commands
