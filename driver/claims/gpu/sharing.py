"""Sharing a GPU at prepare: what a claim's share may do, and the limits its containers get.

A GPU published for sharing (`driver.discovery.gpu.shared`) is allocated to many claims, each with
the `memory` and `computePercent` it consumed (the allocation result's `consumedCapacity`). The
scheduler only counts; nothing on the GPU holds a process to its share unless something enforces
it. How the claim's processes share is its `GpuConfig.sharing` (`driver.claims.opaque_config`; a DeviceClass
can fix it for its users):

* `MPS`: the containers join the GPU's MPS control daemon (`driver.claims.gpu.mps`, started before the claim
  is prepared and kept while any claim uses it) through its pipe directory, mounted by CDI with
  `CUDA_MPS_PIPE_DIRECTORY` and `CUDA_MPS_LOG_DIRECTORY`, and CUDA enforces the share:
  `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=<MiB>M` (device 0: the daemon sees only its GPU) and
  `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=<percent>` (NVIDIA's MPS documentation, 'Environment
  Variables'). Every MPS claim gets both, the whole GPU's included, so the limits are visible.
* `TimeSlicing`: the processes of the pods using the claim take turns on the whole GPU, as CUDA
  schedules processes without MPS. Nothing limits memory, and the time slice is a setting of the
  whole GPU, so it needs a claim that holds all of it. `GpuConfig.timeSliceInterval` (`Default`,
  `Short`, `Medium`, `Long`; `Default` when left out) is recorded with the claim and set on the GPU
  before its spec is written, and the driver's default comes back when the last such claim goes
  (`driver.claims.gpu.time_slices`).

* no strategy: the claim must hold the whole GPU.

Refused, each with a message naming the device and what to change (a per-claim error, never
silent sharing without limits): a share smaller than the whole GPU without MPS; MPS or
TimeSlicing on a MIG device (its partition already is the limit, and neither MPS limits nor the
time slice apply to one), and on the whole GPU of a dynamic-MIG GPU (it is in MIG mode:
preparing it makes the MIG device that spans it, and nvidia-smi refuses a time slice there); a
`timeSliceInterval` without TimeSlicing (an MPS claim's processes run side by side, not in
turns); an MPS GPU together with any other GPU in one claim (a CUDA process talks to one MPS
daemon, which shows only its own GPU); a claim asking a GPU for another interval than a claim
already prepared on it (the slice is the whole GPU's: it waits, and the kubelet's retry succeeds
once the other claim is gone).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence

import cdi
from driver.claims.allocation import ClaimError
from driver.claims.checkpoint import ClaimRecord, DeviceRecord
from driver.claims.gpu.mps import MpsDaemons, MpsError
from driver.claims.gpu.time_slices import TimeSliceError, TimeSlices
from driver.claims.planned import PlannedDevice
from driver.claims.vocabulary import Sharing, TimeSliceInterval
from driver.discovery.gpu.attributes import MIB
from driver.discovery.gpu.shared import COMPUTE, MEMORY
from driver.model import Device, DeviceKind
from driver.resource_api import parse_quantity

log = logging.getLogger(__name__)

# Where a container finds the MPS daemon: NVIDIA's default pipe directory (and the one its DRA
# driver mounts), so tools that do not read CUDA_MPS_PIPE_DIRECTORY find it too.
CONTAINER_PIPE_DIR = "/tmp/nvidia-mps"
CONTAINER_LOG_DIR = "/var/log/nvidia-mps"
_PIPE_OPTIONS = ("rw", "nosuid", "nodev", "bind")
_LOG_OPTIONS = ("ro", "nosuid", "nodev", "bind")


@dataclasses.dataclass(frozen=True)
class Share:
    """What one allocation holds of a GPU: bytes of memory, percent of compute, and whether that
    is all of it. A device allocated without consumable capacity is held whole."""

    memory: int | None
    compute: int | None
    whole: bool


def share_of(p: PlannedDevice) -> Share:
    """The share of `p`'s GPU its allocation consumed (`consumedCapacity`, module docstring)."""
    d = p.device
    total = d.capacity.get(MEMORY)
    memory = _held(p, MEMORY) if MEMORY in d.request_policies else (int(parse_quantity(total)) if total else None)
    compute = _held(p, COMPUTE) if COMPUTE in d.request_policies else 100
    whole = all(_held(p, name) >= parse_quantity(policy.default) for name, policy in d.request_policies.items())
    return Share(memory=memory, compute=compute, whole=whole)


def _held(p: PlannedDevice, name: str) -> int:
    """What the allocation consumed of a capacity with a request policy; its default (all of it)
    when the allocation says nothing (a scheduler without consumable capacity)."""
    raw = p.consumed.get(name)
    return int(parse_quantity(raw if raw is not None else p.device.request_policies[name].default))


