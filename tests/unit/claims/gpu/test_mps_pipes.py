"""The life of MPS pipe directories (issue 33): a fresh one for every start of a GPU's control
daemon, Tandem's link `<device>/pipe` (what the claims' CDI specs mount) leading to the current
one, the previous layout's directory taken over, and old ones removed without following or
opening anything a tenant put in them; the record naming the directory, and a daemon started
again, adopted or upgraded by it. Real daemons of the stand-in control program run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from mps_fixtures import driver_root_fixture, needed_fixture  # noqa: F401  (fixtures: driver_root, needed)

from driver.claims.gpu import mps_pipes
from driver.claims.gpu.mps import MpsDaemons
from driver.claims.gpu.mps_identity import CONTROL_PROGRAM, PID_FILE, RECORD, Recorded, read_record, write_record
from driver.claims.gpu.mps_pipes import LINK, fresh, point, remove_tree, settle
from driver.node.processes import identify, wait_gone
from sim.driver_files import BIN_DIR

UUID = "GPU-00000000-0000-0000-0000-000000000000"


@pytest.fixture
def daemons(tmp_path: Path, driver_root: Path, needed: dict[str, str | None]) -> Iterator[MpsDaemons]:
    mps = MpsDaemons(tmp_path / "data" / "mps", driver_root, lambda: needed)
    yield mps
    needed.clear()
    mps.sync()  # no daemon outlives the test


def _unblocked(work: threading.Thread) -> None:
    """`work` ends: a FIFO opened by mistake would hold it (its writer never comes)."""
    work.start()
    work.join(60)
    assert not work.is_alive(), "blocked on a FIFO a tenant planted"


def _kill(pid: int) -> None:
    process = identify(pid)
    assert process is not None
    os.kill(pid, signal.SIGKILL)
    assert wait_gone(process, 30)


def test_every_start_gets_a_new_empty_directory(tmp_path: Path) -> None:
    device = tmp_path / "gpu-0"
    made = [fresh(device) for _ in range(3)]
    assert len(set(made)) == 3
    assert all(mps_pipes.recordable(p.name) and p.parent == device and not any(p.iterdir()) for p in made)


def test_the_link_is_replaced_and_the_previous_layouts_directory_moved_aside(tmp_path: Path) -> None:
    device = tmp_path / "gpu-0"
    (device / LINK).mkdir(parents=True)  # the previous release's pipe directory, with its tenants' leftovers
    (device / LINK / "left").write_text("x")
    new = fresh(device)
    point(device, new.name)
    assert os.readlink(device / LINK) == new.name
    (retired,) = device.glob("pipe-retired-*")
    assert (retired / "left").read_text() == "x"  # moved, not yet removed
    newer = fresh(device)
    point(device, newer.name)
    assert os.readlink(device / LINK) == newer.name
    settle(device, newer.name)
    assert sorted(p.name for p in device.iterdir()) == sorted([LINK, newer.name])


def test_settle_points_at_the_recorded_directory_and_removes_every_other(tmp_path: Path) -> None:
    device = tmp_path / "gpu-0"
    recorded, linked, old = fresh(device), fresh(device), fresh(device)
    point(device, linked.name)  # a kill -9 came between the record and the link
    os.symlink(linked.name, device / ".pipe-0123456789abcdef")  # a link a kill -9 left half made
    (device / "stale-control-1").mkdir()  # what the previous release set aside
    (device / "log").mkdir()
    (device / RECORD).write_text("{}")
    settle(device, recorded.name)
    assert os.readlink(device / LINK) == recorded.name
    assert {p.name for p in device.iterdir()} == {LINK, recorded.name, "log", RECORD}
    assert not linked.exists() and not old.exists()


def test_settle_keeps_the_directory_a_previous_releases_daemon_reached_through_the_link(tmp_path: Path) -> None:
    """During a rolling update the release before may start a daemon in `<device>/pipe`, which is
    the link then: its record names no directory, and the one the link leads to is its."""
    device = tmp_path / "gpu-0"
    theirs, old = fresh(device), fresh(device)
    point(device, theirs.name)
    settle(device, LINK)
    assert os.readlink(device / LINK) == theirs.name and theirs.exists() and not old.exists()


def test_removal_follows_no_symlink_and_opens_no_fifo(tmp_path: Path) -> None:
    """What a tenant can leave in a pipe directory, at every depth: a symlink to a host directory
    and to a host file, a FIFO, a socket; none is followed or opened, the host's files stay."""
    host = tmp_path / "host"
    (host / "dir").mkdir(parents=True)
    (host / "dir" / "precious").write_text("keep")
    (host / "file").write_text("keep")
    device = tmp_path / "gpu-0"
    pipe = fresh(device)
    nested = pipe / "a" / "b"
    nested.mkdir(parents=True)
    for d in (pipe, nested):
        (d / "to-dir").symlink_to(host / "dir")
        (d / "to-file").symlink_to(host / "file")
        os.mkfifo(d / "fifo")
    (pipe / "bound").write_text("")
    _unblocked(threading.Thread(target=remove_tree, args=(device, pipe.name), daemon=True))
    assert not pipe.exists()
    assert (host / "dir" / "precious").read_text() == "keep" and (host / "file").read_text() == "keep"


