"""Counters read over a window, and verdicts that need time to begin and to end.

Grey failures are told apart from noise by time, not by a single reading: a correctable-error
burst is one rising read, a sick link rises read after read; a GPU boosting lowers its clocks
for a moment, a GPU held down by its power brake stays down. Both classes here are pure (time
comes in as arguments), so every rule is tested with numbers and replayed over a simulated day.
"""

from __future__ import annotations

import collections
import itertools
from dataclasses import dataclass

from driver.health.faults import Fault


@dataclass(frozen=True)
class Increase:
    """What a counter did within its window: by how much it rose, in how many of the reads, over how
    many seconds of reads (shorter than the window until the window has filled)."""

    total: int
    rising_reads: int
    seconds: float

    def per_second(self) -> float:
        return self.total / self.seconds if self.seconds > 0 else 0.0


class CounterWindow:
    """The reads of one counter within the last `window` seconds, and the read before them.

    A value lower than the last is a reset (the counter was recreated, cleared, or wrapped): it
    starts a new baseline and is never a negative or a huge increase. A value at `saturation`
    (IBTA error counters stop at all ones) can no longer rise, so a link that keeps failing looks
    quiet there: `saturated` says so, for the message and the log.
    """

    def __init__(self, window: float, saturation: int | None = None) -> None:
        self.window = window
        self.saturation = saturation
        self._reads: collections.deque[tuple[float, int]] = collections.deque()

    def add(self, value: int, now: float) -> Increase:
        if self._reads and value < self._reads[-1][1]:
            self._reads.clear()
        self._reads.append((now, value))
        while len(self._reads) > 2 and self._reads[1][0] <= now - self.window:
            self._reads.popleft()  # the oldest kept read is the baseline at or before the window
        return self.increase()

    def increase(self) -> Increase:
        reads = list(self._reads)
        rising = sum(1 for (_, a), (_, b) in itertools.pairwise(reads) if b > a)
        if len(reads) < 2:
            return Increase(0, 0, 0.0)
        return Increase(reads[-1][1] - reads[0][1], rising, reads[-1][0] - reads[0][0])

    @property
    def saturated(self) -> bool:
        return bool(self._reads) and self.saturation is not None and self._reads[-1][1] >= self.saturation


class Latch:
    """A verdict that begins once its fault has been seen for `hold` seconds without a good read
    between, and ends once the signal has read good for `recovery` seconds.

    A read that cannot tell is not observed at all and changes neither clock: a GPU gone idle says
    nothing about its link speed. The reported fault keeps its first words while its taint value
    stays the same, so a rate that moves every read does not rewrite the slice every read.
    """

    def __init__(self, hold: float, recovery: float) -> None:
        self.hold = hold
        self.recovery = recovery
        self.reported: Fault | None = None
        self.since_wall = 0.0  # wall time the reported fault began to be seen
        self._bad_since: float | None = None
        self._good_since: float | None = None

    def observe(self, fault: Fault | None, now: float, wall: float) -> bool:
        """Records one read; True when the reported fault changed."""
        if fault is None:
            self._bad_since = None
            if self.reported is None:
                return False
            if self._good_since is None:
                self._good_since = now
            if now - self._good_since < self.recovery:
                return False
            self.reported, self._good_since = None, None
            return True
        self._good_since = None
        if self._bad_since is None:
            self._bad_since = now
        if self.reported is not None and self.reported.value == fault.value:
            return False
        if self.reported is None and now - self._bad_since < self.hold:
            return False
        if self.reported is None:
            self.since_wall = wall - (now - self._bad_since)
        self.reported = fault
        return True

    def restore(self, fault: Fault, since_wall: float) -> None:
        """Reports `fault` again, as a daemon that restarted had reported it: it stays until the
        signal reads well for `recovery`, as if the restart had not happened."""
        self.reported, self.since_wall = fault, since_wall
        self._bad_since = self._good_since = None
