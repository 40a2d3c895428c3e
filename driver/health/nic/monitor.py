"""RDMA NIC health: link and RDMA port state become device conditions that come and go.

Signals, per NIC in the inventory:

* Link state of its netdev. On a real node (`netlink=True`) from rtnetlink events of the driver's
  (or the named) network namespace, plus a re-read every `poll_period` that covers dropped events
  and links that never send one. Events are matched by ifindex once known, else by the
  inventory's `NicInfo.ifname` of the moment, so a rename between two discoveries is followed. In
  sysfs-only mode (the simulated node) from sysfs (`link_sysfs`).
* RDMA port state from sysfs, polled (sysfs has no events): `class/infiniband/<dev>/ports/<p>/state`
  not ACTIVE, or `phys_state` not LinkUp.
* Its PCI function, polled in sysfs (`bus/pci/devices/<bdf>`): gone means the NIC is lost
  (hot-removed, or a VF destroyed). Discovery keeps such a NIC published while it is allocated;
  this condition, NoExecute by default like the GPU's `gpu-lost`, evicts the pods that hold a NIC
  that no longer exists instead of leaving it healthy. It clears when the function is back.

What a state means and how long it must hold (the debounce) is `signals`; what is kept per
NIC and the conditions its settled faults make, `conditions`. This module follows the
inventory's NICs, reads their signals and publishes those conditions, in one thread ("nic-health").

A NIC whose netdev is not visible (`NicInfo.present` False: moved into a pod, which the inventory
allows only while it is allocated) is unobservable, not down: its link says nothing, and a link
condition it had is withdrawn. Its RDMA ports are still judged while sysfs shows them (shared RDMA
namespace mode); in exclusive mode they vanish from the host's sysfs and say nothing either. Its
PCI function stays listed (PCI devices belong to no namespace), so it is not lost.

One NIC whose state cannot be read (a failure no reader expected) is logged and left as it was
for that round; the others are still judged and published. Over 400 lines on purpose: the three
signals share one lock, one round and one thread, and split apart they would share them anyway.
"""

from __future__ import annotations

import errno
import logging
import select
import socket
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from driver.backoff import Backoff, Retry
from driver.health.nic.conditions import NicConditions, NicView, WatchedNic
from driver.health.nic.link_sysfs import LinkSysfs
from driver.health.nic.signals import FUNCTION_GONE, Debounced, link_fault
from driver.inventory.store import Inventory
from driver.model import Condition, DeviceKind, TaintEffect
from driver.node import netlink, rtnl
from driver.node.rtnl import LinkEvent, LinkState
from driver.wakepipe import WakePipe

log = logging.getLogger(__name__)

DEFAULT_BACKOFF = Backoff(initial=1.0, maximum=30.0)


