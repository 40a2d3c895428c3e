"""GPU health from NVML: events (XIDs, ECC) and a periodic probe, as inventory conditions.

One thread, named "gpu-health", does everything, so the monitor's state needs no lock:

    loop: [probe when due or asked] -> reset evidence (`resets`), quiet periods -> wait for an event

* The wait has a timeout (`wait_timeout_ms`), so `stop()` takes effect within it and a burst of
  events is drained one per wait without loss (NVML queues them; NVIDIA's one-slot channel lost some).
* The probe (every `probe_period`, on `trigger_probe()`, after an event it cannot place, and when
  the inventory's set of GPUs changes) asks every GPU in the inventory whether it answers, reads
  its ECC counters and row-remapping state, and registers events on GPUs that are new or answer
  again. Its findings are HARD conditions: stated afresh each probe, so they clear by themselves.
* The monitor holds its own `nvmlInit` (NVML reference-counts it, so discovery's init/shutdown
  pairs do not disturb it). While NVML is unavailable it retries with backoff, GPUs `unmonitored`.
* When an SRE releases NVML (`tandemctl release` of a GPU or all: nvmlInit opens every GPU) the
  session is closed at once and none is opened until the reacquire; the last verdicts stand.

ECC: the volatile counters are the truth, events are a prompt. An ECC event is applied to the
devices it names at once (MIG attribution) and remembered, so the probe's counter delta adds only
errors no event reported (e.g. a lost event), to all devices of the GPU (`memory`).

What the observations mean is `policy`; the NVML event set and registration `nvml_events`;
what the probe reads of a GPU's memory `memory`; the conditions, kept by UUID, and their
publishing `conditions`; the counters `counters`. This is the thread that ties them to NVML.

Every NVML failure is logged and counted; nothing but `stop()` ends the thread. A stopped
monitor leaves its last conditions in the inventory: they describe the hardware as last seen.
Over 400 lines on purpose: the loop, the events and the probe share one NVML session and state
that only this thread touches, and split apart they would have to hand both across modules.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from driver.backoff import Backoff, Retry
from driver.health.gpu import nvml_events
from driver.health.gpu.conditions import GpuConditions
from driver.health.gpu.counters import GpuHealthCounters, SharedCounters
from driver.health.gpu.held import HeldResets
from driver.health.gpu.memory import CORRECTED, UNCORRECTED, EccLedger, memory_conditions
from driver.health.gpu.nvml_events import (
    DOUBLE_BIT,
    EVENT_NAMES,
    LOST_ERRORS,
    SINGLE_BIT,
    XID,
    NvmlGone,
    Session,
    handle_key,
)
from driver.health.gpu.policy import (
    NO_INSTANCE,
    GpuDevices,
    GpuHealthPolicy,
    RecoveryAction,
    event_subjects,
    event_targets,
    index_gpus,
)
from driver.health.gpu.recovery import read_recovery_action, recovery_conditions
from driver.health.gpu.resets import RESET_EVIDENCE, ResetEvidence
from driver.inventory.store import Inventory
from driver.model import Condition
from driver.node.nvml import (
    ERROR_TIMEOUT,
    NVML_ACCESS,
    REINIT_ERRORS,
    NvmlError,
    NvmlReleased,
    NvmlUnavailable,
    init_nvml,
)

log = logging.getLogger(__name__)

INIT_BACKOFF = Backoff(initial=1.0, maximum=60.0)  # between nvmlInit attempts while NVML is unavailable


class GpuHealthMonitor:
    def __init__(
        self,
        inventory: Inventory,
        policy: GpuHealthPolicy,
        *,
        driver_root: Path,
        source: str = "gpu-health",
        wait_timeout_ms: int = 1000,
        probe_period: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        init_backoff: Backoff = INIT_BACKOFF,
        evidence: ResetEvidence = RESET_EVIDENCE,
        held: HeldResets | None = None,  # where what waits for a reset outlives the daemon
    ) -> None:
        self.inventory = inventory
        self.policy = policy
        self.driver_root = driver_root
        self.source = source
        self.wait_timeout_ms = wait_timeout_ms
        self.probe_period = probe_period
        self.clock = clock
        self.init_backoff = init_backoff
        self.evidence = evidence
        self._conditions = GpuConditions(inventory, policy, source, held)
        self._ecc = EccLedger()
        self._counters = SharedCounters()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._probe_requested = threading.Event()
        self._known: frozenset[tuple[str, str]] = frozenset()  # the inventory's (device, instance) pairs
        self._probe_cond = threading.Condition()
        self._probe_seq = 0  # probes started
        self._probe_done = 0  # the sequence number of the last probe that finished
        self._thread: threading.Thread | None = None

    # --- public ----------------------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("the GPU health monitor was already started")
        self._conditions.restore(self.clock())  # before the thread: its first probe publishes them
        self.inventory.subscribe(self._inventory_changed)
        NVML_ACCESS.subscribe(self._wake.set)
        self.evidence.subscribe(self._wake.set)
        self._thread = threading.Thread(target=self._run, name="gpu-health", daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            NVML_ACCESS.unsubscribe(self._wake.set)
            self.evidence.unsubscribe(self._wake.set)
            self._thread.join(self.wait_timeout_ms / 1000 + 5 if timeout is None else timeout)

    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def trigger_probe(self, wait: float | None = None) -> bool:
        """Probe soon (within one event wait), e.g. after a rediscovery.

        With `wait`, block up to that many seconds for a probe that started after this call to
        finish (tandemctl, tests); returns whether one did. Without, returns at once (False).
        """
        with self._probe_cond:
            target = self._probe_seq + 1
        self._probe_requested.set()
        self._wake.set()
        if wait is None:
            return False
        with self._probe_cond:
            return self._probe_cond.wait_for(lambda: self._probe_done >= target, wait)

    def counters(self) -> GpuHealthCounters:
        return self._counters.snapshot()

    # --- the thread ------------------------------------------------------------------------------

    def _run(self) -> None:
        retry = Retry(self.init_backoff)
        while not self._stop.is_set():
            session = self._open(retry)
            if session is None:
                continue
            probes_before = self._counters.snapshot().probes
            try:
                self._loop(session)
            except NvmlGone as e:
                log.warning("NVML went away (%s); initialising it again", e)
                self._counters.count(errors=1)
                if self._counters.snapshot().probes > probes_before:  # a session that got somewhere
                    retry.reset()  # earns a fast retry
                self._stop.wait(retry.next())
            except Exception:  # a bug must not end health monitoring for good
                log.exception("GPU health monitor failed; starting over")
                self._counters.count(errors=1)
                self._stop.wait(retry.next())
            finally:
                nvml_events.close(session)

    def _open(self, retry: Retry) -> Session | None:
        """A new session, or None after waiting as long as NVML asks (backoff, or a reacquire)."""
        generation = NVML_ACCESS.generation()
        try:
            nvml = init_nvml(self.driver_root)
        except NvmlReleased as e:
            log.info("GPU health: %s; not monitoring until it is reacquired", e)
            while not self._stop.is_set() and not NVML_ACCESS.wait_for_change(generation, self.wait_timeout_ms / 1000):
                pass
            return None
        except NvmlUnavailable as e:
            self._nvml_unavailable(e.reason)
            self._stop.wait(retry.next())
            return None
        self._counters.count(nvml_inits=1)
        self._probe_requested.set()
        return Session(nvml, generation=generation)

    def _nvml_unavailable(self, reason: str) -> None:
        log.warning("GPU health: NVML unavailable (%s); retrying", reason)
        self._counters.count(errors=1)
        gpus = index_gpus(self.inventory.devices())
        for uuid in gpus:
            self._conditions.state.set_hard(uuid, [self.policy.unmonitored(reason)])
        self._conditions.publish(gpus)

    def _loop(self, s: Session) -> None:
        next_probe = self.clock()
        wait_error = Retry(Backoff(initial=0.05, maximum=max(self.wait_timeout_ms / 1000, 0.05)))
        while not self._stop.is_set():
            self._wake.clear()
            if NVML_ACCESS.generation() != s.generation:
                log.info("GPU health: NVML is released; closing the NVML session")
                return
            if self._probe_requested.is_set() or self.clock() >= next_probe:
                self._probe_requested.clear()
                self._probe(s)
                next_probe = self.clock() + self.probe_period
            reset = self._conditions.reset(self.evidence.take())
            if self._conditions.state.expire(self.clock()) or reset:
                self._conditions.publish()
            if self._stop.is_set():
                return
            if s.event_set is None or not s.registered:
                self._wake.wait(self.wait_timeout_ms / 1000)
                continue
            try:
                data = s.nvml.nvmlEventSetWait_v2(s.event_set, self.wait_timeout_ms)
            except NvmlError as e:
                if e.value == ERROR_TIMEOUT:
                    wait_error.reset()
                    continue
                if e.value in REINIT_ERRORS:
                    raise NvmlGone(str(e)) from e
                # GPU_IS_LOST: a GPU in the set is off the bus; the probe finds which and rebuilds.
                log.warning("waiting for NVML events failed: %s; probing the GPUs", e)
                self._counters.count(errors=1)
                self._probe_requested.set()
                self._wake.wait(wait_error.next())
                continue
            wait_error.reset()
            self._on_event(s, data)

    # --- events ----------------------------------------------------------------------------------

    def _on_event(self, s: Session, data: Any) -> None:
        etype, edata = int(data.eventType), int(data.eventData)
        gi, ci = int(getattr(data, "gpuInstanceId", NO_INSTANCE)), int(getattr(data, "computeInstanceId", NO_INSTANCE))
        name = EVENT_NAMES.get(etype, f"0x{etype:x}")
        self._counters.event(name, edata if etype == XID else None)
        uuid = s.handle_uuids.get(handle_key(data.device))
        if uuid is None:
            try:
                uuid = str(s.nvml.nvmlDeviceGetUUID(data.device))
            except NvmlError as e:
                log.warning("NVML event %s (data %d) from a GPU that cannot be named (%s); probing", name, edata, e)
                self._counters.count(errors=1)
                self._probe_requested.set()
                return
        gpus = index_gpus(self.inventory.devices())
        gpu = gpus.get(uuid)
        if gpu is None:
            log.warning("NVML event %s (data %d) from GPU %s, which publishes no devices", name, edata, uuid)
            return
        targets, subjects = event_targets(gpu, gi, ci), event_subjects(gpu, gi, ci)
        now = self.clock()
        changed = False
        if etype == XID:
            action = self._event_recovery_action(s, data.device)
            cond = self.policy.xid(edata, action)
            if RecoveryAction.known(action) not in (None, RecoveryAction.NONE):
                self._probe_requested.set()  # the probe states the action's own taint
            log.log(
                logging.INFO if self.policy.is_informational_xid(edata) else logging.WARNING,
                "XID %d on GPU %s -> %s: %s",
                edata,
                uuid,
                ", ".join(targets),
                cond.message,
            )
            changed = self._conditions.observe(subjects, cond, now, self.policy.needs_reset(edata, action))
        elif etype == DOUBLE_BIT:
            self._counters.count(double_bit_ecc=1)
            self._ecc.reported(uuid, UNCORRECTED)
            changed = self._conditions.observe(subjects, self.policy.double_bit_ecc(), now)
        elif etype == SINGLE_BIT:
            self._counters.count(single_bit_ecc=1)
            self._ecc.reported(uuid, CORRECTED)
            changed = self._conditions.single_bits(gpu, 1, now)
        if changed:
            self._conditions.publish(gpus)

    def _event_recovery_action(self, s: Session, handle: Any) -> int | None:
        """The GPU's recovery action right after an XID; None when it cannot be read (the XID then
        keeps its class, and the next probe reads the action again)."""
        try:
            return read_recovery_action(s.nvml, handle)
        except NvmlError as e:
            log.warning("cannot read the recovery action after an XID: %s", e)
            self._counters.count(errors=1)
            return None

    # --- the probe -------------------------------------------------------------------------------

    def _probe(self, s: Session) -> None:
        with self._probe_cond:
            self._probe_seq += 1
            seq = self._probe_seq
        try:
            self._probe_gpus(s)
            self._counters.count(probes=1)
        finally:
            with self._probe_cond:
                self._probe_done = seq
                self._probe_cond.notify_all()

    def _probe_gpus(self, s: Session) -> None:
        gpus = index_gpus(self.inventory.devices())
        self._known = _instances(gpus)
        self._conditions.forget_gone(gpus)
        self._ecc.keep_only(gpus)
        answering: dict[str, Any] = {}
        found: dict[str, list[Condition]] = {}
        for uuid, gpu in gpus.items():
            try:
                found[uuid], handle = self._probe_gpu(s, gpu)
            except NvmlError as e:
                if e.value in REINIT_ERRORS:
                    raise NvmlGone(str(e)) from e
                raise
            if handle is not None:
                answering[uuid] = handle
        nvml_events.register(s, answering, lambda: self._counters.count(errors=1))
        for uuid in gpus:
            conds = list(found[uuid])
            if uuid in s.unmonitored:
                conds.append(self.policy.unmonitored(s.unmonitored[uuid]))
            self._conditions.state.set_hard(uuid, conds)
            self._conditions.probed(gpus[uuid], found[uuid], uuid in answering)
        self._conditions.publish(gpus)

    def _probe_gpu(self, s: Session, gpu: GpuDevices) -> tuple[list[Condition], Any]:
        """The GPU's hard conditions now, and its handle if it answers."""
        nvml, uuid = s.nvml, gpu.uuid
        try:
            handle = nvml.nvmlDeviceGetHandleByUUID(uuid)
        except NvmlError as e:
            self._counters.count(errors=1)
            if e.value in LOST_ERRORS:
                return [self.policy.gpu_lost(f"nvmlDeviceGetHandleByUUID: {e}")], None
            if e.value in REINIT_ERRORS:
                raise
            return [self.policy.nvml_error(f"nvmlDeviceGetHandleByUUID: {e}")], None
        failures: list[str] = []
        conds: list[Condition] = []
        now = self.clock()
        try:
            for kind in (CORRECTED, UNCORRECTED):
                self._probe_ecc(s, gpu, handle, kind, now, failures)
            memory_conditions(nvml, handle, self.policy, conds, failures)
            recovery_conditions(nvml, handle, self.policy, conds, failures)
        except NvmlError as e:
            if e.value not in LOST_ERRORS:
                raise
            self._counters.count(errors=1)
            return [self.policy.gpu_lost(str(e))], None
        if failures:
            self._counters.count(errors=len(failures))
            conds.append(self.policy.nvml_error("; ".join(failures)))
        return conds, handle

    def _probe_ecc(self, s: Session, gpu: GpuDevices, handle: Any, kind: int, now: float, failures: list[str]) -> None:
        unreported = self._ecc.read(s.nvml, gpu.uuid, handle, kind, failures)
        if not unreported:
            return
        if kind == UNCORRECTED:
            self._counters.count(double_bit_ecc=unreported)
            log.warning("GPU %s: %d double-bit ECC error(s) without an event", gpu.uuid, unreported)
            self._conditions.observe([gpu.uuid], self.policy.double_bit_ecc(unreported), now)
        else:
            self._counters.count(single_bit_ecc=unreported)
            self._conditions.single_bits(gpu, unreported, now)

    # --- inventory -------------------------------------------------------------------------------

    def _inventory_changed(self) -> None:
        """Called by the inventory (any thread): a GPU came or went, so probe and (re)register; a
        device names another instance, so probe, which publishes what that one has."""
        if self._stop.is_set():
            return
        known = _instances(index_gpus(self.inventory.devices()))
        if known != self._known:
            self._known = known
            self.trigger_probe()


def _instances(gpus: dict[str, GpuDevices]) -> frozenset[tuple[str, str]]:
    """Every (device name, instance UUID) pair of the GPUs."""
    return frozenset(pair for gpu in gpus.values() for pair in gpu.instances.items())
