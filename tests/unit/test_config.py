"""Flags and environment variables become one validated Config."""

from __future__ import annotations

import builtins
import dataclasses
import logging
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from driver.cli import config_from_args, driver_main, driver_parser
from driver.config import Config, ConfigError, NicExclusions
from driver.kube.kubeconfig import cluster_access
from driver.model import DeviceKind


@pytest.fixture(autouse=True)
def _daemon_logging_stays_in_its_test() -> Iterator[None]:
    """`driver_main` installs the daemon's log handler on the root logger, bound to the stderr it
    finds: this test's captured one, closed when the test ends. Left in place, every later log
    line of any test's threads would fail to write ("I/O operation on closed file")."""
    root, driver = logging.getLogger(), logging.getLogger("driver")
    saved = (root.handlers[:], root.level, driver.level)
    yield
    root.handlers[:], root.level = saved[0], saved[1]
    driver.setLevel(saved[2])


def _config(argv, monkeypatch, env=None):
    _clean_environment(monkeypatch)
    for k, v in (env or {}).items():
        monkeypatch.setenv(k, v)
    return config_from_args(driver_parser().parse_args(["run", *argv]))


def test_defaults(monkeypatch):
    c = _config(["--node-name", "n1"], monkeypatch)
    assert c.driver_name == "tandem.dev"
    assert c.data_dir == Path("/var/lib/kubelet/plugins/tandem.dev")
    assert c.registrar_dir == Path("/var/lib/kubelet/plugins_registry")
    assert c.cdi_root == Path("/var/run/cdi")
    assert c.kubeconfig is None
    assert c.device_kinds == {DeviceKind.GPU, DeviceKind.NIC}
    assert c.pod_uid == ""
    # Five minutes, in the flag and in a Config made without flags alike (docs/architecture.md: why).
    assert c.rediscover_period == Config(node_name="n1").rediscover_period == 300.0


def test_environment_supplies_every_flag(monkeypatch):
    c = _config(
        [],
        monkeypatch,
        {
            "NODE_NAME": "node-7",
            "DRIVER_NAME": "gpu.example.com",
            "POD_UID": "aaaaaaaa-0000-4000-8000-000000000001",
            "DEVICE_KINDS": "nic",
            "CDI_ROOT": "/run/cdi",
            "KUBELET_PLUGINS_DIRECTORY_PATH": "/p",
        },
    )
    assert (c.node_name, c.driver_name, c.pod_uid) == (
        "node-7",
        "gpu.example.com",
        "aaaaaaaa-0000-4000-8000-000000000001",
    )
    assert c.device_kinds == {DeviceKind.NIC}
    assert c.cdi_root == Path("/run/cdi")
    assert c.data_dir == Path("/p/gpu.example.com")


def test_flags_override_environment(monkeypatch):
    c = _config(["--node-name", "flag-node"], monkeypatch, {"NODE_NAME": "env-node"})
    assert c.node_name == "flag-node"


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--node-name", "n", "--pod-uid", "../x"], "pod UID"),
        (["--node-name", "n", "--driver-name", "UPPER.dev"], "DNS subdomain"),
        (["--node-name", "n", "--driver-name", "x" * 60 + ".dev"], "at most 63"),
        (["--node-name", "n", "--device-kinds", ","], "at least one"),
        (["--node-name", "n", "--metrics-address", "nope"], "HOST:PORT"),
    ],
)
def test_invalid_values(argv, match, monkeypatch):
    with pytest.raises(ConfigError, match=match):
        _config(argv, monkeypatch)


