"""Binding conditions: a device made ready before the scheduler binds its pod, so that a failure
sends the pod elsewhere instead of leaving it in ContainerCreating.

A dynamic-MIG partition is made with NVML, which can fail (an NVML error, a GPU fragmented by
hand, a GPU fallen off the bus); a NIC's link can go down between allocation and start. Made at
NodePrepareResources, after the pod is bound, such a failure only makes the kubelet retry while
the pod waits on a node that cannot run it. Kubernetes 1.36+ (KEP-5007, gates
DRADeviceBindingConditions and DRAResourceClaimDeviceStatus, beta and on) lets a device say in its
slice `bindsToNode: true`, `bindingConditions` and `bindingFailureConditions`; the scheduler copies
them into the allocation result and waits in PreBind (polling its claim cache every 5 s, up to
its bindingTimeout, 10 minutes by default) until each binding condition is True in the device's
`status.devices[]` entry. A True failure condition or the timeout makes it deallocate the claim
and schedule the pod again.

The node's part: `PreBinder.want` is told the claims of each pod the scheduler nominates to this
node (`driver.claims.binding_pods`). For a claim allocated here whose results carry binding
conditions, it makes the partitions (`MigPartitions.ensure`, the same noted, crash-safe path
prepare uses, so prepare later finds them made and adopts them) and checks the NICs, then applies
the ready conditions; on failure it destroys what it made, applies the failure conditions, sends
an Event and taints the failed GPU or NIC for `cooldown` seconds, so that the scheduler's next
try picks another. Its entries are applied under a field manager of their own, so prepare's
Ready entries (another manager) neither remove nor are removed by them.

A partition made here belongs to a claim no record names until prepare: the MIG note alone says
it is Tandem's (`driver.claims.gpu.mig_owners`). While the claim waits, `PreBinder` follows it; a
claim deleted, replaced or deallocated (the pod deleted, a failure elsewhere in the pod) has its
partitions destroyed. A kill -9 at any step leaves the note: start-up destroys partitions noted
for claims without a record (`MigPartitions.collect`), and the claim, still nominated, is made
ready again by the new instance.

A partition is kept only while the claim's allocation names it, by device identity (the GPU and
placement its device name stands for), checked at every read of the claim and before a partition
is made for it: a standalone claim deallocated and allocated another partition between two reads
(its pod deleted before binding, and named again at once) loses the partition it no longer
holds, which the scheduler already counts free. Kept, that partition made the next claim
allocated there fail and taint the whole GPU, and a tenant could repeat it.

One worker serves every tenant of the node: which claim it reads next, and for how long, is
`driver.claims.binding_queue` (turns by namespace, a cap of claims read per namespace, a deadline
for claims that stay unallocated). Which devices carry binding conditions, and what the claim's
status says of them, are pure and live in `driver.claims.binding_conditions`; this module is the
worker.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Protocol

from driver.claims.allocation import ClaimLocks, ClaimRef, PrepareSettings
from driver.claims.binding_conditions import ConditionTypes, binding_results, decided, status_entries
from driver.claims.binding_queue import WantedClaims, next_turn
from driver.claims.checkpoint import Checkpoint
from driver.claims.gpu.mig import MigError, MigPartitions
from driver.errors import ApiServerError, DeviceError
from driver.kube.api import NotFound
from driver.kube.types import AllocatedDeviceStatus, DeviceRequestAllocationResult, ResourceClaim
from driver.logs import log_context
from driver.model import BINDING_FAILURE_REASONS, Condition, Device, Health, MigPlacement, TaintEffect

log = logging.getLogger(__name__)

SOURCE = "binding"  # the inventory's health source for the failure taints
RECHECK_PERIOD = 2.0  # seconds between reads of a claim made ready and not yet prepared


class NotReady(DeviceError):
    """A device cannot be made ready for its pod: gone, unhealthy, or its link down."""


class BindingAPI(Protocol):
    """What the binding worker needs of the API server (`driver.kube.api.KubeAPI`)."""

    def get_claim(self, namespace: str, name: str) -> ResourceClaim: ...

    def apply_claim_status(
        self, namespace: str, name: str, devices: list[AllocatedDeviceStatus], field_manager: str, *, uid: str
    ) -> None:
        """`uid` is required: with it the server refuses to write to a claim that was deleted and
        recreated under the same name, so a late call about the old claim cannot touch the new one."""


@dataclass
class _Made:
    """A claim made ready here that no prepare has recorded yet."""

    ref: ClaimRef
    next_check: float = 0.0


class PreBinder:
    """One worker thread. `want` may be called from any thread."""

    def __init__(
        self,
        api: BindingAPI,
        settings: PrepareSettings,
        checkpoint: Checkpoint,
        partitions: MigPartitions,
        locks: ClaimLocks,
        lookup: Callable[[str], Device | None],
        devices: Callable[[], list[Device]],
        taint: Callable[[str, Sequence[Condition]], object],
        report: Callable[[ClaimRef, str], None],
        nic_fault: Callable[[str], str | None] = lambda _name: None,
        on_ready: Callable[[float], None] = lambda _seconds: None,
        on_failure: Callable[[str], None] = lambda _reason: None,
        cooldown: float = 300.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._api = api
        self._s = settings
        self._types = ConditionTypes.of(settings.driver_name)
        self._manager = f"{settings.driver_name}/binding"
        self._checkpoint = checkpoint
        self._partitions = partitions
        self._locks = locks
        self._lookup = lookup
        self._devices = devices
        self._taint = taint
        self._report = report
        self._nic_fault = nic_fault  # `NicHealthMonitor.fault_now`: the link as read now
        self._cooldown = cooldown
        self._clock = clock
        self._cond = threading.Condition()
        self._wanted = WantedClaims()
        self._made: dict[str, _Made] = {}
        self._served = ""  # the namespace served last (`binding_queue.next_turn`)
        self._tainted: dict[str, float] = {}  # device name -> when its failure taint goes
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._on_ready = on_ready  # metrics: seconds from the claim seen allocated to its conditions set
        self._on_failure = on_failure  # metrics: a failure, by reason

    def want(self, namespace: str, names: Sequence[str]) -> None:
        """Claims of a pod nominated to this node: each is read until it is allocated here (or not)."""
        with self._cond:
            self._wanted.add(namespace, names)
            self._cond.notify()

    def waiting(self) -> list[dict[str, str]]:
        """What `tandemctl` shows: the claims read for an allocation, and those made ready that
        no prepare has recorded yet (the pod not bound or not started)."""
        with self._cond:
            out = [
                {"claim": f"{ns}/{n}", "state": "waiting for allocation" if read else "queued behind its namespace"}
                for ns, n, read in self._wanted.listing()
            ]
            out += [
                {"claim": f"{m.ref.namespace}/{m.ref.name}", "uid": uid, "state": "ready, waiting for bind"}
                for uid, m in sorted(self._made.items())
            ]
        return out

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="binding", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout=10)

    # -- the worker ------------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                if self._stopping:
                    return
                self._cond.wait(timeout=self._next_wake())
            while not self._stopping and self.step():
                pass
            self._expire_taints()

    def _next_wake(self) -> float | None:
        times = [m.next_check for m in self._made.values()] + list(self._tainted.values())
        wanted = self._wanted.next_time()
        times += [wanted] if wanted is not None else []
        return max(0.0, min(times) - self._clock()) if times else None

    def step(self) -> bool:
        """One read of one claim due now, of the namespace whose turn it is (`binding_queue`):
        a wanted claim's look or a made-ready claim's recheck, whichever of that namespace's is
        due first. Whether any was due. The worker thread calls it; a test drives it directly."""
        with self._cond:
            now = self._clock()
            due: dict[str, tuple[float, Callable[[], None]]] = {
                ns: (when, partial(self._step, ns, name)) for ns, (when, name) in self._wanted.due(now).items()
            }
            for uid, made in self._made.items():
                ns = made.ref.namespace
                if made.next_check <= now and (ns not in due or made.next_check < due[ns][0]):
                    due[ns] = (made.next_check, partial(self._recheck, uid))
            if not due:
                return False
            self._served = next_turn(due, self._served)
            work = due[self._served][1]
        work()
        return True

    def _step(self, namespace: str, name: str) -> None:
        """One look at a wanted claim; guarded so that one claim's surprise never stops the worker."""
        with log_context(op="binding", claim_namespace=namespace, claim_name=name):
            try:
                finished = self._look(namespace, name)
            except ApiServerError as e:
                log.warning("binding conditions of claim %s/%s: %s; read again", namespace, name, e)
                finished = False
            except Exception:
                log.exception("binding conditions of claim %s/%s", namespace, name)
                finished = True
        with self._cond:
            self._wanted.looked(namespace, name, finished, self._clock())

    def _look(self, namespace: str, name: str) -> bool:
        """Whether the claim needs no more looks: made ready, failed, prepared, gone, or not ours."""
        try:
            claim = self._api.get_claim(namespace, name)
        except NotFound:
            return True
        uid = str((claim.get("metadata") or {}).get("uid", ""))
        allocation = (claim.get("status") or {}).get("allocation")
        if not allocation:
            return False  # the scheduler writes it in PreBind, after nominating the pod
        results = binding_results(claim, self._s)
        if not results or uid in self._checkpoint.read():
            return True
        ref = ClaimRef(namespace, name, uid)
        state = decided(claim, results, self._s)
        if state == "failed":
            return True
        started = self._clock()
        with self._locks.hold(uid):
            if uid in self._checkpoint.read():  # the kubelet prepared it meanwhile
                return True
            try:
                self._drop_unnamed(uid, results)  # first: a new partition may overlap one no longer named
                for r in results:
                    self._make_ready(uid, r)
            except (MigError, NotReady) as e:
                self._fail(ref, claim, results, e)
                return True
            with self._cond:  # followed from now on: a claim gone before the apply lands loses its partitions
                self._made[uid] = _Made(ref, self._clock() + RECHECK_PERIOD)
            if state != "ready":
                self._api.apply_claim_status(
                    namespace,
                    name,
                    status_entries(results, ready=True, reason="Ready", message="", pool=self._s.pool),
                    self._manager,
                    uid=uid,
                )
                log.info("binding conditions of claim %s/%s are True", namespace, name)
                self._on_ready(self._clock() - started)
        return True

    def _make_ready(self, uid: str, result: DeviceRequestAllocationResult) -> None:
        device = self._lookup(result["device"])
        if device is None:
            raise NotReady(f"device {result['device']!r} is not (or no longer) present on this node")
        if device.gpu is not None and device.gpu.placement is not None:
            self._partitions.ensure(device.gpu.placement, uid, adopt=False)
        elif device.nic is not None:
            fault = self._nic_fault(device.name) or (device.health_message if device.health == Health.UNHEALTHY else "")
            if not device.nic.present or fault:
                raise NotReady(
                    f"NIC {device.name} ({device.nic.pci_address}) is not ready: {fault or 'not on the host'}"
                )

    def _fail(
        self, ref: ClaimRef, claim: ResourceClaim, results: Sequence[DeviceRequestAllocationResult], error: Exception
    ) -> None:
        """Destroy what was made, say why in the failure conditions and an Event, and taint the
        device for `cooldown` so that the scheduler's next try goes elsewhere."""
        message = str(error)
        log.warning("claim %s/%s cannot be made ready: %s", ref.namespace, ref.name, message)
        try:
            self._partitions.destroy(ref.uid)
        except MigError as e:
            log.error("%s; destroyed when the claim goes", e)
            with self._cond:
                self._made[ref.uid] = _Made(ref, self._clock() + RECHECK_PERIOD)
        reason = BINDING_FAILURE_REASONS[0] if isinstance(error, MigError) else BINDING_FAILURE_REASONS[1]
        self._on_failure(reason)
        self._taint_devices(results, reason, message)
        self._report(ref, message)
        self._api.apply_claim_status(
            ref.namespace,
            ref.name,
            status_entries(results, ready=False, reason=reason, message=message, pool=self._s.pool),
            self._manager,
            uid=ref.uid,
        )

    def _taint_devices(self, results: Sequence[DeviceRequestAllocationResult], reason: str, message: str) -> None:
        """The failed GPU's every published device (its partitions and the whole GPU), or the NIC."""
        failed = [d for d in (self._lookup(r["device"]) for r in results) if d is not None]
        gpus = {d.gpu.placement.parent_uuid for d in failed if d.gpu is not None and d.gpu.placement is not None}
        names = {d.name for d in failed if d.nic is not None}
        for d in self._devices():
            if d.gpu is not None and (d.gpu.uuid in gpus or (d.gpu.placement and d.gpu.placement.parent_uuid in gpus)):
                names.add(d.name)
        key = self._types.partition_failed if gpus else self._types.nic_failed
        cond = Condition(
            key, TaintEffect.NO_SCHEDULE, reason, f"{message} (for {self._cooldown:.0f} s)", unhealthy=False
        )
        until = self._clock() + self._cooldown
        for name in sorted(names):
            self._taint(name, [cond])
            with self._cond:
                self._tainted[name] = until

    def _expire_taints(self) -> None:
        now = self._clock()
        with self._cond:
            due = [name for name, until in self._tainted.items() if until <= now]
            for name in due:
                del self._tainted[name]
        for name in due:
            self._taint(name, [])

    def _recheck(self, uid: str) -> None:
        """A claim made ready and not yet prepared: destroy its partitions once it is gone,
        replaced or deallocated (its pod deleted before binding, or its binding failed elsewhere),
        and those its allocation no longer names once it is allocated again."""
        with self._cond:
            made = self._made.get(uid)
        if made is None:
            return
        ref = made.ref
        done = uid in self._checkpoint.read()
        if not done:
            results: list[DeviceRequestAllocationResult] | None = None  # not known: nothing is destroyed
            try:
                claim = self._api.get_claim(ref.namespace, ref.name)
                same = (claim.get("metadata") or {}).get("uid") == uid
                results = binding_results(claim, self._s) if same else []
            except NotFound:
                results = []
            except ApiServerError as e:
                log.warning("claim %s/%s: %s; read again", ref.namespace, ref.name, e)
            done = results is not None and self._settle(ref, results)
        with self._cond:
            if done:
                self._made.pop(uid, None)
            else:
                made.next_check = self._clock() + RECHECK_PERIOD

    def _settle(self, ref: ClaimRef, results: Sequence[DeviceRequestAllocationResult]) -> bool:
        """Under the claim's lock, what the claim's partitions become now that its allocation reads
        `results` (none: gone, replaced or deallocated); whether the claim needs no more rechecks.
        A claim the kubelet prepared meanwhile is prepare's."""
        with self._locks.hold(ref.uid):
            if ref.uid in self._checkpoint.read():
                return True
            try:
                if results:
                    self._drop_unnamed(ref.uid, results)
                    return False
                log.info("claim %s/%s went before its pod started: destroying its partitions", ref.namespace, ref.name)
                self._partitions.destroy(ref.uid)
            except MigError as e:
                log.error("%s; tried again", e)
                return False
            return True

    def _drop_unnamed(self, uid: str, results: Sequence[DeviceRequestAllocationResult]) -> None:
        """Destroy the partitions made for claim `uid` that its allocation (`results`) no longer
        names, by GPU and placement: it was deallocated and allocated again between two reads,
        and the scheduler counts the old ones free. The claim's lock is held. Nothing goes while a
        device the allocation names is missing from the inventory (a rediscovery in flight): what
        it stands for is unknown, so no partition is taken for unnamed."""
        named: set[MigPlacement] = set()
        for r in results:
            device = self._lookup(r["device"])
            if device is None:
                return
            if device.gpu is not None and device.gpu.placement is not None:
                named.add(device.gpu.placement)
        self._partitions.destroy(uid, keep=named)
