"""Grey-failure health: every GPU and NIC of the inventory read every `period` for the signals of
a device that is up but sick, and what the rules report published as conditions.

One thread ("grey-health") and one health source (`grey-health`), apart from the GPU and NIC
monitors: those react to events and state within seconds, this one reads counters at the slow
cadence their meaning needs (DCGM's health watches, which judge the same counters, sample every
30 s over a minute), so an idle node pays one round of file and NVML reads per period. Its own
source means its verdicts and theirs never clear each other.

State is kept by device identity (a GPU's UUID, a NIC's PCI address), never by the published
name, so a renamed netdev or a re-enumerated name does not inherit or lose a history. A GPU's
conditions go to every device published of it (the whole GPU or its MIG devices): its PCIe link,
clocks and NVLinks are shared by all of them. NVML is opened for each round and closed after
(NVML counts references, so with the GPU monitor's session open this costs nothing); while an SRE
has released it (`tandemctl release`) the GPUs are not read and keep their last verdicts.

One device that cannot be read (a failure no reader expected) is logged and keeps its last
verdict; the others are still judged. What is reported is kept across a restart (`grey_kept`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from driver.health.gpu.grey import GpuReading, read_gpu
from driver.health.gpu.policy import GpuDevices, index_gpus
from driver.health.grey_judge import GreyJudge, NicRead
from driver.health.grey_kept import KeptVerdicts
from driver.health.nic.grey import read_nic
from driver.health.thresholds import GreyThresholds
from driver.inventory.store import Inventory
from driver.model import Condition, Device, DeviceKind, TaintEffect
from driver.node.nvml import NvmlError, NvmlReleased, NvmlUnavailable, init_nvml, shutdown_nvml

log = logging.getLogger(__name__)


class GreyMonitor:
    """Publishes the grey-failure conditions of the inventory's GPUs and NICs (`kinds`) as health
    source `source`. `poll()` is one round (the thread runs one every `thresholds.period`); with
    injected clocks a test steps time without sleeping. What the readings mean is `GreyJudge`."""

    def __init__(
        self,
        inventory: Inventory,
        thresholds: GreyThresholds,
        *,
        sysfs_root: Path,
        driver_root: Path,
        domain: str = "tandem.dev",
        kinds: Iterable[DeviceKind] = (DeviceKind.GPU, DeviceKind.NIC),
        effects: Mapping[str, TaintEffect] | None = None,
        source: str = "grey-health",
        kept: KeptVerdicts | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.inventory = inventory
        self.kept = kept
        self.thresholds = thresholds
        self.sysfs_root = sysfs_root
        self.driver_root = driver_root
        self.kinds = frozenset(kinds)
        self.source = source
        self.clock = clock
        self.wall_clock = wall_clock
        self.rounds = 0
        self.errors = 0  # devices that could not be read, NVML that could not be opened
        self._lock = threading.Lock()
        self._judge = GreyJudge(thresholds, domain, dict(effects or {}))
        self._names: dict[str, str] = {}  # published device name -> the identity it is judged under
        self._published: dict[str, frozenset[Condition]] = {}
        self._nvml_note = ""  # why NVML was last not opened, logged once per reason
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Reports again what the daemon before reported (before the first publish: a restart
        must not offer a sick device untainted), then reads in the thread."""
        if self.kept is not None:
            with self._lock:
                self._judge.restore(self.kept.load())
                self._publish(*self._devices(self.inventory.devices()), {})
        self._thread = threading.Thread(target=self._run, name="grey-health", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def counters(self) -> dict[str, int]:
        return {"rounds": self.rounds, "errors": self.errors}

    def readings(self) -> dict[str, dict[str, int]]:
        """The last value of every counter read, by published device name (a GPU's under its whole
        GPU's name only), for `/metrics`."""
        with self._lock:
            devices = self._judge.devices
            return {name: dict(devices[i].readings) for name, i in self._names.items() if i in devices}

    def poll(self) -> None:
        """One round: read every device, judge, publish what changed."""
        with self._lock:
            now, wall = self.clock(), self.wall_clock()
            gpus, nics = self._devices(self.inventory.devices())
            verdicts = self._judge.judge(self._read_gpus(gpus), self._read_nics(nics), now, wall)
            self._judge.forget(set(self._names.values()))
            self._publish(gpus, nics, verdicts)
            if self.kept is not None:
                self.kept.save(self._judge.kept())
            self.rounds += 1

    def _devices(self, devices: list[Device]) -> tuple[dict[str, GpuDevices], list[Device]]:
        """The GPUs (by UUID) and NICs of the kinds watched; notes the identity of each name."""
        gpus = index_gpus(devices) if DeviceKind.GPU in self.kinds else {}
        nics = [d for d in devices if d.kind == DeviceKind.NIC and d.nic] if DeviceKind.NIC in self.kinds else []
        self._names = {_whole(gpu): uuid for uuid, gpu in gpus.items()}
        self._names.update({d.name: d.nic.pci_address for d in nics if d.nic})
        return gpus, nics

    def _publish(
        self, gpus: dict[str, GpuDevices], nics: list[Device], verdicts: Mapping[str, frozenset[Condition]]
    ) -> None:
        """Sets each device's conditions where they changed: this round's verdict, or the last one
        of a device not read this round."""
        found: dict[str, frozenset[Condition]] = {}
        for uuid, gpu in gpus.items():
            for name in gpu.devices:
                found[name] = verdicts.get(uuid, self._judge.conditions(uuid))
        for d in nics:
            assert d.nic is not None
            found[d.name] = verdicts.get(d.nic.pci_address, self._judge.conditions(d.nic.pci_address))
        for name in self._published.keys() - found.keys():
            self._set(name, frozenset())
        for name, conditions in found.items():
            if conditions != self._published.get(name, frozenset()):
                self._set(name, conditions)

    def _read_gpus(self, gpus: dict[str, GpuDevices]) -> dict[str, GpuReading]:
        """What NVML and sysfs say of each GPU that answers; {} while NVML cannot be opened."""
        if not gpus:
            return {}
        try:
            nvml = init_nvml(self.driver_root)
        except NvmlUnavailable as e:
            if not isinstance(e, NvmlReleased):
                self.errors += 1
            if str(e) != self._nvml_note:
                log.warning("grey-failure checks of GPUs paused: %s", e)
                self._nvml_note = str(e)
            return {}
        self._nvml_note = ""
        out: dict[str, GpuReading] = {}
        try:
            for uuid, gpu in gpus.items():
                try:
                    handle = nvml.nvmlDeviceGetHandleByUUID(uuid)
                    out[uuid] = read_gpu(nvml, handle, self.sysfs_root, gpu.pci)
                except (NvmlError, OSError, ValueError) as e:  # lost, gone: the GPU monitor's verdict
                    self.errors += 1
                    log.debug("GPU %s: not read for grey failures: %s", uuid, e)
        finally:
            shutdown_nvml(nvml)
        return out

    def _read_nics(self, nics: list[Device]) -> dict[str, NicRead]:
        out: dict[str, NicRead] = {}
        for d in nics:
            assert d.nic is not None
            try:
                reading = read_nic(self.sysfs_root, d.nic)
            except (OSError, ValueError) as e:
                self.errors += 1
                log.warning("NIC %s: not read for grey failures: %s", d.name, e)
                continue
            out[d.nic.pci_address] = NicRead(
                (d.attributes.get("pciVendorID"), d.attributes.get("pciDeviceID")), reading
            )
        return out

    def _set(self, name: str, conditions: frozenset[Condition]) -> None:
        self.inventory.set_conditions(self.source, name, conditions)
        if conditions:
            self._published[name] = conditions
            log.warning("%s: %s", name, "; ".join(sorted(c.message for c in conditions)))
        else:
            self._published.pop(name, None)
            log.info("%s: no grey failure any more", name)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.poll()
            except Exception:  # the monitor must outlive any one failure
                self.errors += 1
                log.exception("grey-failure round failed; next one in %.0fs", self.thresholds.period)
            self._stop.wait(self.thresholds.period)


def _whole(gpu: GpuDevices) -> str:
    """The device that names the whole GPU (its MIG devices share its readings), else its first."""
    return next((n for n in gpu.devices if gpu.instances.get(n) == gpu.uuid), gpu.devices[0])
