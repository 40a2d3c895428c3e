"""The documents stay true to the tree: the module map names every module, and citations resolve.

docs/architecture.md's module map is what a newcomer reads first; a module added, moved or
removed without it would make the map lie. Citations of the reference documents must name files
(and section titles) that exist in the repository, never a document outside it.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ARCHITECTURE = REPO / "docs" / "architecture.md"
# Packages whose every module the map must name; generated code is named as one directory.
MAPPED_PACKAGES = ("driver", "cdi", "sim", "demo")
GENERATED = ("driver/kubelet/api/",)
# Documents that lived outside the repository before docs/reference/ (spelled so that this file
# does not cite them itself).
OUTSIDE = ("../" + "shared/", "kubelet-" + "contract.md", "anchors" + ".md")


def _module_map() -> list[str]:
    text = ARCHITECTURE.read_text()
    section = text.split("## Module map", 1)[1]
    return re.findall(r"^\| `([^`]+)` \|", section, re.MULTILINE)


def _modules() -> set[str]:
    found = set()
    for package in MAPPED_PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            rel = path.relative_to(REPO).as_posix()
            if path.name == "__init__.py" or rel.startswith(GENERATED):
                continue
            found.add(rel)
    return found


def _tracked_files() -> list[Path]:
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True, timeout=60
        ).stdout.decode()
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"not a git checkout ({e}): the tracked files are unknown")
    return [REPO / name for name in out.split("\0") if name]


def test_the_module_map_names_only_what_exists() -> None:
    listed = _module_map()
    assert listed, "docs/architecture.md has no module map"
    missing = [p for p in listed if not (REPO / p).exists()]
    assert not missing, f"docs/architecture.md lists modules that do not exist: {missing}"
    assert len(listed) == len(set(listed)), "docs/architecture.md lists a module twice"


def test_every_module_is_in_the_module_map() -> None:
    unlisted = sorted(_modules() - set(_module_map()))
    assert not unlisted, f"add these modules to the module map in docs/architecture.md: {unlisted}"


def test_no_file_cites_a_document_outside_the_repository() -> None:
    offenders = []
    for path in _tracked_files():
        if not path.is_file() or path.suffix not in (".py", ".md", ".sh", ".yaml", ".toml", ".proto", ""):
            continue
        text = path.read_text(errors="replace")
        offenders += [f"{path.relative_to(REPO)}: {needle}" for needle in OUTSIDE if needle in text]
    assert not offenders, offenders


def test_reference_citations_name_existing_files_and_sections() -> None:
    """`(docs/reference/<file>.md, '<section title>')` must name a file there and one of its headings."""
    problems = []
    for path in _tracked_files():
        if not path.is_file() or path.suffix not in (".py", ".md", ".yaml", ".toml"):
            continue
        # A citation may wrap across comment or docstring lines.
        text = re.sub(r"\s*\n\s*(?:#\s*)?", " ", path.read_text(errors="replace"))
        for m in re.finditer(r"docs/reference/([a-z-]+\.md)(?:, '([^']+)')?", text):
            doc = REPO / "docs" / "reference" / m.group(1)
            if not doc.is_file():
                problems.append(f"{path.relative_to(REPO)}: {m.group(0)}: no such file")
                continue
            title = m.group(2)
            headings = {h.strip() for h in re.findall(r"^#+ (.+)$", doc.read_text(), re.MULTILINE)}
            if title is not None and title not in headings:
                problems.append(f"{path.relative_to(REPO)}: {m.group(0)}: no such section")
    assert not problems, problems
