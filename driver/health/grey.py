"""Grey failures: a device that is up but sick, judged like a dead one but fenced more gently.

What each kind of device is read for and what a reading means is `driver.health.gpu.grey` and
`driver.health.nic.grey`; the thread that reads them is `driver.health.grey_monitor`. This module
is what they share: the condition names, one device's memory of its signals (`GreyDevice`), and
the two kinds of rule every signal is one of.

* A **state** (a PCIe link below its capability, clocks held down, NVLink links down, a NIC
  slower than its peers) is reported once it has been seen for `hold` seconds at every read.
* A **rate** (errors per second) is reported at the first read where the counter rose faster
  than its limit over the reads within `window` AND rose in at least `rising_reads` of them: a
  burst rises in one read, a sick link in read after read.
* A **count** (flaps, link-integrity errors, exhausted retries, uncorrectable errors) is
  reported once the counter rose by at least its limit within `window`, however it came.

Either clears once it has read well for `recovery` seconds. A grey condition is NoSchedule by
default: the device still works, so the pods on it are told (a `DeviceUnhealthy` Event on their
claims, the kubelet's health stream) and left to decide, while new work goes elsewhere. The one
exception is what a tenant can cause (`DEFAULT_EFFECTS`). Hard faults keep their own effects.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from driver.health.faults import Fault
from driver.health.pcie_sysfs import AerCounts
from driver.health.thresholds import GreyThresholds
from driver.health.windows import CounterWindow, Increase, Latch
from driver.model import Condition, TaintEffect
from driver.resource_api import rfc3339

PCIE_DEGRADED = "pcie-degraded"
PCIE_ERRORS = "pcie-errors"
CLOCKS_SLOWDOWN = "clocks-slowdown"
NVLINK_DEGRADED = "nvlink-degraded"
LINK_FLAPPING = "link-flapping"
RDMA_ERRORS = "rdma-errors"
RDMA_TRANSPORT = "rdma-transport-errors"
LINK_SLOW = "link-slow"
NAMES = (
    PCIE_DEGRADED,
    PCIE_ERRORS,
    CLOCKS_SLOWDOWN,
    NVLINK_DEGRADED,
    LINK_FLAPPING,
    RDMA_ERRORS,
    RDMA_TRANSPORT,
    LINK_SLOW,
)
# Effects other than NoSchedule. A tenant's own traffic can raise the transport's loss counters
# (an unreachable peer times out, retries run out), and they count for the whole port: they are
# told (taint, Event, health stream) but never keep work away, or any tenant could fence a shared
# NIC. The physical link's counters, which no tenant can move, do.
DEFAULT_EFFECTS = {RDMA_TRANSPORT: TaintEffect.NONE}

NO_AER = AerCounts(None, None, None)  # a function or port without AER: nothing to count

# PCIe transfer rate per lane of each generation, GT/s.
GEN_SPEED = {1: 2.5, 2: 5.0, 3: 8.0, 4: 16.0, 5: 32.0, 6: 64.0}


def allowed_link_errors(speed_gts: float, lanes: int, ber: float) -> float:
    """The errors per second a healthy link may log at bit error ratio `ber`: DCGM's PCIe replay
    budget (bits per second over all lanes x ratio), rounded up to whole errors per minute."""
    return math.ceil(speed_gts * 1e9 * lanes * ber * 60) / 60


def total(*values: int | None) -> int | None:
    """The sum of counters read together; None when any of them could not be read."""
    return None if any(v is None for v in values) else sum(v for v in values if v is not None)


@dataclass(frozen=True, order=True)
class Kept:
    """One reported signal of a device, as kept across a restart (`driver.health.grey_kept`)."""

    condition: str
    signal: str
    state: bool  # a state (held before it is reported) or a rate
    value: str
    reason: str
    since: float  # wall time it began


class GreyDevice:
    """What the rules remember of one device: a window per counter, a latch per signal. A signal
    belongs to one condition (its `condition/signal` key), so one condition may have several."""

    def __init__(self, thresholds: GreyThresholds) -> None:
        self.t = thresholds
        self._windows: dict[str, CounterWindow] = {}
        self._latches: dict[tuple[str, str], Latch] = {}
        self.readings: dict[str, int] = {}  # the last value of every counter read, for metrics

    def counter(self, name: str, value: int | None, now: float, saturation: int | None = None) -> Increase | None:
        """Adds a read of counter `name`; its increase over the window, or None when unreadable."""
        if value is None:
            return None
        self.readings[name] = value
        window = self._windows.get(name)
        if window is None:
            window = self._windows[name] = CounterWindow(self.t.window, saturation)
        return window.add(value, now)

    def reported(self, condition: str, signal: str) -> bool:
        latch = self._latches.get((condition, signal))
        return latch is not None and latch.reported is not None

    def record(self, name: str, value: int) -> None:
        """A counter kept for metrics only, judged by no rule (congestion: a busy fabric, not a sick NIC)."""
        self.readings[name] = value

    def saturated(self, name: str) -> bool:
        window = self._windows.get(name)
        return window is not None and window.saturated

    def state(self, condition: str, signal: str, fault: Fault | None, now: float, wall: float) -> None:
        """A state read: reported after `hold`."""
        self._latch(condition, signal, self.t.hold).observe(fault, now, wall)

    def rate(self, condition: str, signal: str, fault: Fault | None, now: float, wall: float) -> None:
        """A rate read: the window is its hold, so it is reported at once."""
        self._latch(condition, signal, 0.0).observe(fault, now, wall)

    def rate_rule(
        self, condition: str, signal: str, inc: Increase | None, per_second: float, words: str, now: float, wall: float
    ) -> None:
        """A rate: more than `per_second` over the reads in the window, rising in at least
        `rising_reads` of them (a burst rises in one). An unread counter says nothing."""
        if inc is None:
            return
        bad = inc.per_second() > per_second and inc.rising_reads >= self.t.rising_reads
        fault = Fault(signal, f"{inc.total} {words} in {inc.seconds:.0f}s") if bad else None
        self.rate(condition, signal, fault, now, wall)

    def count_rule(
        self, condition: str, signal: str, inc: Increase | None, at_least: int, words: str, now: float, wall: float
    ) -> None:
        """A count: at least `at_least` within the window, however they came. An unread counter
        says nothing."""
        if inc is None:
            return
        fault = Fault(signal, f"{inc.total} {words} in {self.t.window:.0f}s") if inc.total >= at_least else None
        self.rate(condition, signal, fault, now, wall)

    def conditions(self, domain: str, effects: Mapping[str, TaintEffect]) -> frozenset[Condition]:
        """One condition per condition name with a reported signal: the first signal's taint value,
        every reported signal's words, since the earliest of them."""
        by_condition: dict[str, list[tuple[str, Latch]]] = {}
        for (condition, signal), latch in sorted(self._latches.items()):
            if latch.reported is not None:
                by_condition.setdefault(condition, []).append((signal, latch))
        out = []
        for condition, latches in by_condition.items():
            key = f"{domain}/{condition}"
            faults = [latch.reported for _, latch in latches if latch.reported is not None]
            since = min(latch.since_wall for _, latch in latches)
            message = "; ".join(f.reason for f in faults) + f" since {rfc3339(since)}"
            effect = effects.get(key, DEFAULT_EFFECTS.get(condition, TaintEffect.NO_SCHEDULE))
            out.append(Condition(key, effect, faults[0].value, message, unhealthy=True))
        return frozenset(out)

    def kept(self) -> list[Kept]:
        """What this device reports now, as a restart must find it again."""
        return [
            Kept(condition, signal, latch.hold > 0, latch.reported.value, latch.reported.reason, latch.since_wall)
            for (condition, signal), latch in sorted(self._latches.items())
            if latch.reported is not None
        ]

    def restore(self, kept: Kept) -> None:
        hold = self.t.hold if kept.state else 0.0
        self._latch(kept.condition, kept.signal, hold).restore(Fault(kept.value, kept.reason), kept.since)

    def _latch(self, condition: str, signal: str, hold: float) -> Latch:
        latch = self._latches.get((condition, signal))
        if latch is None:
            latch = self._latches[(condition, signal)] = Latch(hold, self.t.recovery)
        return latch


def judge_aer(dev: GreyDevice, aer: AerCounts, port: AerCounts, per_second: float, now: float, wall: float) -> None:
    """AER of a function and the port above it: correctable errors as a rate against the link's
    budget, uncorrectable (non-fatal and fatal) as a count. A port without AER adds nothing."""
    corrected = dev.counter("aer-correctable", total(aer.correctable, port.correctable or 0), now)
    words = f"correctable PCIe errors (at most {per_second * 60:.0f}/min allowed)"
    dev.rate_rule(PCIE_ERRORS, "aer-correctable", corrected, per_second, words, now, wall)
    uncorrectable = total(aer.nonfatal, aer.fatal, port.nonfatal or 0, port.fatal or 0)
    inc = dev.counter("aer-uncorrectable", uncorrectable, now)
    dev.count_rule(
        PCIE_ERRORS, "aer-uncorrectable", inc, dev.t.aer_uncorrectable, "uncorrectable PCIe errors", now, wall
    )
