"""What GPU health observations mean for scheduling: a pure policy, and the state that lets
conditions come *and go*.

NVIDIA's driver taints a device on every XID and never clears it, ignores ECC events and never
evicts (docs/reference/drivers.md, 'NVIDIA DRA driver for GPUs' and 'User complaints'). Here every condition has a way back:

* TRANSIENT conditions come from events (XIDs, ECC errors). Each occurrence restarts a quiet
  period; when it passes without a new occurrence the condition clears, except a reset XID on a
  driver that reports no recovery action: that one waits for evidence of a reset (`resets`).
* HARD conditions come from the periodic probe (GPU lost, rows waiting for remapping, a
  recovery action the driver asks for, NVML errors, events that could not be registered). The
  probe states them afresh each time, so they clear as soon as the probe finds the GPU well again
  (it answers, nothing is pending, the driver asks for nothing).

What the GPU needs is the driver's to say where it can: NVML's recovery action
(`NVML_FI_DEV_GET_GPU_RECOVERY_ACTION`, NVIDIA's "Error Recovery and Response Flags":
none, GPU reset, node reboot, drain P2P, drain and reset, recover the IMEX domain, bus reset,
system reboot). Every action but none means the GPU cannot simply serve the next process, so:

* an XID after which the driver reports an action is a fault with the reset effect (**NoExecute**)
  whatever its XID class, and says which action;
* the action itself is the HARD condition `recovery-action` (value: the action, e.g. `gpu-reset`),
  NoExecute, stated by every probe until the driver reports none again (after the reset or
  reboot), so it outlives the XID's quiet period and a restart of the daemon, and clears as soon
  as the GPU is repaired. An action this code does not know is NoSchedule, and its XID keeps its
  class: not understood is not a reason to evict.

Where the driver reports no action (none, or a driver or GPU without the field: NOT_SUPPORTED),
the XID keeps its class from NVIDIA's Xid catalog for Ampere and later
(docs.nvidia.com/deploy/xid-errors, its "resolution bucket" column). "None" does not lower a reset
XID: the XID event and the driver's update of the action are not ordered for the reader, and a
GPU that really needs no reset loses only the quiet period. Where it reports nothing at all, a
reset XID holds until evidence of a reset (`needs_reset`); its message says what clears it.

* application XIDs 13, 31, 43, 45, 68, 109 (the set NVIDIA's DRA and device plugins skip), plus
  `ignored_xids`: the application crashed, the GPU is fine. Informational: effect None, healthy.
* reset XIDs, whose immediate action is RESET_GPU (or a reboot): 48 double-bit ECC, 61/62
  micro-controller breakpoint/halt, 64 row-remap/page-retirement recording failure, 74 NVLink,
  79 fallen off the bus, 95 uncontained ECC, 119/120 GSP timeout/error, 121 C2C link,
  140 unrecovered ECC, 143 GPU initialisation failure. Default effect **NoExecute**: every
  process on the GPU is already dead or may compute on corrupt memory, and the reset that repairs
  the GPU needs them gone; evicting lets their pods restart elsewhere now instead of hanging.
* every other XID (e.g. 94 contained ECC: RESTART_APP, the GPU stays usable): NoSchedule.

Effects are overridable per condition key (`--taint-effect tandem.dev/xid=NoSchedule` keeps
reset XIDs from evicting, whether the action or the catalog said reset;
`tandem.dev/recovery-action=NoSchedule` does the same for the action's own taint). An override
changes the effect of the key's *fault* conditions only:
informational ones (ignored XIDs, the single-bit ECC rate notice) stay None; to make an XID a
fault, leave it out of the ignored set.

Over 400 lines on purpose: the XID classes, the state that holds their conditions and the devices
an event is about are the one set of rules the monitor applies; apart, a rule and the state it
governs would be read in two places.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from driver.model import Condition, Device, TaintEffect

APPLICATION_XIDS = frozenset({13, 31, 43, 45, 68, 109})
RESET_XIDS = frozenset({48, 61, 62, 64, 74, 79, 95, 119, 120, 121, 140, 143})

# Condition names; the key is "<domain>/<name>".
XID = "xid"
ECC = "ecc"
GPU_LOST = "gpu-lost"
ROW_REMAP_PENDING = "row-remap-pending"
ROW_REMAP_FAILED = "row-remap-failed"
NVML_ERROR = "nvml-error"
UNMONITORED = "unmonitored"
RECOVERY_ACTION = "recovery-action"
NAMES = (XID, ECC, GPU_LOST, ROW_REMAP_PENDING, ROW_REMAP_FAILED, NVML_ERROR, UNMONITORED, RECOVERY_ACTION)

CLEARS_ON_RESET = "clears when the GPU is reset (tandemctl release, nvidia-smi -r, tandemctl reacquire), \
when it falls off the bus and answers again, or by tandemctl clear"

DOUBLE_BIT = "double-bit"
SINGLE_BIT = "single-bit"

# So that a burst of different XIDs cannot crowd the taints of one device (the API allows 16). Per
# `HealthState` subject: a MIG device shows its GPU's and its own, at most twice this many, and
# as `xid` sorts after every other condition key the inventory's cut at 16 drops XIDs first.
MAX_XIDS_PER_SUBJECT = 8

_XID_NAMES = {
    13: "graphics engine exception",
    31: "GPU memory page fault",
    43: "GPU stopped processing",
    45: "preemptive cleanup",
    48: "double-bit ECC error",
    61: "internal micro-controller breakpoint",
    62: "internal micro-controller halt",
    63: "row remapping or page retirement recorded",
    64: "row remapping or page retirement recording failed",
    68: "video decoder exception",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    92: "high single-bit ECC error rate",
    94: "contained ECC error",
    95: "uncontained ECC error",
    109: "context switch timeout",
    119: "GSP RPC timeout",
    120: "GSP error",
    121: "C2C link error",
    140: "unrecovered ECC error",
    143: "GPU initialization failure",
}


class RecoveryAction(enum.IntEnum):
    """NVML's `nvmlDeviceGpuRecoveryAction_t`: what the GPU needs after an error."""

    NONE = 0  # a new process can use the GPU at once
    GPU_RESET = 1
    NODE_REBOOT = 2
    DRAIN_P2P = 3  # quiesce peer-to-peer traffic, then ask again
    DRAIN_AND_RESET = 4
    RECOVER_IMEX_DOMAIN = 5
    BUS_RESET = 6
    SYSTEM_REBOOT = 7

    @property
    def label(self) -> str:
        """The taint value: `gpu-reset`, `drain-and-reset`, ..."""
        return self.name.lower().replace("_", "-")

    @classmethod
    def known(cls, value: int | None) -> RecoveryAction | None:
        """The action for an NVML value; None for no value or one this code does not know."""
        try:
            return None if value is None else cls(value)
        except ValueError:
            return None


