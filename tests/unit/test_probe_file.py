"""The probe file (`driver.kubelet.liveness.ProbeFile`) and the DaemonSet's shell probes that read it:
the verdicts of `tandem-driver liveness [--ready]`, and a verdict that expires when nobody renews it.
The scripts are taken from daemonset.yaml, as the kubelet runs them (`sh -c`)."""

from __future__ import annotations

import logging
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from driver.kubelet.liveness import (
    MAX_PROBE_REASON,
    PROBE_PERIOD,
    PROBE_VALID,
    SELF_CHECK_PERIOD,
    NotAlive,
    ProbeFile,
    probe_path,
)

REPO = Path(__file__).resolve().parents[2]
NOW = 1_800_000_000.0


def _scripts() -> dict[str, str]:
    (ds,) = [d for d in yaml.safe_load_all((REPO / "daemonset.yaml").read_text()) if d and d["kind"] == "DaemonSet"]
    container = ds["spec"]["template"]["spec"]["containers"][0]
    return {p: container[f"{p}Probe"]["exec"]["command"][2] for p in ("liveness", "readiness", "startup")}


SCRIPTS = _scripts()


def _probe(kind: str, data_dir: Path, pod_uid: str = "pod-1") -> subprocess.CompletedProcess[str]:
    env = {"KUBELET_PLUGINS_DIRECTORY_PATH": str(data_dir.parent), "DRIVER_NAME": data_dir.name, "POD_UID": pod_uid}
    return subprocess.run(["sh", "-c", SCRIPTS[kind]], env=env, capture_output=True, text=True, timeout=10)


def _alive() -> None:
    return None


def _dead() -> None:
    raise NotAlive("GetInfo on /registry/tandem.dev-reg.sock failed: DEADLINE_EXCEEDED")


def _health(ready: bool, *reasons: str) -> Any:
    return lambda: {"ready": ready, "reasons": list(reasons)}


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    d = tmp_path / "plugins" / "tandem.dev"
    d.mkdir(parents=True)
    return d


def _file(data_dir: Path, alive: Any, health: Any, clock: float | None = None) -> ProbeFile:
    now = time.time() if clock is None else clock
    return ProbeFile(probe_path(data_dir, "pod-1"), alive, health, clock=lambda: now)


def test_a_ready_daemon_passes_every_probe(data_dir: Path) -> None:
    line = _file(data_dir, _alive, _health(True), clock=NOW).refresh()
    assert line == f"{int(NOW) + PROBE_VALID} ready\n"
    _file(data_dir, _alive, _health(True)).refresh()
    for kind in SCRIPTS:
        assert _probe(kind, data_dir).returncode == 0, kind


def test_an_unready_daemon_is_alive_but_not_ready_and_says_why(data_dir: Path) -> None:
    why = "no ResourceSlices published: the API server at https://10.0.0.1:6443 cannot be reached"
    _file(data_dir, _alive, _health(False, why, "1 device(s) not healthy: gpu-1")).refresh()
    assert _probe("liveness", data_dir).returncode == 0 and _probe("startup", data_dir).returncode == 0
    ready = _probe("readiness", data_dir)
    assert ready.returncode == 1 and ready.stdout == f"not ready: {why}; 1 device(s) not healthy: gpu-1\n"


def test_a_daemon_whose_kubelet_sockets_fail_is_dead(data_dir: Path) -> None:
    _file(data_dir, _dead, _health(True)).refresh()
    for kind in SCRIPTS:
        out = _probe(kind, data_dir)
        assert out.returncode == 1, kind
    assert "DEADLINE_EXCEEDED" in _probe("liveness", data_dir).stdout


def test_a_verdict_nobody_renewed_expires(data_dir: Path) -> None:
    _file(data_dir, _alive, _health(True), clock=time.time() - PROBE_VALID - 2).refresh()
    for kind in SCRIPTS:
        out = _probe(kind, data_dir)
        assert out.returncode == 1 and "expired" in out.stdout, (kind, out)


@pytest.mark.parametrize("content", [None, "", "soon ready\n", "ready\n"])
def test_no_file_or_a_garbled_one_fails_every_probe(data_dir: Path, content: str | None) -> None:
    if content is not None:
        probe_path(data_dir, "pod-1").write_text(content)
    for kind in SCRIPTS:
        assert _probe(kind, data_dir).returncode != 0, (kind, content)


def test_each_pod_reads_its_own_file(data_dir: Path) -> None:
    _file(data_dir, _alive, _health(True)).refresh()
    assert _probe("liveness", data_dir, pod_uid="pod-2").returncode != 0, "the other pod of a surge"


def test_why_is_one_bounded_line(data_dir: Path) -> None:
    line = _file(data_dir, _alive, _health(False, "a\nb\tc", "x" * 5000)).refresh()
    _until, verdict, why = line.rstrip("\n").split(" ", 2)
    assert verdict == "unready" and why.startswith("a b c; xxx") and len(why) == MAX_PROBE_REASON
    assert probe_path(data_dir, "pod-1").read_text() == line


def test_a_failed_write_is_logged_and_the_verdict_expires(data_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    gone = data_dir / "gone"
    probe = ProbeFile(gone / "probe", _alive, _health(True))
    with caplog.at_level(logging.ERROR):
        probe.refresh()
    assert "cannot write the probe file" in caplog.text


def test_stop_removes_the_file(data_dir: Path) -> None:
    probe = _file(data_dir, _alive, _health(True))
    probe.refresh()
    probe.remove()
    probe.remove()  # twice is fine
    assert not probe.path.exists() and _probe("liveness", data_dir).returncode != 0


def test_a_check_that_breaks_is_dead_and_logged(data_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    def broken() -> dict[str, Any]:
        raise KeyError("ready")

    with caplog.at_level(logging.ERROR):
        line = _file(data_dir, _alive, broken).refresh()
    assert line.split(" ", 2)[1] == "dead" and "check of itself failed" in caplog.text


def test_a_passing_self_check_runs_once_a_period_and_a_failing_one_at_every_refresh(data_dir: Path) -> None:
    """The self-check dials both sockets (about 9 ms of CPU), so while it passes it runs once per
    SELF_CHECK_PERIOD; the refreshes between keep its verdict. Once it fails it runs at every
    refresh, so the file says `alive` again as soon as the daemon is."""
    now = [NOW]
    failing = [False]
    checks: list[float] = []

    def alive() -> None:
        checks.append(now[0])
        if failing[0]:
            _dead()

    probe = ProbeFile(probe_path(data_dir, "pod-1"), alive, _health(True), clock=lambda: now[0])
    for _ in range(7):  # 60 s of refreshes every PROBE_PERIOD
        assert probe.refresh().split()[1] == "ready"
        now[0] += PROBE_PERIOD
    assert checks == [NOW, NOW + SELF_CHECK_PERIOD, NOW + 2 * SELF_CHECK_PERIOD]
    failing[0] = True  # just after a check passed: the file says so until the next check is due
    verdicts = []
    for _ in range(4):
        verdicts.append(probe.refresh().split()[1])
        now[0] += PROBE_PERIOD
    assert verdicts == ["ready", "ready", "dead", "dead"]
    checks.clear()
    for _ in range(2):
        now[0] += PROBE_PERIOD
        assert probe.refresh().split()[1] == "dead"
    failing[0] = False
    now[0] += PROBE_PERIOD
    assert probe.refresh().split()[1] == "ready"
    assert len(checks) == 3  # every refresh while dead, and the one that found it alive again
