"""RDMA NIC discovery: netlink for netdevs and addresses, sysfs for PCI and RDMA identity.

One pass of `NicDiscovery.discover` runs the three steps: `scan` lists the netdevs and groups
them by PCI function, `device` turns each function into a published device, and `link_hold`
holds back link facts that have not settled yet. What is skipped and why is said in those
modules; here the default-route functions are left out, and a kept NIC the configured exclusions
(`--exclude-nics`) name is not kept: excluded means never published, allocated or not. A NIC Tandem
is bringing home from a pod (`home_names`) is excluded by its home name, not by the one it has
(`NicScanner.excluded_by`), and `host_netdevs` names its netdev, excluded or not, for the return.

Kept devices: `discover(keep=...)` names PCI addresses of allocated NICs. One that discovery does
not publish now (its netdev moved into a pod, or it stopped qualifying) is published from its last
known attributes with `NicInfo.present=False` and `state="absent"`; never seen before (e.g. after a
restart), it is rebuilt from what sysfs still shows of the PCI function and its RDMA device. One
whose PCI function is gone (hot-removed) is kept too, so that NIC health's `nic-lost` taint
(`driver.health.nic.monitor`) evicts its pods rather than vanishing with it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import replace
from pathlib import Path

from driver.config import NO_EXCLUSIONS, NicExclusions
from driver.discovery.nic.device import NicDeviceReader
from driver.discovery.nic.link_hold import LinkHold
from driver.discovery.nic.scan import NicScanner, representative
from driver.discovery.nic.sysfs import BROKEN
from driver.model import Device
from driver.node.rtnl import Link

log = logging.getLogger(__name__)

ABSENT_STATE = "absent"

Keep = Collection[str] | Callable[[], Collection[str]]


class NicDiscovery:
    """Lists the node's RDMA NICs; remembers each one's last published form for `keep`.

    `link_hold`: seconds a changed link fact must hold before it is published; `link_events`
    counts the link messages seen per netdev (the NIC watcher's), so a flap between two passes
    still restarts the hold. `home_names`: PCI address -> home name of each NIC Tandem is bringing
    home from a pod (`driver.claims.nic.homes.NicHomes.home_names`).
    """

    def __init__(
        self,
        sysfs_root: Path,
        list_attributes: bool = False,
        netns: str | None = None,
        skip_default_route: bool = True,
        exclude: NicExclusions = NO_EXCLUSIONS,
        netlink: bool = True,
        link_hold: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
        link_events: Callable[[str], int] | None = None,
        proc_root: Path = Path("/proc"),
        shares: int = 1,
        home_names: Callable[[], Mapping[str, str]] = dict,
    ) -> None:
        sysfs_root = Path(sysfs_root)
        self.exclude = exclude
        self._scanner = NicScanner(
            sysfs_root,
            netlink=netlink,
            netns=netns,
            skip_default_route=skip_default_route,
            exclude=exclude,
            home_names=home_names,
        )
        self._reader = NicDeviceReader(sysfs_root, list_attributes, proc_root, shares)
        self._hold = LinkHold(link_hold, clock, link_events or (lambda _name: 0))
        self._lock = threading.Lock()
        self._last_known: dict[str, Device] = {}
        self._nic_indexes: frozenset[int] = frozenset()  # replaced whole: read without the lock
        self._host_netdevs: dict[str, str] = {}

    @property
    def pending_until(self) -> float | None:
        """When a held link change becomes due (clock time): rediscover then to publish it."""
        with self._lock:
            return self._hold.pending_until()

    def may_be_nic(self, link: Link) -> bool:
        """Whether a link an event names can be a NIC this discovery publishes (the NIC watcher's
        filter); cheap, and safe to call from another thread while a discovery runs."""
        return self._scanner.may_be_nic(link)

    def is_nic(self, ifindex: int) -> bool:
        """Whether the last discovery found a NIC's netdev at this ifindex (netlink mode): lets
        the NIC watcher correct a verdict it could not reach from one message."""
        return ifindex in self._nic_indexes

    def host_netdevs(self) -> dict[str, str]:
        """PCI address -> the name of its netdev on the host, for every function the last pass
        found one for, excluded ones too: where `NicHomes.restore` finds a NIC back from its pod."""
        with self._lock:
            return dict(self._host_netdevs)

    def discover(self, keep: Keep = ()) -> list[Device]:
        """The RDMA NICs to publish now, sorted by name. `keep`: PCI addresses of allocated NICs.

        A broken sysfs entry costs only the NIC it describes (logged as a warning); NicDiscoveryError
        when netlink itself cannot be read.
        """
        with self._lock:
            kept = {k.lower() for k in (keep() if callable(keep) else keep)}
            scan = self._scanner.scan()
            self._nic_indexes = scan.nic_indexes
            self._host_netdevs = {
                bdf: rep.name
                for bdf, netdevs in (*scan.functions.items(), *scan.excluded.items())
                if (rep := representative(netdevs)) is not None
            }
            self._reader.begin_pass()
            devices: dict[str, Device] = {}
            for bdf, netdevs in sorted(scan.functions.items()):
                if bdf in scan.uplink_functions:
                    log.debug("skip %s: carries (or is a VF of) the default-route uplink", bdf)
                    continue
                try:
                    device = self._reader.device(bdf, netdevs)
                except BROKEN as e:
                    log.warning("skip NIC %s (%s): %s", bdf, ",".join(n.name for n in netdevs), e)
                    continue
                if device is not None:
                    devices[bdf] = device
            self._last_known.update(devices)
            for bdf in sorted(kept - devices.keys()):
                last = self._last_known.get(bdf)
                names = [last.nic.ifname] if last and last.nic else []
                if bdf in scan.excluded or self._scanner.excluded_by(bdf, names):
                    log.info("allocated NIC %s is excluded by --exclude-nics: not published", bdf)
                    continue
                absent = self._absent(bdf)
                if absent is not None:
                    devices[bdf] = absent
            return sorted(self._hold.apply(devices).values(), key=lambda d: d.name)

    def _absent(self, bdf: str) -> Device | None:
        last = self._last_known.get(bdf)
        if last is None:
            last = self._rebuild_from_sysfs(bdf)
            if last is None:
                log.warning("allocated NIC %s is gone and was never seen: cannot keep it", bdf)
                return None
            self._last_known[bdf] = last
        attrs = dict(last.attributes)
        attrs["state"] = ABSENT_STATE
        nic = replace(last.nic, present=False) if last.nic else None
        return replace(last, attributes=attrs, nic=nic)

    def _rebuild_from_sysfs(self, bdf: str) -> Device | None:
        try:
            return self._reader.device(bdf, [])
        except BROKEN as e:
            log.debug("cannot rebuild %s from sysfs: %s", bdf, e)
            return None
