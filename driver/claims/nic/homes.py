"""An exclusive NIC back from its pod: its host name, MTU, MAC and addresses given back.

When a pod's network namespace goes, the kernel moves a physical netdev back to the host's
namespace (runtime-spec 1.3, 'Namespace Lifecycle and Container Termination'; network_namespaces(7))
under the name it had in the pod (`net1`), or `dev<N>` if that name is taken, and without
addresses: the kernel drops them on every move. No runtime moves it back under its own name: the
spec forbids the runtime to try. Left so, the NIC would be published as `net1` without addresses,
and a claim sharing it next would get a RoCE port without routable GIDs.

So Tandem remembers each exclusive NIC's host identity when it prepares the claim, before the
runtime moves it (`remember`: name, MTU, MAC, global addresses, in `<data dir>/nic-homes.json`,
written atomically, so a restart of the daemon in between loses nothing), and
after every NIC discovery pass gives it back (`restore`) once no prepared claim holds the NIC any
more and its netdev is visible on the host again; then forgets it. Only with netlink
(`--nic-link-source netlink`): a simulated node without netdevs has nothing to give back.

The device's identity decides, never a name the tenant chose: in the pod, the netdev's name,
addresses, MTU and MAC are the tenant's to change. A record is keyed by the NIC's PCI address and
its netdev found again by it (`NicDiscovery.host_netdevs`, excluded NICs too); while a NIC is
remembered, `--exclude-nics` name patterns match its home name, not the name it came back with
(`home_names`, `NicScanner.excluded_by`), so a pod cannot hide it from its return by naming it
`eth0`; and the return makes it exactly what was remembered, a tenant's addresses removed.

Each NIC comes home on its own: a record that cannot be used or a netlink refusal is logged on
every pass, reported once through `warn` (a Node event), and tried again on the next pass, while
the other NICs go on. A home name held by another NIC coming home (a pod swapped the names of two
NICs it held) is freed first: that NIC is renamed to a name made of its PCI address
(`parked_name`), which no pod chose, and takes its own home name in turn. A home name any other
netdev holds stays that netdev's: the NIC keeps its name until the home one is free.

Of this boot only: after a reboot no pod's namespace holds a NIC any more, the kernel brought each
one up under its own name and the host configured it, so a record of an earlier boot is dropped
rather than forced on a NIC the host has made its own (removing the addresses it gave it). A
record is tied to its boot by `boot`; a record without one (0.1.0's, or one written before the
field) is kept as before, since it cannot tell.

The file (`FORMAT_VERSION` 1): `{"version": 1, "nics": {PCI address: {"ifname", "mtu", "mac",
"addresses", "boot"}}}`. A file without a version is the first format, the `nics` object alone; one this
release cannot read is set aside (`driver.fsutil`). The two instances of a rolling update share
it under a flock.
"""

from __future__ import annotations

import errno
import ipaddress
import json
import logging
import re
import threading
from collections.abc import Callable, Collection, Iterable, Mapping
from pathlib import Path
from typing import Any

from cdi import atomic_write
from driver.fsutil import Upgrade, boot_id, locked, read_json_state
from driver.model import Device
from driver.node import netlink
from driver.untrusted import shown

log = logging.getLogger(__name__)

FILE = "nic-homes.json"
LOCK = "nic-homes.lock"
FORMAT_VERSION = 1
PARKING_PREFIX = "tdm"


def _nested(doc: dict[str, Any]) -> dict[str, Any]:
    """Version 0 (no `version`) held the `nics` object alone, at the top level."""
    return {"nics": doc}


UPGRADES: Mapping[int, Upgrade] = {0: _nested}
_PCI = re.compile(r"[0-9a-f]{4,8}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]")


def _strays(path: Path) -> dict[str, Any]:
    """Records 0.1.0 wrote beside `nics` in a versioned file. 0.1.0 reads this file as its own
    format (the records at the top level) and writes it back so, beside the keys it took for
    records: during an upgrade's overlap, or after a downgrade. They are home identities all the
    same, and a NIC whose record was only there would come home without its addresses."""
    try:
        doc = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return {}
    if not isinstance(doc, dict) or "version" not in doc:
        return {}
    return {k: v for k, v in doc.items() if _PCI.fullmatch(k)}


