"""The cluster node's simulated NICs as real netdevs, and the kernel's part when a pod takes one.

The node's RDMA NICs are sysfs trees (`sim.nics`); exclusive mode moves a NIC's netdev into a pod
(CDI netDevices, done by runc), so each NIC also gets a netdev the kernel knows: a veth pair in
the host's namespace, the NIC end named, addressed and sized as the NIC (`ens1f0np0`, its MAC, MTU,
IPv4 and IPv6 addresses), the peer (`ens1f0np0p`) its cable. Tandem runs with netlink
(`--nic-link-source netlink`) and finds each netdev's PCI function through the node's sysfs
(`class/net/<name>/device`), as on a real node.

Where a veth is not a ConnectX: when a pod's network namespace goes, the kernel moves a physical
netdev back to the host's namespace, under the name it had in the pod and without addresses
(runtime-spec 1.3, 'Namespace Lifecycle and Container Termination'), but destroys a veth. This
process stands in for the kernel there: it holds the namespace of each pod that has one of the
NICs (so freeing it cannot destroy the veth) and, once containerd has removed the namespace, moves
the netdev back to the host's namespace, as the kernel would have (a name the host already uses
becomes `dev<ifindex>`). It also keeps the node's sysfs in step, as the kernel keeps /sys:
`class/net/<name>` and `<function>/net/<name>` exist while the netdev is in the host's namespace,
under its current name. What Tandem then does with a NIC back under its pod name is its own
business (driver/claims/nic/homes.py).

    python -m demo.cluster_nics run --root DIR --node-name NAME [--gpus 8 --nics 4]   (hack/cluster.sh: nic-hardware)
    python -m demo.cluster_nics down --root DIR --node-name NAME [--gpus 8 --nics 4]  (removes the veths)
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from demo.cluster_node import ClusterNode, add_size_arguments
from sim.profile import NicSpec

log = logging.getLogger("cluster-nics")
NETNS_DIRS = (Path("/run/netns"), Path("/var/run/netns"))
PERIOD = 0.5


def _ip(*args: str, netns_fd: int | None = None, check: bool = True) -> str:
    cmd = ["ip", *args]
    if netns_fd is not None:
        cmd = ["nsenter", f"--net=/proc/{os.getpid()}/fd/{netns_fd}", *cmd]
    return subprocess.run(cmd, capture_output=True, text=True, check=check).stdout


def _links(netns_fd: int | None = None) -> list[dict[str, Any]]:
    return json.loads(_ip("-j", "link", "show", netns_fd=netns_fd) or "[]")


@dataclass
class _Held:
    """A pod's namespace holding a NIC: its path (gone once containerd removed it) and our fd."""

    path: Path
    fd: int


