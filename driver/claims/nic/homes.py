"""An exclusive NIC back from its pod: its host name, MTU and addresses given back.

When a pod's network namespace goes, the kernel moves a physical netdev back to the host's
namespace (runtime-spec 1.3, 'Namespace Lifecycle and Container Termination'; network_namespaces(7))
under the name it had in the pod (`net1`), or `dev<N>` if that name is taken, and without
addresses: the kernel drops them on every move. No runtime moves it back under its own name: the
spec forbids the runtime to try. Left so, the NIC would be published as `net1` without addresses,
and a claim sharing it next would get a RoCE port without routable GIDs.

So Tandem remembers each exclusive NIC's host identity when it prepares the claim, before the
runtime moves it (`remember`: name, MTU, global addresses, in `<data dir>/nic-homes.json`,
written atomically, so a restart of the daemon in between loses nothing), and
after every NIC discovery pass gives it back (`restore`) once no prepared claim holds the NIC any
more and its netdev is visible on the host again; then forgets it. A failed restore is logged and
tried again on the next pass. Only with netlink (`--nic-link-source netlink`): a simulated node
without netdevs has nothing to give back.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Collection, Iterable
from pathlib import Path
from typing import Any

from cdi import atomic_write
from driver.model import Device
from driver.node import netlink

log = logging.getLogger(__name__)

FILE = "nic-homes.json"


class NicHomes:
    """The host identity of every exclusive NIC that is, or was until it comes back, in a pod."""

    def __init__(self, data_dir: Path, netns: str | None = None) -> None:
        self._path = Path(data_dir) / FILE
        self._netns = netns
        self._lock = threading.Lock()

    def _read(self) -> dict[str, dict[str, Any]]:
        try:
            raw = json.loads(self._path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as e:
            log.warning(
                "%s unreadable (%s): exclusive NICs back from pods keep the name they return with", self._path, e
            )
            return {}
        return raw if isinstance(raw, dict) else {}

    def _write(self, homes: dict[str, dict[str, Any]]) -> None:
        # Not fsynced: only a reboot loses what is not on disk, and after one no pod's namespace
        # holds a NIC; the host names and addresses them again (`cdi.files`, atomic vs durable).
        atomic_write(self._path, json.dumps(homes, indent=1, sort_keys=True).encode(), 0o600, durable=False)

    def remember(self, devices: Iterable[Device]) -> None:
        """Before the runtime moves them: the host identity of these exclusive NICs. A NIC already
        remembered keeps its entry (a retried prepare finds it in the pod already)."""
        with self._lock:
            homes = self._read()
            added = False
            for d in devices:
                nic = d.nic
                if nic is None or not nic.present or not nic.ifname or nic.pci_address in homes:
                    continue
                mtu = d.attributes.get("mtu")
                homes[nic.pci_address] = {
                    "ifname": nic.ifname,
                    "mtu": mtu if isinstance(mtu, int) and not isinstance(mtu, bool) else 0,
                    "addresses": [*nic.ipv4, *nic.ipv6],
                }
                added = True
            if added:
                self._write(homes)

    def restore(self, devices: Iterable[Device], held: Collection[str]) -> bool:
        """Give back what came back: NICs (by PCI address) that no prepared claim holds (`held`)
        and whose netdev is on the host again. True when a netdev was changed (rediscover)."""
        with self._lock:
            homes = self._read()
            if not homes:
                return False
            by_pci = {d.nic.pci_address: d for d in devices if d.nic is not None}
            changed = forgotten = False
            for pci, home in sorted(homes.items()):
                device = by_pci.get(pci)
                if pci in held or device is None or device.nic is None or not device.nic.present:
                    continue  # still in its pod (or gone with the hardware): wait
                nic = device.nic
                missing = [a for a in home.get("addresses", []) if a not in (*nic.ipv4, *nic.ipv6)]
                if nic.ifname != home["ifname"] or missing:
                    try:
                        netlink.restore_link(
                            nic.ifname, home["ifname"], int(home.get("mtu") or 0), missing, self._netns
                        )
                    except OSError as e:
                        log.warning("NIC %s back from its pod as %s: cannot give it back its name %s and "
                                    "addresses (will retry): %s", pci, nic.ifname, home["ifname"], e)  # fmt: skip
                        continue
                    log.info("NIC %s back from its pod as %s: renamed %s, addresses %s restored", pci, nic.ifname,
                             home["ifname"], ", ".join(missing) or "none missing")  # fmt: skip
                    changed = True
                del homes[pci]
                forgotten = True
            if forgotten:
                self._write(homes)
            return changed
