"""The thread that turns netlink link and address events into NIC rediscoveries.

Netlink says *that* something changed, not what a NIC now looks like: the watcher only wakes the
NIC refresh loop, coalesced, and rediscovery reads the facts afresh. It also counts link messages
per netdev, which the link hold uses to see a flap that happened between two discoveries.
"""

from __future__ import annotations

import logging
import select
import socket
import threading
import time
from collections.abc import Callable

from driver.discovery import netlink
from driver.discovery.nic_scan import NicDiscoveryError
from driver.wakepipe import WakePipe

log = logging.getLogger(__name__)


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
    def idle(self) -> bool:
        """True when no event is waiting to be reported."""
        return self._pending_since is None

    def start(self) -> None:
        """Subscribes before returning, so a change made after start() is never missed."""
        if self.use_netlink:
            try:
                self._sock = netlink.open_event_socket(self.netns)
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
        next_resync = time.monotonic() + self.resync_period
        assert self._wakeup is not None  # start() made it before starting this thread
        wakeup = self._wakeup
        readers: list[WakePipe | socket.socket] = [wakeup] + ([self._sock] if self._sock is not None else [])
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
            if wakeup in ready and b"t" in wakeup.drain():
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

    def _call(self) -> None:
        self.callbacks += 1
        try:
            self.callback()
        except Exception:  # the watcher must outlive a failing consumer
            log.exception("NIC change callback failed")
