"""RDMA NIC discovery: netlink (pyroute2) for netdevs and addresses, sysfs for PCI and RDMA identity.

One published device per RDMA-capable PCI function, named from its PCI address
(`pci-0000-8a-00-0`) so the name survives interface renames and the netdev moving into a pod.

Where link facts come from (`netlink=`):

* `True` (a real node, and the netns tests): netlink of the driver's network namespace (or the
  named `netns`) is the only source of which netdevs exist, their MAC, MTU, operstate and global
  addresses, and of the default route. Sysfs under `sysfs_root` only maps a netdev name to its PCI
  function and RDMA device, so a test can map veths to fake PCI functions.
* `False` (the simulated node: its NICs exist only in a sysfs tree, no netdev exists anywhere):
  `class/net/*` lists the netdevs and `address`, `mtu`, `operstate`, `type`, `dev_port` give their
  facts, as on a real kernel. Addresses have no sysfs file on Linux, so the simulation writes them
  to `class/net/<if>/tandem-sim-addresses` (one CIDR per line), a name no kernel uses, read only
  in this mode. There are no routes, so `skip_default_route` has nothing to skip.

netdev -> RDMA device: the first entry of `class/net/<if>/device/infiniband/`, else the RDMA device
whose GID table names the netdev (`class/infiniband/*/ports/*/gid_attrs/ndevs/*`, e.g. soft-RoCE
or drivers without the `infiniband/` link). InfiniBand functions with no netdev at all (IPoIB not
loaded) are published too, from `class/infiniband/*`; a RoCE function without a visible netdev is
not, unless it is kept.

Skipped (each logged at debug level with the reason): loopback, links without a PCI function
(veth, bridge, ...), functions bound to no driver or to vfio-pci/uio/pci-stub, functions without an
RDMA device, `exclude_interfaces` (netdev names or PCI addresses), and with `skip_default_route`
the default-route links, their bridge/bond ports and lower devices, the PCI functions under them
and those functions' VFs.

Kept devices: `discover(keep=...)` names PCI addresses of allocated NICs. One that discovery does
not publish now (its netdev moved into a pod, or it stopped qualifying) is published from its last
known attributes with `NicInfo.present=False` and `state="absent"`; never seen before (e.g. after a
restart), it is rebuilt from what sysfs still shows of the PCI function and its RDMA device.

Addresses: `ipv4`/`ipv6` hold global addresses in CIDR form, sorted. With list attributes on they
are string lists (at most 8 each, fewer if the device would exceed 48 attribute values); with
list attributes off they hold the first address of the sorted list, so the value is bounded and
the same whatever order the kernel reports addresses in. `NicInfo` always carries all of them.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import re
import select
import socket
import threading
import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path

from pyroute2.netlink.exceptions import NetlinkError

from driver.discovery import netlink
from driver.discovery.topology import topology_attributes
from driver.model import AttrValue, Device, DeviceKind, NicInfo

log = logging.getLogger(__name__)

SIM_ADDRESSES_FILE = "tandem-sim-addresses"
ABSENT_STATE = "absent"
UNUSABLE_DRIVERS = frozenset({"vfio-pci", "uio_pci_generic", "igb_uio", "pci-stub"})
MAX_ATTRIBUTES = 32
MAX_VALUES = 48
MAX_STRING = 64
MAX_ADDRESSES_PER_FAMILY = 8

_BDF = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")
_ARPHRD_LOOPBACK = 772

Keep = Collection[str] | Callable[[], Collection[str]]


def device_name(pci_address: str) -> str:
    """`0000:8a:00.0` -> `pci-0000-8a-00-0`: a DNS label that does not change with the netdev."""
    return "pci-" + pci_address.replace(":", "-").replace(".", "-")


class NicError(ValueError):
    """Sysfs says something that cannot be true of an RDMA NIC (bad number, broken link, ...)."""


class NicDiscoveryError(RuntimeError):
    """Discovery as a whole cannot run (netlink unreadable, namespace gone); nothing is published."""


# What a broken sysfs entry raises: I/O errors, unparsable values, symlink loops (RuntimeError).
_BROKEN = (OSError, ValueError, RuntimeError)


@dataclass(frozen=True)
class _Netdev:
    name: str
    mac: str
    mtu: int
    operstate: str
    ipv4: tuple[str, ...] = ()
    ipv6: tuple[str, ...] = ()
    dev_port: int = 0


@dataclass
class _Scan:
    """Netdevs grouped by PCI function, plus the functions the default-route rule rules out."""

    functions: dict[str, list[_Netdev]] = field(default_factory=dict)
    uplink_functions: set[str] = field(default_factory=set)


def _read(path: Path) -> str:
    return path.read_text().strip()


def _read_int(path: Path, default: int | None = None) -> int | None:
    try:
        text = _read(path)
    except OSError:  # absent, or EINVAL (e.g. `speed` of a link that is down)
        return default
    try:
        return int(text, 0)
    except ValueError as e:
        raise NicError(f"{path}: not a number: {text[:40]!r}") from e


def _hex_id(path: Path) -> str:
    """`0x15b3` -> `15b3`, the form lspci and device plugin selectors use."""
    text = _read(path).lower()
    value = text[2:] if text.startswith("0x") else text
    if not re.fullmatch(r"[0-9a-f]{4}", value):
        raise NicError(f"{path}: not a PCI ID: {text[:40]!r}")
    return value


def _link_target_name(path: Path) -> str | None:
    """Basename of a symlink's target (`driver` -> `mlx5_core`), None when there is no link."""
    try:
        return os.path.basename(os.readlink(path))
    except OSError:
        return None