def with_sharing(records: Sequence[DeviceRecord], planned: Sequence[PlannedDevice]) -> list[DeviceRecord]:
    """The claim's records, each GPU's naming how it is shared (`MPS`, `TimeSlicing` with its
    interval): what phase 1 of a prepare records before the MPS daemon is started or the time
    slice set, so both follow the records."""
    by_device = {(p.device.name, p.share_id): p.config.gpu for p in planned if p.device.kind == DeviceKind.GPU}
    out = []
    for r in records:
        gpu = by_device.get((r.device, r.share_id))
        sharing = gpu.sharing if gpu else None
        interval = (
            (gpu.time_slice_interval or TimeSliceInterval.DEFAULT) if gpu and sharing == Sharing.TIME_SLICING else None
        )
        out.append(dataclasses.replace(r, sharing=sharing, time_slice=interval))
    return out


def time_slice_gpus(
    records: Iterable[DeviceRecord], lookup: Callable[[str], Device | None]
) -> dict[str, tuple[str | None, TimeSliceInterval]]:
    """The GPUs (device name -> (UUID, interval)) the recorded claims time-slice: what
    `driver.claims.gpu.time_slices.TimeSlices` keeps set. The UUID is None for a GPU the inventory lacks
    now (NVML unanswered, or the GPU gone): its interval is left as it is while a record names it."""
    return {r.device: (_uuid(lookup(r.device)), r.time_slice) for r in records if r.time_slice}


def check_time_slices(uid: str, records: Sequence[DeviceRecord], claims: Mapping[str, ClaimRecord]) -> None:
    """In phase 1, before the record of claim `uid` is written: ClaimError where one of its GPUs
    is already time-sliced with another interval by a claim prepared on it (the slice is the
    whole GPU's)."""
    for r in records:
        if not r.time_slice:
            continue
        for key, other in claims.items():
            if key == uid:
                continue
            held = next((d.time_slice for d in other.devices if d.device == r.device and d.time_slice), None)
            if held and held != r.time_slice:
                raise ClaimError(
                    f"GPU {r.device!r}: this claim asks for the time-slice interval {r.time_slice}, but claim "
                    f"{other.namespace}/{other.name} prepared on it set {held}, and the interval is the whole "
                    "GPU's: it is retried once that claim is gone (or ask for the same interval)"
                )


def mps_gpus(records: Iterable[DeviceRecord], lookup: Callable[[str], Device | None]) -> dict[str, str | None]:
    """The GPUs (device name -> UUID) the recorded claims share through MPS: those that need a
    control daemon (`driver.claims.gpu.mps.MpsDaemons`). The UUID is None for a GPU the inventory lacks now
    (NVML unanswered, or the GPU gone): its daemon, if it runs, stays while a record names it."""
    return {r.device: _uuid(lookup(r.device)) for r in records if r.sharing == Sharing.MPS}


def _uuid(device: Device | None) -> str | None:
    return device.gpu.uuid if device is not None and device.gpu is not None else None


def check_gpu_sharing(planned: Sequence[PlannedDevice]) -> None:
    """ClaimError for a combination nothing could enforce or honour (module docstring)."""
    gpus = [p for p in planned if p.device.kind in (DeviceKind.GPU, DeviceKind.MIG)]
    for p in gpus:
        d, strategy = p.device, p.config.gpu.sharing
        if p.config.gpu.time_slice_interval and strategy != Sharing.TIME_SLICING:
            raise ClaimError(
                f"GPU {d.name!r}: GpuConfig.timeSliceInterval {p.config.gpu.time_slice_interval} needs sharing "
                f"TimeSlicing, not {strategy or 'none'}: "
                + (
                    "MPS runs the processes of its clients side by side, not in turns; "
                    if strategy == Sharing.MPS
                    else ""
                )
                + "leave timeSliceInterval out, or set sharing TimeSlicing"
            )
        if d.kind == DeviceKind.MIG and strategy:
            raise ClaimError(
                f"MIG device {d.name!r}: GpuConfig.sharing {strategy} applies to full GPUs only; a MIG device's "
                "partition is its limit already (leave sharing out, or ask for a shared full GPU)"
            )
        if d.gpu is not None and d.gpu.placement is not None and strategy:
            raise ClaimError(
                f"GPU {d.name!r} is in MIG mode (dynamic MIG): preparing it makes the MIG device that spans it, "
                f"and GpuConfig.sharing {strategy} applies to GPUs outside MIG mode only (leave sharing out, or "
                "ask for a GPU that is not in MIG mode)"
            )
        share = share_of(p)
        if share.whole or strategy == Sharing.MPS:
            continue
        held = f"{_mib(share.memory)} of memory and {share.compute}% of compute"
        if strategy == Sharing.TIME_SLICING:
            raise ClaimError(
                f"GPU {d.name!r}: GpuConfig.sharing TimeSlicing sets the time slice of the whole GPU and limits no "
                f"memory, but this claim holds only a share of it ({held}): ask for the whole GPU (leave "
                "capacity.requests out), or use sharing MPS, which enforces the share"
            )
        raise ClaimError(
            f"GPU {d.name!r}: this claim holds a share of it ({held}) and nothing would hold its processes to "
            "it: set GpuConfig.sharing MPS (or use a DeviceClass that does), or ask for the whole GPU"
        )
    mps = [p for p in gpus if _mps(p)]

    if mps and len({p.device.name for p in gpus}) > 1:
        raise ClaimError(
            f"GPU {mps[0].device.name!r} is shared through MPS, and a CUDA process connects to one MPS daemon, "
            f"which shows it only that GPU: put the claim's other GPUs "
            f"({', '.join(sorted({p.device.name for p in gpus} - {mps[0].device.name}))}) in a claim of their own"
        )


