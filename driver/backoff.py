"""Exponential backoff with jitter, shared by every retry loop (discovery, slice publishing).

Jitter keeps a fleet of nodes that lost the API server at the same moment from retrying in
lock-step when it comes back.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Backoff:
    initial: float = 1.0
    maximum: float = 60.0
    factor: float = 2.0
    jitter: float = 0.2  # +/- this fraction of the delay

    def base_delay(self, attempt: int) -> float:
        """Delay before retry number `attempt` (0-based), without jitter."""
        return min(self.initial * self.factor ** min(attempt, 64), self.maximum)

    def delay(self, attempt: int) -> float:
        return self.base_delay(attempt) * (1 + random.uniform(-self.jitter, self.jitter))
