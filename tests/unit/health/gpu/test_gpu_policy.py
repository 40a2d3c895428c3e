"""The GPU health policy: which observation gives which condition, and how each one clears."""

from __future__ import annotations

import pytest

from driver.health import parse_taint_effects
from driver.health.gpu.memory import EventRate
from driver.health.gpu.policy import (
    APPLICATION_XIDS,
    MAX_XIDS_PER_SUBJECT,
    NO_INSTANCE,
    GpuDevices,
    GpuHealthPolicy,
    HealthState,
    Recovery,
    RecoveryAction,
    event_targets,
    index_gpus,
)
from driver.model import Condition, Device, DeviceKind, GpuInfo, TaintEffect

NONE, NO_SCHEDULE, NO_EXECUTE = TaintEffect.NONE, TaintEffect.NO_SCHEDULE, TaintEffect.NO_EXECUTE


@pytest.mark.parametrize(
    ("xid", "effect", "unhealthy"),
    [
        (13, NONE, False),
        (31, NONE, False),
        (43, NONE, False),
        (45, NONE, False),
        (68, NONE, False),
        (109, NONE, False),
        (94, NO_SCHEDULE, True),  # contained ECC: restart the app, the GPU stays usable
        (32, NO_SCHEDULE, True),
        (48, NO_EXECUTE, True),  # reset class
        (79, NO_EXECUTE, True),
        (95, NO_EXECUTE, True),
        (119, NO_EXECUTE, True),
        (120, NO_EXECUTE, True),
    ],
)
def test_xid_table(xid: int, effect: TaintEffect, unhealthy: bool) -> None:
    cond = GpuHealthPolicy().xid(xid)
    assert (cond.key, cond.value, cond.effect, cond.unhealthy) == ("tandem.dev/xid", str(xid), effect, unhealthy)
    assert cond.message.startswith(f"XID {xid}")


def test_application_xids_are_nvidias_set() -> None:
    assert frozenset({13, 31, 43, 45, 68, 109}) == APPLICATION_XIDS


def test_ignored_xids_and_domain() -> None:
    policy = GpuHealthPolicy(domain="gpu.example.com", ignored_xids=frozenset({94, 79}))
    for xid in (94, 79):
        cond = policy.xid(xid)
        assert (cond.key, cond.effect, cond.unhealthy) == ("gpu.example.com/xid", NONE, False)
    assert policy.xid(32).effect is NO_SCHEDULE


def test_fault_conditions_and_their_defaults() -> None:
    p = GpuHealthPolicy()
    table = {
        p.double_bit_ecc(): ("tandem.dev/ecc", "double-bit", NO_SCHEDULE, True),
        p.single_bit_ecc_rate(150): ("tandem.dev/ecc", "single-bit", NONE, False),
        p.gpu_lost("x"): ("tandem.dev/gpu-lost", "", NO_EXECUTE, True),
        p.row_remap_pending("x"): ("tandem.dev/row-remap-pending", "", NO_SCHEDULE, True),
        p.row_remap_failed("x"): ("tandem.dev/row-remap-failed", "", NO_SCHEDULE, True),
        p.nvml_error("x"): ("tandem.dev/nvml-error", "", NO_SCHEDULE, True),
        p.unmonitored("x"): ("tandem.dev/unmonitored", "", NONE, False),
    }
    for cond, expected in table.items():
        assert (cond.key, cond.value, cond.effect, cond.unhealthy) == expected


