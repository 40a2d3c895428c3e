"""The createRuntime hook of an exclusive NIC, run as an OCI runtime runs it: with a container's
state on stdin, after the netdev was moved into the container's network namespace (root only)."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator

import pytest
from nic_fixtures import ip, make_netns

from driver.claims.nic.setup import setup_hook
from driver.claims.opaque_config import NicConfig, Route


@pytest.fixture
def pod(request: pytest.FixtureRequest) -> Iterator[tuple[str, int]]:
    """A namespace holding `net1` (a veth moved in and renamed, as runc does) and a process in it."""
    ns = make_netns(request, "hook")
    host = f"thk{ns[-6:]}"
    subprocess.run(["ip", "link", "add", host, "type", "veth", "peer", "name", f"{host}p"], check=True)
    request.addfinalizer(lambda: subprocess.run(["ip", "link", "del", f"{host}p"], check=False))
    subprocess.run(["ip", "link", "set", host, "netns", ns, "name", "net1"], check=True)
    ip(ns, "address", "add", "198.51.100.9/24", "dev", "net1")  # brought from the host: replaced
    proc = subprocess.Popen(["ip", "netns", "exec", ns, "sleep", "60"])
    request.addfinalizer(proc.kill)
    yield ns, proc.pid


def _run(hook_args: tuple[str, ...], env: tuple[str, ...], pid: int) -> subprocess.CompletedProcess[str]:
    state = json.dumps({"ociVersion": "1.3.0", "id": "c", "status": "creating", "pid": pid, "bundle": "/b"})
    return subprocess.run(
        list(hook_args), input=state, env=dict(e.split("=", 1) for e in env), capture_output=True, text=True
    )


def _show(ns: str, *what: str) -> list[dict]:
    out = subprocess.run(["ip", "-n", ns, "-j", *what], capture_output=True, text=True, check=True).stdout
    return json.loads(out)


def test_the_hook_gives_the_interface_its_addresses_mtu_and_routes(pod: tuple[str, int]) -> None:
    ns, pid = pod
    config = NicConfig(
        mode="exclusive",
        interface_name="net1",
        addresses=("10.9.0.5/24", "fd42::5/64"),
        routes=(Route("10.10.0.0/16", "10.9.0.1"), Route("10.11.0.0/16")),
        mtu=4200,
    )
    hook = setup_hook(config)
    assert hook.path == "/bin/sh" and hook.hook_name == "createRuntime"
    result = _run(hook.args, hook.env, pid)
    assert result.returncode == 0, result.stderr
    (link,) = _show(ns, "address", "show", "dev", "net1")
    assert link["mtu"] == 4200 and "UP" in link["flags"]
    addresses = {f"{a['local']}/{a['prefixlen']}" for a in link["addr_info"] if a.get("scope") == "global"}
    assert addresses == {"10.9.0.5/24", "fd42::5/64"}
    routes = {(r["dst"], r.get("gateway", "")) for r in _show(ns, "route", "show", "dev", "net1")}
    assert {("10.10.0.0/16", "10.9.0.1"), ("10.11.0.0/16", "")} <= routes


def test_a_failing_step_fails_the_hook_with_its_message(pod: tuple[str, int]) -> None:
    _, pid = pod
    hook = setup_hook(NicConfig(mode="exclusive", interface_name="nosuch0", mtu=1500))
    result = _run(hook.args, hook.env, pid)
    assert result.returncode != 0 and "nosuch0" in result.stderr


def test_no_pid_in_the_state_fails_the_hook(pod: tuple[str, int]) -> None:
    hook = setup_hook(NicConfig(mode="exclusive", interface_name="net1", mtu=1500))
    result = subprocess.run(list(hook.args), input="{}", env=dict(e.split("=", 1) for e in hook.env),
                            capture_output=True, text=True)  # fmt: skip
    assert result.returncode != 0 and "no pid" in result.stderr