# One bad value per environment variable the daemon reads, and what its error must say. The
# test below fails when a flag gains an environment variable this table does not cover.
BAD_ENVIRONMENT = {
    "NODE_NAME": ("Bad_Name", "--node-name 'Bad_Name' is not a valid node name"),
    "GPU_SHARING": ("gpu7", "--gpu-sharing: 'gpu7' is not 'all', a GPU minor number or a GPU UUID"),
    "DRIVER_NAME": ("nodomain", "--driver-name 'nodomain' must be"),
    "KUBECONFIG": ("/nonexistent/kubeconfig", "--kubeconfig '/nonexistent/kubeconfig' is not a file"),
    "KUBELET_REGISTRAR_DIRECTORY_PATH": ("registry", "--kubelet-registrar-dir 'registry' must be an absolute path"),
    "POD_UID": ("../x", "--pod-uid '../x' is not a valid pod UID"),
    "KUBELET_PLUGINS_DIRECTORY_PATH": ("plugins", "--kubelet-plugins-dir 'plugins' must be an absolute path"),
    "CDI_ROOT": ("cdi", "--cdi-root 'cdi' must be an absolute path"),
    "SYSFS_ROOT": ("sys", "--sysfs-root 'sys' must be an absolute path"),
    "DEV_ROOT": ("dev", "--dev-root 'dev' must be an absolute path"),
    "PROC_ROOT": ("proc", "--proc-root 'proc' must be an absolute path"),
    "NVIDIA_DRIVER_ROOT": ("drv", "--nvidia-driver-root 'drv' must be an absolute path"),
    "NVIDIA_DRIVER_ROOT_HOST": ("drv", "--nvidia-driver-root-host 'drv' must be an absolute path"),
    "DEVICE_KINDS": ("gpu,tpu", "--device-kinds: unknown kind 'tpu'"),
    "LIST_ATTRIBUTES": ("maybe", "argument --list-attributes (from LIST_ATTRIBUTES='maybe'): 'maybe' is not a boolean"),
    "NO_BINDING_CONDITIONS": ("sometimes", "(from NO_BINDING_CONDITIONS='sometimes'): 'sometimes' is not a boolean"),
    "NIC_BINDING_CONDITIONS": ("2", "(from NIC_BINDING_CONDITIONS='2'): '2' is not a boolean"),
    "REDISCOVER_PERIOD": ("abc", "argument --rediscover-period (from REDISCOVER_PERIOD='abc'): 'abc' is not a number"),
    "METRICS_ADDRESS": ("0.0.0.0:99999", "--metrics-address '0.0.0.0:99999' must be HOST:PORT"),
    "IGNORED_XIDS": ("13,x", "--ignored-xids: 'x' is not an XID number"),
    "TAINT_EFFECTS": ("tandem.dev/xid=Sometimes", "--taint-effect: "),
    "GREY_THRESHOLDS": (
        "window=10,windw=600",
        "--grey-threshold: grey threshold 'windw=600': unknown name 'windw'",
    ),
    "HEALTH_QUIET_PERIOD": ("-1", "--health-quiet-period -1.0 must be a finite number of seconds"),
    "LINK_DEBOUNCE": ("inf", "argument --link-debounce (from LINK_DEBOUNCE='inf'): 'inf' is not a finite number"),
    "NETNS": ("../x", "--netns '../x' must be the name of a namespace"),
    "EXCLUDE_NICS": ("eth 0", "--exclude-nics: 'eth 0' is not a netdev name or glob"),
    "DYNAMIC_MIG": ("gpu-3", "--dynamic-mig: 'gpu-3' is not 'all', a GPU minor number or a GPU UUID"),
    "NIC_LINK_SOURCE": ("pigeon", "argument --nic-link-source (from NIC_LINK_SOURCE='pigeon'): 'pigeon' is not one of"),
    "NIC_SHARES": ("2000", "--nic-shares 2000 must be 1 to 1000 (from NIC_SHARES='2000')"),
    "VERBOSITY": ("x", "argument -v/--verbose/--v (from VERBOSITY='x'): 'x' is not a verbosity level"),
    "LOG_FORMAT": ("xml", "argument --log-format (from LOG_FORMAT='xml'): 'xml' is not one of: text, json"),
}


def _environment_variables() -> set[str]:
    parser = driver_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    return {f.env for sub in commands.values() for f in sub.env_flags}


def _clean_environment(monkeypatch) -> None:
    for name in _environment_variables():
        monkeypatch.delenv(name, raising=False)


def test_the_table_covers_every_environment_variable():
    assert set(BAD_ENVIRONMENT) == _environment_variables()


@pytest.mark.parametrize("name", sorted(BAD_ENVIRONMENT))
def test_a_bad_environment_value_is_a_one_line_error_with_exit_code_2(name, monkeypatch, capsys):
    _clean_environment(monkeypatch)
    value, message = BAD_ENVIRONMENT[name]
    monkeypatch.setenv(name, value)
    if name != "NODE_NAME":
        monkeypatch.setenv("NODE_NAME", "n1")
    with pytest.raises(SystemExit) as exit_:
        driver_main(["run"])
    assert exit_.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], lines
    assert f"{name}={value!r}" in lines[0], "the error names the variable that set the bad value"


