"""One binding worker serves every tenant of the node (issue 33, item 4): a namespace holding many
claims that stay unallocated does not starve another namespace's claim, reads of one namespace's
claims are capped, and a claim that stays unallocated is given up after a deadline
(`driver.claims.binding_queue`).

The worker is driven step by step (`PreBinder.step`, one claim read a step) on an injected clock,
against a fake of its two API calls; the claims are NIC claims, so nothing but the reads costs."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

from test_binding_worker import SETTINGS, NoPartitions

from driver.claims.allocation import ClaimLocks
from driver.claims.binding import RECHECK_PERIOD, PreBinder
from driver.claims.binding_queue import IN_FLIGHT, LOOK_PERIODS, WANT_FOR
from driver.claims.checkpoint import Checkpoint
from driver.kube.api import NotFound
from driver.kube.types import AllocatedDeviceStatus, ResourceClaim
from driver.model import Device, DeviceKind, NicInfo

NIC = Device("nic-0", DeviceKind.NIC, nic=NicInfo("0000:04:00.0", "eth0", "mlx5_0"))
GREEDY = 40  # claims of the namespace that floods the worker; more than IN_FLIGHT


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class FakeAPI:
    """`BindingAPI`: claims by namespace and name, allocated to the NIC or not yet; every read and
    every applied status is kept."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.claims: dict[tuple[str, str], ResourceClaim] = {}
        self.reads: list[tuple[float, str, str]] = []  # (when, namespace, name)
        self.applied: list[tuple[str, str]] = []

    def add(self, namespace: str, name: str, allocated: bool) -> None:
        doc: dict[str, Any] = {"metadata": {"namespace": namespace, "name": name, "uid": str(uuid.uuid4())}}
        if allocated:
            result = {
                "request": "nic",
                "driver": "x.dev",
                "pool": "node-a",
                "device": "nic-0",
                "bindingConditions": ["x.dev/nic-ready"],
                "bindingFailureConditions": ["x.dev/nic-failed"],
            }
            doc["status"] = {"allocation": {"devices": {"results": [result]}}}
        self.claims[(namespace, name)] = doc  # type: ignore[assignment]

    def get_claim(self, namespace: str, name: str) -> ResourceClaim:
        self.reads.append((self.clock(), namespace, name))
        if (namespace, name) not in self.claims:
            raise NotFound(f"claim {namespace}/{name} not found", 404)
        return self.claims[(namespace, name)]

    def apply_claim_status(
        self, namespace: str, name: str, devices: list[AllocatedDeviceStatus], field_manager: str, *, uid: str
    ) -> None:
        self.applied.append((namespace, name))


def binder(tmp_path: Path, api: FakeAPI, clock: Clock) -> PreBinder:
    return PreBinder(
        api,
        SETTINGS,
        Checkpoint(tmp_path, "boot-1"),
        NoPartitions(),  # type: ignore[arg-type]
        ClaimLocks(),
        lookup=lambda name: NIC if name == NIC.name else None,
        devices=lambda: [NIC],
        taint=lambda name, conds: None,
        report=lambda ref, error: None,
        clock=clock,
    )


def flooded(tmp_path: Path) -> tuple[FakeAPI, Clock, PreBinder]:
    """The namespace `greedy` has named GREEDY claims that stay unallocated."""
    clock = Clock()
    api = FakeAPI(clock)
    worker = binder(tmp_path, api, clock)
    names = [f"c{i}" for i in range(GREEDY)]
    for name in names:
        api.add("greedy", name, allocated=False)
    worker.want("greedy", names)
    return api, clock, worker


def steps_until_ready(api: FakeAPI, worker: PreBinder, claim: tuple[str, str]) -> int:
    steps = 0
    while claim not in api.applied:
        assert worker.step(), f"nothing due, and {claim} not made ready"
        steps += 1
    return steps


def test_another_namespaces_claim_is_made_ready_within_one_turn_of_a_flooding_namespace(tmp_path: Path) -> None:
    api, clock, worker = flooded(tmp_path)
    api.add("other", "mine", allocated=True)
    worker.want("other", ["mine"])
    assert steps_until_ready(api, worker, ("other", "mine")) <= 2  # at most one greedy read before it

    # Later, with every greedy claim due again and the first claim made ready (rechecked every
    # 2 s), a new claim of the other namespace still waits at most one greedy read.
    while worker.step():
        pass
    clock.now += RECHECK_PERIOD + max(LOOK_PERIODS)
    api.add("other", "second", allocated=True)
    worker.want("other", ["second"])
    assert steps_until_ready(api, worker, ("other", "second")) <= 3  # a greedy read, the recheck of "mine"


def test_a_namespace_has_at_most_its_cap_of_claims_read_and_each_is_given_up_after_the_deadline(
    tmp_path: Path,
) -> None:
    api, clock, worker = flooded(tmp_path)
    start = clock.now
    while clock.now < start + WANT_FOR + 2 * max(LOOK_PERIODS):
        while worker.step():
            pass
        clock.now += LOOK_PERIODS[0]
    first, second = {f"c{i}" for i in range(IN_FLIGHT)}, {f"c{i}" for i in range(IN_FLIGHT, 2 * IN_FLIGHT)}
    before = {name for when, _, name in api.reads if when < start + WANT_FOR - max(LOOK_PERIODS)}
    assert before == first  # the others wait their turn, unread
    assert all(when < start + WANT_FOR for when, _, name in api.reads if name in first)  # given up
    assert {name for when, _, name in api.reads if when >= start + WANT_FOR} == second  # the next ones' turn
    most = max(sum(1 for _, _, n in api.reads if n == name) for name in first)
    assert most <= len(LOOK_PERIODS) + WANT_FOR / max(LOOK_PERIODS)  # backoff: ~65 reads, not 1,200
    states = {w["claim"]: w["state"] for w in worker.waiting()}
    assert "greedy/c0" not in states
    assert states["greedy/c16"] == "waiting for allocation"
    assert states["greedy/c39"] == "queued behind its namespace"


def test_a_claim_that_is_done_makes_room_for_the_next_of_its_namespace(tmp_path: Path) -> None:
    api, clock, worker = flooded(tmp_path)
    while worker.step():
        pass
    del api.claims[("greedy", "c0")]  # its pod and claim deleted
    clock.now += LOOK_PERIODS[0]
    api.reads.clear()
    while worker.step():
        pass
    read = [name for _, _, name in api.reads]
    assert read.count("c0") == 1 and f"c{IN_FLIGHT}" in read and f"c{IN_FLIGHT + 1}" not in read