class NicHealthMonitor:
    """Turns NIC link and RDMA port state into `<domain>/link-down` and `<domain>/rdma-port-down`
    conditions, and a PCI function that is gone into `<domain>/nic-lost`, of health source
    `source`; one thread, started by `start()`.

    `effects` overrides the taint effect per condition key (the full key, e.g.
    `tandem.dev/link-down`); NoSchedule otherwise, NoExecute for `nic-lost`. `poll()` runs one
    round synchronously (the thread runs it every `poll_period`); with an injected `clock` a test
    steps the debounce without sleeping. The counters are for metrics.
    """

    def __init__(
        self,
        inventory: Inventory,
        *,
        sysfs_root: Path,
        domain: str = "tandem.dev",
        source: str = "nic-health",
        netns: str | None = None,
        netlink: bool = True,
        debounce: float = 2.0,
        poll_period: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        effects: Mapping[str, TaintEffect] | None = None,
        backoff: Backoff = DEFAULT_BACKOFF,
    ) -> None:
        self.inventory = inventory
        self.sysfs_root = Path(sysfs_root)
        self.source = source
        self.netns = netns
        self.use_netlink = netlink
        self.debounce = debounce
        self.poll_period = poll_period
        self.clock = clock
        self.wall_clock = wall_clock
        self._conditions = NicConditions(domain, effects)

        self.netlink_events = 0  # link messages about watched NICs (the others are skipped unread)
        self.link_transitions = 0  # observed changes of a link's, port's or PCI function's fault (before debounce)
        self.condition_changes = 0  # changes of a device's published conditions
        self.errors = 0  # failed rounds and NICs, socket failures, unreadable sysfs entries

        self._lock = threading.RLock()
        self._watched: dict[str, WatchedNic] = {}
        self._sysfs = LinkSysfs(self.sysfs_root, self._count_error)
        self._retry = Retry(backoff)
        self._sock: socket.socket | None = None
        self._reopen_at: float | None = None
        self._wakeup: WakePipe | None = None
        self._inventory_changed = True
        self._resync = True  # a watched NIC appeared or changed since the last full read
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    # ----------------------------------------------------------------------------- lifecycle

    def start(self) -> None:
        """Subscribes before returning, so a link change after start() is never missed; a
        subscription that fails is logged and retried by the thread."""
        self._wakeup = WakePipe()
        self.inventory.subscribe(self._on_inventory_change)
        if self.use_netlink:
            self._open_socket(self.clock())
        self._thread = threading.Thread(target=self._run, name="nic-health", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stopping.set()
        self._wake()
        if self._thread is not None:
            self._thread.join(timeout)
        self._close_socket()
        if self._wakeup is not None:
            self._wakeup.close()

    def counters(self) -> dict[str, int]:
        return {
            "netlink_events": self.netlink_events,
            "link_transitions": self.link_transitions,
            "condition_changes": self.condition_changes,
            "errors": self.errors,
        }

    def settled(self) -> bool:
        """True when no observed fault is waiting out its debounce."""
        with self._lock:
            return all(d.due() is None for w in self._watched.values() for d in w.signals())

    def fault_now(self, name: str) -> str | None:
        """What is wrong with NIC `name` as read now, before any debounce (None: nothing, or not
        watched): a pod must not be bound to a link that just went down (`driver.claims.binding`)."""
        self.poll()
        with self._lock:
            w = self._watched.get(name)
            faults = [d.observed.reason for d in w.signals() if d.observed is not None] if w else []
        return "; ".join(faults) or None

    # ----------------------------------------------------------------------------- one round

    def poll(self) -> None:
        """Re-reads every watched NIC (netlink or sysfs for links, sysfs for ports and PCI
        functions) and publishes what has held for `debounce`."""
        with self._lock:
            now = self.clock()
            self._refresh()
            states = self._read_links([w for w in self._watched.values() if w.nic.present and w.nic.ifname])
            for w in self._watched.values():
                try:
                    if states is not None:
                        self._observe_link(w, states.get(w.nic.ifname) if w.nic.present else None, now)
                    self._observe_ports(w, now)
                    self._observe_function(w, now)
                except Exception:  # one NIC that cannot be read must not blind the monitor to the rest
                    self.errors += 1
                    log.exception("NIC %s: cannot read its state; judged again next round", w.nic.name)
            self._resync = False
            self._publish(now)

    def _read_links(self, watched: list[WatchedNic]) -> dict[str, LinkState] | None:
        """Link states by the inventory's netdev name (found by ifindex when one is known: the
        netdev may have been renamed since); None (links keep their last state) when netlink
        cannot be read."""
        if not self.use_netlink:
            return {w.nic.ifname: s for w in watched if (s := self._sysfs.link(w.nic.ifname)) is not None}
        try:
            indexes = {w.nic.ifname: w.ifindex for w in watched if w.ifindex}
            return netlink.read_link_states([w.nic.ifname for w in watched], self.netns, indexes)
        except OSError as e:
            self.errors += 1
            log.error("cannot read link state of %s: %s; keeping the last known", netlink.namespace_name(self.netns), e)
            return None

    def observe_events(self, events: Iterable[LinkEvent]) -> None:
        """What the event thread does with the link messages it read (public so that a test or a
        replay drives it without a netlink socket). A message is a NIC's by its ifindex once that
        is known, by the inventory's netdev name before; a name that another link took over after
        a rename does not count."""
        with self._lock:
            now = self.clock()
            self._refresh()
            by_index = {w.ifindex: w for w in self._watched.values() if w.ifindex}
            by_name = {w.nic.ifname: w for w in self._watched.values() if w.nic.ifname}
            for ev in events:
                self.netlink_events += 1
                w = by_index.get(ev.state.index)
                if w is None and (named := by_name.get(ev.state.name)) and named.ifindex in (0, ev.state.index):
                    w = named
                if w is None or not w.nic.present:
                    continue
                if ev.deleted:  # gone from this namespace (deleted, or moved into a pod)
                    self._observe_link(w, None, now)
                    by_index.pop(ev.state.index, None)
                else:
                    self._observe_link(w, ev.state, now)
                    by_index[ev.state.index] = w
            self._publish(now)

    # ----------------------------------------------------------------------------- state

    def _on_inventory_change(self) -> None:
        self._inventory_changed = True
        self._wake()

    def _wake(self) -> None:
        if self._wakeup is not None:
            self._wakeup.wake()

    def _count_error(self) -> None:
        self.errors += 1

    def _refresh(self) -> None:
        """Follows the inventory's NICs; one that appeared or changed asks for a full read, one
        that left takes its conditions with it."""
        current = {
            d.name: NicView.of(d.name, d.nic) for d in self.inventory.devices() if d.kind == DeviceKind.NIC and d.nic
        }
        changed = False
        for name in self._watched.keys() - current.keys():
            gone = self._watched.pop(name)
            changed = True
            if gone.published:
                self._set(name, frozenset())
        for name, nic in current.items():
            w = self._watched.get(name)
            if w is not None and w.nic == nic:
                continue
            changed = True
            if w is None:
                self._watched[name] = WatchedNic(nic)
                continue
            if not nic.present:
                w.link, w.ifindex = None, 0
            if nic.rdma_device != w.nic.rdma_device:
                w.ports = {}
            w.nic = nic
        self._inventory_changed = False
        self._resync = self._resync or changed

    def _observe_link(self, w: WatchedNic, state: LinkState | None, now: float) -> None:
        if state is None:
            w.link, w.ifindex = None, 0
            return
        w.ifindex = state.index or w.ifindex
        if w.link is None:
            w.link = Debounced(self.debounce, now)
        fault = link_fault(state)
        if w.link.observe(fault, now):
            self.link_transitions += 1
            if fault is not None:
                w.link_ifname = state.name or w.nic.ifname

    def _observe_ports(self, w: WatchedNic, now: float) -> None:
        ports = self._sysfs.ports(w.nic.rdma_device) if w.nic.rdma_device else {}
        for port in w.ports.keys() - ports.keys():
            del w.ports[port]
        for port, fault in ports.items():
            d = w.ports.get(port)
            if d is None:
                d = w.ports[port] = Debounced(self.debounce, now)
            if d.observe(fault, now):
                self.link_transitions += 1

    def _observe_function(self, w: WatchedNic, now: float) -> None:
        if w.lost is None:
            w.lost = Debounced(self.debounce, now)
        if w.lost.observe(FUNCTION_GONE if self._sysfs.function_gone(w.nic.pci_address) else None, now):
            self.link_transitions += 1

    def _publish(self, now: float) -> None:
        wall = self.wall_clock()
        for name, w in self._watched.items():
            for d in w.signals():
                d.settle(now, wall)
            conditions = self._conditions.of(w)
            if conditions != w.published:
                self._set(name, conditions)
                w.published = conditions

    def _set(self, name: str, conditions: frozenset[Condition]) -> None:
        self.condition_changes += 1
        self.inventory.set_conditions(self.source, name, conditions)
        if conditions:
            log.warning("NIC %s: %s", name, "; ".join(sorted(c.message for c in conditions)))
        else:
            log.info("NIC %s: healthy again, or no longer observable (link, RDMA ports, PCI function)", name)

    def _next_due(self) -> float | None:
        dues = [t for w in self._watched.values() for d in w.signals() if (t := d.due()) is not None]
        return min(dues, default=None)

    # ----------------------------------------------------------------------------- thread

    def _open_socket(self, now: float) -> None:
        try:
            self._sock = netlink.open_event_socket(self.netns, groups=netlink.RTMGRP_LINK)
        except OSError as e:
            self.errors += 1
            delay = self._retry.next()
            where = netlink.namespace_name(self.netns)
            log.error("cannot subscribe to link events of %s: %s; retrying in %.1fs", where, e, delay)
            self._reopen_at = now + delay
            return
        self._reopen_at = None
        self._retry.reset()

    def _close_socket(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _drain_socket(self, sock: socket.socket, now: float) -> tuple[list[LinkEvent], bool]:
        """(link events of watched NICs read, whether a full re-read is needed: the kernel dropped
        events). Messages of other links (veths come and go by the thousand) are not decoded; a
        NIC that joins the inventory meanwhile is read in full by the round that follows."""
        with self._lock:
            indexes = {w.ifindex for w in self._watched.values() if w.ifindex}
            names = {w.nic.ifname for w in self._watched.values() if w.nic.ifname}

        def watched(index: int, name: str) -> bool:
            return index in indexes or name in names

        events: list[LinkEvent] = []
        while True:
            try:
                data = sock.recv(1 << 16)
            except BlockingIOError:
                return events, False
            except OSError as e:
                self.errors += 1
                if e.errno == errno.ENOBUFS:
                    log.info("link event socket overflowed; re-reading link state")
                    return events, True
                delay = self._retry.next()
                log.error("link event socket failed: %s; re-subscribing in %.1fs", e, delay)
                self._close_socket()
                self._reopen_at = now + delay
                return events, True
            events.extend(rtnl.parse_link_events(data, watched))

    def _run(self) -> None:
        next_poll = self.clock()  # the first round reads everything at once
        failures = Retry(self._retry.policy)
        while not self._stopping.is_set():
            try:
                next_poll = self._round(next_poll)
                failures.reset()
            except Exception:  # the monitor must outlive any one failure
                self.errors += 1
                delay = failures.next()
                log.exception("NIC health round failed; next try in %.1fs", delay)
                next_poll = self.clock() + delay
                self._stopping.wait(delay)

    def _round(self, next_poll: float) -> float:
        """One wait-and-handle step of the thread; returns when the next full poll is due."""
        now = self.clock()
        with self._lock:
            due = self._next_due()
        deadlines = [next_poll] + ([due] if due is not None else [])
        if self._reopen_at is not None:
            deadlines.append(self._reopen_at)
        assert self._wakeup is not None  # start() made it before starting this thread
        readers: list[WakePipe | socket.socket] = [self._wakeup] + ([self._sock] if self._sock is not None else [])
        ready, _, _ = select.select(readers, [], [], max(0.0, min(deadlines) - now))
        if self._stopping.is_set():
            return next_poll
        now = self.clock()
        if self._wakeup in ready:
            self._wakeup.drain()
        if self._sock is not None and self._sock in ready:
            events, dropped = self._drain_socket(self._sock, now)
            self._resync = self._resync or dropped
            if events:
                self.observe_events(events)
        if self._reopen_at is not None and now >= self._reopen_at:
            self._open_socket(now)
            self._resync = self._resync or self._sock is not None
        with self._lock:
            if self._inventory_changed:
                self._refresh()
            if self._resync or now >= next_poll:
                self.poll()
                return self.clock() + self.poll_period
            if due is not None and now >= due:  # a debounce ran out (events publish on their own)
                self._publish(now)
        return next_poll