class NicDiscovery:
    """Lists the node's RDMA NICs; remembers each one's last published form for `keep`."""

    def __init__(
        self,
        sysfs_root: Path,
        dev_root: Path,
        list_attributes: bool = False,
        netns: str | None = None,
        skip_default_route: bool = True,
        exclude_interfaces: Iterable[str] = (),
        netlink: bool = True,
        link_hold: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
        link_events: Callable[[str], int] | None = None,
    ) -> None:
        self.sysfs_root = Path(sysfs_root)
        self.dev_root = Path(dev_root)
        self.list_attributes = list_attributes
        self.netns = netns
        self.skip_default_route = skip_default_route
        self.exclude = frozenset(x.lower() if _BDF.match(x.lower()) else x for x in exclude_interfaces)
        self.use_netlink = netlink
        self._lock = threading.Lock()
        self._last_known: dict[str, Device] = {}
        # Link facts (state, speed, portState) change on every flap of a bad cable; published as
        # they are, each flap would be a ResourceSlice write seen by every scheduler. A new value is
        # published once it has held for `link_hold` seconds (health taints do the same).
        self.link_hold = link_hold
        self._clock = clock
        # Discovery only samples; with netlink, this counts the link messages between two samples,
        # so a link that went down and up again unseen still restarts the hold.
        self._link_events = link_events or (lambda _name: 0)
        self._held: dict[str, _HeldLink] = {}

    @property
    def pending_until(self) -> float | None:
        """When a held link change becomes due (clock time): rediscover then to publish it."""
        with self._lock:
            due = [h.since + self.link_hold for h in self._held.values() if h.candidate is not None]
        return min(due) if due else None

    # ----------------------------------------------------------------------------- public

    def discover(self, keep: Keep = ()) -> list[Device]:
        """The RDMA NICs to publish now, sorted by name. `keep`: PCI addresses of allocated NICs.

        A broken sysfs entry costs only the NIC it describes (logged as a warning); NicDiscoveryError
        when netlink itself cannot be read.
        """
        with self._lock:
            kept = {k.lower() for k in (keep() if callable(keep) else keep)}
            scan = self._scan()
            devices: dict[str, Device] = {}
            for bdf, netdevs in sorted(scan.functions.items()):
                if bdf in self.exclude:
                    log.debug("skip %s: excluded by configuration", bdf)
                    continue
                if bdf in scan.uplink_functions:
                    log.debug("skip %s: carries (or is a VF of) the default-route uplink", bdf)
                    continue
                try:
                    device = self._device(bdf, netdevs)
                except _BROKEN as e:
                    log.warning("skip NIC %s (%s): %s", bdf, ",".join(n.name for n in netdevs), e)
                    continue
                if device is not None:
                    devices[bdf] = device
            self._last_known.update(devices)
            for bdf in sorted(kept - devices.keys()):
                absent = self._absent(bdf)
                if absent is not None:
                    devices[bdf] = absent
            held = {bdf: self._hold_link_facts(bdf, d) for bdf, d in devices.items()}
            self._held = {bdf: h for bdf, h in self._held.items() if bdf in devices}
            return sorted(held.values(), key=lambda d: d.name)

    def _hold_link_facts(self, bdf: str, device: Device) -> Device:
        facts = {k: device.attributes.get(k) for k in LINK_FACTS}
        held = self._held.get(bdf)
        now = self._clock()
        events = self._link_events(device.nic.ifname) if device.nic else 0
        if held is None or self.link_hold <= 0 or not (device.nic and device.nic.present):
            self._held[bdf] = _HeldLink(facts, events=events)  # first sight, no hold, or moved away: at once
            return device
        if facts == held.published:
            held.candidate = None
        elif facts != held.candidate or events != held.events:
            held.candidate, held.since = facts, now
        held.events = events
        if held.candidate is not None and now - held.since >= self.link_hold:
            held.published, held.candidate = held.candidate, None
        attrs = {k: v for k, v in device.attributes.items() if k not in LINK_FACTS}
        attrs.update({k: v for k, v in held.published.items() if v is not None})
        return replace(device, attributes=attrs)

    # ----------------------------------------------------------------------------- netdevs

    def _scan(self) -> _Scan:
        if self.use_netlink:
            netdevs, uplinks = self._netlink_netdevs()
        else:
            netdevs, uplinks = self._sysfs_netdevs(), frozenset()

        scan = _Scan()
        for nd in netdevs:
            if nd.name in self.exclude:
                log.debug("skip %s: excluded by configuration", nd.name)
                continue
            try:
                bdf = self._pci_function_of(nd.name)
                if bdf is None:
                    continue
                if nd.name in uplinks:
                    scan.uplink_functions.add(bdf)
                    scan.uplink_functions.update(self._virtfns(bdf))
            except _BROKEN as e:
                log.warning("skip netdev %s: unreadable sysfs entry: %s", nd.name, e)
                continue
            scan.functions.setdefault(bdf, []).append(nd)
        for bdf in self._infiniband_only_functions(scan.functions.keys()):
            scan.functions[bdf] = []
        return scan

    def _netlink_netdevs(self) -> tuple[list[_Netdev], frozenset[str]]:
        """Netdevs that sysfs ties to a device, as netlink sees them; those carrying the default
        route. Netdevs without a `device` link in sysfs have no PCI function and are not asked for.
        """
        names = [e.name for e in sorted((self.sysfs_root / "class/net").glob("*")) if (e / "device").is_symlink()]
        try:
            snapshot = netlink.read_links(names, self.netns)
        except (OSError, NetlinkError) as e:
            where = f"network namespace {self.netns!r}" if self.netns else "the driver's network namespace"
            raise NicDiscoveryError(f"cannot read netlink of {where}: {e}") from e
        out = []
        for name in names:
            link = snapshot.links.get(name)
            if link is None:
                log.debug("skip %s: in sysfs but unknown to netlink (moved to another namespace?)", name)
                continue
            if link.loopback:
                log.debug("skip %s: loopback", name)
                continue
            try:
                dev_port = _read_int(self.sysfs_root / "class/net" / name / "dev_port", 0) or 0
            except NicError as e:
                log.warning("skip netdev %s: unreadable sysfs entry: %s", name, e)
                continue
            out.append(_Netdev(name, link.mac, link.mtu, link.operstate, link.ipv4, link.ipv6, dev_port))
        return out, snapshot.uplinks if self.skip_default_route else frozenset()

    def _sysfs_netdevs(self) -> list[_Netdev]:
        out = []
        for entry in sorted((self.sysfs_root / "class/net").glob("*")):
            name = entry.name
            try:
                if name == "lo" or _read_int(entry / "type") == _ARPHRD_LOOPBACK:
                    log.debug("skip %s: loopback", name)
                    continue
                addresses = self._sim_addresses(entry / SIM_ADDRESSES_FILE)
                out.append(
                    _Netdev(
                        name=name,
                        mac=_read(entry / "address").lower(),
                        mtu=_read_int(entry / "mtu") or 0,
                        operstate=_read(entry / "operstate").lower(),
                        ipv4=tuple(a for a in addresses if ":" not in a),
                        ipv6=tuple(a for a in addresses if ":" in a),
                        dev_port=_read_int(entry / "dev_port", 0) or 0,
                    )
                )
            except _BROKEN as e:
                log.warning("skip netdev %s: unreadable sysfs entry: %s", name, e)
        return out

    @staticmethod
    def _sim_addresses(path: Path) -> list[str]:
        try:
            lines = path.read_text().split()
        except FileNotFoundError:
            return []
        try:
            parsed = sorted({ipaddress.ip_interface(x) for x in lines}, key=lambda a: (a.version, a.ip))
        except ValueError as e:
            raise NicError(f"{path}: {e}") from e
        return [str(a) for a in parsed]

    def _pci_function_of(self, ifname: str) -> str | None:
        link = self.sysfs_root / "class/net" / ifname / "device"
        if not link.is_symlink():
            log.debug("skip %s: no PCI device (virtual link)", ifname)
            return None
        bdf = link.resolve().name.lower()
        if not _BDF.match(bdf):
            log.debug("skip %s: device %r is not a PCI function", ifname, bdf)
            return None
        return bdf

    def _function_dir(self, bdf: str) -> Path:
        path = self.sysfs_root / "bus/pci/devices" / bdf
        if not path.exists():
            raise NicError(f"PCI function {bdf} not found under {self.sysfs_root}/bus/pci/devices")
        return path.resolve()

    def _virtfns(self, bdf: str) -> set[str]:
        try:
            fn = self._function_dir(bdf)
        except NicError:
            return set()
        return {p.resolve().name for p in fn.glob("virtfn*")}

    def _infiniband_only_functions(self, known: Iterable[str]) -> list[str]:
        """PCI functions with an InfiniBand RDMA device and no netdev (IPoIB not loaded)."""
        known = set(known)
        out = []
        for dev in sorted((self.sysfs_root / "class/infiniband").glob("*")):
            try:
                bdf = (dev / "device").resolve().name.lower() if (dev / "device").is_symlink() else ""
            except _BROKEN as e:
                log.warning("skip RDMA device %s: %s", dev.name, e)
                continue
            if not _BDF.match(bdf) or bdf in known or bdf in out:
                continue
            layers = {_read_or_empty(p / "link_layer") for p in (dev / "ports").glob("*")}
            if layers == {"InfiniBand"}:
                out.append(bdf)
            else:
                log.debug("skip %s (%s): RoCE function without a visible netdev", bdf, dev.name)
        return out

    # ----------------------------------------------------------------------------- one function

    def _device(self, bdf: str, netdevs: list[_Netdev]) -> Device | None:
        fn = self._function_dir(bdf)
        driver = _link_target_name(fn / "driver")
        if driver is None:
            log.debug("skip %s: bound to no driver", bdf)
            return None
        if driver in UNUSABLE_DRIVERS:
            log.debug("skip %s: bound to %s", bdf, driver)
            return None
        rep = min(netdevs, key=lambda n: (n.dev_port, n.name)) if netdevs else None
        rdma = self._rdma_device(fn, rep.name if rep else None)
        if rdma is None:
            log.debug("skip %s (%s): no RDMA device", bdf, rep.name if rep else "-")
            return None
        rdma_dir, port = rdma
        port_dir = rdma_dir / "ports" / str(port)
        link_layer = _read_or_empty(port_dir / "link_layer")
        port_state = _read_or_empty(port_dir / "state").split(":")[-1].strip()
        uverbs = self._char_device(fn / "infiniband_verbs", "uverbs", rdma_dir.name, None)
        umad = self._char_device(fn / "infiniband_mad", "umad", rdma_dir.name, port)
        issm = self._char_device(fn / "infiniband_mad", "issm", rdma_dir.name, port)
        sriov_total = _read_int(fn / "sriov_totalvfs", 0) or 0
        is_vf = (fn / "physfn").is_symlink()

        attrs: dict[str, AttrValue] = {"type": "nic"}
        if rep is not None:
            attrs.update(ifName=rep.name, mac=rep.mac, mtu=rep.mtu)
            speed = _read_int(self.sysfs_root / "class/net" / rep.name / "speed", -1)
            if speed is not None and speed > 0:
                attrs["speed"] = speed
            attrs["state"] = rep.operstate
        if link_layer:
            attrs["linkLayer"] = link_layer
        if port_state:
            attrs["portState"] = port_state
        attrs["rdmaDevice"] = rdma_dir.name
        attrs["pciVendorID"] = _hex_id(fn / "vendor")
        attrs["pciDeviceID"] = _hex_id(fn / "device")
        attrs["sriov"] = sriov_total > 0 and not is_vf
        if attrs["sriov"]:
            attrs["sriovVfs"] = _read_int(fn / "sriov_numvfs", 0) or 0
        attrs["isSriovVf"] = is_vf
        ipv4 = rep.ipv4 if rep else ()
        ipv6 = rep.ipv6 if rep else ()
        attrs.update(self._address_attributes(ipv4, ipv6))
        try:
            attrs.update(topology_attributes(self.sysfs_root, bdf, self.list_attributes))
        except (OSError, ValueError) as e:
            log.warning("NIC %s: no topology attributes: %s", bdf, e)
        attrs = _fit_limits(bdf, attrs)

        info = NicInfo(
            pci_address=bdf,
            ifname=rep.name if rep else "",
            rdma_device=rdma_dir.name,
            mac=rep.mac if rep else "",
            ipv4=ipv4,
            ipv6=ipv6,
            uverbs=uverbs,
            umad=umad,
            issm=issm,
        )
        return Device(name=device_name(bdf), kind=DeviceKind.NIC, attributes=attrs, nic=info)

    def _rdma_device(self, fn: Path, ifname: str | None) -> tuple[Path, int] | None:
        """(RDMA device dir, port) of a function: `infiniband/` first, then the GID tables."""
        direct = sorted((fn / "infiniband").glob("*"))
        if direct:
            dev = direct[0]
            return dev, self._port_of(dev, ifname)
        if ifname is None:
            return None
        for dev in sorted((self.sysfs_root / "class/infiniband").glob("*")):
            for port_dir in sorted((dev / "ports").glob("*")):
                if self._gid_names(port_dir, ifname):
                    return dev.resolve(), int(port_dir.name)
        return None

    def _port_of(self, dev: Path, ifname: str | None) -> int:
        """The port whose GID table names the netdev; the lowest port otherwise."""
        ports = sorted(int(p.name) for p in (dev / "ports").glob("*") if p.name.isdigit())
        if ifname is not None:
            for port in ports:
                if self._gid_names(dev / "ports" / str(port), ifname):
                    return port
        return ports[0] if ports else 1

    @staticmethod
    def _gid_names(port_dir: Path, ifname: str) -> bool:
        for entry in (port_dir / "gid_attrs/ndevs").glob("*"):
            try:
                if entry.read_text().strip() == ifname:
                    return True
            except OSError:  # the kernel answers EINVAL for empty GID slots
                continue
        return False

    def _char_device(self, class_dir: Path, prefix: str, rdma_name: str, port: int | None) -> str:
        """`uverbs3`-style name of the char device of this RDMA device (and port), when its node
        exists under dev_root; entries that say which device/port they belong to must match."""
        for entry in sorted(class_dir.glob(f"{prefix}*")):
            ibdev = _read_or_empty(entry / "ibdev")
            if ibdev and ibdev != rdma_name:
                continue
            if port is not None and _read_int(entry / "port", port) != port:
                continue
            if (self.dev_root / "infiniband" / entry.name).exists():
                return entry.name
            log.debug("%s: %s has no node under %s/infiniband", rdma_name, entry.name, self.dev_root)
            return ""
        return ""

    def _address_attributes(self, ipv4: tuple[str, ...], ipv6: tuple[str, ...]) -> dict[str, AttrValue]:
        out: dict[str, AttrValue] = {}
        for key, addrs in (("ipv4", ipv4), ("ipv6", ipv6)):
            if not addrs:
                continue
            out[key] = tuple(addrs[:MAX_ADDRESSES_PER_FAMILY]) if self.list_attributes else addrs[0]
        return out

    # ----------------------------------------------------------------------------- kept NICs

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
            return self._device(bdf, [])
        except _BROKEN as e:
            log.debug("cannot rebuild %s from sysfs: %s", bdf, e)
            return None