def test_effect_overrides_change_faults_but_not_informational_conditions() -> None:
    effects = parse_taint_effects(
        ["tandem.dev/xid=NoSchedule", "tandem.dev/gpu-lost=NoSchedule", "tandem.dev/ecc=NoExecute"]
    )
    p = GpuHealthPolicy(effects=effects)
    assert p.xid(79).effect is NO_SCHEDULE  # reset XIDs no longer evict
    assert p.xid(32).effect is NO_SCHEDULE
    assert p.xid(13).effect is NONE  # an ignored XID stays informational
    assert p.gpu_lost("x").effect is NO_SCHEDULE
    assert p.double_bit_ecc().effect is NO_EXECUTE
    assert p.single_bit_ecc_rate(500).effect is NONE
    assert GpuHealthPolicy(effects=parse_taint_effects(["tandem.dev/xid=NoExecute"])).xid(32).effect is NO_EXECUTE


@pytest.mark.parametrize(
    ("spec", "error"),
    [
        ("tandem.dev/xid", "KEY=EFFECT"),
        ("tandem.dev/xyd=NoSchedule", "unknown key"),
        ("tandem.dev/xid=PreferNoSchedule", "not one of"),
    ],
)
def test_bad_effect_overrides_are_refused(spec: str, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        parse_taint_effects([spec])


def test_policy_validates_itself() -> None:
    with pytest.raises(ValueError, match="unknown keys"):
        GpuHealthPolicy(effects={"other.dev/xid": NO_EXECUTE})
    with pytest.raises(ValueError, match="xid_quiet_period"):
        GpuHealthPolicy(xid_quiet_period=0)
    with pytest.raises(ValueError, match="single_bit_threshold"):
        GpuHealthPolicy(single_bit_threshold=0)


@pytest.mark.parametrize(
    ("xid", "action", "effect", "says"),
    [
        (94, RecoveryAction.GPU_RESET, NO_EXECUTE, "recovery action gpu-reset"),  # catalog: NoSchedule
        (31, RecoveryAction.DRAIN_AND_RESET, NO_EXECUTE, "drain-and-reset"),  # catalog: application
        (32, RecoveryAction.NODE_REBOOT, NO_EXECUTE, "node-reboot"),
        (94, RecoveryAction.NONE, NO_SCHEDULE, "recovery action none"),  # none: the XID's class
        (13, RecoveryAction.NONE, NONE, "recovery action none"),
        (79, RecoveryAction.NONE, NO_EXECUTE, "Xid catalog"),  # none never lowers a reset XID
        (79, None, NO_EXECUTE, "reports no recovery action"),  # a driver without the field
        (94, None, NO_SCHEDULE, "reports no recovery action"),
        (94, 42, NO_SCHEDULE, "recovery action 42 is unknown"),  # not understood: the XID's class
    ],
)
def test_xid_effect_follows_the_drivers_recovery_action(
    xid: int, action: int | None, effect: TaintEffect, says: str
) -> None:
    cond = GpuHealthPolicy().xid(xid, action)
    assert (cond.key, cond.value, cond.effect) == ("tandem.dev/xid", str(xid), effect)
    assert says in cond.message


def test_recovery_action_condition_names_the_action() -> None:
    p = GpuHealthPolicy()
    assert p.recovery_action(RecoveryAction.NONE) is None
    table = {
        RecoveryAction.GPU_RESET: ("gpu-reset", NO_EXECUTE),
        RecoveryAction.NODE_REBOOT: ("node-reboot", NO_EXECUTE),
        RecoveryAction.DRAIN_P2P: ("drain-p2p", NO_EXECUTE),
        RecoveryAction.DRAIN_AND_RESET: ("drain-and-reset", NO_EXECUTE),
        RecoveryAction.RECOVER_IMEX_DOMAIN: ("recover-imex-domain", NO_EXECUTE),
        RecoveryAction.BUS_RESET: ("bus-reset", NO_EXECUTE),
        RecoveryAction.SYSTEM_REBOOT: ("system-reboot", NO_EXECUTE),
        99: ("action-99", NO_SCHEDULE),  # a newer driver's action: keep work off, evict nothing
    }
    for action, (value, effect) in table.items():
        cond = p.recovery_action(action)
        assert cond is not None and (cond.key, cond.value, cond.effect, cond.unhealthy) == (
            "tandem.dev/recovery-action",
            value,
            effect,
            True,
        )
        assert str(action) in cond.message or value in cond.message
    assert p.recovery(p.recovery_action(RecoveryAction.GPU_RESET))[0] is Recovery.HARD  # type: ignore[arg-type]


def test_effect_overrides_apply_on_top_of_the_recovery_action() -> None:
    p = GpuHealthPolicy(
        effects=parse_taint_effects(["tandem.dev/xid=NoSchedule", "tandem.dev/recovery-action=NoSchedule"])
    )
    assert p.xid(94, RecoveryAction.GPU_RESET).effect is NO_SCHEDULE
    cond = p.recovery_action(RecoveryAction.DRAIN_AND_RESET)
    assert cond is not None and cond.effect is NO_SCHEDULE


def test_recovery_kinds() -> None:
    p = GpuHealthPolicy(xid_quiet_period=30, ecc_quiet_period=60)
    assert p.recovery(p.xid(79)) == (Recovery.TRANSIENT, 30)
    assert p.recovery(p.double_bit_ecc()) == (Recovery.TRANSIENT, 60)
    for cond in (p.gpu_lost("x"), p.row_remap_pending("x"), p.nvml_error("x"), p.unmonitored("x")):
        assert p.recovery(cond)[0] is Recovery.HARD


# --- state: transient expiry with a fake clock, hard replacement --------------------------------


def test_transient_condition_clears_after_a_quiet_period() -> None:
    p = GpuHealthPolicy(xid_quiet_period=10)
    state = HealthState(p)
    assert state.observe("gpu-0", p.xid(79), now=100.0)
    assert state.conditions("gpu-0") == {p.xid(79)}
    assert state.expire(109.9) == set()
    assert not state.observe("gpu-0", p.xid(79), now=105.0)  # same condition, quiet period restarts
    assert state.expire(114.9) == set()
    assert state.conditions("gpu-0") == {p.xid(79)}
    assert state.expire(115.0) == {"gpu-0"}
    assert state.conditions("gpu-0") == frozenset()
    assert state.subjects() == set()


def test_each_xid_has_its_own_quiet_period() -> None:
    p = GpuHealthPolicy(xid_quiet_period=10)
    state = HealthState(p)
    state.observe("gpu-0", p.xid(79), now=0.0)
    state.observe("gpu-0", p.xid(13), now=5.0)
    assert state.expire(10.0) == {"gpu-0"}
    assert state.conditions("gpu-0") == {p.xid(13)}


def test_xids_per_device_are_capped_oldest_first() -> None:
    p = GpuHealthPolicy()
    state = HealthState(p)
    for i in range(MAX_XIDS_PER_SUBJECT + 3):
        state.observe("gpu-0", p.xid(200 + i), now=float(i))
    state.observe("gpu-0", p.double_bit_ecc(), now=50.0)
    values = sorted(int(c.value) for c in state.conditions("gpu-0") if c.key == "tandem.dev/xid")
    assert values == list(range(203, 200 + MAX_XIDS_PER_SUBJECT + 3))
    assert p.double_bit_ecc() in state.conditions("gpu-0")


def test_hard_conditions_are_replaced_by_each_probe() -> None:
    p = GpuHealthPolicy()
    state = HealthState(p)
    lost = p.gpu_lost("gone")
    assert state.set_hard("gpu-0", [lost])
    assert state.expire(1e9) == set()  # no quiet period ends a hard condition
    assert state.conditions("gpu-0") == {lost}
    assert not state.set_hard("gpu-0", [lost])
    assert state.set_hard("gpu-0", [])
    assert state.conditions("gpu-0") == frozenset()


def test_hard_and_transient_conditions_combine_and_forget() -> None:
    p = GpuHealthPolicy()
    state = HealthState(p)
    state.set_hard("gpu-0", [p.row_remap_pending("x")])
    state.observe("gpu-0", p.double_bit_ecc(), now=0.0)
    assert state.conditions("gpu-0") == {p.row_remap_pending("x"), p.double_bit_ecc()}
    with pytest.raises(ValueError):
        state.observe("gpu-0", p.gpu_lost("x"), now=0.0)
    assert state.forget("gpu-0")
    assert state.conditions("gpu-0") == frozenset()
    assert not state.forget("gpu-0")


def test_single_bit_rate_window() -> None:
    rate = EventRate(window=10)
    assert rate.add(60, now=0.0) == 60
    assert rate.add(50, now=5.0) == 110
    assert rate.add(0, now=10.0) == 50  # the first 60 left the window
    assert rate.add(0, now=15.0) == 0


def test_single_bit_threshold_gives_an_informational_condition() -> None:
    p = GpuHealthPolicy(single_bit_threshold=100, single_bit_window=10, ecc_quiet_period=10)
    cond = p.single_bit_ecc_rate(120)
    assert "120" in cond.message and "100" in cond.message
    state = HealthState(p)
    state.observe("gpu-0", cond, now=0.0)
    assert not any(c.unhealthy for c in state.conditions("gpu-0"))
    assert state.expire(10.0) == {"gpu-0"}


# --- which devices an event is about -------------------------------------------------------------


def _gpu(name: str, uuid: str) -> Device:
    return Device(name, DeviceKind.GPU, gpu=GpuInfo(minor=0, uuid=uuid, pci_bus_id=""))


def _mig(name: str, uuid: str, parent: str, gi: int, ci: int) -> Device:
    info = GpuInfo(minor=1, uuid=uuid, pci_bus_id="", parent_uuid=parent, mig_gi=gi, mig_ci=ci)
    return Device(name, DeviceKind.MIG, gpu=info)


def test_index_groups_devices_by_physical_gpu() -> None:
    devices = [
        _gpu("gpu-0", "GPU-a"),
        _mig("gpu-1-mig-1g-5gb-7-0", "MIG-1", "GPU-b", 7, 0),
        _mig("gpu-1-mig-1g-5gb-8-0", "MIG-2", "GPU-b", 8, 0),
        Device("nic-x", DeviceKind.NIC),
    ]
    index = index_gpus(devices)
    assert set(index) == {"GPU-a", "GPU-b"}
    assert index["GPU-a"].devices == ("gpu-0",) and not index["GPU-a"].migs
    assert index["GPU-b"].migs == {(7, 0): "gpu-1-mig-1g-5gb-7-0", (8, 0): "gpu-1-mig-1g-5gb-8-0"}
    # Which instance each name stands for now: health state is about an instance, not a name.
    assert index["GPU-a"].instances == {"gpu-0": "GPU-a"}
    assert index["GPU-b"].instances == {"gpu-1-mig-1g-5gb-7-0": "MIG-1", "gpu-1-mig-1g-5gb-8-0": "MIG-2"}


def test_event_targets() -> None:
    gpu = GpuDevices("GPU-b", ("m70", "m71", "m80"), {(7, 0): "m70", (7, 1): "m71", (8, 0): "m80"})
    assert event_targets(gpu, 8, 0) == ("m80",)
    assert event_targets(gpu, 7, NO_INSTANCE) == ("m70", "m71")
    assert event_targets(gpu, NO_INSTANCE, NO_INSTANCE) == ("m70", "m71", "m80")
    assert event_targets(gpu, 9, 0) == ("m70", "m71", "m80")  # unknown instance: the whole GPU
    full = GpuDevices("GPU-a", ("gpu-0",))
    assert event_targets(full, 0, 0) == ("gpu-0",)


def test_conditions_are_hashable_values() -> None:
    p = GpuHealthPolicy()
    assert p.xid(79) == p.xid(79) and isinstance(p.xid(79), Condition)
    assert len({p.xid(79), p.xid(79), p.xid(48)}) == 2
