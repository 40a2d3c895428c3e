"""The daemon as a real process serving the NICs of a test network namespace over real netlink.

The test namespace holds veths that a sysfs fixture maps to RDMA PCI functions, as a ConnectX's
netdev maps to its function on real hardware. Address and link changes made with `ip` must reach
the published ResourceSlice through the daemon's netlink watcher, and a link that stays down must
taint the device until it comes back. Needs root (network namespaces).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from nic_fixtures import SysfsFixture, ip, make_netns, nic_spec, veth
from waiting import poll

from demo.node import DRIVER
from sim.kubelet import ClaimRef, KubeletSim
from sim.profile import NodeProfile
from sim.scheduler import Request, allocate, attribute, claim_object, published_devices

DEVICE = "pci-0000-8a-00-0"


def _device(apiserver, node) -> dict:
    return next((d for d in published_devices(apiserver, DRIVER, node.profile.name) if d["name"] == DEVICE), {})


@pytest.fixture
def served(request, apiserver, sim_node, start_daemon, short_tmp: Path):
    ns = make_netns(request, "daemon")
    veth(ns, "ens1f0np0", "02:00:00:00:00:00")
    fixture = SysfsFixture(short_tmp / "nicfx")
    fixture.map(nic_spec(0, "ens1f0np0"))
    node = sim_node(NodeProfile(name="node-n"))
    daemon = start_daemon(
        node,
        *("--device-kinds", "nic", "--netns", ns, "--nic-link-source", "netlink"),
        *("--sysfs-root", str(fixture.sys), "--dev-root", str(fixture.dev), "--link-debounce", "0.5"),
    )
    with KubeletSim(node.registry) as kubelet:
        kubelet.register(kubelet.wait_for_registration_socket(DRIVER, timeout=60))
    assert poll(lambda: _device(apiserver, node), 60), daemon.log_text()
    return ns, node, daemon


def test_address_changes_reach_the_slice_through_netlink_events(apiserver, served):
    ns, node, daemon = served
    assert attribute(_device(apiserver, node), "ifName") == "ens1f0np0"
    assert attribute(_device(apiserver, node), "mac") == "02:00:00:00:00:00"
    ip(ns, "addr", "add", "192.0.2.7/24", "dev", "ens1f0np0")
    # The slow resync is 60 s: only the netlink event can make this happen within the deadline.
    assert poll(lambda: attribute(_device(apiserver, node), "ipv4") == "192.0.2.7/24", 20), daemon.log_text()
    ip(ns, "addr", "del", "192.0.2.7/24", "dev", "ens1f0np0")
    assert poll(lambda: attribute(_device(apiserver, node), "ipv4") is None, 20), daemon.log_text()


def test_link_down_taints_and_up_clears(apiserver, served):
    ns, node, daemon = served
    ip(ns, "link", "set", "ens1f0np0p", "down")  # the peer goes away: no carrier
    assert poll(
        lambda: any(t["key"] == "tandem.dev/link-down" for t in _device(apiserver, node).get("taints") or []), 20
    ), daemon.log_text()
    ip(ns, "link", "set", "ens1f0np0p", "up")
    assert poll(lambda: not _device(apiserver, node).get("taints"), 20), daemon.log_text()


def test_a_flapping_link_causes_no_slice_writes(apiserver, served):
    ns, node, daemon = served
    writes_before = _slice_writes(apiserver)
    for _ in range(8):  # each state lasts longer than the watcher's coalescing, shorter than the debounce
        ip(ns, "link", "set", "ens1f0np0p", "down")
        time.sleep(0.25)
        ip(ns, "link", "set", "ens1f0np0p", "up")
        time.sleep(0.25)
    # A lasting change afterwards still gets through: the slice shows it, so the flaps were seen.
    ip(ns, "addr", "add", "192.0.2.9/24", "dev", "ens1f0np0")
    assert poll(lambda: attribute(_device(apiserver, node), "ipv4") == "192.0.2.9/24", 20), daemon.log_text()
    assert _slice_writes(apiserver) - writes_before <= 2, "link flaps must not become slice writes"
    assert attribute(_device(apiserver, node), "state") == "up"


def _slice_writes(apiserver) -> int:
    return sum(1 for r in apiserver.requests if r.resource == "resourceslices" and r.method in ("POST", "PUT"))


def test_a_prepared_nics_new_address_reaches_the_claim_status_and_metadata(apiserver, served):
    ns, node, daemon = served
    req = Request("nic", "nic.tandem.dev", lambda d: attribute(d, "type") == "nic")
    claim = apiserver.create(claim_object("default", "net", [req]))
    allocate(apiserver, claim, DRIVER, node.profile.name, [req])
    ref = ClaimRef("default", "net", claim["metadata"]["uid"])
    with KubeletSim(node.registry) as kubelet:
        kubelet.register(kubelet.wait_for_registration_socket(DRIVER, timeout=60))
        assert kubelet.prepare([ref])[ref.uid].error == ""
    meta = node.plugins / DRIVER / "dra-device-metadata" / ref.uid / "nic/metadata.json"
    inode = meta.stat().st_ino

    def status_ips() -> list[str]:
        devices = apiserver.get("resourceclaims", "net", "default").get("status", {}).get("devices") or []
        return devices[0].get("networkData", {}).get("ips", []) if devices else []

    assert status_ips() == []
    ip(ns, "addr", "add", "198.51.100.4/24", "dev", "ens1f0np0")
    assert poll(lambda: status_ips() == ["198.51.100.4/24"], 20), daemon.log_text()
    assert poll(lambda: "198.51.100.4/24" in meta.read_text(), 20)
    assert meta.stat().st_ino == inode, "the metadata file is bind-mounted by inode: rewrite it in place"