def _read_or_empty(path: Path) -> str:
    try:
        return _read(path)
    except OSError:
        return ""


def _fit_limits(bdf: str, attrs: dict[str, AttrValue]) -> dict[str, AttrValue]:
    """Keep a device within the API's limits: strings of at most 64 characters (a longer one came
    from a broken sysfs file and is dropped), at most 48 values (address lists are shortened)."""
    out: dict[str, AttrValue] = {}
    for key, value in attrs.items():
        items = value if isinstance(value, tuple) else (value,)
        if any(isinstance(v, str) and len(v) > MAX_STRING for v in items):
            log.warning("NIC %s: attribute %s is longer than %d characters, dropped", bdf, key, MAX_STRING)
            continue
        out[key] = value

    def values() -> int:
        return sum(len(v) if isinstance(v, tuple) else 1 for v in out.values())

    while values() > MAX_VALUES:
        lists = [(len(v), k) for k in ("ipv4", "ipv6") if isinstance(v := out.get(k), tuple) and len(v) > 1]
        if not lists:
            break
        key = max(lists)[1]
        out[key] = out[key][:-1]  # type: ignore[index]
    if len(out) > MAX_ATTRIBUTES:
        raise NicError(f"{len(out)} attributes, more than {MAX_ATTRIBUTES}")
    return out


