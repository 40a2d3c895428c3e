"""A NIC's link and RDMA port state as sysfs shows it: the health monitor's view on a simulated node.

On a real node link state comes from netlink; RDMA ports have no events anywhere and are always
read here (`class/infiniband/<dev>/ports/<p>/{state,phys_state}`). On the simulated node, whose
NICs exist only as a sysfs tree, links are read here too (`class/net/<if>/{operstate,carrier,
flags,ifindex}`). Whether a NIC's PCI function is still there is read here on every node
(`bus/pci/devices/<bdf>`). A file in a form that cannot be read makes its signal unobservable,
with one warning per file.

This runs every poll for every NIC (six files and a directory each), so paths are plain strings
and files are read by `sysfs.read`, straight through the OS.
"""

from __future__ import annotations

import errno
import logging
import os
import re
from collections.abc import Callable
from pathlib import Path

from driver.discovery.nic import sysfs as nic_sysfs
from driver.health.faults import Fault
from driver.health.nic.signals import BAD_OPERSTATES, port_fault
from driver.node import rtnl
from driver.node.rtnl import LinkState

log = logging.getLogger(__name__)

_PORT_STATE = re.compile(r"^\s*(\d+)\s*:\s*(\S(?:.*\S)?)\s*$")


class LinkSysfs:
    """Reads link and port state under `sysfs_root`; `on_error` counts every unreadable entry."""

    def __init__(self, sysfs_root: Path, on_error: Callable[[], None]) -> None:
        self._net = os.path.join(sysfs_root, "class/net")
        self._infiniband = os.path.join(sysfs_root, "class/infiniband")
        self._pci = os.path.join(sysfs_root, "bus/pci/devices")
        self._on_error = on_error
        self._warned: set[str] = set()

    def _warn_once(self, key: str, message: str, *args: object) -> None:
        self._on_error()
        if key not in self._warned:
            self._warned.add(key)
            log.warning(message, *args)

    def _read(self, path: str) -> str | None:
        """Contents of a sysfs file; None when it is absent, unreadable (EINVAL: `carrier` of a
        link that is administratively down) or not UTF-8 (garbled: unobservable, like unreadable)."""
        try:
            return nic_sysfs.read(path)
        except FileNotFoundError:
            return None
        except OSError as e:
            if e.errno != errno.EINVAL:
                self._warn_once(path, "cannot read %s: %s", path, e)
            return None
        except UnicodeDecodeError as e:
            self._warn_once(path, "%s: not UTF-8 (%s), not judged", path, e)
            return None

    def link(self, ifname: str) -> LinkState | None:
        """A netdev's state from sysfs (the simulated node); None when there is no such netdev."""
        net = f"{self._net}/{ifname}"
        operstate = self._read(f"{net}/operstate")
        if operstate is None:
            return None
        try:
            flags = int(self._read(f"{net}/flags") or "0x1", 0)
            index = int(self._read(f"{net}/ifindex") or "0")
            carrier_text = self._read(f"{net}/carrier")
            carrier = int(carrier_text) == 1 if carrier_text is not None else None
        except ValueError as e:
            self._warn_once(net, "netdev %s: unreadable sysfs state, not judged: %s", ifname, e)
            return None
        admin_up = bool(flags & rtnl.IFF_UP)
        if carrier is None:  # the kernel refuses to say while the link is administratively down
            carrier = False if not admin_up else operstate.lower() not in BAD_OPERSTATES
        return LinkState(index, ifname, operstate.lower(), admin_up, carrier)

    def function_gone(self, pci_address: str) -> bool:
        """Whether sysfs no longer lists the PCI function. Only its absence says so: any other
        failure to look (warned once) is no verdict, as a wrong one would evict the NIC's pods."""
        path = f"{self._pci}/{pci_address}"
        try:
            os.stat(path)
        except FileNotFoundError:
            return True
        except OSError as e:
            self._warn_once(path, "cannot tell whether PCI function %s is present: %s", pci_address, e)
        return False

    def ports(self, rdma_device: str) -> dict[int, Fault | None]:
        """Each readable port of an RDMA device with its fault; ports sysfs does not show, or
        shows in a form we cannot read, are left out (unobservable)."""
        ports = f"{self._infiniband}/{rdma_device}/ports"
        try:
            names = os.listdir(ports)
        except OSError:  # no such RDMA device (any more), or not a directory: no ports to judge
            return {}
        out: dict[int, Fault | None] = {}
        for name in sorted(names):
            if not (name.isascii() and name.isdigit()):  # `isdigit` also takes "²", which `int` refuses
                continue
            state = self._port_state(f"{ports}/{name}/state")
            if state is None:
                continue
            out[int(name)] = port_fault(int(name), state, self._port_state(f"{ports}/{name}/phys_state"))
        return out

    def _port_state(self, path: str) -> str | None:
        """`4: ACTIVE` -> `ACTIVE`; None (and a warning, once) for a file in another form."""
        text = self._read(path)
        if text is None:
            return None
        m = _PORT_STATE.match(text)
        if m is None:
            self._warn_once(str(path), "%s: not a port state (%r), not judged", path, text[:40])
            return None
        return m.group(2)
