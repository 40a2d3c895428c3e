"""The thread that turns netlink link, address and default-route events into NIC rediscoveries.

Netlink says *that* something changed, not what a NIC now looks like: the watcher only wakes the
NIC refresh loop, coalesced, and rediscovery reads the facts afresh. It also counts link messages
per netdev, which the link hold uses to see a flap that happened between two discoveries.

Most links are never NICs: on a node with a CNI every pod start creates and deletes a veth, and
rediscovering for each would dump links and routing tables thousands of times an hour. Each link
message is judged by `may_be_nic` (netlink's parent device, or one sysfs look-up) when it arrives,
and the verdict is kept per ifindex until the link leaves the namespace: a message about a link
that is no NIC, and never was one, and an address message of such a link, are dropped before any
work. The links that exist when the watcher starts are judged from one link dump (a link
announces itself only when it appears); what the watcher still cannot judge (an address message
of a link it has no verdict for) counts, so nothing is missed. Both per-link tables shrink when a
link leaves, and are bounded by `MAX_TRACKED_LINKS` besides; after the kernel dropped events, or
at that bound, they are judged afresh from a new dump.

Route messages count for the default route alone: discovery leaves out the NICs that carry it (the
uplinks: moving one into a pod would cut the node off), so a NIC that just became one must stop
being offered at once, not at the next periodic rediscovery. The CNI adds and deletes a route per
pod as well, so every route message but a new or deleted default route (dst_len 0) of the main
table is dropped at its fixed header (`rtnl.peek_route`), before any attribute is read; the route's
link is not judged, since a default route over a bond or VLAN decides about the NICs beneath it.
Every way a default route appears is reported. IPv4 removes the routes of a link that goes down
without a message: that link's own message is the event when it may be a NIC, and the NICs beneath
a bond or VLAN that went down stay left out until the next rediscovery (the safe side).
"""

from __future__ import annotations

import logging
import select
import socket
import threading
import time
from collections.abc import Callable

from driver.backoff import Backoff, Retry
from driver.discovery.nic.scan import NicDiscoveryError
from driver.node import netlink, rtnl
from driver.node.rtnl import Link
from driver.wakepipe import WakePipe

log = logging.getLogger(__name__)

MAX_TRACKED_LINKS = 1 << 16
DEFAULT_BACKOFF = Backoff(initial=1.0, maximum=30.0)  # between failed steps of the thread