_ACTION_TEXT = {
    RecoveryAction.GPU_RESET: "the GPU needs a reset",
    RecoveryAction.NODE_REBOOT: "the node needs a reboot",
    RecoveryAction.DRAIN_P2P: "its peer-to-peer traffic must be drained",
    RecoveryAction.DRAIN_AND_RESET: "drain its peer-to-peer traffic, then reset the GPU",
    RecoveryAction.RECOVER_IMEX_DOMAIN: "its IMEX domain needs recovery",
    RecoveryAction.BUS_RESET: "the GPU's PCIe bus needs a reset",
    RecoveryAction.SYSTEM_REBOOT: "the system needs a reboot",
}


class Recovery(enum.StrEnum):
    TRANSIENT = "transient"  # clears after a quiet period without a new occurrence
    HARD = "hard"  # clears when the probe finds the device well again


@dataclass(frozen=True)
class GpuHealthPolicy:
    """Turns observations into conditions; pure and immutable so tests can table it."""

    domain: str = "tandem.dev"
    ignored_xids: frozenset[int] = frozenset()
    application_xids: frozenset[int] = APPLICATION_XIDS
    reset_xids: frozenset[int] = RESET_XIDS
    reset_xid_effect: TaintEffect = TaintEffect.NO_EXECUTE
    effects: Mapping[str, TaintEffect] = field(default_factory=dict)  # full key -> effect
    xid_quiet_period: float = 600.0
    ecc_quiet_period: float = 600.0
    single_bit_threshold: int = 100  # corrected errors within single_bit_window
    single_bit_window: float = 600.0

    def __post_init__(self) -> None:
        known = {self.key(n) for n in NAMES}
        unknown = sorted(set(self.effects) - known)
        if unknown:
            raise ValueError(f"taint effects for unknown keys {unknown}; known keys: {sorted(known)}")
        for name in ("xid_quiet_period", "ecc_quiet_period", "single_bit_window"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, not {getattr(self, name)!r}")
        if self.single_bit_threshold < 1:
            raise ValueError(f"single_bit_threshold must be at least 1, not {self.single_bit_threshold}")
        bad = sorted(x for x in self.ignored_xids | self.application_xids | self.reset_xids if not 0 <= x < 2**32)
        if bad:
            raise ValueError(f"XIDs {bad} are out of range")

    def key(self, name: str) -> str:
        return f"{self.domain}/{name}"

    def _fault(self, name: str, value: str, message: str, default: TaintEffect) -> Condition:
        effect = self.effects.get(self.key(name), default)
        return Condition(self.key(name), effect, value, message, unhealthy=True)

    def _info(self, name: str, value: str, message: str) -> Condition:
        return Condition(self.key(name), TaintEffect.NONE, value, message, unhealthy=False)

    def is_informational_xid(self, xid: int) -> bool:
        return xid in self.application_xids or xid in self.ignored_xids

    def xid(self, xid: int, action: int | None = None) -> Condition:
        """An XID event; `action` is the GPU's recovery action read right after it (None: not reported)."""
        what = _XID_NAMES.get(xid)
        text = f"XID {xid}" + (f" ({what})" if what else "")
        known = RecoveryAction.known(action)
        if known is not None and known is not RecoveryAction.NONE:
            why = f"{text}: recovery action {known.label} (NVML): {_ACTION_TEXT[known]}"
            return self._fault(XID, str(xid), why, self.reset_xid_effect)
        if action is None:
            source = "the driver reports no recovery action"
        elif known is None:
            source = f"recovery action {action} is unknown"
        else:
            source = "NVML reports recovery action none"
        if self.is_informational_xid(xid):
            return self._info(XID, str(xid), f"{text}: an application error, the GPU is fine ({source})")
        if xid in self.reset_xids:
            if self.needs_reset(xid, action):
                why = f"{text}: the GPU needs a reset (Xid catalog; {source}); {CLEARS_ON_RESET}"
            else:  # the driver says what it needs, and it is nothing: the quiet period clears it
                quiet = f"clears after {self.xid_quiet_period:.0f} s without another"
                why = f"{text}: the Xid catalog advises a reset, but {source}; {quiet}"
            return self._fault(XID, str(xid), why, self.reset_xid_effect)
        return self._fault(XID, str(xid), f"{text} ({source})", TaintEffect.NO_SCHEDULE)

    def needs_reset(self, xid: int, action: int | None) -> bool:
        """Whether the XID's condition clears only on evidence of a reset: a reset XID where the
        driver reports no recovery action (None: no field, or it could not be read)."""
        return action is None and xid in self.reset_xids and not self.is_informational_xid(xid)

    def recovery_action(self, action: int) -> Condition | None:
        """What the probe read of the GPU's recovery action; None when the driver asks for nothing."""
        known = RecoveryAction.known(action)
        if known is RecoveryAction.NONE:
            return None
        if known is None:
            why = f"the driver reports recovery action {action}, unknown to this driver version"
            return self._fault(RECOVERY_ACTION, f"action-{action}", why, TaintEffect.NO_SCHEDULE)
        why = f"recovery action {known.label} (NVML): {_ACTION_TEXT[known]}"
        return self._fault(RECOVERY_ACTION, known.label, why, TaintEffect.NO_EXECUTE)

    def double_bit_ecc(self, count: int = 1) -> Condition:
        return self._fault(ECC, DOUBLE_BIT, f"{count} double-bit (uncorrectable) ECC error(s)", TaintEffect.NO_SCHEDULE)

    def single_bit_ecc_rate(self, count: int) -> Condition:
        return self._info(
            ECC,
            SINGLE_BIT,
            f"{count} single-bit (corrected) ECC errors within {self.single_bit_window:g}s "
            f"(threshold {self.single_bit_threshold})",
        )

    def gpu_lost(self, detail: str) -> Condition:
        return self._fault(GPU_LOST, "", f"GPU lost: {detail}", TaintEffect.NO_EXECUTE)

    def row_remap_pending(self, detail: str) -> Condition:
        return self._fault(ROW_REMAP_PENDING, "", f"{detail}; a GPU reset applies it", TaintEffect.NO_SCHEDULE)

    def row_remap_failed(self, detail: str) -> Condition:
        return self._fault(ROW_REMAP_FAILED, "", f"{detail}; the GPU needs service", TaintEffect.NO_SCHEDULE)

    def nvml_error(self, detail: str) -> Condition:
        return self._fault(NVML_ERROR, "", f"NVML errors: {detail}", TaintEffect.NO_SCHEDULE)

    def unmonitored(self, detail: str) -> Condition:
        return self._info(UNMONITORED, "", f"no NVML health events: {detail}")

    def recovery(self, condition: Condition) -> tuple[Recovery, float]:
        """How a condition clears: after a quiet period (seconds), or by a healthy probe (0)."""
        if condition.key == self.key(XID):
            return Recovery.TRANSIENT, self.xid_quiet_period
        if condition.key == self.key(ECC):
            return Recovery.TRANSIENT, self.ecc_quiet_period
        return Recovery.HARD, 0.0


class HealthState:
    """The conditions of each subject, with the time each transient one was last seen. A subject
    is what conditions are about: the monitor (`driver.health.gpu.monitor`) uses a GPU's UUID and a MIG
    device's, so a device made again under the same name (a new UUID) has none of the old one's.

    Pure: time is passed in, nothing is published. Every method that can change what a subject
    reports returns whether (or which subjects) changed.
    """

    def __init__(self, policy: GpuHealthPolicy) -> None:
        self.policy = policy
        self._transient: dict[str, dict[tuple[str, str], tuple[Condition, float]]] = {}
        self._until_reset: dict[str, dict[tuple[str, str], tuple[Condition, float]]] = {}  # no quiet period
        self._hard: dict[str, frozenset[Condition]] = {}

    def observe(self, subject: str, condition: Condition, now: float, until_reset: bool = False) -> bool:
        """An event happened: (re)start the condition's quiet period or, `until_reset`, hold it
        until `clear_reset` (`GpuHealthPolicy.needs_reset`)."""
        recovery, _ = self.policy.recovery(condition)
        if recovery is not Recovery.TRANSIENT:
            raise ValueError(f"{condition.key} is not an event condition")
        before = self.conditions(subject)
        store, other = (self._until_reset, self._transient) if until_reset else (self._transient, self._until_reset)
        other.get(subject, {}).pop((condition.key, condition.value), None)  # one entry per key and value
        conds = store.setdefault(subject, {})
        conds.pop((condition.key, condition.value), None)
        conds[(condition.key, condition.value)] = (condition, now)  # dict order = last seen
        xids = [k for k in conds if k[0] == self.policy.key(XID)]
        for k in xids[: max(len(xids) - MAX_XIDS_PER_SUBJECT, 0)]:
            del conds[k]
        return self.conditions(subject) != before

    def set_hard(self, subject: str, conditions: Iterable[Condition]) -> bool:
        """What the probe found now (empty: nothing wrong); replaces the last probe's verdict."""
        new = frozenset(conditions)
        old = self._hard.get(subject, frozenset())
        if new:
            self._hard[subject] = new
        else:
            self._hard.pop(subject, None)
        return new != old

    def expire(self, now: float) -> set[str]:
        """Drop transient conditions whose quiet period has passed; the subjects that changed."""
        changed = set()
        for subject, conds in list(self._transient.items()):
            for k, (cond, seen) in list(conds.items()):
                _, quiet = self.policy.recovery(cond)
                if now - seen >= quiet:
                    del conds[k]
                    changed.add(subject)
            if not conds:
                del self._transient[subject]
        return changed

    def clear_reset(self, subject: str) -> bool:
        """The subject's GPU was reset (`resets`): drop what waited for it; whether anything did."""
        return self._until_reset.pop(subject, None) is not None

    def held(self) -> dict[str, frozenset[Condition]]:
        """Each subject's conditions held until a reset (`observe(until_reset=True)`)."""
        return {s: frozenset(c for c, _ in conds.values()) for s, conds in self._until_reset.items() if conds}

    def forget(self, subject: str) -> bool:
        had = subject in self.subjects()
        for store in (self._transient, self._until_reset, self._hard):
            store.pop(subject, None)
        return had

    def subjects(self) -> set[str]:
        return set(self._transient) | set(self._until_reset) | set(self._hard)

    def conditions(self, subject: str) -> frozenset[Condition]:
        events = {**self._transient.get(subject, {}), **self._until_reset.get(subject, {})}
        return frozenset(c for c, _ in events.values()) | self._hard.get(subject, frozenset())


# --- which devices an NVML event is about --------------------------------------------------------


@dataclass(frozen=True)
class GpuDevices:
    """The published devices of one physical GPU: itself, or its MIG devices."""

    uuid: str
    devices: tuple[str, ...]
    migs: Mapping[tuple[int, int], str] = field(default_factory=dict)  # (GI, CI) -> device name
    # Device name -> the UUID of the instance it names now: the GPU's, a MIG device's ("" for a
    # dynamic-MIG partition not made yet). A name outlives its instance: a MIG device made again
    # at the same GI/CI, a GPU swapped in at the same minor.
    instances: Mapping[str, str] = field(default_factory=dict)
    pci: str = ""  # the GPU's PCI address: with its UUID, what names a held reset XID's GPU (`held`)


def index_gpus(devices: Iterable[Device]) -> dict[str, GpuDevices]:
    """Group the inventory's GPU and MIG devices by the UUID of the physical GPU."""
    instances: dict[str, dict[str, str]] = {}
    migs: dict[str, dict[tuple[int, int], str]] = {}
    pci: dict[str, str] = {}
    for d in devices:
        info = d.gpu
        parent = (info.parent_uuid or info.uuid) if info is not None else ""
        if info is None or not parent:  # a dynamic-MIG partition not made yet has only its parent's
            continue
        instances.setdefault(parent, {})[d.name] = info.uuid
        pci.setdefault(parent, info.pci_bus_id)  # a MIG device's is its GPU's
        if info.parent_uuid and info.mig_gi is not None and info.mig_ci is not None:
            migs.setdefault(parent, {})[(info.mig_gi, info.mig_ci)] = d.name
    return {u: GpuDevices(u, tuple(sorted(n)), migs.get(u, {}), n, pci[u]) for u, n in instances.items()}


NO_INSTANCE = 0xFFFFFFFF  # NVML's "not attributable to a GPU/compute instance"


def event_targets(gpu: GpuDevices, gi: int, ci: int) -> tuple[str, ...]:
    """The devices an event on `gpu` with these instance IDs is about.

    A MIG device when GI and CI name one; the MIG devices of a GPU instance when only the GI does;
    otherwise (no MIG, unknown or undecodable instance) every device of the GPU: better to taint
    a healthy neighbour for a quiet period than to miss the sick one.
    """
    return _attributed(gpu, gi, ci) or gpu.devices


def event_subjects(gpu: GpuDevices, gi: int, ci: int) -> tuple[str, ...]:
    """What an event's condition is recorded against (`HealthState`): the UUIDs of the MIG
    devices its instance IDs name, as it is about those instances; otherwise the GPU's UUID, as
    it is about the GPU and so about every device of it (`event_targets`)."""
    return tuple(gpu.instances[name] for name in _attributed(gpu, gi, ci)) or (gpu.uuid,)


def _attributed(gpu: GpuDevices, gi: int, ci: int) -> tuple[str, ...]:
    """The MIG devices an event's instance IDs name (see `event_targets`); () when they name none."""
    if gi == NO_INSTANCE or not gpu.migs:
        return ()
    exact = gpu.migs.get((gi, ci))
    if exact is not None:
        return (exact,)
    return tuple(sorted(name for (g, _), name in gpu.migs.items() if g == gi))