def test_a_tree_deeper_than_recursion_is_removed_flat(tmp_path: Path) -> None:
    device = tmp_path / "gpu-0"
    pipe = fresh(device)
    fd = os.open(pipe, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(1500):  # deeper than Python's recursion limit, and than PATH_MAX allows by name
            os.mkdir("d" * 8, dir_fd=fd)
            deeper = os.open("d" * 8, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = deeper
        os.mkfifo("fifo", dir_fd=fd)
    finally:
        os.close(fd)
    remove_tree(device, pipe.name)
    assert not pipe.exists()


def test_one_pass_does_a_bounded_share_and_the_next_goes_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A container that still has an old directory may fill it without end: one sync's pass must
    stay bounded, and the next one carries on."""
    monkeypatch.setattr(mps_pipes, "_PASS_ENTRIES", 5)
    device = tmp_path / "gpu-0"
    pipe = fresh(device)
    for i in range(12):
        (pipe / f"f{i}").write_text("")
    remove_tree(device, pipe.name)
    assert len(list(pipe.iterdir())) == 7
    remove_tree(device, pipe.name)
    remove_tree(device, pipe.name)
    assert not pipe.exists()


def test_the_record_names_the_directory_and_reads_the_previous_releases(tmp_path: Path) -> None:
    record = tmp_path / RECORD
    me = identify(os.getpid())
    assert me is not None
    write_record(record, Recorded(me, "pipe-0123456789abcdef"))
    assert read_record(record) == Recorded(me, "pipe-0123456789abcdef")
    record.write_text(json.dumps({"version": 1, "daemon": me.to_json()}))  # the release before: no directory
    assert read_record(record) == Recorded(me, LINK)
    for bad in ("../../../etc", "log", "pipe-../x", 7):
        record.write_text(json.dumps({"version": 1, "daemon": {**me.to_json(), "pipe": bad}}))
        assert read_record(record) is None


def test_a_daemon_started_again_gets_a_new_directory_and_the_old_one_goes(
    daemons: MpsDaemons, needed: dict[str, str | None]
) -> None:
    needed["gpu-0"] = UUID
    daemons.sync()
    first = daemons.running("gpu-0")
    assert first is not None
    old = daemons.pipe_dir("gpu-0").resolve()
    _kill(first)
    daemons.sync()
    again = daemons.running("gpu-0")
    new = daemons.pipe_dir("gpu-0").resolve()
    assert again not in (None, first) and new != old and not old.exists()
    recorded = read_record(daemons.root / "gpu-0" / RECORD)
    assert recorded is not None and recorded.pipe == new.name
    assert (new / PID_FILE).read_text() == f"{again}\n"


def test_a_restarted_tandem_talks_to_the_recorded_directory_and_mends_the_link(
    driver_root: Path, daemons: MpsDaemons, needed: dict[str, str | None]
) -> None:
    """A kill -9 between the record and the link leaves the link at the directory before: the next
    Tandem adopts the daemon by its record and points the link where the record says."""
    needed["gpu-0"] = UUID
    daemons.sync()
    pid = daemons.running("gpu-0")
    device = daemons.root / "gpu-0"
    recorded = os.readlink(device / LINK)
    stray = fresh(device)
    point(device, stray.name)
    (stray / "control").symlink_to(Path(device / recorded / "control"))  # a tenant's, never used
    again = MpsDaemons(daemons.root, driver_root, lambda: needed)
    again.sync()
    assert again.running("gpu-0") == pid
    assert os.readlink(device / LINK) == recorded and not stray.exists()


def test_the_previous_layouts_daemon_is_adopted_then_replaced_in_a_new_directory(
    tmp_path: Path, driver_root: Path, daemons: MpsDaemons, needed: dict[str, str | None]
) -> None:
    """The upgrade: a daemon the release before started in `<device>/pipe` itself, with a record
    naming no directory, is adopted where it runs; once it dies, the next one starts in a new
    directory, `pipe` becomes the link to it, and the old directory, with what a tenant planted
    there, is removed without anything in it followed."""
    device = daemons.root / "gpu-0"
    pipe = device / LINK
    env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(pipe), "CUDA_MPS_LOG_DIRECTORY": str(device / "log")}
    subprocess.run([str(driver_root / BIN_DIR / CONTROL_PROGRAM), "-d"], env=env, check=True, timeout=30)
    legacy = identify(int((pipe / PID_FILE).read_text()))
    assert legacy is not None
    (device / RECORD).write_text(json.dumps({"version": 1, "daemon": legacy.to_json()}))
    host_file = tmp_path / "host-file"
    host_file.write_text("keep")
    (pipe / "planted").symlink_to(host_file)
    needed["gpu-0"] = UUID
    daemons.sync()
    assert daemons.running("gpu-0") == legacy.pid and pipe.is_dir() and not pipe.is_symlink()
    _kill(legacy.pid)
    daemons.sync()
    now = daemons.running("gpu-0")
    assert now not in (None, legacy.pid)
    assert pipe.is_symlink() and mps_pipes.recordable(os.readlink(pipe)) and os.readlink(pipe) != LINK
    assert not list(device.glob("pipe-retired-*")) and host_file.read_text() == "keep"


def test_no_container_gets_a_new_directory_before_its_daemon_answers(
    daemons: MpsDaemons, needed: dict[str, str | None], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Until the daemon has made its PID file and socket, the link leads where it led (nowhere
    at the first start): a container made meanwhile cannot plant anything in its names."""
    seen: list[tuple[str, str | None]] = []
    wait_up = MpsDaemons._wait_up

    def watched(self: MpsDaemons, device: str, gate: subprocess.Popen[bytes], output: Path, pipe: Path) -> None:
        link = self.pipe_dir(device)
        seen.append((pipe.name, os.readlink(link) if os.path.lexists(link) else None))
        wait_up(self, device, gate, output, pipe)

    monkeypatch.setattr(MpsDaemons, "_wait_up", watched)
    needed["gpu-0"] = UUID
    daemons.sync()
    first = daemons.running("gpu-0")
    assert first is not None
    _kill(first)
    daemons.sync()
    (started, before), (restarted, then) = seen
    assert before is None and then == started
    assert os.readlink(daemons.pipe_dir("gpu-0")) == restarted
