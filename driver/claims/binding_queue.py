"""Which claim the binding worker reads next, so that one tenant's claims cannot starve another's.

The binding worker (`driver.claims.binding.PreBinder`) is one thread for the whole node, and each
of its reads is a GET of one claim; a partition it makes holds the node's MIG lock. Served in the
order claims were named, a tenant (a namespace: the unit the API server authorizes) whose pods
the scheduler nominates in numbers, with claims that never get allocated here, put every other
tenant's claim behind all of its own, each read again for 15 minutes. Three bounds instead:

* **Turns by namespace.** Each step of the worker serves one claim of the next namespace, in
  name order after the one served last, that has a claim due (`next_turn`); within it, the claim
  due first. So a claim that is due is served within as many steps as namespaces have work due,
  however many claims each holds. Pure round-robin rather than weights: every tenant pays the
  same for a read, and the node cannot know which tenant matters more.
* **A cap of claims read per namespace** (`IN_FLIGHT`). A namespace's claims past the first
  `IN_FLIGHT` it named wait, unread, until one of those is done: the reads a namespace costs the
  API server and the worker are bounded by the cap, not by how many pods it has nominated. The
  waiting ones are kept (their pods are still nominated, the scheduler still waits for them)
  and read in the order named; their number is bounded by the pods the scheduler nominates to
  this node, which no tenant can write.
* **A deadline for a claim that stays unallocated** (`WANT_FOR`, counted from its first read):
  the scheduler writes the allocation in PreBind, seconds after it nominates the pod; 5 minutes
  leave room for a nomination that waits on preempted pods' graceful termination, and a claim
  still unallocated then frees its place. Its pod's next event (a new nomination) names it again.
  Reads back off per claim (`LOOK_PERIODS`), so one claim costs at most about 65 reads.

Reads stay one at a time: a GET is bounded by the API door's timeout, a slow or failing one is
retried on its own claim's backoff and never holds the claim's place in the turn, so the worst a
tenant can do is cost others one read's time per turn. Parallel reads would need more threads
and connections per node for a load that, bounded as above, one thread carries.

Pure: the worker holds its lock around every call and passes the time in.
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Iterator
from dataclasses import dataclass

LOOK_PERIODS = (0.25, 0.5, 1.0, 2.0, 5.0)  # a claim not yet allocated is read again after these
WANT_FOR = 300.0  # seconds a claim is read for an allocation, from its first read
IN_FLIGHT = 16  # claims of one namespace read at a time; the others wait their turn


def next_turn(due: Collection[str], last: str) -> str:
    """The namespace to serve now, of those with work `due`: the first in name order after `last`,
    the one served last, else the first (round-robin). `due` must not be empty."""
    ordered = sorted(due)
    return next((n for n in ordered if n > last), ordered[0])


@dataclass
class _Wanted:
    until: float | None = None  # set at the first read
    next_look: float = 0.0
    looks: int = 0


class WantedClaims:
    """The claims of nominated pods not yet read allocated, by namespace, in the order named."""

    def __init__(self) -> None:
        self._by_namespace: dict[str, dict[str, _Wanted]] = {}

    def add(self, namespace: str, names: Collection[str]) -> None:
        """Claims to read; one already here keeps its place, backoff and deadline."""
        claims = self._by_namespace.setdefault(namespace, {})
        for name in names:
            claims.setdefault(name, _Wanted())

    def _in_flight(self) -> Iterator[tuple[str, str, _Wanted]]:
        for namespace, claims in self._by_namespace.items():
            for name, wanted in itertools.islice(claims.items(), IN_FLIGHT):
                yield namespace, name, wanted

    def due(self, now: float) -> dict[str, tuple[float, str]]:
        """By namespace: (when, name) of its claim due first among those it may have read now."""
        out: dict[str, tuple[float, str]] = {}
        for namespace, name, wanted in self._in_flight():
            if wanted.next_look <= now and (namespace not in out or wanted.next_look < out[namespace][0]):
                out[namespace] = (wanted.next_look, name)
        return out

    def next_time(self) -> float | None:
        """When the next claim falls due, or None for none."""
        return min((w.next_look for _, _, w in self._in_flight()), default=None)

    def looked(self, namespace: str, name: str, finished: bool, now: float) -> None:
        """After a read: a claim `finished` (allocated and dealt with, gone, not ours), or whose
        next read would fall past its deadline, is dropped, and the next of its namespace may be
        read at once; another is read again after its backoff."""
        claims = self._by_namespace.get(namespace, {})
        wanted = claims.get(name)
        if wanted is None:
            return
        if wanted.until is None:
            wanted.until = now + WANT_FOR
        wanted.next_look = now + LOOK_PERIODS[min(wanted.looks, len(LOOK_PERIODS) - 1)]
        wanted.looks += 1
        if finished or wanted.next_look > wanted.until:
            del claims[name]
            if not claims:
                del self._by_namespace[namespace]

    def listing(self) -> list[tuple[str, str, bool]]:
        """(namespace, name, read now) of every claim, sorted: what `tandemctl` shows."""
        read = {(ns, n) for ns, n, _ in self._in_flight()}
        return sorted((ns, n, (ns, n) in read) for ns, claims in self._by_namespace.items() for n in claims)
