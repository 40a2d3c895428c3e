"""The GPU health monitor in-process against the fake pynvml, feeding a real Inventory that GPU
discovery filled from a rendered simulated node. Time for quiet periods is a fake clock; every
wait is a poll with a deadline."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from types import ModuleType

import pytest

from driver.backoff import Backoff
from driver.discovery.gpu.discover import GpuDiscovery
from driver.health.gpu.monitor import GpuHealthMonitor
from driver.health.gpu.policy import GpuHealthPolicy
from driver.health.gpu.resets import ResetEvidence
from driver.inventory.store import Inventory
from driver.model import Health, TaintEffect
from driver.node.nvml import NVML_ACCESS, NvmlDoor, NvmlError, NvmlReleased, NvmlUnavailable
from sim import nvml as sim_nvml
from sim.profile import NodeProfile, a100_mig_node, h100_node
from sim.sysfs import render_node

XID = 0x8  # nvmlEventTypeXidCriticalError
DBE = 0x2  # nvmlEventTypeDoubleBitEccError
SBE = 0x1  # nvmlEventTypeSingleBitEccError
NVML_ERROR_UNKNOWN = 999
DEADLINE = 10.0


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def wait_for(what: str, predicate: Callable[[], bool], timeout: float = DEADLINE) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.01)


@dataclass
class Node:
    tmp: Path
    nvml: ModuleType
    profile: NodeProfile
    inventory: Inventory
    clock: FakeClock
    monitor: GpuHealthMonitor | None = None

    @property
    def state(self) -> Path:
        return self.tmp / "nvml.json"

    def write(self) -> None:
        sim_nvml.write_state(self.profile, self.state)

    def discover(self) -> None:
        render_node(self.profile, self.tmp / "sys", self.tmp / "dev", self.tmp / "proc")
        self.write()
        devices = GpuDiscovery(self.tmp / "sys", proc_root=self.tmp / "proc").discover()
        self.inventory.replace("gpu", devices)

    def start(self, policy: GpuHealthPolicy | None = None, **kwargs: object) -> GpuHealthMonitor:
        self.monitor = GpuHealthMonitor(
            self.inventory,
            policy or GpuHealthPolicy(xid_quiet_period=60, ecc_quiet_period=60),
            driver_root=Path("/"),
            wait_timeout_ms=50,
            probe_period=3600,  # probes only when a test asks (the fake clock stands still)
            clock=self.clock,
            **kwargs,  # type: ignore[arg-type]
        )
        self.monitor.start()
        return self.monitor

    def ready(self) -> GpuHealthMonitor:
        assert self.monitor is not None
        wait_for("the first probe", lambda: self.monitor is not None and self.monitor.counters().probes >= 1)
        return self.monitor

    def probe(self) -> None:
        """Ask for a probe and wait until one has run from start to end after the request."""
        assert self.ready().trigger_probe(wait=DEADLINE), "no probe ran"

    def event(self, gpu: int, event_type: int, data: int = 0, **instance: int) -> None:
        sim_nvml.append_event(self.state, self.profile.gpus[gpu].uuid, event_type, data, **instance)

    def taints(self, device: str) -> set[tuple[str, str, TaintEffect]]:
        d = self.inventory.get(device)
        assert d is not None, device
        return {(t.key, t.value, t.effect) for t in d.taints}

    def health(self, device: str) -> Health:
        d = self.inventory.get(device)
        assert d is not None, device
        return d.health

    def names(self, gpu: int) -> list[str]:
        uuid = self.profile.gpus[gpu].uuid
        return [d.name for d in self.inventory.devices() if d.gpu and uuid in (d.gpu.uuid, d.gpu.parent_uuid)]


@pytest.fixture
def fake_nvml(tmp_path: Path) -> Iterator[ModuleType]:
    with sim_nvml.fake_pynvml_in_process(tmp_path / "nvml.json") as module:
        yield module


@pytest.fixture
def node(tmp_path: Path, fake_nvml: ModuleType) -> Iterator[Callable[[NodeProfile], Node]]:
    nodes: list[Node] = []

    def make(profile: NodeProfile) -> Node:
        n = Node(tmp_path, fake_nvml, profile, Inventory(), FakeClock())
        n.discover()
        nodes.append(n)
        return n

    yield make
    for n in nodes:
        if n.monitor is not None:
            n.monitor.stop()
            assert not n.monitor.running(), "the monitor thread did not stop"


def test_application_xid_is_informational(node: Callable[[NodeProfile], Node]) -> None:
    n = node(h100_node(gpus=2, nics=0))
    n.start()
    n.ready()
    n.event(0, XID, 13)
    wait_for("the xid taint", lambda: ("tandem.dev/xid", "13", TaintEffect.NONE) in n.taints("gpu-0"))
    assert n.health("gpu-0") is Health.HEALTHY
    assert n.taints("gpu-1") == set()
    assert n.ready().counters().xids == {13: 1}


def test_reset_xid_evicts_and_clears_after_the_quiet_period(node: Callable[[NodeProfile], Node]) -> None:
    n = node(h100_node(gpus=2, nics=0))
    n.start()
    n.ready()
    n.event(1, XID, 79)
    wait_for("the xid taint", lambda: ("tandem.dev/xid", "79", TaintEffect.NO_EXECUTE) in n.taints("gpu-1"))
    assert n.health("gpu-1") is Health.UNHEALTHY
    assert "fallen off the bus" in n.inventory.get("gpu-1").health_message  # type: ignore[union-attr]
    n.clock.advance(59)
    n.probe()  # the loop ran (and expired nothing) before the quiet period ended
    assert n.health("gpu-1") is Health.UNHEALTHY
    n.clock.advance(1)
    wait_for("recovery", lambda: n.taints("gpu-1") == set())
    assert n.health("gpu-1") is Health.HEALTHY


def test_other_xid_is_noschedule_and_overridable(node: Callable[[NodeProfile], Node]) -> None:
    n = node(h100_node(gpus=1, nics=0))
    n.start(GpuHealthPolicy(effects={"tandem.dev/xid": TaintEffect.NO_EXECUTE}))
    n.ready()
    n.event(0, XID, 94)
    wait_for("the xid taint", lambda: ("tandem.dev/xid", "94", TaintEffect.NO_EXECUTE) in n.taints("gpu-0"))


def test_double_bit_ecc_event(node: Callable[[NodeProfile], Node]) -> None:
    n = node(h100_node(gpus=2, nics=0))
    monitor = n.start()
    n.ready()
    n.event(0, DBE)
    wait_for("the ecc taint", lambda: ("tandem.dev/ecc", "double-bit", TaintEffect.NO_SCHEDULE) in n.taints("gpu-0"))
    assert n.health("gpu-0") is Health.UNHEALTHY
    n.probe()  # the counter went up by the same error: not counted twice
    assert monitor.counters().double_bit_ecc == 1
    assert monitor.counters().events == {"double_bit_ecc": 1}
    n.clock.advance(60)
    wait_for("recovery", lambda: n.taints("gpu-0") == set())


def test_double_bit_ecc_seen_only_by_the_counter(node: Callable[[NodeProfile], Node]) -> None:
    n = node(h100_node(gpus=1, nics=0))
    monitor = n.start()
    n.ready()
    n.profile.gpus[0].ecc_uncorrected_volatile = 2  # errors whose events never came
    n.write()
    n.probe()
    assert ("tandem.dev/ecc", "double-bit", TaintEffect.NO_SCHEDULE) in n.taints("gpu-0")
    assert monitor.counters().double_bit_ecc == 2


def test_single_bit_ecc_threshold(node: Callable[[NodeProfile], Node]) -> None:
    n = node(h100_node(gpus=1, nics=0))
    monitor = n.start(GpuHealthPolicy(single_bit_threshold=3, single_bit_window=60))
    n.ready()
    for _ in range(2):
        n.event(0, SBE)
    wait_for("two single-bit errors", lambda: monitor.counters().single_bit_ecc == 2)
    assert n.taints("gpu-0") == set()
    n.event(0, SBE)
    wait_for("the rate notice", lambda: ("tandem.dev/ecc", "single-bit", TaintEffect.NONE) in n.taints("gpu-0"))
    assert n.health("gpu-0") is Health.HEALTHY


def test_gpu_lost_taints_all_its_mig_devices_and_clears_when_it_answers(
    node: Callable[[NodeProfile], Node],
) -> None:
    n = node(a100_mig_node(gpus=2, per_gpu=3))
    n.start()
    n.ready()
    lost, other = n.names(0), n.names(1)
    assert len(lost) == 3 and len(other) == 3
    n.profile.gpus[0].lost = True
    n.write()
    n.probe()
    for name in lost:
        assert ("tandem.dev/gpu-lost", "", TaintEffect.NO_EXECUTE) in n.taints(name)
        assert n.health(name) is Health.UNHEALTHY
    for name in other:
        assert n.taints(name) == set()
    n.profile.gpus[0].lost = False
    n.write()
    n.probe()
    for name in lost:
        assert n.taints(name) == set()
    n.event(0, XID, 79)  # watched again after coming back
    wait_for("an event from the returned GPU", lambda: all(n.taints(d) for d in lost))


def test_mig_event_is_attributed_to_its_instance(node: Callable[[NodeProfile], Node]) -> None:
    n = node(a100_mig_node(gpus=1, per_gpu=3))
    n.start()
    n.ready()
    spec = n.profile.gpus[0].mig_devices[1]
    target = f"gpu-0-mig-1g-5gb-{spec.gi_id}-{spec.ci_id}"
    n.event(0, XID, 31, gi=spec.gi_id, ci=spec.ci_id)
    wait_for("the xid taint", lambda: ("tandem.dev/xid", "31", TaintEffect.NONE) in n.taints(target))
    assert [d for d in n.names(0) if n.taints(d)] == [target]
    n.event(0, XID, 32)  # no instance: the whole GPU
    wait_for(
        "the whole GPU",
        lambda: all(("tandem.dev/xid", "32", TaintEffect.NO_SCHEDULE) in n.taints(d) for d in n.names(0)),
    )


def test_a_mig_device_made_again_at_the_same_gi_ci_has_none_of_the_old_ones_faults(
    node: Callable[[NodeProfile], Node],
) -> None:
    """Destroyed and made again, a MIG device keeps its name (GI/CI) but is a new instance (a new
    UUID): the old instance's XID is not its own. What its GPU has, it still has; its neighbours
    keep their own."""
    n = node(a100_mig_node(gpus=1, per_gpu=3))
    n.start()
    n.ready()
    old, neighbour = n.profile.gpus[0].mig_devices[1], n.profile.gpus[0].mig_devices[2]
    name = f"gpu-0-mig-1g-5gb-{old.gi_id}-{old.ci_id}"
    other = f"gpu-0-mig-1g-5gb-{neighbour.gi_id}-{neighbour.ci_id}"
    own, gpu_wide = ("tandem.dev/xid", "94", TaintEffect.NO_SCHEDULE), ("tandem.dev/xid", "32", TaintEffect.NO_SCHEDULE)
    n.event(0, XID, 94, gi=old.gi_id, ci=old.ci_id)
    n.event(0, XID, 94, gi=neighbour.gi_id, ci=neighbour.ci_id)
    n.event(0, XID, 32)  # no instance: the whole GPU's
    wait_for("all three xid taints", lambda: n.taints(name) == n.taints(other) == {own, gpu_wide})
    n.profile.gpus[0].mig_devices[1] = replace(old, uuid="MIG-ffffffff-0000-4000-8000-000000000001")
    n.discover()  # the inventory change alone: no probe asked for, the quiet periods far away
    wait_for("the old instance's xid gone", lambda: n.taints(name) == {gpu_wide})
    assert n.taints(other) == {own, gpu_wide}
    n.event(0, XID, 94, gi=old.gi_id, ci=old.ci_id)  # the new instance's own fault
    wait_for("the new instance's own xid", lambda: n.taints(name) == {own, gpu_wide})


def test_a_gpu_swapped_in_at_the_same_minor_starts_clean(node: Callable[[NodeProfile], Node]) -> None:
    n = node(h100_node(gpus=2, nics=0))
    n.start()
    n.ready()
    n.event(0, XID, 94)
    n.event(1, XID, 94)
    wait_for("both xid taints", lambda: bool(n.taints("gpu-0")) and bool(n.taints("gpu-1")))
    n.profile.gpus[0] = replace(n.profile.gpus[0], uuid="GPU-ffffffff-0000-4000-8000-000000000001")
    n.discover()
    wait_for("the new GPU clean", lambda: n.taints("gpu-0") == set())
    assert n.taints("gpu-1") == {("tandem.dev/xid", "94", TaintEffect.NO_SCHEDULE)}


def test_row_remap_pending_comes_and_goes(node: Callable[[NodeProfile], Node]) -> None:
    n = node(h100_node(gpus=1, nics=0))
    n.start()
    n.profile.gpus[0].remapped_rows_pending = True
    n.write()
    n.probe()
    assert n.taints("gpu-0") == {("tandem.dev/row-remap-pending", "", TaintEffect.NO_SCHEDULE)}
    n.profile.gpus[0].remapped_rows_pending = False
    n.write()
    n.probe()
    assert n.taints("gpu-0") == set()


def test_monitor_survives_nvml_errors(node: Callable[[NodeProfile], Node]) -> None:
    n = node(h100_node(gpus=2, nics=0))
    n.profile.gpus[1].nvml_errors = {"nvmlDeviceRegisterEvents": NVML_ERROR_UNKNOWN}
    n.write()
    monitor = n.start()
    n.ready()
    assert n.taints("gpu-1") == {("tandem.dev/unmonitored", "", TaintEffect.NONE)}
    assert n.health("gpu-1") is Health.HEALTHY
    n.profile.gpus[0].nvml_errors = {"nvmlDeviceGetTotalEccErrors": NVML_ERROR_UNKNOWN}
    n.profile.gpus[1].nvml_errors = {}
    n.write()
    n.probe()
    assert n.taints("gpu-0") == {("tandem.dev/nvml-error", "", TaintEffect.NO_SCHEDULE)}
    assert n.taints("gpu-1") == set()  # registered on this probe
    assert monitor.counters().errors >= 2
    n.event(1, XID, 48)
    wait_for("events from the GPU that failed to register", lambda: bool(n.taints("gpu-1")))
    n.profile.gpus[0].nvml_errors = {}
    n.write()
    n.probe()
    assert n.taints("gpu-0") == set()


def test_nvml_unavailable_then_back(node: Callable[[NodeProfile], Node]) -> None:
    n = node(h100_node(gpus=1, nics=0))
    sim_nvml.write_driver_unloaded(n.state)
    monitor = n.start(init_backoff=Backoff(initial=0.02, maximum=0.05))
    wait_for("unmonitored", lambda: n.taints("gpu-0") == {("tandem.dev/unmonitored", "", TaintEffect.NONE)})
    n.write()
    wait_for("monitored again", lambda: n.taints("gpu-0") == set() and monitor.counters().probes >= 1)
    n.event(0, XID, 79)
    wait_for("events after NVML came back", lambda: bool(n.taints("gpu-0")))
    inits = monitor.counters().nvml_inits
    sim_nvml.write_driver_unloaded(n.state)  # the driver goes away under a running monitor
    wait_for("unmonitored again", lambda: ("tandem.dev/unmonitored", "", TaintEffect.NONE) in n.taints("gpu-0"))
    n.write()
    wait_for("a new nvmlInit", lambda: monitor.counters().nvml_inits > inits)


def test_hot_plug_registers_new_gpus_and_forgets_removed_ones(node: Callable[[NodeProfile], Node]) -> None:
    n = node(h100_node(gpus=2, nics=0))
    full = h100_node(gpus=3, nics=0)
    n.start()
    n.ready()
    n.event(1, XID, 79)
    wait_for("the xid taint", lambda: bool(n.taints("gpu-1")))
    n.profile.gpus.append(full.gpus[2])
    n.discover()  # the inventory change makes the monitor probe and register the new GPU
    wait_for("gpu-2 watched", lambda: n.ready().counters().probes >= 2)
    n.event(2, XID, 79)
    wait_for("an event from the new GPU", lambda: bool(n.taints("gpu-2")))
    del n.profile.gpus[1]
    n.discover()
    n.probe()
    assert n.inventory.conditions("gpu-health").keys() == {"gpu-2"}


def test_pre_ampere_page_retirement_and_ecc_disabled(node: Callable[[NodeProfile], Node]) -> None:
    profile = h100_node(gpus=2, nics=0)
    profile.gpus[0].architecture = 5  # Volta: page retirement, no row remapping
    profile.gpus[0].retired_pages_pending = True
    profile.gpus[1].ecc_enabled = False  # the ECC queries are not supported: not an error
    n = node(profile)
    n.start()
    n.probe()
    assert n.taints("gpu-0") == {("tandem.dev/row-remap-pending", "", TaintEffect.NO_SCHEDULE)}
    assert n.taints("gpu-1") == set()
    n.profile.gpus[0].retired_pages_pending = False
    n.write()
    n.probe()
    assert n.taints("gpu-0") == set()


def test_an_error_that_asks_for_reinit_backs_off_instead_of_spinning(node: Callable[[NodeProfile], Node]) -> None:
    n = node(h100_node(gpus=1, nics=0))
    n.profile.gpus[0].nvml_errors = {"nvmlDeviceGetTotalEccErrors": 18}  # LIB_RM_VERSION_MISMATCH: re-init
    n.write()
    monitor = n.start(init_backoff=Backoff(initial=0.2, maximum=0.4, jitter=0.0))
    wait_for("a few re-initialisations", lambda: monitor.counters().nvml_inits >= 3)
    inits = monitor.counters().nvml_inits
    # Within one more backoff period at most a couple more inits can happen, never thousands.
    wait_for("one backoff period", lambda: monitor.counters().errors >= 3)
    assert monitor.counters().nvml_inits - inits < 10


# --- the driver's recovery action ----------------------------------------------------------------

GPU_RESET = 1  # NVML_GPU_RECOVERY_ACTION_GPU_RESET


def test_recovery_action_decides_the_xid_effect_and_holds_until_the_reset(node: Callable[[NodeProfile], Node]) -> None:
    n = node(h100_node(gpus=2, nics=0))
    n.start()
    n.ready()
    n.profile.gpus[1].recovery_action = GPU_RESET  # what the driver reports with this XID
    n.write()
    n.event(1, XID, 94)  # contained ECC: the Xid catalog says NoSchedule, the driver says reset
    wait_for(
        "the recovery action's own taint",
        lambda: ("tandem.dev/recovery-action", "gpu-reset", TaintEffect.NO_EXECUTE) in n.taints("gpu-1"),
    )
    assert ("tandem.dev/xid", "94", TaintEffect.NO_EXECUTE) in n.taints("gpu-1")
    assert "recovery action gpu-reset" in n.inventory.get("gpu-1").health_message  # type: ignore[union-attr]
    assert n.taints("gpu-0") == set()
    n.clock.advance(60)  # the XID's quiet period passes; the GPU still waits for its reset
    n.probe()
    assert n.taints("gpu-1") == {("tandem.dev/recovery-action", "gpu-reset", TaintEffect.NO_EXECUTE)}
    n.profile.gpus[1].recovery_action = 0  # reset: the driver asks for nothing any more
    n.write()
    n.probe()
    assert n.taints("gpu-1") == set()


def test_a_driver_without_the_recovery_action_keeps_the_xid_catalog(node: Callable[[NodeProfile], Node]) -> None:
    profile = h100_node(gpus=1, nics=0)
    profile.gpus[0].recovery_action = None  # NVML answers NOT_SUPPORTED for the field
    n = node(profile)
    n.start()
    n.ready()
    n.event(0, XID, 94)
    wait_for("the xid taint", lambda: ("tandem.dev/xid", "94", TaintEffect.NO_SCHEDULE) in n.taints("gpu-0"))
    assert "no recovery action" in n.inventory.get("gpu-0").health_message  # type: ignore[union-attr]
    n.probe()
    assert n.taints("gpu-0") == {("tandem.dev/xid", "94", TaintEffect.NO_SCHEDULE)}
    assert n.ready().counters().errors == 0  # not supported is not an error


def test_a_reset_xid_without_a_recovery_action_holds_until_evidence_of_a_reset(
    node: Callable[[NodeProfile], Node],
) -> None:
    profile = h100_node(gpus=2, nics=0)
    for gpu in profile.gpus:
        gpu.recovery_action = None  # an older driver: nothing will ever say the GPU was repaired
    n = node(profile)
    evidence = ResetEvidence()
    n.start(evidence=evidence)
    n.ready()
    held = ("tandem.dev/xid", "79", TaintEffect.NO_EXECUTE)
    n.event(1, XID, 79)
    n.event(0, XID, 94)  # not reset-class: its quiet period is right, and shows when one has passed
    wait_for("both taints", lambda: held in n.taints("gpu-1") and bool(n.taints("gpu-0")))
    assert "tandemctl clear" in n.inventory.get("gpu-1").health_message  # type: ignore[union-attr]
    n.clock.advance(3600)
    n.probe()
    wait_for("the other XID's quiet period to end", lambda: n.taints("gpu-0") == set())
    assert n.taints("gpu-1") == {held}  # no reset yet: still NoExecute

    n.profile.gpus[1].lost = True  # off the bus, then back: NVML says lost until a reset
    n.write()
    n.probe()
    assert ("tandem.dev/gpu-lost", "", TaintEffect.NO_EXECUTE) in n.taints("gpu-1")
    n.profile.gpus[1].lost = False
    n.write()
    n.probe()
    assert n.taints("gpu-1") == set()

    n.event(1, XID, 48)
    wait_for("the double-bit ECC XID", lambda: ("tandem.dev/xid", "48", TaintEffect.NO_EXECUTE) in n.taints("gpu-1"))
    evidence.report(n.profile.gpus[1].uuid, "tandemctl clear by an SRE")  # or a reacquire
    wait_for("the evidence", lambda: n.taints("gpu-1") == set())


# --- letting go of NVML: tandemctl release -------------------------------------------------------


@pytest.fixture
def reacquired() -> Iterator[None]:
    """Whatever a test released is taken back, so the process-wide NVML access is clean again."""
    yield
    assert NVML_ACCESS.set_released("", timeout=DEADLINE)


def test_a_release_lets_go_of_nvml_and_nothing_takes_it_back_until_the_reacquire(
    node: Callable[[NodeProfile], Node], reacquired: None
) -> None:
    n = node(h100_node(gpus=3, nics=0))
    n.start()
    n.ready()
    me = os.getpid()
    uuids = frozenset(g.uuid for g in n.profile.gpus)
    assert sim_nvml.nvml_clients(n.state)[me].attached == uuids  # nvmlInit opened every GPU
    with pytest.raises(sim_nvml.DeviceInUse):
        sim_nvml.reset_gpu(n.profile, n.state, 1)

    assert NVML_ACCESS.set_released("gpu-1 is released", timeout=DEADLINE)
    held = sim_nvml.nvml_clients(n.state)[me]
    assert (held.initialised, held.attached) == (0, frozenset())  # when the release returns
    sim_nvml.reset_gpu(n.profile, n.state, 1)  # what nvidia-smi -r needs: nobody holds the GPU
    with pytest.raises(NvmlReleased, match="gpu-1 is released"):  # discovery, the monitor, anyone
        GpuDiscovery(n.tmp / "sys", proc_root=n.tmp / "proc").discover()
    assert sim_nvml.nvml_clients(n.state)[me].inits == held.inits
    sim_nvml.unload_driver(n.state)  # a driver upgrade could start too
    n.write()

    assert NVML_ACCESS.set_released("", timeout=DEADLINE)  # reacquire
    n.probe()
    assert sim_nvml.nvml_clients(n.state)[me].attached == uuids
    n.event(1, XID, 79)
    wait_for("events from the reacquired GPU", lambda: bool(n.taints("gpu-1")))


def test_a_release_that_cannot_close_a_session_says_so(node: Callable[[NodeProfile], Node], reacquired: None) -> None:
    n = node(h100_node(gpus=1, nics=0))
    nvml = NVML_ACCESS.init(Path("/"))  # someone holds NVML and does not let go
    try:
        assert not NVML_ACCESS.set_released("NVML is released", timeout=0.2)
        assert NVML_ACCESS.open_sessions() == 1
        with pytest.raises(NvmlReleased):
            NVML_ACCESS.init(Path("/"))
    finally:
        NVML_ACCESS.shutdown(nvml)
    assert sim_nvml.nvml_clients(n.state)[os.getpid()].initialised == 0


def test_reading_the_recovery_action_as_drivers_old_and_new_answer(node: Callable[[NodeProfile], Node]) -> None:
    from driver.health.gpu.recovery import read_recovery_action

    profile = h100_node(gpus=3, nics=0)
    profile.gpus[0].recovery_action = 4  # drain and reset
    profile.gpus[1].recovery_action = None  # a driver before the field: the field says NOT_SUPPORTED
    profile.gpus[2].nvml_errors = {"nvmlDeviceGetFieldValues": 13}  # a library before the call
    n = node(profile)
    nvml = NvmlDoor(n.nvml)  # the fake as the monitor's session sees it
    nvml.nvmlInit()
    try:
        handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(3)]
        assert [read_recovery_action(nvml, h) for h in handles] == [4, None, None]
        field = nvml.nvmlDeviceGetFieldValues(handles[1], [nvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION])[0]
        assert field.nvmlReturn == nvml.NVML_ERROR_NOT_SUPPORTED  # the call itself succeeded
        n.profile.gpus[0].nvml_errors = {"nvmlDeviceGetFieldValues": NVML_ERROR_UNKNOWN}
        n.write()
        with pytest.raises(NvmlError):  # any other failure is the caller's to judge
            read_recovery_action(nvml, handles[0])
    finally:
        nvml.nvmlShutdown()


def test_a_driver_upgraded_under_the_process_asks_for_a_restart(node: Callable[[NodeProfile], Node]) -> None:
    """A process keeps the NVML library it loaded; the new kernel module refuses it."""
    n = node(h100_node(gpus=1, nics=0))  # discovery loaded the library of driver 580
    n.profile.driver_version = "590.10.01"
    n.write()
    with pytest.raises(NvmlUnavailable, match="restart it to load the new library"):
        NVML_ACCESS.init(Path("/"))
    assert NVML_ACCESS.open_sessions() == 0
