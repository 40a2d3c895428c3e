"""The node's devices: the one place that knows them.

Discovery sources (GPUs, NICs) replace their own share of the inventory; readers (slice
publisher, prepare path, CLI) take immutable snapshots. Subscribers are told when anything
changed, outside the lock, so a slow subscriber cannot stall discovery.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

from driver.model import Device

log = logging.getLogger(__name__)


class Inventory:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_source: dict[str, tuple[Device, ...]] = {}
        self._by_name: dict[str, Device] = {}
        self._subscribers: list[Callable[[], None]] = []

    def subscribe(self, callback: Callable[[], None]) -> None:
        with self._lock:
            self._subscribers.append(callback)

    def replace(self, source: str, devices: Sequence[Device]) -> bool:
        """Sets the devices a source found; returns whether anything changed."""
        new = tuple(sorted(devices, key=lambda d: d.name))
        with self._lock:
            if self._by_source.get(source) == new:
                return False
            clash = {d.name for d in new} & {d.name for s, devs in self._by_source.items() if s != source for d in devs}
            if clash:
                log.error("devices %s reported by two sources; keeping the first", sorted(clash))
                new = tuple(d for d in new if d.name not in clash)
            self._by_source[source] = new
            self._by_name = {d.name: d for devs in self._by_source.values() for d in devs}
            subscribers = list(self._subscribers)
        log.info("inventory: %s now has %d device(s)", source, len(new))
        for cb in subscribers:
            cb()
        return True

    def devices(self) -> list[Device]:
        with self._lock:
            return sorted(self._by_name.values(), key=lambda d: d.name)

    def get(self, name: str) -> Device | None:
        with self._lock:
            return self._by_name.get(name)