def parked_name(pci_address: str) -> str:
    """Where a NIC coming home waits while its name is another's home name: `tdm` and its PCI
    address's hex digits (`0000:8a:00.0` -> `tdm00008a000`), within the kernel's 15 bytes."""
    return (PARKING_PREFIX + re.sub(r"[^0-9a-f]", "", pci_address.lower()))[:15]


def _home(record: Any) -> netlink.LinkHome:
    """A record as `netlink.restore_link` takes it; ValueError saying why it cannot be used."""
    if not isinstance(record, dict) or not isinstance(record.get("ifname"), str) or not record["ifname"]:
        raise ValueError("the record names no netdev")
    mtu, mac, addresses = record.get("mtu", 0), record.get("mac", ""), record.get("addresses", [])
    if type(mtu) is not int or mtu < 0 or not isinstance(mac, str) or not isinstance(addresses, list):
        raise ValueError("the record's mtu, mac or addresses are malformed")
    cidrs = tuple(str(ipaddress.ip_interface(a)) for a in addresses if isinstance(a, str))
    if len(cidrs) != len(addresses):
        raise ValueError("the record's addresses are malformed")
    return netlink.LinkHome(record["ifname"], mtu, mac.lower(), cidrs)


class NicHomes:
    """The host identity of every exclusive NIC that is, or was until it comes back, in a pod.
    `warn`: a note for the Node's events when a NIC cannot come home (once per NIC and note)."""

    def __init__(
        self,
        data_dir: Path,
        netns: str | None = None,
        warn: Callable[[str], None] = lambda _: None,
        boot: str | None = None,
    ) -> None:
        self._boot = boot_id() if boot is None else boot
        self._path = Path(data_dir) / FILE
        self._lock_path = Path(data_dir) / LOCK
        self._netns = netns
        self._warn = warn
        self._lock = threading.Lock()
        self._reported: dict[str, str] = {}  # PCI address -> the last note `warn` got for it

    def _read(self) -> dict[str, Any]:
        """The records of this boot (or of none); those of an earlier one are dropped from the file."""
        nics: dict[str, Any] = read_json_state(
            self._path, "NIC homes", "nics", dict, version=FORMAT_VERSION, upgrades=UPGRADES
        )
        nics = {**_strays(self._path), **nics}
        earlier = [pci for pci, r in nics.items() if isinstance(r, dict) and r.get("boot", self._boot) != self._boot]
        if not earlier:
            return nics
        for pci in earlier:
            log.info("NIC %s: its home record is of an earlier boot; the host configured it at boot, dropped", pci)
            del nics[pci]
        self._write(nics)
        return nics

    def _write(self, nics: Mapping[str, Any]) -> None:
        # Not fsynced: only a reboot loses what is not on disk, and after one no pod's namespace
        # holds a NIC; the host names and addresses them again (`cdi.files`, atomic vs durable).
        doc = {"version": FORMAT_VERSION, "nics": dict(nics)}
        atomic_write(self._path, json.dumps(doc, indent=1, sort_keys=True).encode(), 0o600, durable=False)

    def home_names(self) -> dict[str, str]:
        """PCI address -> home name of every NIC remembered (for `--exclude-nics`, module docstring)."""
        try:
            with locked(self._lock, self._lock_path):
                nics = self._read()
        except OSError as e:
            log.warning("%s unreadable (%s): NICs back from pods are excluded by the names they have", self._path, e)
            return {}
        return {pci: r["ifname"] for pci, r in nics.items() if isinstance(r, dict) and isinstance(r.get("ifname"), str)}

    def remember(self, devices: Iterable[Device]) -> None:
        """Before the runtime moves them: the host identity of these exclusive NICs. A NIC already
        remembered keeps its entry (a retried prepare finds it in the pod already)."""
        with locked(self._lock, self._lock_path):
            nics = self._read()
            added = False
            for d in devices:
                nic = d.nic
                if nic is None or not nic.present or not nic.ifname or nic.pci_address in nics:
                    continue
                mtu = d.attributes.get("mtu")
                nics[nic.pci_address] = {
                    "ifname": nic.ifname,
                    "mtu": mtu if isinstance(mtu, int) and not isinstance(mtu, bool) else 0,
                    "mac": nic.mac,
                    "addresses": [*nic.ipv4, *nic.ipv6],
                    "boot": self._boot,
                }
                added = True
            if added:
                self._write(nics)

    def restore(self, netdevs: Mapping[str, str], held: Collection[str]) -> bool:
        """Give back what came back: each remembered NIC (by PCI address) that no prepared claim
        holds (`held`) and whose netdev is on the host again (`netdevs`: PCI address -> its name
        now, `NicDiscovery.host_netdevs`), then forget it; each on its own (module docstring).
        True when a netdev was changed (rediscover)."""
        try:
            with locked(self._lock, self._lock_path):
                return self._restore(self._read(), netdevs, held)
        except OSError as e:  # the file's failure; each NIC's own is caught in `_restore`
            log.warning("%s unreadable (%s): no NIC back from its pod is given back on this pass", self._path, e)
            return False

    def _restore(self, nics: dict[str, Any], netdevs: Mapping[str, str], held: Collection[str]) -> bool:
        now = {pci: netdevs[pci] for pci in sorted(nics) if pci not in held and pci in netdevs}
        done: list[str] = []
        changed = False
        for pci, name in now.items():
            try:
                home = _home(nics[pci])
                changed = self._clear_way(pci, home.name, now, done) or changed
                name = now[pci]
                netlink.restore_link(name, home, self._netns)
            except (OSError, ValueError) as e:
                self._failed(pci, name, nics[pci], e)
                continue
            # Names are shown, never logged raw: the one it came back with is the pod's choice.
            log.info(
                "NIC %s back from its pod as %s: given back its name %s, MTU, MAC and addresses %s",
                pci,
                shown(name),
                shown(home.name),
                ", ".join(home.addresses) or "(none)",
            )
            now[pci] = home.name
            done.append(pci)
            changed = True
            self._reported.pop(pci, None)
        if not done:
            return changed
        for pci in done:
            del nics[pci]
        try:
            self._write(nics)
        except OSError as e:  # given back all the same; forgotten on the next pass
            log.warning("%s not rewritten (%s): NICs given back are forgotten on the next pass", self._path, e)
        return changed

    def _clear_way(self, pci: str, home: str, now: dict[str, str], done: Collection[str]) -> bool:
        """When another NIC coming home has `home` for its name now, moves it to its parked name
        (module docstring). True when it did."""
        holder = next((p for p, name in now.items() if name == home and p != pci and p not in done), None)
        if holder is None:
            return False
        netlink.rename_link(home, parked_name(holder), self._netns)
        log.info(
            "NIC %s back from its pod as %s, the home name of NIC %s: renamed %s until it gets its own",
            holder,
            shown(home),
            pci,
            shown(parked_name(holder)),
        )
        now[holder] = parked_name(holder)
        return True

    def _failed(self, pci: str, name: str, record: Any, error: Exception) -> None:
        home = record.get("ifname") if isinstance(record, dict) else None
        if isinstance(error, OSError) and error.errno == errno.EEXIST:
            note = (
                f"NIC {pci} is back from its pod as {shown(name)}, but its host name {shown(str(home))} is taken "
                f"by another netdev: it keeps {shown(name)} until that name is free (tried again on every NIC "
                "discovery)"
            )
        else:
            note = (
                f"NIC {pci} is back from its pod as {shown(name)} and cannot be given back its host name, MTU "
                f"and addresses (tried again on every NIC discovery): {error}"
            )
        log.warning("%s", note)
        if self._reported.get(pci) != note:
            self._reported[pci] = note
            self._warn(note)