LINK_FACTS = ("state", "speed", "portState")


@dataclass
class _HeldLink:
    published: dict[str, AttrValue | None]
    candidate: dict[str, AttrValue | None] | None = None
    since: float = 0.0
    events: int = 0


class NicWatcher:
    """A thread that turns netlink link/address events into calls of `callback`.

    Bursts are coalesced: the callback runs once the events have been quiet for `quiet` seconds,
    but never later than `max_delay` after the first event of the burst. Every `resync_period`
    seconds without a callback it runs anyway, to catch what netlink did not say (sysfs-only
    changes, a dropped event, a default-route change: route events are not subscribed to).
    `trigger()` asks for a rescan as if an event had arrived. With `netlink=False` (the simulated
    node) only `trigger()` and the resync call it.
    """

    def __init__(
        self,
        callback: Callable[[], None],
        netns: str | None = None,
        resync_period: float = 60.0,
        quiet: float = 0.15,
        max_delay: float = 1.0,
        netlink: bool = True,
    ) -> None:
        self.callback = callback
        self.netns = netns
        self.resync_period = resync_period
        self.quiet = quiet
        self.max_delay = max_delay
        self.use_netlink = netlink
        self.events = 0  # netlink messages received
        self._link_events: dict[str, int] = {}  # link messages per interface name
        self._wake_lock = threading.Lock()
        self.callbacks = 0
        self._sock: socket.socket | None = None
        self._wake_r, self._wake_w = -1, -1
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._pending_since: float | None = None
        self._last_event = 0.0

    def link_events(self, ifname: str) -> int:
        """Link messages seen for `ifname` so far: tells a link that flapped between two looks."""
        return self._link_events.get(ifname, 0)

    @property
    def idle(self) -> bool:
        """True when no event is waiting to be reported."""
        return self._pending_since is None

    def start(self) -> None:
        """Subscribes before returning, so a change made after start() is never missed."""
        if self.use_netlink:
            try:
                self._sock = netlink.open_event_socket(self.netns)
            except OSError as e:
                where = f"network namespace {self.netns!r}" if self.netns else "the driver's network namespace"
                raise NicDiscoveryError(f"cannot subscribe to netlink events of {where}: {e}") from e
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._thread = threading.Thread(target=self._run, name="nic-watcher", daemon=True)
        self._thread.start()

    def trigger(self) -> None:
        self._wake(b"t")

    def _wake(self, what: bytes) -> None:
        with self._wake_lock:
            if self._wake_w >= 0:
                with contextlib.suppress(BlockingIOError):  # a full pipe already says "wake up"
                    os.write(self._wake_w, what)

    def stop(self, timeout: float = 5.0) -> None:
        self._stopping.set()
        self._wake(b"s")
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                # A slow callback still runs and will select() on these descriptors: leave them
                # open (the thread exits at its next loop) rather than close them under it.
                log.warning("NIC watcher still busy after %.0f s; leaving it to finish", timeout)
                return
        if self._sock is not None:
            self._sock.close()
        with self._wake_lock:
            fds, (self._wake_r, self._wake_w) = (self._wake_r, self._wake_w), (-1, -1)
        for fd in fds:
            if fd >= 0:
                os.close(fd)

    def _run(self) -> None:
        next_resync = time.monotonic() + self.resync_period
        readers = [self._wake_r] + ([self._sock] if self._sock is not None else [])
        while not self._stopping.is_set():
            now = time.monotonic()
            if self._pending_since is not None:
                due = min(self._last_event + self.quiet, self._pending_since + self.max_delay)
            else:
                due = next_resync
            ready, _, _ = select.select(readers, [], [], max(0.0, due - now))
            now = time.monotonic()
            if self._sock in ready and self._drain_socket():
                self._note_event(now)
            if self._wake_r in ready and self._drain_wake():
                self._note_event(now)
            if self._stopping.is_set():
                break
            fire = self._pending_since is not None and (
                now >= self._last_event + self.quiet or now >= self._pending_since + self.max_delay
            )
            if fire or now >= next_resync:
                self._pending_since = None
                next_resync = now + self.resync_period
                self._call()

    def _note_event(self, now: float) -> None:
        if self._pending_since is None:
            self._pending_since = now
        self._last_event = now

    def _drain_socket(self) -> bool:
        got = False
        while True:
            try:
                data = self._sock.recv(1 << 16)
            except BlockingIOError:
                return got
            except OSError as e:  # ENOBUFS: the kernel dropped events; a rescan covers them
                log.info("netlink event socket: %s; rescanning", e)
                return True
            self.events += netlink.count_messages(data)
            for event in netlink.parse_link_events(data):
                self._link_events[event.state.name] = self._link_events.get(event.state.name, 0) + 1
            got = True

    def _drain_wake(self) -> bool:
        try:
            data = os.read(self._wake_r, 4096)
        except BlockingIOError:
            return False
        return b"t" in data

    def _call(self) -> None:
        self.callbacks += 1
        try:
            self.callback()
        except Exception:  # the watcher must outlive a failing consumer
            log.exception("NIC change callback failed")
