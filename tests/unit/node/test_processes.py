"""A supervised process is known by its boot, PID and start time, and only that process is ever
signalled: not one that got its PID later, not one a record from another boot names."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from collections.abc import Iterator

import pytest

from driver.node.processes import ProcessId, alive, identify, kill, wait_gone


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    yield proc
    proc.kill()
    proc.wait()


def test_a_process_is_identified_by_its_start_time_and_boot(sleeper: subprocess.Popen[bytes]) -> None:
    me = identify(sleeper.pid)
    assert me is not None and me.pid == sleeper.pid and alive(me)
    assert ProcessId.from_json(me.to_json()) == me
    assert not alive(dataclasses.replace(me, start=me.start + 1))  # the PID now names another process
    assert not alive(dataclasses.replace(me, boot="an earlier boot"))


def test_a_pid_that_names_another_process_now_is_never_signalled(sleeper: subprocess.Popen[bytes]) -> None:
    me = identify(sleeper.pid)
    assert me is not None
    assert kill(dataclasses.replace(me, start=me.start + 1), timeout=5)  # "gone": that process is
    assert sleeper.poll() is None and alive(me)  # and the one that has the PID now lives on
    assert kill(me, timeout=30)
    assert sleeper.wait(timeout=30) == -9


def test_a_zombie_counts_as_gone(sleeper: subprocess.Popen[bytes]) -> None:
    me = identify(sleeper.pid)
    assert me is not None
    sleeper.kill()
    assert wait_gone(me, timeout=30)  # exited, not reaped yet
    assert identify(sleeper.pid) is None and not alive(me)


@pytest.mark.parametrize(
    "raw",
    [
        None,
        [],
        {},
        {"boot": "b", "pid": "1", "start": 2},
        {"boot": "b", "pid": 0, "start": 2},
        {"boot": 1, "pid": 1, "start": 2},
    ],
)
def test_a_record_that_is_no_identity_is_refused(raw: object) -> None:
    with pytest.raises(ValueError):
        ProcessId.from_json(raw)