def test_a_bad_command_line_value_names_no_variable_even_when_the_variable_is_set(monkeypatch, capsys):
    """The command line wins over the environment: the error blames the flag, not NIC_SHARES."""
    _clean_environment(monkeypatch)
    monkeypatch.setenv("NIC_SHARES", "8")
    with pytest.raises(SystemExit):
        driver_main(["run", "--node-name", "n1", "--nic-shares", "2000"])
    assert capsys.readouterr().err.strip().endswith("--nic-shares 2000 must be 1 to 1000")


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("REDISCOVER_PERIOD", "nan"),
        ("REDISCOVER_PERIOD", "0"),
        ("HEALTH_QUIET_PERIOD", "nan"),
        ("LINK_DEBOUNCE", "-inf"),
    ],
)
def test_periods_must_be_finite_and_positive(name, value, monkeypatch, capsys):
    _clean_environment(monkeypatch)
    monkeypatch.setenv("NODE_NAME", "n1")
    monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exit_:
        driver_main(["run"])
    assert exit_.value.code == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


@pytest.mark.parametrize("command", ["liveness", "demo"])
def test_other_commands_check_their_environment_too(command, monkeypatch, capsys):
    _clean_environment(monkeypatch)
    monkeypatch.setenv("VERBOSITY", "loud")
    with pytest.raises(SystemExit) as exit_:
        driver_main([command])
    assert exit_.value.code == 2
    assert "VERBOSITY='loud'" in capsys.readouterr().err


