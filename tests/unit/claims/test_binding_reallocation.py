"""A claim allocated again before the binding worker reads it keeps no partition it no longer holds
(issue 33, item 1). The attack: a tenant's standalone claim is made ready on one partition, its pod
deleted before it binds and named again at once; within the 2 s between two reads of the claim the
scheduler deallocates it and allocates it another partition. Kept, the first partition stayed in
NVML while the scheduler counted it free, and the next claim allocated there failed its binding and
tainted the whole GPU `partition-failed`.

The scheduler is `sim.scheduler` over the simulated API server, NVML the fake one of `mig_fakes`,
the partitions the real `MigPartitions`, and time an injected clock: the worker is driven step by
step (`PreBinder.step`), so the race lands exactly between two rechecks."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from mig_fakes import ONE_G, THREE_G, MigNode, mig_node_fixture  # noqa: F401  (fixture: node)
from prepare_fakes import DRIVER, NODE
from test_binding_fairness import Clock

from driver.claims.allocation import ClaimLocks, ClaimRef
from driver.claims.binding import RECHECK_PERIOD, PreBinder
from driver.claims.binding_conditions import with_binding_conditions
from driver.claims.checkpoint import Checkpoint
from driver.kube.api import KubeAPI
from driver.model import Condition
from driver.slices.build import build_slices
from sim.apierrors import ApiError
from sim.apiserver import SimApiServer
from sim.scheduler import Request, allocate, claim_object, deallocate

READY, FAILED = f"{DRIVER}/partition-ready", f"{DRIVER}/partition-failed"


class Cluster:
    """The node's dynamic-MIG GPU published with its binding conditions, the simulated scheduler,
    and the binding worker with the failure taints it set."""

    def __init__(self, node: MigNode, srv: SimApiServer, api: KubeAPI) -> None:
        self.node, self.srv, self.clock = node, srv, Clock()
        self.taints: dict[str, list[Condition]] = {}
        self.reports: list[str] = []
        (node.root / "data").mkdir()
        devices = with_binding_conditions(list(node.devices.values()), DRIVER, mig=True, nic=False)
        for body in build_slices(devices, DRIVER, NODE, "node-uid", 1):
            srv.create(body)
        self.binder = PreBinder(
            api,
            node.settings,
            Checkpoint(node.root / "data", "boot"),
            node.partitions("a"),
            ClaimLocks(),
            lookup=node.devices.get,
            devices=lambda: list(node.devices.values()),
            taint=self._taint,
            report=lambda ref, error: self.reports.append(f"{ref.name}: {error}"),
            clock=self.clock,
        )

    def _taint(self, name: str, conditions: list[Condition]) -> None:
        if conditions:
            self.taints[name] = list(conditions)
        else:
            self.taints.pop(name, None)

    def allocate(self, name: str, device: str) -> ClaimRef:
        """Claim `name` (made if new, keeping its UID if not) allocated `device`, its pod nominated
        here: the worker is told, as the nominated-pods watch tells it."""
        try:
            claim = self.srv.get("resourceclaims", name, "default")
        except ApiError:
            claim = self.srv.create(claim_object("default", name, [self.request(device)]))
        allocate(self.srv, claim, DRIVER, NODE, [self.request(device)])
        self.binder.want("default", [name])
        return ClaimRef("default", name, claim["metadata"]["uid"])

    @staticmethod
    def request(device: str) -> Request:
        return Request("mig", "mig.tandem.dev", lambda d: d["name"] == device)

    def work(self) -> None:
        """Every step due now."""
        while self.binder.step():
            pass

    def conditions(self, ref: ClaimRef) -> dict[str, str]:
        claim: dict[str, Any] = self.srv.get("resourceclaims", ref.name, ref.namespace)
        entries = (claim.get("status") or {}).get("devices") or []
        return {c["type"]: c["status"] for e in entries for c in e.get("conditions") or []}

    def owners(self) -> dict[str, list[str]]:
        """Claim UID -> the device names of the partitions the note gives it."""
        by_placement = {d.gpu.placement: d.name for d in self.node.devices.values() if d.gpu and d.gpu.placement}
        out: dict[str, list[str]] = {}
        for placement, made in self.node.noted().items():
            out.setdefault(made.claim, []).append(by_placement[placement])
        return out


@pytest.fixture
def cluster(node: MigNode, tmp_path: Path) -> Iterator[Cluster]:
    with SimApiServer() as srv:
        api = KubeAPI(str(srv.write_kubeconfig(tmp_path / "kubeconfig")))
        try:
            yield Cluster(node, srv, api)
        finally:
            api.close()


def test_a_claim_allocated_another_partition_between_two_rechecks_keeps_only_the_new_one(cluster: Cluster) -> None:
    tenant = cluster.allocate("tenant", ONE_G)
    cluster.work()
    assert cluster.conditions(tenant) == {READY: "True"}
    assert cluster.owners() == {tenant.uid: [ONE_G]}

    # The pod deleted before it binds, named again at once: deallocated and allocated elsewhere,
    # all before the worker's next recheck of the claim is due.
    deallocate(cluster.srv, cluster.srv.get("resourceclaims", "tenant", "default"))
    assert cluster.allocate("tenant", THREE_G) == tenant  # the same claim, the same UID
    cluster.clock.now += RECHECK_PERIOD / 2
    cluster.work()
    assert cluster.conditions(tenant) == {READY: "True"}
    assert cluster.owners() == {tenant.uid: [THREE_G]}  # the first partition went before the new one came
    assert [p for p, _, _ in cluster.node.instances()] == ["3g.40gb"]

    # The scheduler counts the first partition free: the next claim allocated there binds.
    other = cluster.allocate("other", ONE_G)
    cluster.work()
    cluster.clock.now += RECHECK_PERIOD
    cluster.work()  # the rechecks of both claims
    assert cluster.conditions(other) == {READY: "True"}
    assert cluster.owners() == {tenant.uid: [THREE_G], other.uid: [ONE_G]}  # one GPU instance per claim
    assert sorted(p for p, _, _ in cluster.node.instances()) == ["1g.10gb", "3g.40gb"]
    assert cluster.taints == {} and cluster.reports == []
    assert FAILED not in cluster.conditions(tenant) | cluster.conditions(other)


def test_a_recheck_drops_a_partition_the_allocation_no_longer_names(cluster: Cluster) -> None:
    """The race as a recheck meets it: deallocated and allocated again, the new allocation not
    yet looked at (its pod's nomination not yet seen); the recheck alone gives the old one back."""
    tenant = cluster.allocate("tenant", ONE_G)
    cluster.work()
    deallocate(cluster.srv, cluster.srv.get("resourceclaims", "tenant", "default"))
    claim = cluster.srv.get("resourceclaims", "tenant", "default")
    allocate(cluster.srv, claim, DRIVER, NODE, [cluster.request(THREE_G)])
    cluster.clock.now += RECHECK_PERIOD
    cluster.work()
    assert cluster.owners() == {} and cluster.node.instances() == []
    assert cluster.binder.waiting() == [
        {"claim": "default/tenant", "uid": tenant.uid, "state": "ready, waiting for bind"}
    ]  # still followed: its new allocation is made ready when its pod's nomination is seen
