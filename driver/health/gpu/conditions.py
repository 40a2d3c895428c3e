"""The GPU health monitor's conditions, kept by UUID, and what it has published of them per device.

Conditions are recorded against what they are about, by UUID (`HealthState`): a GPU's probe
verdicts and the events NVML attributes to no instance against the GPU, and so against every
device of it; an event attributed to a MIG device against that instance. A device publishes its
GPU's and its own instance's. A name outlives its instance: a MIG device destroyed and made again
at the same GI/CI is a new instance with a new UUID, a GPU swapped in at the same minor has a new
UUID too, and neither inherits what the old one had; a dynamic-MIG partition not made yet has no
instance of its own, so only its GPU's.

Kept apart from the monitor's thread (`driver.health.gpu.monitor`), which talks to NVML, so that what is
known and what is written to the inventory live in one place. Only that thread uses it: no lock.
What is held until a reset is written to the data dir with every publish that changed it, and
held again when the daemon starts (`held`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from driver.health.gpu.held import HeldResets
from driver.health.gpu.memory import EventRate
from driver.health.gpu.policy import GPU_LOST, GpuDevices, GpuHealthPolicy, HealthState, index_gpus
from driver.health.gpu.resets import EVERY_GPU
from driver.inventory.store import Inventory
from driver.model import Condition

log = logging.getLogger(__name__)


class GpuConditions:
    """The state by UUID (`state`), the single-bit ECC rate of each GPU, and the conditions each
    device was last published with, so that only a device whose set changed is written."""

    def __init__(
        self, inventory: Inventory, policy: GpuHealthPolicy, source: str, held: HeldResets | None = None
    ) -> None:
        """`held`: where the held set outlives the daemon; None keeps it in memory only."""
        self.inventory = inventory
        self.policy = policy
        self.source = source
        self.state = HealthState(policy)
        self._held = held
        self._sbe_rate: dict[str, EventRate] = {}
        self._published: dict[str, frozenset[Condition]] = {}  # device name -> its conditions as published
        self._lost: set[str] = set()  # GPUs the last probe found lost (off the bus)

    def restore(self, now: float) -> None:
        """Holds again what was held until a reset when the daemon stopped (`held`)."""
        if self._held is not None:
            for subject, cond in self._held.load(self.policy):
                self.state.observe(subject, cond, now, until_reset=True)

    def observe(self, subjects: Iterable[str], cond: Condition, now: float, until_reset: bool = False) -> bool:
        """Records an event against each subject; whether any subject's conditions changed."""
        return bool({s for s in subjects if self.state.observe(s, cond, now, until_reset)})

    def single_bits(self, gpu: GpuDevices, count: int, now: float) -> bool:
        rate = self._sbe_rate.setdefault(gpu.uuid, EventRate(self.policy.single_bit_window))
        total = rate.add(count, now)
        if total < self.policy.single_bit_threshold:
            return False
        return self.observe([gpu.uuid], self.policy.single_bit_ecc_rate(total), now)

    def reset(self, evidence: dict[str, str], gpus: dict[str, GpuDevices] | None = None) -> bool:
        """Drops what waited for a reset of each GPU in `evidence` (UUID, or EVERY_GPU -> why;
        `resets`), its MIG instances' too; whether anything was dropped."""
        if not evidence:
            return False
        gpus = index_gpus(self.inventory.devices()) if gpus is None else gpus
        changed = False
        for gpu in gpus.values():
            why = evidence.get(gpu.uuid, evidence.get(EVERY_GPU))
            if why is None:
                continue
            cleared = [s for s in (gpu.uuid, *gpu.instances.values()) if s and self.state.clear_reset(s)]
            if cleared:
                log.warning("GPU %s: the conditions that waited for a reset are cleared: %s", gpu.uuid, why)
            changed = changed or bool(cleared)
        return changed

    def probed(self, gpu: GpuDevices, conds: list[Condition], answers: bool) -> None:
        """Records the probe's verdict on a GPU: one that was lost and answers again was reset or
        re-enumerated (NVML's GPU_IS_LOST holds until then), which is evidence for `reset`."""
        if any(c.key == self.policy.key(GPU_LOST) for c in conds):
            self._lost.add(gpu.uuid)
        elif answers and gpu.uuid in self._lost:
            self._lost.discard(gpu.uuid)
            self.reset({gpu.uuid: "it was lost (off the bus) and answers again"}, {gpu.uuid: gpu})

    def forget_gone(self, gpus: dict[str, GpuDevices]) -> None:
        """Drops what is known of GPUs and instances no longer in the inventory; a GPU whose held
        reset XIDs were restored is not gone until it was found (`held`)."""
        present = set(gpus) | {uuid for gpu in gpus.values() for uuid in gpu.instances.values()}
        if self._held is not None:
            for subject in self._held.found(gpus):
                self.state.clear_reset(subject)
            present |= self._held.waiting()
        for subject in self.state.subjects() - present:
            self.state.forget(subject)
        for uuid in set(self._sbe_rate) - set(gpus):
            del self._sbe_rate[uuid]
        self._lost &= set(gpus)

    def publish(self, gpus: dict[str, GpuDevices] | None = None) -> None:
        """Publishes the conditions of every device that changed: its GPU's and its own
        instance's; a device that left the inventory has none. `gpus`: the inventory's, when the
        caller has just read them."""
        gpus = index_gpus(self.inventory.devices()) if gpus is None else gpus
        now = {
            name: self.state.conditions(gpu.uuid) | self.state.conditions(instance)
            for gpu in gpus.values()
            for name, instance in gpu.instances.items()
        }
        for d in sorted(now.keys() | self._published.keys()):
            conds = now.get(d, frozenset())
            if conds == self._published.get(d, frozenset()):
                continue
            try:
                self.inventory.set_conditions(self.source, d, conds)
            except Exception:
                log.exception("%s: cannot publish health conditions", d)
                continue
            if conds:
                self._published[d] = conds
                level = logging.WARNING if any(c.unhealthy for c in conds) else logging.INFO
                log.log(level, "%s: %s", d, "; ".join(sorted(f"{c.key}={c.value} ({c.effect})" for c in conds)))
            else:
                del self._published[d]
                log.info("%s: no GPU health conditions", d)
        if self._held is not None:
            self._held.save(self.state.held(), gpus, self.policy)
