"""The node's devices: the one place that knows them, and their health.

Discovery sources (GPUs, NICs) replace their own share of the devices; health sources (NVML
events, netlink link state, manual cordons) replace their own share of each device's conditions.
Readers (slice publisher, prepare path, health stream, CLI) take immutable snapshots in which
conditions are already folded into taints and health. Subscribers are told when anything changed,
outside the lock, so a slow subscriber cannot stall discovery or a health monitor.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Iterable, Sequence

from driver.model import Condition, Device, Health, Taint
from driver.resource_api import MAX_TAINTS

log = logging.getLogger(__name__)


def apply_conditions(device: Device, conditions: Iterable[Condition]) -> Device:
    """The device as published: one taint per (key, value, effect), health from the conditions."""
    conds = sorted(set(conditions), key=lambda c: (c.key, c.value, c.effect))
    if not conds:
        return device
    taints = tuple(dict.fromkeys(Taint(c.key, c.effect, c.value) for c in conds))[:MAX_TAINTS]
    unhealthy = [c for c in conds if c.unhealthy]
    health = Health.UNHEALTHY if unhealthy else Health.HEALTHY
    message = "; ".join(c.message or f"{c.key}={c.value}" for c in (unhealthy or conds))
    return dataclasses.replace(device, taints=taints, health=health, health_message=message)


class Inventory:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_source: dict[str, tuple[Device, ...]] = {}
        # health source -> device name -> conditions
        self._conditions: dict[str, dict[str, frozenset[Condition]]] = {}
        self._view: dict[str, Device] = {}
        self._subscribers: list[Callable[[], None]] = []

    def subscribe(self, callback: Callable[[], None]) -> None:
        with self._lock:
            self._subscribers.append(callback)

    def _rebuild(self) -> bool:
        """Recompute the published view under the lock; True if it changed."""
        merged: dict[str, set[Condition]] = {}
        for per_device in self._conditions.values():
            for name, conds in per_device.items():
                merged.setdefault(name, set()).update(conds)
        view = {d.name: apply_conditions(d, merged.get(d.name, ())) for devs in self._by_source.values() for d in devs}
        changed = view != self._view
        self._view = view
        return changed

    def _notify(self) -> None:
        with self._lock:
            subscribers = list(self._subscribers)
        for cb in subscribers:
            cb()

    def replace(self, source: str, devices: Sequence[Device]) -> bool:
        """Sets the devices a discovery source found; returns whether the published view changed."""
        new = tuple(sorted(devices, key=lambda d: d.name))
        with self._lock:
            if self._by_source.get(source) == new:
                return False
            others = {d.name for s, devs in self._by_source.items() if s != source for d in devs}
            clash = {d.name for d in new} & others
            if clash:
                log.error("devices %s reported by two sources; keeping the first", sorted(clash))
                new = tuple(d for d in new if d.name not in clash)
            self._by_source[source] = new
            changed = self._rebuild()
        log.info("inventory: %s now has %d device(s)", source, len(new))
        if changed:
            self._notify()
        return changed

    def set_conditions(self, source: str, device: str, conditions: Iterable[Condition]) -> bool:
        """Sets what one health source says about one device (empty = nothing wrong)."""
        conds = frozenset(conditions)
        with self._lock:
            per_device = self._conditions.setdefault(source, {})
            if per_device.get(device, frozenset()) == conds:
                return False
            if conds:
                per_device[device] = conds
            else:
                per_device.pop(device, None)
            changed = self._rebuild()
        if changed:
            self._notify()
        return changed

    def conditions(self, source: str) -> dict[str, frozenset[Condition]]:
        with self._lock:
            return dict(self._conditions.get(source, {}))

    def devices(self) -> list[Device]:
        with self._lock:
            return sorted(self._view.values(), key=lambda d: d.name)

    def get(self, name: str) -> Device | None:
        with self._lock:
            return self._view.get(name)
