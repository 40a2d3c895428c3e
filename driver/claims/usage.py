"""What the GPUs of prepared claims are doing, by claim and pod: NVML's utilisation and memory, read
at scrape time for `/metrics` (`tandem_claim_gpu_*`; docs/deployment.md, 'Per-pod GPU metrics',
says why Tandem exports them rather than leaving them to dcgm-exporter).

Who holds a device is the checkpoint's word, as for `tandemctl devices` (`driver.status.documents`):
the claims whose completed records name it, and the pods their `status.reservedFor` named at
prepare (a record of an older release names none: its series have an empty `pod`). So a series
appears once the kubelet's prepare completed and goes with the record at unprepare, when the pod
has gone: no series outlives its claim. Which container of the pod uses the claim is in the pod's
spec, which Tandem does not read: there is no `container` label.

Per device, not per process: every claim sharing a GPU (MPS, time slicing) shows the whole GPU's
utilisation and memory. NVML measures no utilisation on a MIG-enabled GPU, so a MIG device
(a dynamic-MIG partition, or a whole GPU in MIG mode) has its memory series only, read on the MIG
device's own handle.

Bounded in time and out of the claim flow's way: NVML is initialised through its one door
(`driver.node.nvml`: while an SRE has released NVML there are no usage series) on a thread of its
own, `gpu-usage`, one read at a time. A scrape waits at most `READ_TIMEOUT` for it; while a read is
still stuck (a GPU whose driver call never returns), scrapes get no usage series rather than
another stuck thread. No lock of the claim flow is taken, only the checkpoint's flock for one read,
as `tandem_prepared_claims` does.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from driver.claims.checkpoint import ClaimRecord
from driver.claims.vocabulary import PrepareState
from driver.model import Device
from driver.node.nvml import NvmlError, NvmlUnavailable, init_nvml, shutdown_nvml

log = logging.getLogger(__name__)

READ_TIMEOUT = 2.0  # seconds a scrape waits for NVML; Prometheus' own scrape timeout is 10 s by default


@dataclass(frozen=True)
class Holder:
    """One pod's hold on a prepared claim's device: the labels of its series."""

    namespace: str
    pod: str
    claim: str
    device: str
    uuid: str


@dataclass(frozen=True)
class Reading:
    """One GPU or MIG device as NVML answered; None where it did not (MIG: no utilisation)."""

    utilization: float | None  # 0..1 of the last sample period in which a kernel ran
    memory_used: int | None  # bytes
    memory_total: int | None


@dataclass(frozen=True)
class GpuUsage(Holder):
    """A series' labels and values (what `driver.metrics.ClaimGpu` reads)."""

    utilization: float | None
    memory_used: int | None
    memory_total: int | None


def holders(prepared: Mapping[str, ClaimRecord], lookup: Callable[[str], Device | None]) -> dict[str, list[Holder]]:
    """By GPU or MIG device UUID, each pod holding it through a completed record; a device the
    inventory lacks, or knows no UUID of (a partition not made yet), has none."""
    out: dict[str, list[Holder]] = {}
    for claim in sorted(prepared.values(), key=lambda c: (c.namespace, c.name)):
        if claim.state != PrepareState.COMPLETED:
            continue
        for record in claim.devices:
            device = lookup(record.device)
            if device is None or device.gpu is None or not device.gpu.uuid:
                continue
            held = out.setdefault(device.gpu.uuid, [])
            for pod in claim.pods or ("",):
                holder = Holder(claim.namespace, pod, claim.name, record.device, device.gpu.uuid)
                if holder not in held:  # two shares of one GPU in one claim are one series
                    held.append(holder)
    return out


class ClaimGpuUsage:
    """`read()` on every scrape (`driver.metrics.ScrapeSources.claim_gpus`)."""

    def __init__(
        self,
        prepared: Callable[[], Mapping[str, ClaimRecord]],
        lookup: Callable[[str], Device | None],
        driver_root: Path,
        timeout: float = READ_TIMEOUT,
    ) -> None:
        self._prepared = prepared
        self._lookup = lookup
        self._driver_root = driver_root
        self._timeout = timeout
        self._lock = threading.Lock()
        self._reading: threading.Thread | None = None

    def read(self) -> list[GpuUsage]:
        held = holders(self._prepared(), self._lookup)
        if not held:
            return []
        readings: dict[str, Reading] = {}  # written by the reading thread, read once it has ended
        with self._lock:
            if self._reading is not None and self._reading.is_alive():
                log.warning("per-claim GPU metrics: NVML has not answered an earlier read yet; none this scrape")
                return []
            thread = threading.Thread(
                target=self._read_nvml, args=(sorted(held), readings), name="gpu-usage", daemon=True
            )
            self._reading = thread
            thread.start()
        thread.join(self._timeout)
        if thread.is_alive():
            log.warning("per-claim GPU metrics: NVML did not answer within %.1f s; none this scrape", self._timeout)
            return []
        return [
            GpuUsage(h.namespace, h.pod, h.claim, h.device, h.uuid, r.utilization, r.memory_used, r.memory_total)
            for uuid, hs in held.items()
            if (r := readings.get(uuid)) is not None
            for h in hs
        ]

    def _read_nvml(self, uuids: Sequence[str], out: dict[str, Reading]) -> None:
        try:
            nvml = init_nvml(self._driver_root)
        except NvmlUnavailable as e:  # released, or no driver: no usage series
            log.debug("per-claim GPU metrics: %s", e.reason)
            return
        try:
            for uuid in uuids:
                reading = _reading(nvml, uuid)
                if reading is not None:
                    out[uuid] = reading
        finally:
            shutdown_nvml(nvml)


def _reading(nvml: ModuleType, uuid: str) -> Reading | None:
    handle = _answer(uuid, nvml.nvmlDeviceGetHandleByUUID, uuid)
    if handle is None:  # gone or lost: its health series say so
        return None
    rates = _answer(uuid, nvml.nvmlDeviceGetUtilizationRates, handle)
    memory = _answer(uuid, nvml.nvmlDeviceGetMemoryInfo, handle)
    return Reading(
        rates.gpu / 100 if rates is not None else None,
        int(memory.used) if memory is not None else None,
        int(memory.total) if memory is not None else None,
    )


def _answer(uuid: str, fn: Callable[..., Any], *args: Any) -> Any:
    """NVML's answer, or None: not supported (a MIG device's utilisation) or failing. Logged at
    debug only: this runs on every scrape, and a GPU's failures show in its health series."""
    try:
        return fn(*args)
    except NvmlError as e:
        log.debug("per-claim GPU metrics: %s: %s failed: %s", uuid, fn.__name__, e)
        return None
