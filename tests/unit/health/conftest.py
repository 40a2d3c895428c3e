"""sysfs as captured on real hosts, for the tests of the grey-failure readers: the archives of
tests/fixtures/sysfs-captures/ (trimmed from prometheus/procfs and prometheus/node_exporter; their
NOTICE says from which commits and under which license), each extracted into the test's own
tmp_path by a fixture that gives its `sys` directory.

The archives are in ttar, the text format those projects keep their fixtures in: `Directory: <p>`,
`Path: <p>` followed by `Lines: <n>` and n lines of content or by `SymlinkTo: <target>`, then
`Mode: <octal>`; lines starting with `#` between entries are comments. ttar escapes a NUL byte as
`NULLBYTE` and marks a last line without its newline with `EOF`; none of the trimmed entries needs
either, and `extract_ttar` refuses content that holds one rather than extract it wrongly.
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath

import pytest

CAPTURES = Path(__file__).resolve().parents[2] / "fixtures/sysfs-captures"
_ESCAPES = ("EOF", "NULLBYTE")


def _target(dest: Path, name: str) -> Path:
    relative = PurePosixPath(name)
    assert not relative.is_absolute() and ".." not in relative.parts, name
    return dest / relative


def extract_ttar(archive: Path, dest: Path) -> None:
    """Extracts `archive` below `dest`: files with their content and mode, directories, and
    symlinks as symlinks (their targets as written, relative as the kernel makes them)."""
    lines = archive.read_text().splitlines()
    path = dest
    at = 0
    while at < len(lines):
        line = lines[at]
        at += 1
        keyword, _, value = line.partition(": ")
        if line.startswith("#"):
            continue
        if keyword == "Directory":
            path = _target(dest, value)
            path.mkdir(parents=True, exist_ok=True)
        elif keyword == "Path":
            path = _target(dest, value)
        elif keyword == "Lines":
            content = lines[at : at + int(value)]
            at += int(value)
            if any(escape in text for text in content for escape in _ESCAPES):
                raise ValueError(f"{archive}: {path} uses a ttar escape this extractor does not read")
            path.write_text("".join(f"{text}\n" for text in content))
        elif keyword == "SymlinkTo":
            path.symlink_to(value)
        elif keyword == "Mode":
            path.chmod(int(value, 8))
        else:
            raise ValueError(f"{archive}:{at}: not a ttar line: {line!r}")


@pytest.fixture
def procfs_sys(tmp_path: Path) -> Path:
    """prometheus/procfs's capture (`fixtures/sys`)."""
    extract_ttar(CAPTURES / "procfs-fixtures.ttar", tmp_path / "procfs")
    return tmp_path / "procfs/fixtures/sys"


@pytest.fixture
def node_exporter_sys(tmp_path: Path) -> Path:
    """prometheus/node_exporter's capture (`sys`)."""
    extract_ttar(CAPTURES / "node_exporter-sys.ttar", tmp_path / "node_exporter")
    return tmp_path / "node_exporter/sys"
