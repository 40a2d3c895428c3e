"""Flags and environment variables become one validated Config."""

from __future__ import annotations

from pathlib import Path

import pytest

from driver.cli import config_from_args, driver_parser
from driver.config import ConfigError
from driver.model import DeviceKind


def _config(argv, monkeypatch, env=None):
    for key in ("NODE_NAME", "DRIVER_NAME", "KUBECONFIG", "POD_UID", "DEVICE_KINDS", "CDI_ROOT"):
        monkeypatch.delenv(key, raising=False)
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
