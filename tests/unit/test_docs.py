"""The documents stay true to the tree: the module map and README's layout name every module, and
citations resolve.

docs/architecture.md's module map is what a newcomer reads first, README's layout table what a
visitor reads first; a module added, moved or removed without them would make them lie. Citations of the reference documents must name files
(and section titles) that exist in the repository, never a document outside it.
"""

from __future__ import annotations

import re
import subprocess
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ARCHITECTURE = REPO / "docs" / "architecture.md"
README = REPO / "README.md"
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


def _readme_layout() -> list[tuple[list[str], str]]:
    """The rows of README's layout table: the paths of the first cell, and the second cell."""
    section = README.read_text().split("## Layout", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| ((?:`[^`]+`(?:, )?)+) \| (.*) \|$", section, re.MULTILINE)
    return [(re.findall(r"`([^`]+)`", paths), what) for paths, what in rows]


def _readme_modules() -> list[str]:
    """Every module README's layout names: as a path of its own, or as `name.py` in its folder's
    row (`driver/claims/`: `prepare.py`, ...), which keeps a package's modules on one line."""
    named = []
    for paths, what in _readme_layout():
        named += [p for p in paths if p.endswith(".py")]
        for folder in (p for p in paths if p.endswith("/") and p.split("/")[0] in MAPPED_PACKAGES):
            named += [folder + name for name in re.findall(r"`([\w/]+\.py)`", what)]
    return named


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


def test_the_readme_layout_names_only_what_exists() -> None:
    rows = _readme_layout()
    assert rows, "README.md has no layout table"
    missing = [p for paths, _ in rows for p in paths if not (REPO / p).exists()]
    missing += [p for p in _readme_modules() if not (REPO / p).is_file()]
    assert not missing, f"README.md's layout names paths that do not exist: {missing}"
    named = _readme_modules()
    assert len(named) == len(set(named)), "README.md's layout names a module twice"


def test_every_module_is_in_the_readme_layout() -> None:
    unlisted = sorted(_modules() - set(_readme_modules()))
    assert not unlisted, f"name these modules in README.md's layout table (in their folder's row): {unlisted}"


def test_every_top_level_folder_is_in_the_readme_layout() -> None:
    folders = {p.relative_to(REPO).parts[0] for p in _tracked_files() if len(p.relative_to(REPO).parts) > 1}
    listed = {p.split("/")[0] for paths, _ in _readme_layout() for p in paths}
    unlisted = sorted(f for f in folders - listed if not f.startswith("."))
    assert not unlisted, f"add these folders to README.md's layout table: {unlisted}"


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


def _contract_layers() -> list[str]:
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    layered = [c for c in config["tool"]["importlinter"]["contracts"] if c["type"] == "layers"]
    assert len(layered) == 1, "pyproject.toml has one layers contract, the one docs/architecture.md draws"
    return list(layered[0]["layers"])


def _drawn_layers() -> list[str]:
    """The layers block of docs/architecture.md's 'Layers': one layer a line, a note in parentheses."""
    section = ARCHITECTURE.read_text().split("## Layers", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"^```\n(.*?)^```", section, re.MULTILINE | re.DOTALL)
    assert block, "docs/architecture.md's 'Layers' has no block of layers"
    return [re.sub(r"\s+\(.*\)$", "", line).strip() for line in block.group(1).splitlines() if line.strip()]


def test_the_layers_drawn_are_the_layers_checked() -> None:
    assert _drawn_layers() == _contract_layers()


def test_every_part_of_driver_sits_in_a_layer() -> None:
    """A package or root module added to driver/ is placed in the layers, so the contract sees it."""
    parts = {
        f"driver.{p.stem if p.is_file() else p.name}"
        for p in (REPO / "driver").iterdir()
        if (p.suffix == ".py" and p.stem not in ("__init__", "__main__")) or (p / "__init__.py").is_file()
    }
    placed = [name for layer in _contract_layers() for name in re.split(r"\s*[:|]\s*", layer)]
    assert len(placed) == len(set(placed)), "a part of driver/ sits in two layers"
    assert sorted(parts - set(placed)) == [], "place these in the layers of pyproject.toml and docs/architecture.md"
    assert sorted(set(placed) - parts) == [], "these layers name parts that do not exist"
