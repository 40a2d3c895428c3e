"""The cluster node's NIC stand-in (demo/cluster_nics.py) does the kernel's part: a NIC's netdev
moved into a pod comes back to the host when the pod's namespace goes, under its pod-side name,
down and without addresses, and sysfs follows it. Run in a namespace of its own (root only)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from nic_fixtures import make_netns
from waiting import wait_for

from demo.node import repo_root


def _links(ns: str) -> dict[str, dict]:
    out = subprocess.run(["ip", "-n", ns, "-j", "address", "show"], capture_output=True, text=True, check=True).stdout
    return {link["ifname"]: link for link in json.loads(out)}


def _addressed(ns: str, ifname: str) -> dict | None:
    """The link once it carries the stand-in's host address (10.0.0.10), else None."""
    link = _links(ns).get(ifname)
    return link if link and any(a["local"] == "10.0.0.10" for a in link["addr_info"]) else None


def test_a_nic_comes_back_from_its_pod_as_the_kernel_brings_a_physical_one(
    request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    host = make_netns(request, "hw")  # the stand-in's "host"
    pod = make_netns(request, "pod")
    env = {**os.environ, "PYTHONPATH": repo_root()}
    args = [sys.executable, "-m", "demo.cluster_nics", "run", "--root", str(tmp_path), "--node-name", "n"]
    with open(tmp_path / "log", "w") as log:
        proc = subprocess.Popen(["ip", "netns", "exec", host, *args], env=env, stdout=log, stderr=log)
    request.addfinalizer(proc.kill)
    # The stand-in makes the netdev, then gives it its address: wait for both.
    link = wait_for("the NIC's netdev on the host, with its address", lambda: _addressed(host, "ens1f0np0"))
    assert link["address"] == "b8:3f:d2:00:00:01"
    sysfs = tmp_path / "sys" / "class" / "net"
    wait_for("sysfs showing it", lambda: (sysfs / "ens1f0np0" / "device").resolve().name == "0000:1a:00.0")

    # runc: into the pod's namespace, renamed
    subprocess.run(["ip", "-n", host, "link", "set", "ens1f0np0", "netns", pod, "name", "net1"], check=True)
    wait_for("sysfs without it", lambda: not (sysfs / "ens1f0np0").exists())
    wait_for("the stand-in holding the pod's namespace", lambda: "held" in (tmp_path / "log").read_text())
    # containerd removes the pod's namespace: the netdev is back, as the kernel returns a physical one
    subprocess.run(["ip", "netns", "del", pod], check=True)
    back = wait_for("net1 back on the host", lambda: _links(host).get("net1"))
    assert back["address"] == "b8:3f:d2:00:00:01"
    assert "UP" not in back["flags"] and not [a for a in back["addr_info"] if a.get("scope") == "global"]
    assert (sysfs / "net1" / "device").resolve().name == "0000:1a:00.0"  # before the move: sysfs first