class NicWatcher:
    """A thread that turns netlink link, address and default-route events into calls of `callback`.

    Bursts are coalesced: the callback runs once the events have been quiet for `quiet` seconds,
    but never later than `max_delay` after the first event of the burst. Every `resync_period`
    seconds without a callback it runs anyway, to catch what netlink did not say (sysfs-only
    changes, a dropped event); None when the callback's owner rescans periodically itself (the
    daemon's NIC refresh loop does: a second timer would only add a rediscovery, and an idle
    wakeup, per period).
    `trigger()` asks for a rescan as if an event had arrived. With `netlink=False` (the simulated
    node) only `trigger()` and the resync call it. `may_be_nic` judges a link message (see the
    module docstring); by default every link may be one. `is_nic` says which ifindexes the last
    discovery found NICs at: those always count, whatever the message let the watcher judge.
    A link `may_be_nic` fails on counts as one that may be a NIC; any other failure of the
    thread is logged, waited out (`backoff`) and answered with a callback, as a dropped event is.
    """

    def __init__(
        self,
        callback: Callable[[], None],
        netns: str | None = None,
        resync_period: float | None = 60.0,
        quiet: float = 0.15,
        max_delay: float = 1.0,
        netlink: bool = True,
        may_be_nic: Callable[[Link], bool] = lambda _link: True,
        is_nic: Callable[[int], bool] = lambda _index: False,
        backoff: Backoff = DEFAULT_BACKOFF,
    ) -> None:
        self.callback = callback
        self.netns = netns
        self.resync_period = resync_period
        self.quiet = quiet
        self.max_delay = max_delay
        self.use_netlink = netlink
        self.may_be_nic = may_be_nic
        self.is_nic = is_nic
        self.backoff = backoff
        self.events = 0  # netlink messages received
        self.ignored = 0  # of those, messages of links that are no NIC and of routes but the default
        self._nic_links: dict[int, tuple[bool, str]] = {}  # ifindex -> (may be a NIC, name)
        self._link_events: dict[str, int] = {}  # link messages per name of a link that may be a NIC
        self.callbacks = 0
        self._sock: socket.socket | None = None
        self._wakeup: WakePipe | None = None
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._pending_since: float | None = None
        self._last_event = 0.0

    def link_events(self, ifname: str) -> int:
        """Link messages seen for `ifname` so far: tells a link that flapped between two looks."""
        return self._link_events.get(ifname, 0)

    @property
    def tracked(self) -> tuple[int, int]:
        """Sizes of the per-link tables: (links with a verdict, names with a message count)."""
        return len(self._nic_links), len(self._link_events)

    @property
    def idle(self) -> bool:
        """True when no event is waiting to be reported."""
        return self._pending_since is None

    def start(self) -> None:
        """Subscribes before returning, so a change made after start() is never missed."""
        if self.use_netlink:
            try:
                self._sock = netlink.open_event_socket(self.netns)
                self._judge_existing_links()
            except OSError as e:
                where = netlink.namespace_name(self.netns)
                raise NicDiscoveryError(f"cannot subscribe to netlink events of {where}: {e}") from e
        self._wakeup = WakePipe()
        self._thread = threading.Thread(target=self._run, name="nic-watcher", daemon=True)
        self._thread.start()

    def trigger(self) -> None:
        if self._wakeup is not None:
            self._wakeup.wake(b"t")

    def stop(self, timeout: float = 5.0) -> None:
        self._stopping.set()
        if self._wakeup is not None:
            self._wakeup.wake(b"s")
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                # A slow callback still runs and will select() on these descriptors: leave them
                # open (the thread exits at its next loop) rather than close them under it.
                log.warning("NIC watcher still busy after %.0f s; leaving it to finish", timeout)
                return
        if self._sock is not None:
            self._sock.close()
        if self._wakeup is not None:
            self._wakeup.close()

    def _run(self) -> None:
        next_resync = self._next_resync(time.monotonic())
        failures = Retry(self.backoff)
        while not self._stopping.is_set():
            try:
                next_resync = self._step(next_resync)
                failures.reset()
            except Exception:  # the watcher must outlive any one failure, a bad link's included
                delay = failures.next()
                log.exception("NIC watcher failed; rescanning in %.1fs", delay)
                self._note_event(time.monotonic())  # what the failed step lost, a rescan reads
                self._stopping.wait(delay)

    def _next_resync(self, now: float) -> float | None:
        return now + self.resync_period if self.resync_period is not None else None

    def _step(self, next_resync: float | None) -> float | None:
        """One wait-and-handle step of the thread; returns when the next resync is due."""
        assert self._wakeup is not None  # start() made it before starting this thread
        wakeup, sock = self._wakeup, self._sock
        readers: list[WakePipe | socket.socket] = [wakeup] + ([sock] if sock is not None else [])
        now = time.monotonic()
        due: float | None
        if self._pending_since is not None:
            due = min(self._last_event + self.quiet, self._pending_since + self.max_delay)
        else:
            due = next_resync
        ready, _, _ = select.select(readers, [], [], None if due is None else max(0.0, due - now))
        now = time.monotonic()
        if sock is not None and sock in ready and self._drain_socket(sock):
            self._note_event(now)
        if wakeup in ready and b"t" in wakeup.drain():
            self._note_event(now)
        if self._stopping.is_set():
            return next_resync
        fire = self._pending_since is not None and (
            now >= self._last_event + self.quiet or now >= self._pending_since + self.max_delay
        )
        if fire or (next_resync is not None and now >= next_resync):
            self._pending_since = None
            next_resync = self._next_resync(now)
            self._call()
        return next_resync

    def _note_event(self, now: float) -> None:
        if self._pending_since is None:
            self._pending_since = now
        self._last_event = now

    def _drain_socket(self, sock: socket.socket) -> bool:
        got = False
        while True:
            try:
                data = sock.recv(1 << 16)
            except BlockingIOError:
                return got
            except OSError as e:  # ENOBUFS: the kernel dropped events; a rescan covers them
                log.info("netlink event socket: %s; rescanning", e)
                self._rejudge()  # a NEWLINK or DELLINK may be among the lost
                return True
            for kind, _, begin, end in rtnl.messages(data):
                self.events += 1
                if self._matters(kind, data, begin, end):
                    got = True
                else:
                    self.ignored += 1

    def _matters(self, kind: int, data: bytes, start: int, end: int) -> bool:
        """Whether one message may concern a NIC; keeps the per-link verdicts and counts."""
        if kind in (rtnl.RTM_NEWROUTE, rtnl.RTM_DELROUTE):  # the default route's alone (module docstring)
            route = rtnl.peek_route(data, start, end)
            return route is None or route == (0, netlink.RT_TABLE_MAIN)  # too short to judge: counts
        if kind in (rtnl.RTM_NEWADDR, rtnl.RTM_DELADDR):  # its link's verdict; no verdict counts
            index = rtnl.address_index(data, start, end)
            return index is None or self._nic_links.get(index, (True, ""))[0] or self.is_nic(index)
        if kind not in (rtnl.RTM_NEWLINK, rtnl.RTM_DELLINK):
            return False  # nothing else is subscribed to
        peeked = rtnl.peek_link(data, start, end)
        if peeked is None:
            return True  # too short to judge
        index, name = peeked
        deleted = kind == rtnl.RTM_DELLINK
        before = self._nic_links.get(index)
        if before is not None and not before[0] and not self.is_nic(index):  # judged no NIC
            if deleted:
                del self._nic_links[index]
                return False
            if before[1] == name:
                return False  # and not renamed since: nothing more to read
        decoded = rtnl.decode_link(data, start, end)
        if decoded is None:
            return True
        link = decoded[0]
        self._nic_links.pop(index, None)
        if before is not None and before[1] != name:
            self._link_events.pop(before[1], None)  # renamed: the old name is no NIC's any more
        if deleted:
            # Judged when it was seen; a link never seen is judged now, if netlink names its
            # parent device (sysfs no longer shows a link that has left).
            nic = before[0] if before is not None else (self._judge(link) if link.parent_bus else True)
            self._link_events.pop(name, None)
        else:
            nic = self._judge(link)
            if len(self._nic_links) >= MAX_TRACKED_LINKS or len(self._link_events) >= MAX_TRACKED_LINKS:
                self._rejudge()
            self._nic_links[index] = (nic, name)
        if nic or (before is not None and before[0]) or self.is_nic(index):
            if not deleted:
                self._link_events[name] = self._link_events.get(name, 0) + 1
            return True
        return False

    def _judge_existing_links(self) -> None:
        """A verdict for every link of the namespace now: OSError when it cannot be read."""
        with netlink.RouteSocket(self.netns) as rs:
            links = rs.links()
        self._nic_links = {link.index: (self._judge(link), link.name) for link in links}
        self._link_events = {n: self._link_events.get(n, 0) for nic, n in self._nic_links.values() if nic}

    def _judge(self, link: Link) -> bool:
        """`may_be_nic`; True when it fails (e.g. a sysfs entry of the link that cannot be read):
        such a link's messages count, so a rediscovery reads it afresh, and one link that cannot
        be judged never stops the watcher, nor its start."""
        try:
            return self.may_be_nic(link)
        except Exception:
            log.warning(
                "cannot judge link %s (ifindex %d); counting its messages", link.name, link.index, exc_info=True
            )
            return True

    def _rejudge(self) -> None:
        try:
            self._judge_existing_links()
        except OSError as e:  # no verdicts: every message counts until links are seen again
            log.warning("cannot list the links of %s: %s", netlink.namespace_name(self.netns), e)
            self._nic_links, self._link_events = {}, {}

    def _call(self) -> None:
        self.callbacks += 1
        try:
            self.callback()
        except Exception:  # the watcher must outlive a failing consumer
            log.exception("NIC change callback failed")