class NicHardware:
    def __init__(self, node: ClusterNode) -> None:
        self.node = node
        self.sim = node.sim_node()  # renders the node on first use
        self.nics: list[NicSpec] = self.sim.profile.nics
        self.held: dict[str, _Held] = {}  # MAC -> the pod namespace holding it

    # -- the veths -------------------------------------------------------------------------------

    def create(self, nic: NicSpec) -> None:
        """The NIC's netdev and its cable, up, with the NIC's addresses."""
        peer = f"{nic.ifname}p"
        _ip("link", "add", nic.ifname, "address", nic.mac, "mtu", str(nic.mtu), "type", "veth", "peer", "name", peer)
        for address in nic.ipv4:
            _ip("address", "add", address, "dev", nic.ifname)
        for address in nic.ipv6:
            _ip("address", "add", address, "dev", nic.ifname, "nodad")
        _ip("link", "set", peer, "up")
        _ip("link", "set", nic.ifname, "up")
        self._sysfs_show(nic, nic.ifname)
        log.info("%s: netdev %s made", nic.pci_address, nic.ifname)

    def remove(self) -> None:
        by_mac = {link.get("address"): link["ifname"] for link in _links()}
        for nic in self.nics:
            if nic.mac in by_mac:
                _ip("link", "del", by_mac[nic.mac], check=False)  # its peer goes with it

    # -- the kernel's part -----------------------------------------------------------------------

    def step(self) -> None:
        on_host = {link.get("address"): link for link in _links()}
        for nic in self.nics:
            link = on_host.get(nic.mac)
            if link is not None:
                self._sysfs_show(nic, link["ifname"])
                continue
            self._sysfs_hide(nic)
            held = self.held.get(nic.mac)
            if held is None:
                self._hold_or_create(nic)
            elif not held.path.exists():
                self._give_back(nic, held, {link["ifname"] for link in on_host.values()})

    def _hold_or_create(self, nic: NicSpec) -> None:
        for directory in NETNS_DIRS:
            for path in sorted(directory.glob("*")) if directory.is_dir() else []:
                try:
                    fd = os.open(path, os.O_RDONLY)
                except OSError:
                    continue
                try:
                    found = any(link.get("address") == nic.mac for link in _links(fd))
                except (subprocess.CalledProcessError, ValueError):
                    found = False
                if found:
                    self.held[nic.mac] = _Held(path, fd)
                    log.info("%s: netdev in pod namespace %s, held", nic.pci_address, path.name)
                    return
                os.close(fd)
        # Nowhere: destroyed with a namespace this process did not hold (it was not running).
        self.create(nic)

    def _give_back(self, nic: NicSpec, held: _Held, host_names: set[str]) -> None:
        """The pod's namespace was removed: move the netdev home as the kernel moves a physical one."""
        try:
            (link,) = [link for link in _links(held.fd) if link.get("address") == nic.mac]
            name = link["ifname"]
            if name in host_names:  # the kernel's fallback name
                name = f"dev{link['ifindex']}"
                _ip("link", "set", "dev", link["ifname"], "name", name, netns_fd=held.fd)
            self._sysfs_show(nic, name)  # sysfs first: whoever the move's netlink event wakes finds it
            _ip("link", "set", "dev", name, "netns", str(os.getpid()), netns_fd=held.fd)
            log.info("%s: pod namespace %s removed, netdev back on the host as %s", nic.pci_address, held.path.name,
                     name)  # fmt: skip
        except (subprocess.CalledProcessError, ValueError) as e:
            log.warning("%s: cannot move the netdev back from %s: %s", nic.pci_address, held.path.name, e)
            return
        finally:
            os.close(held.fd)
            del self.held[nic.mac]

    # -- sysfs -----------------------------------------------------------------------------------

    def _function(self, nic: NicSpec) -> Path:
        return (self.sim.sysfs / "bus" / "pci" / "devices" / nic.pci_address).resolve()

    def _stash(self, nic: NicSpec) -> Path:
        return self.node.root / "netdevs-away" / nic.pci_address

    def _sysfs_show(self, nic: NicSpec, name: str) -> None:
        net = self._function(nic) / "net"
        current = [p for p in net.iterdir() if p.is_dir()] if net.is_dir() else []
        if [p.name for p in current] == [name]:
            return
        source = current[0] if current else self._stash(nic)
        if not source.is_dir():
            return
        target = net / name
        shutil.move(source, target)
        for old in (self.sim.sysfs / "class" / "net" / p.name for p in current):
            old.unlink(missing_ok=True)
        link = self.sim.sysfs / "class" / "net" / name
        link.unlink(missing_ok=True)
        link.symlink_to(os.path.relpath(target, link.parent))

    def _sysfs_hide(self, nic: NicSpec) -> None:
        net = self._function(nic) / "net"
        for entry in [p for p in net.iterdir() if p.is_dir()] if net.is_dir() else []:
            stash = self._stash(nic)
            stash.parent.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(stash, ignore_errors=True)
            shutil.move(entry, stash)
            (self.sim.sysfs / "class" / "net" / entry.name).unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m demo.cluster_nics", description=__doc__.splitlines()[0])
    p.add_argument("action", choices=("run", "down"))
    p.add_argument("--root", type=Path, required=True, help="where the simulated node lives")
    p.add_argument("--node-name", required=True)
    add_size_arguments(p)
    a = p.parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    hardware = NicHardware(ClusterNode(a.root, Path("/dev/null"), a.node_name, a.gpus, a.nics))
    if a.action == "down":
        hardware.remove()
        return 0
    stop, changed = threading.Event(), threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: (stop.set(), changed.set()))
    # Link events wake a step at once (sysfs follows a rename as the kernel's does, within
    # milliseconds); the period catches a pod namespace that containerd removed.
    monitor = subprocess.Popen(["ip", "-o", "monitor", "link"], stdout=subprocess.PIPE, text=True)
    threading.Thread(target=lambda: [changed.set() for _ in monitor.stdout or ()], daemon=True).start()
    try:
        while not stop.is_set():
            changed.clear()
            hardware.step()
            changed.wait(PERIOD)
    finally:
        monitor.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
