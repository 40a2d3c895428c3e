"""Reading a file a tenant can write (`driver.fsutil.read_untrusted`): what a tenant can put in its
place neither hangs the reader (a FIFO), floods it (a symlink to /dev/zero, a huge file), nor
leads it elsewhere (a symlink, a directory): each is an OSError, at once."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from driver.fsutil import read_untrusted


def test_a_small_regular_file_is_read_whole(tmp_path: Path) -> None:
    (tmp_path / "pid").write_bytes(b"4242\n")
    assert read_untrusted(tmp_path / "pid", 32) == b"4242\n"
    (tmp_path / "exact").write_bytes(b"x" * 32)
    assert read_untrusted(tmp_path / "exact", 32) == b"x" * 32


def test_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "pid")
    with pytest.raises(OSError, match="not a regular file") as e:
        read_untrusted(tmp_path / "pid", 32)  # a blocking open would wait here for ever
    assert e.value.errno == errno.EINVAL


def test_a_symlink_is_refused_not_followed(tmp_path: Path) -> None:
    (tmp_path / "zero").symlink_to("/dev/zero")
    (tmp_path / "target").write_bytes(b"1")
    (tmp_path / "link").symlink_to(tmp_path / "target")
    for name in ("zero", "link"):
        with pytest.raises(OSError, match="not a regular file"):
            read_untrusted(tmp_path / name, 32)


def test_a_directory_is_refused(tmp_path: Path) -> None:
    (tmp_path / "pid").mkdir()
    with pytest.raises(OSError, match="not a regular file"):
        read_untrusted(tmp_path / "pid", 32)


def test_a_file_over_the_limit_is_refused_after_reading_at_most_one_byte_more(tmp_path: Path) -> None:
    big = tmp_path / "pid"
    with open(big, "wb") as f:
        f.truncate(1 << 40)  # sparse: a terabyte a whole read would try to hold
    with pytest.raises(OSError, match="larger than 32 bytes") as e:
        read_untrusted(big, 32)
    assert e.value.errno == errno.EFBIG


def test_a_missing_file_is_file_not_found(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        read_untrusted(tmp_path / "pid", 32)


def test_a_proc_entry_reads_as_a_regular_file() -> None:
    cmdline = Path(f"/proc/{os.getpid()}/cmdline")
    assert read_untrusted(cmdline, 1 << 16) == cmdline.read_bytes() != b""
