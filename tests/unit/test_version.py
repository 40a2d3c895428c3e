"""`--version` and the daemon's first log line name the build: the package's version and the
commit, from the image's build args or, in a checkout, from git, and never a crash without either."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shutil
import subprocess
from importlib import metadata
from pathlib import Path

import pytest

from driver import daemon
from driver.cli import ctl_main, driver_main
from driver.config import Config, GpuSelection
from driver.logs import CONFIG_FIELD
from driver.version import COMMIT_ENV, CREATED_ENV, PACKAGE, describe

SHA = "1a2b3c4d5e6f7a8b9c0d1e2f3a4b5c6d7e8f9a0b"
VERSION = metadata.version(PACKAGE)
LINE = re.compile(r"^(tandem-driver|tandemctl) (\S+) \(commit ([0-9a-f]{12}|unknown)(, built \d{4}-\d{2}-\d{2})?\)$")


@pytest.fixture
def no_git(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No git on PATH, as in the image."""
    empty = tmp_path / "no-git-bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))


def _checkout(path: Path) -> str:
    """A real checkout with one commit; its HEAD."""
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    path.mkdir()
    (path / "driver").mkdir()
    (path / "driver" / "x.py").write_text("")
    env = {**os.environ, "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1"}
    for args in (["init", "-q"], ["add", "."], ["-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "x"]):
        subprocess.run(["git", "-C", str(path), *args], check=True, capture_output=True, env=env, timeout=60)
    return subprocess.run(
        ["git", "-C", str(path), "rev-parse", "HEAD"], check=True, capture_output=True, text=True, env=env, timeout=60
    ).stdout.strip()


def test_the_image_line_names_version_commit_and_build_date(tmp_path: Path, no_git: None) -> None:
    """The image: no .git, no git; the build args baked into its environment say it all."""
    environ = {COMMIT_ENV: SHA, CREATED_ENV: "2026-12-01T10:20:30Z"}
    line = describe("tandem-driver", environ=environ, checkout=tmp_path)
    assert line == f"tandem-driver {VERSION} (commit 1a2b3c4d5e6f, built 2026-12-01)"
    assert LINE.match(line)


def test_the_version_is_the_installed_package_metadata(tmp_path: Path) -> None:
    """pyproject.toml's `version`, as pip installed it (hack/venv.sh reinstalls when it changes)."""
    assert describe("tandemctl", environ={}, checkout=tmp_path).startswith(f"tandemctl {VERSION} (")


def test_a_checkout_names_its_head(tmp_path: Path) -> None:
    head = _checkout(tmp_path / "repo")
    line = describe(environ={}, checkout=tmp_path / "repo")
    assert line == f"tandem-driver {VERSION} (commit {head[:12]})"


def test_the_built_commit_wins_over_the_checkout(tmp_path: Path) -> None:
    """What the artifact says of itself is what it is, even run where a checkout lies."""
    _checkout(tmp_path / "repo")
    assert "(commit 1a2b3c4d5e6f)" in describe(environ={COMMIT_ENV: SHA}, checkout=tmp_path / "repo")


def test_a_package_inside_another_repository_does_not_take_its_commit(tmp_path: Path) -> None:
    """Installed in a venv that happens to sit in a checkout: that checkout is not this build."""
    _checkout(tmp_path / "repo")
    site = tmp_path / "repo" / ".venv" / "lib" / "site-packages"
    site.mkdir(parents=True)
    assert describe(environ={}, checkout=site).endswith("(commit unknown)")


def test_neither_build_args_nor_a_checkout_is_unknown_not_a_crash(tmp_path: Path) -> None:
    assert describe(environ={COMMIT_ENV: " ", CREATED_ENV: ""}, checkout=tmp_path) == (
        f"tandem-driver {VERSION} (commit unknown)"
    )


def test_git_missing_or_refusing_is_unknown_not_a_crash(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    checkout = tmp_path / "broken"
    (checkout / ".git").mkdir(parents=True)  # a .git git cannot read
    if shutil.which("git") is not None:
        assert describe(environ={}, checkout=checkout).endswith("(commit unknown)")
    empty = tmp_path / "no-git-bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    assert describe(environ={}, checkout=checkout).endswith("(commit unknown)")


def test_a_package_imported_without_being_installed_is_version_unknown(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def not_installed(name: str) -> str:
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", not_installed)
    assert describe(environ={}, checkout=tmp_path) == "tandem-driver unknown (commit unknown)"


def test_build_args_that_are_no_commit_or_date_are_shown_escaped_on_one_line(tmp_path: Path) -> None:
    line = describe(environ={COMMIT_ENV: "main\nFAKE", CREATED_ENV: "soon\r\n"}, checkout=tmp_path)
    assert "\n" not in line and "\r" not in line
    assert line == f"tandem-driver {VERSION} (commit 'main\\nFAKE', built 'soon')"


@pytest.mark.parametrize(("main", "program"), [(driver_main, "tandem-driver"), (ctl_main, "tandemctl")])
def test_the_version_flag_prints_one_line_and_exits_0(main, program, monkeypatch, capsys) -> None:
    """`tandem-driver --version` is not taken for `run --version`, and `tandemctl --version`
    needs no subcommand."""
    monkeypatch.setenv(COMMIT_ENV, SHA)
    monkeypatch.setenv(CREATED_ENV, "2026-12-01T00:00:00Z")
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out == f"{program} {VERSION} (commit 1a2b3c4d5e6f, built 2026-12-01)\n"


def test_the_daemon_logs_its_build_and_configuration_at_start_up(monkeypatch, caplog, tmp_path) -> None:
    """The first line of a daemon's log says which build runs, even one that cannot start, and with
    what: every field of its configuration, whichever flag or variable set it."""

    class Unstartable:
        def __init__(self, config: Config) -> None:
            raise RuntimeError("no")

    monkeypatch.setenv(COMMIT_ENV, SHA)
    monkeypatch.delenv(CREATED_ENV, raising=False)
    monkeypatch.setattr(daemon, "Daemon", Unstartable)
    monkeypatch.setattr(daemon.signal, "signal", lambda *_: None)  # leave pytest's handlers alone
    caplog.set_level(logging.INFO, logger="driver.daemon")
    kubeconfig = tmp_path / "kubeconfig"
    config = Config(node_name="n1", kubeconfig=str(kubeconfig), dynamic_mig=GpuSelection(gpus=frozenset({"0"})))
    assert daemon.run_daemon(config) == 1
    first = caplog.records[0]
    assert first.getMessage().startswith(f"starting tandem-driver {VERSION} (commit 1a2b3c4d5e6f) pid=")
    logged = json.loads(json.dumps(getattr(first, CONFIG_FIELD)))  # as the JSON log writes it
    assert set(logged) == {f.name for f in dataclasses.fields(Config)}
    assert (logged["node_name"], logged["driver_name"], logged["kubeconfig"]) == ("n1", "tandem.dev", str(kubeconfig))
    assert logged["dynamic_mig"] == {"everything": False, "gpus": ["0"]}
    assert logged["device_kinds"] == ["gpu", "nic"] and logged["plugins_dir"] == "/var/lib/kubelet/plugins"