def _mps(p: PlannedDevice) -> bool:
    return p.device.kind == DeviceKind.GPU and p.config.gpu.sharing == Sharing.MPS


def _mib(n: int | None) -> str:

    return f"{n // MIB}Mi" if n is not None else "all"


class GpuSharing:
    """The node side of sharing: MPS limits into the claim's CDI edits, its daemon running, and
    time slices set. `daemons` None: a node without MPS supervision, where an MPS claim is
    refused; `time_slices` None: a node where a time-sliced claim keeps the GPU's interval."""

    def __init__(self, daemons: MpsDaemons | None, time_slices: TimeSlices | None = None) -> None:
        self.daemons = daemons
        self.time_slices = time_slices

    def plan(self, planned: Sequence[PlannedDevice]) -> list[PlannedDevice]:
        """The claim's devices, checked, each MPS GPU with the environment and mounts of its share."""
        check_gpu_sharing(planned)
        return [self._with_limits(p) if _mps(p) else p for p in planned]

    def _with_limits(self, p: PlannedDevice) -> PlannedDevice:
        if self.daemons is None:
            raise ClaimError(f"GPU {p.device.name!r}: GpuConfig.sharing MPS, but this driver runs no MPS daemons")
        share = share_of(p)

        env = [
            ("CUDA_MPS_PIPE_DIRECTORY", CONTAINER_PIPE_DIR),
            ("CUDA_MPS_LOG_DIRECTORY", CONTAINER_LOG_DIR),
            ("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", str(share.compute)),
        ]
        if share.memory is not None:
            env.append(("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", f"0={share.memory // MIB}M"))
        name = p.device.name
        mounts = (
            # Tandem's link to the current daemon's pipe directory, a new one for each start: the
            # runtime follows it when it makes the container, so this spec never goes stale (`mps_pipes`).
            cdi.Mount(
                host_path=str(self.daemons.pipe_dir(name)), container_path=CONTAINER_PIPE_DIR, options=_PIPE_OPTIONS
            ),
            cdi.Mount(
                host_path=str(self.daemons.log_dir(name)), container_path=CONTAINER_LOG_DIR, options=_LOG_OPTIONS
            ),
            # The daemon's private /dev/shm (`driver.claims.gpu.mps_shm`): MPS servers and clients share memory there.
            cdi.Mount(host_path=str(self.daemons.shm_dir(name)), container_path="/dev/shm", options=_PIPE_OPTIONS),
        )
        return dataclasses.replace(p, share_env=tuple(env), share_mounts=mounts)

    def realise(self, claim: str, records: Sequence[DeviceRecord]) -> None:
        """After the claim's record names its MPS GPUs and time slices: their daemons running and
        their intervals set (ClaimError if not)."""
        # This claim's GPUs only: another GPU's daemon that cannot start, or nvidia-smi failing
        # there, is that GPU's claims' failure, and costs this claim no time either.
        mps = {r.device for r in records if r.sharing == Sharing.MPS}
        sliced = {r.device for r in records if r.time_slice}
        try:
            if self.daemons is not None and mps:
                self.daemons.sync(mps)
            if self.time_slices is not None and sliced:
                self.time_slices.sync(devices=sliced)
        except MpsError as e:
            raise ClaimError(f"claim {claim}: MPS: {e}") from e
        except TimeSliceError as e:
            raise ClaimError(f"claim {claim}: time slice: {e}") from e

    def released(self) -> None:
        """After an unprepare: a daemon no claim needs any more stopped, an interval no claim
        needs any more back to the default (failures are logged; the next sync retries)."""
        for part in (self.daemons, self.time_slices):
            if part is None:
                continue
            try:
                part.sync()
            except (MpsError, TimeSliceError) as e:
                log.warning("GPU sharing: %s", e)
