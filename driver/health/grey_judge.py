"""One round of grey-failure verdicts for a whole node, from readings already taken (pure).

Kept apart from the thread that reads (`driver.health.grey_monitor`) so that a day of readings
can be replayed through exactly what the daemon runs (`hack/grey_replay.py`), in simulated time.
Peers are judged here because a verdict may depend on them: a NIC's speed against the fastest of
its model and firmware, a GPU's active NVLinks against the most any GPU with its link count has.
Devices are kept by identity (a GPU's UUID, a NIC's PCI address); one that leaves the readings
keeps nothing.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass

from driver.health.gpu.grey import GpuReading, judge_gpu
from driver.health.grey import GreyDevice, Kept
from driver.health.nic.grey import NicReading, judge_nic
from driver.health.thresholds import GreyThresholds
from driver.model import Condition, TaintEffect


@dataclass(frozen=True)
class NicRead:
    """A NIC's reading and the model it is compared within (PCI vendor and device ID; the firmware
    comes with the reading)."""

    model: Hashable
    reading: NicReading


class GreyJudge:
    """Every device's signals, judged a round at a time."""

    def __init__(self, thresholds: GreyThresholds, domain: str, effects: Mapping[str, TaintEffect]) -> None:
        self.thresholds = thresholds
        self.domain = domain
        self.effects = effects
        self.devices: dict[str, GreyDevice] = {}

    def judge(
        self, gpus: Mapping[str, GpuReading], nics: Mapping[str, NicRead], now: float, wall: float
    ) -> dict[str, frozenset[Condition]]:
        """Feeds one round of readings (GPUs by UUID, NICs by PCI address) to their devices; their
        conditions, by identity. A device known but not read this round keeps its state and is
        not judged (`conditions` tells its last verdict); `forget` drops the ones gone."""
        out: dict[str, frozenset[Condition]] = {}
        for uuid, r in gpus.items():
            judge_gpu(self._device(uuid), r, _expected_nvlinks(r, gpus.values()), now, wall)
            out[uuid] = self.devices[uuid].conditions(self.domain, self.effects)
        fastest: dict[tuple[Hashable, str], int] = {}
        for n in nics.values():
            if (speed := n.reading.counters.speed_mbps) is not None:
                model = (n.model, n.reading.counters.fw_ver)
                fastest[model] = max(fastest.get(model, 0), speed)
        for address, n in nics.items():
            peers = fastest.get((n.model, n.reading.counters.fw_ver))
            judge_nic(self._device(address), n.reading, peers, now, wall)
            out[address] = self.devices[address].conditions(self.domain, self.effects)
        return out

    def conditions(self, identity: str) -> frozenset[Condition]:
        """A device's conditions as last judged (nothing for one never judged)."""
        dev = self.devices.get(identity)
        return dev.conditions(self.domain, self.effects) if dev is not None else frozenset()

    def kept(self) -> dict[str, list[Kept]]:
        """Every device's reported verdicts, to keep across a restart."""
        return {identity: kept for identity, dev in self.devices.items() if (kept := dev.kept())}

    def restore(self, kept: Mapping[str, list[Kept]]) -> None:
        """Reports again what a daemon before this one reported (`driver.health.grey_kept`)."""
        for identity, verdicts in kept.items():
            for k in verdicts:
                self._device(identity).restore(k)

    def forget(self, keep: set[str]) -> None:
        """Drops every device not in `keep` (gone from the node)."""
        for identity in self.devices.keys() - keep:
            del self.devices[identity]

    def _device(self, identity: str) -> GreyDevice:
        dev = self.devices.get(identity)
        if dev is None:
            dev = self.devices[identity] = GreyDevice(self.thresholds)
        return dev


def _expected_nvlinks(reading: GpuReading, readings: Iterable[GpuReading]) -> int | None:
    """The most active NVLinks a GPU with the same link count has on this node (itself included)."""
    if reading.nvlinks is None or reading.nvlinks_up is None:
        return None
    ups = [r.nvlinks_up for r in readings if r.nvlinks == reading.nvlinks and r.nvlinks_up is not None]
    return max(ups, default=reading.nvlinks_up)