def test_demo_without_the_simulation_says_so_in_one_line(monkeypatch, capsys):
    """The image leaves demo/ and sim/ out: `tandem-driver demo` there is one clear line, no traceback."""
    _clean_environment(monkeypatch)
    monkeypatch.setitem(sys.modules, "demo.story", None)  # import of it raises ModuleNotFoundError
    assert driver_main(["demo"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "runs from a checkout" in err[0]


def test_demo_without_the_sim_extra_names_it_in_one_line(monkeypatch, capsys):
    """The kubernetes client is in the `sim` extra, not a runtime dependency: an install without the
    extra has demo/ and sim/ but not what they import, and is told which extra to install."""
    _clean_environment(monkeypatch)
    real_import = builtins.__import__

    def import_without_the_client(name, *args, **kwargs):
        if name == "demo.story":  # what importing it raises when the client is not installed
            raise ModuleNotFoundError("No module named 'kubernetes'", name="kubernetes")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", import_without_the_client)
    assert driver_main(["demo"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'kubernetes'" in err[0] and "pip install '.[sim]'" in err[0], err
    assert "runs from a checkout" not in err[0]


def _kubeconfig(path: Path, server: str) -> Path:
    path.write_text(
        f"clusters: [{{name: c, cluster: {{server: '{server}'}}}}]\n"
        "users: [{name: u, user: {token: t}}]\n"
        "contexts: [{name: ctx, context: {cluster: c, user: u}}]\n"
        "current-context: ctx\n"
    )
    return path


def test_a_kubeconfig_list_is_accepted_and_merged_as_kubectl_merges_it(monkeypatch, tmp_path):
    """KUBECONFIG=a:b, as kubectl takes it: files that are missing are skipped, the first file to
    define a name wins; driver.kube.kubeconfig does the merging, the Config only lets the list through."""
    first = _kubeconfig(tmp_path / "a", "https://first:6443")
    second = _kubeconfig(tmp_path / "b", "https://second:6443")
    listed = os.pathsep.join([str(tmp_path / "missing"), str(first), str(second)])
    c = _config(["--node-name", "n1"], monkeypatch, env={"KUBECONFIG": listed})
    assert c.kubeconfig == listed
    assert cluster_access(c.kubeconfig).server == "https://first:6443"
    c = _config(["--node-name", "n1", "--kubeconfig", f"{second}{os.pathsep}{first}"], monkeypatch)
    assert cluster_access(c.kubeconfig).server == "https://second:6443"


@pytest.mark.parametrize(
    ("listed", "match"),
    [
        (["missing-1", "missing-2"], "none of the listed files exists"),
        (["missing", "."], r"'\.' of the list .* is not a file"),
        (["", ""], "names no file"),
        (["missing", ""], "is not a file"),  # one name: it must be there, as before
    ],
)
def test_a_kubeconfig_list_needs_one_file_and_only_files(listed, match, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=match):
        _config(["--node-name", "n1", "--kubeconfig", os.pathsep.join(listed)], monkeypatch)


def test_command_line_values_get_the_same_checks(monkeypatch):
    _clean_environment(monkeypatch)
    with pytest.raises(SystemExit):
        driver_parser().parse_args(["run", "--rediscover-period", "nan"])
    with pytest.raises(ConfigError, match="finite"):
        _config(["--node-name", "n", "--link-debounce", "-1"], monkeypatch)


def test_environment_values_of_every_kind(monkeypatch):
    c = _config(
        [],
        monkeypatch,
        {
            "NODE_NAME": "n1",
            "LIST_ATTRIBUTES": "true",
            "REDISCOVER_PERIOD": "2.5",
            "TAINT_EFFECTS": "tandem.dev/xid=NoExecute, tandem.dev/ecc=None",
            "LINK_DEBOUNCE": "0",
            "NIC_LINK_SOURCE": "sysfs",
            "EXCLUDE_NICS": "eth*, 0000:3B:00.1",
        },
    )
    assert c.list_attributes and c.rediscover_period == 2.5 and c.link_debounce == 0
    assert c.taint_effects == ("tandem.dev/xid=NoExecute", "tandem.dev/ecc=None")
    assert c.nic_link_source == "sysfs"
    assert c.exclude_nics.patterns == ("eth*", "0000:3b:00.1")
    flags = _config(["--node-name", "n1", "--list-attributes", "--taint-effect", "tandem.dev/xid=None"], monkeypatch,
                    {"LIST_ATTRIBUTES": "0", "TAINT_EFFECTS": "tandem.dev/ecc=None"})  # fmt: skip
    assert flags.list_attributes and flags.taint_effects == ("tandem.dev/xid=None",)


def test_nic_exclusions_match_netdev_names_and_pci_addresses():
    ex = NicExclusions.parse("stor*,0000:3b:00.*,mgmt0")
    assert ex.match("0000:8a:00.0", ["storage0"]) == "stor*"
    assert ex.match("0000:3B:00.1", []) == "0000:3b:00.*"
    assert ex.match("0000:8a:00.0", ["ens1f0", "mgmt0"]) == "mgmt0"
    assert ex.match("0000:8a:00.0", ["ens1f0"]) is None
    assert NicExclusions.parse(" , ").patterns == ()
    for bad in ("0000:zz:00.0", "a/b", "x y"):
        with pytest.raises(ConfigError, match="--exclude-nics"):
            NicExclusions.parse(bad)


def test_dynamic_mig_selects_gpus_by_minor_or_uuid(monkeypatch):
    uuid = "GPU-00000001-0000-4000-8000-000000000001"
    chosen = _config(["--node-name", "n", "--dynamic-mig", f"3, {uuid}"], monkeypatch).dynamic_mig
    assert chosen.selects(3, "GPU-x") and chosen.selects(0, uuid) and not chosen.selects(1, "GPU-x")
    everything = _config(["--node-name", "n", "--dynamic-mig", "all"], monkeypatch).dynamic_mig
    assert everything.selects(5, "GPU-y")
    assert not _config(["--node-name", "n"], monkeypatch).dynamic_mig.selects(0, uuid)  # off by default


@pytest.mark.parametrize(
    ("argv", "level"),
    [
        (["-v=4"], 4),
        (["-v", "4"], 4),
        (["--v=4"], 4),
        (["--v", "4"], 4),
        (["-v4"], 4),
        (["-v"], 1),
        (["-vv"], 2),
        (["-vvv"], 3),
        (["--verbose"], 1),
        (["-v", "-v"], 2),
        ([], 0),
    ],
)
def test_verbosity_as_klog_users_type_it(argv, level, monkeypatch):
    _clean_environment(monkeypatch)
    for command in ("run", "liveness", "demo"):
        assert driver_parser().parse_args([command, *argv]).verbose == level, command


def test_a_bad_verbosity_is_a_one_line_usage_error(monkeypatch, capsys):
    _clean_environment(monkeypatch)
    with pytest.raises(SystemExit) as exit_:
        driver_parser().parse_args(["run", "-v=loud"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'loud' is not a verbosity level" in err


def test_the_configuration_holds_no_secret():
    """It is logged whole: the kubeconfig is a path, and no field may ever carry a credential."""
    assert not [f.name for f in dataclasses.fields(Config) if re.search("token|password|secret|credential", f.name)]
