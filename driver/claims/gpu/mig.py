"""Dynamic MIG on the node: making the MIG device a claim was allocated, and destroying it again.

`ensure` makes the GPU instance of a `MigPlacement` with NVML (nvmlDeviceCreateGpuInstanceWithPlacement),
then one compute instance spanning it (nvmlGpuInstanceCreateComputeInstance), and returns the device
as a container gets it: the MIG device's UUID, GPU/compute instance IDs and `nvidia-caps` minors,
read back as discovery reads any MIG device (`driver.discovery.gpu.mig`). `destroy` removes the compute
instances, then the GPU instance (NVML refuses the reverse with IN_USE).

Both are idempotent, which is what makes them safe inside the two-phase checkpoint
(`driver.claims.prepare`, `driver.claims.reconcile`): the placement is recorded before `ensure` and dropped only
after `destroy`, so a kill -9 at any step leaves a record naming what may exist, and the next call
finishes the job. A GPU instance already at the placement, of the placement's profile, is the one
an interrupted call made and is adopted; a compute instance already in it likewise. A failure
after this call made the GPU instance destroys it again, so no half-made partition is left behind.
Only what Tandem made is ever destroyed: a MIG device an administrator made is never touched.

What Tandem made is also noted apart from the records, by device identity (GPU UUID and
placement) with the claim it was made for (`driver.claims.gpu.mig_owners`): noted before it is
made, the note dropped after it is destroyed. So a lost checkpoint loses no GPU instance: discovery
still publishes it as its claim's partition, never as a free MIG device; the claim's prepare, run
again to rebuild its record, adopts it; the kubelet's unprepare, with or without a record, destroys
it; and start-up destroys those of claims that are gone (`collect`).

Every MIG change on the node, and every read of the note, holds one lock across the instances of
a rolling update, and each change bumps `generation`, which GPU discovery uses to redo a pass that
overlapped one of this process (`driver.discovery.gpu.discover`). Under that lock an instance that rolls back
what it made re-checks the note first: the other instance may have adopted the GPU instance
meanwhile (the kubelet turned to it) and handed it to a container, and then it stays.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from driver.claims.checkpoint import DeviceRecord
from driver.claims.gpu.mig_owners import Made, MigOwners
from driver.discovery.gpu.mig import MigReader
from driver.errors import DeviceError
from driver.model import Device, MigPlacement
from driver.node.nvml import (
    ERROR_GPU_IS_LOST,
    ERROR_NOT_FOUND,
    ERROR_NOT_SUPPORTED,
    NvmlError,
    init_nvml,
    shutdown_nvml,
)

log = logging.getLogger(__name__)

_MAX_INSTANCES = 16  # GPU instance IDs run 0-14 on every MIG GPU; compute instances 0-7
_CI_PROFILE_COUNT = 0x9  # NVML_COMPUTE_INSTANCE_PROFILE_COUNT in nvidia-ml-py 13
_ENGINE_SHARED = 0x0  # NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED
_ERROR_IN_USE = 19
_GONE = (ERROR_GPU_IS_LOST, ERROR_NOT_FOUND, ERROR_NOT_SUPPORTED)  # GPU gone or out of MIG mode: nothing left


class MigError(DeviceError):
    """The MIG device cannot be made or destroyed; the message says which and what NVML answered.
    `nothing_left`: a failed make left the node as it was (nothing of it to destroy later)."""

    def __init__(self, message: str, nothing_left: bool = False) -> None:
        super().__init__(message)
        self.nothing_left = nothing_left


def placements_of(devices: Sequence[Device]) -> list[MigPlacement]:
    return [d.gpu.placement for d in devices if d.gpu is not None and d.gpu.placement is not None]


def with_placements(records: Sequence[DeviceRecord], devices: Mapping[str, Device]) -> list[DeviceRecord]:
    """The claim's records, each naming the GPU instance its device is made as (dynamic MIG): what
    phase 1 of a prepare records before `ensure` makes it."""
    out = []
    for r in records:
        info = devices[r.device].gpu if r.device in devices else None
        out.append(dataclasses.replace(r, mig=info.placement) if info is not None and info.placement else r)
    return out


def describe(p: MigPlacement) -> str:
    return (
        f"GPU instance profile {p.profile_id} on memory slices {p.start}-{p.start + p.size - 1} of GPU {p.parent_uuid}"
    )


class MigPartitions:
    """`owners`: the note of the GPU instances Tandem made and the node-wide lock of every MIG
    change (`driver.claims.gpu.mig_owners`); `instance`: this driver instance's ID (`InstanceLock`),
    the owner it notes. `on_change` is called (outside the lock) after every change that reached NVML."""

    def __init__(
        self,
        driver_root: Path,
        proc_root: Path,
        owners: MigOwners,
        instance: str,
        on_change: Callable[[], None] = lambda: None,
    ) -> None:
        self._driver_root = driver_root
        self._proc_root = proc_root
        self._owners = owners
        self._instance = instance
        self._on_change = on_change
        self._generation = 0

    def generation(self) -> int:
        """How many MIG changes this process started; read without the lock (an int is atomic)."""
        return self._generation

    def owned(self) -> set[MigPlacement]:
        """The GPU instances the note says Tandem made or is making: discovery never publishes them
        as anyone else's (`driver.discovery.gpu.dynamic_mig`)."""
        with self._owners.changing() as notes:
            return set(notes)

    def realise(self, devices: Sequence[Device], claim: str, adopt: bool, recorded: Callable[[], bool]) -> list[Device]:
        """The devices of claim `claim` (its UID) as a container gets them, their MIG devices made
        first (`ensure`). When one cannot be made, a call that may not adopt destroys again those it
        made (`_roll_back`), and its MigError says whether nothing is left; a call that may adopt
        leaves all to the claim's record. `recorded`: whether the claim still has its record once
        they are made; if the claim was unprepared meanwhile (by the other instance of a rolling
        update, whose destroy came before some of them were made), none of them is kept."""
        out: list[Device] = []
        try:
            for device in devices:
                out.append(self._realise(device, claim, adopt))
        except MigError as e:
            rolled_back = adopt or self._roll_back(claim, placements_of(out))
            raise MigError(str(e), nothing_left=e.nothing_left and not adopt and rolled_back) from e
        if placements_of(out) and not recorded():
            self.destroy(claim)
            raise MigError("the claim was unprepared while its MIG devices were made", nothing_left=True)
        return out

    def _realise(self, device: Device, claim: str, adopt: bool) -> Device:
        info = device.gpu
        if info is None or info.placement is None:
            return device
        made = self.ensure(info.placement, claim, adopt)
        assert made.gpu is not None
        gpu = dataclasses.replace(
            info,
            uuid=made.gpu.uuid,
            parent_uuid=info.placement.parent_uuid,
            mig_gi=made.gpu.mig_gi,
            mig_ci=made.gpu.mig_ci,
            mig_caps=made.gpu.mig_caps,
        )
        return dataclasses.replace(device, gpu=gpu)

    def ensure(self, placement: MigPlacement, claim: str, adopt: bool) -> Device:
        """The MIG device of `placement` for claim `claim` (as `driver.discovery.gpu.mig` reads it),
        made if missing.

        A GPU instance already there is the claim's when the note says Tandem made it for this
        claim (a call that a crash, a failure or a lost checkpoint cut short), or, where the note
        names none, when `adopt` says the claim's record named the placement before this call. It
        is then adopted: this instance notes itself as its owner, so that the instance that made it
        no longer rolls it back. Any other GPU instance there is someone else's, made after the
        scheduler allocated the placement, and the claim fails.
        """
        try:
            return self._ensure(placement, claim, adopt)
        finally:
            self._on_change()

    def destroy(self, claim: str, placements: Iterable[MigPlacement] = (), keep: Collection[MigPlacement] = ()) -> None:
        """Destroy the MIG devices of claim `claim`, which is gone: those its record names
        (`placements`) and those the note gives it (its record may have been lost). One the note
        gives another claim is left to that claim: a record names a placement before its prepare
        finds out whether the placement is free. `keep`: the placements the claim's allocation
        still names, when the claim is not gone but was allocated again (the binding worker,
        `driver.claims.binding`): only the others go. MigError when NVML refuses one (those before
        it are gone); NVML is not even opened for a claim that has none."""
        placements = tuple(placements)
        reached = False
        try:
            with self._owners.changing() as notes:
                theirs = {p for p, m in notes.items() if m.claim != claim}
                for p in theirs.intersection(placements):
                    log.warning("%s is claim %s's, not %s's: left to it", describe(p), notes[p].claim, claim)
                mine = [p for p, m in notes.items() if m.claim == claim and p not in keep]
                targets = [p for p in dict.fromkeys([*placements, *mine]) if p not in theirs]
                if not targets:
                    return
                reached = True
                with _Nvml(self._driver_root) as nvml:
                    self._generation += 1
                    for p in targets:
                        self._remove(nvml, notes, p)
        finally:
            if reached:
                self._on_change()

    def collect(self, claims: Collection[str], alive: Callable[[str], bool]) -> None:
        """Destroy the GPU instances the note gives a claim that no record names (`claims`: the
        UIDs the checkpoint records, read before this call) when the instance of the driver that
        made or adopted it is gone (`alive`): a claim whose record was lost and that no pod uses
        any more, or a rollback a crash cut short. Start-up runs it once the records are complete;
        an instance of a live driver instance may be a prepare in flight, and is left to it. What
        NVML refuses is logged and tried again at the next start."""
        reached = False
        try:
            with self._owners.changing() as notes:
                orphans = [p for p, m in notes.items() if m.claim not in claims and not alive(m.owner)]
                if not orphans:
                    return
                reached = True
                with _Nvml(self._driver_root) as nvml:
                    self._generation += 1
                    for p in orphans:
                        log.warning(
                            "%s was made for claim %s, which no record names: destroying it",
                            describe(p),
                            notes[p].claim,
                        )
                        try:
                            self._remove(nvml, notes, p)
                        except MigError as e:
                            log.error("%s; tried again at the next start", e)
        except MigError as e:  # NVML not available
            log.error("%s; Tandem's GPU instances of claims that are gone are destroyed at the next start", e)
        finally:
            if reached:
                self._on_change()

    def _roll_back(self, claim: str, placements: Sequence[MigPlacement]) -> bool:
        """Destroy again what this call made for the claim when a later device of it failed; each
        unless another instance of the driver adopted it since (rolling update: the kubelet turned
        to that instance, which may have handed the device to a container already), which the note,
        read under the lock, tells. Whether nothing of them is left."""
        if not placements:
            return True
        try:
            with self._owners.changing() as notes, _Nvml(self._driver_root) as nvml:
                self._generation += 1
                clean = True
                for p in placements:
                    noted = notes.get(p)
                    if noted is not None and noted != Made(claim, self._instance):
                        log.warning(
                            "%s is not rolled back: instance %s of the driver took it over", describe(p), noted.owner
                        )
                        clean = False
                    elif noted is not None:
                        clean = self._undo(nvml, notes, p) and clean
                return clean
        except MigError as e:  # NVML not available
            log.error("%s; it is retried with the claim", e)
            return False
        finally:
            self._on_change()

    def _ensure(self, placement: MigPlacement, claim: str, adopt: bool) -> Device:
        with self._owners.changing() as notes, _Nvml(self._driver_root) as nvml:
            self._generation += 1
            try:
                gpu = nvml.nvmlDeviceGetHandleByUUID(placement.parent_uuid)
                gi = _find_gi(nvml, gpu, placement)
            except NvmlError as e:
                raise MigError(f"cannot make the MIG device ({describe(placement)}): {e}", nothing_left=True) from e
            noted = notes.get(placement)
            if gi is not None and not (noted.claim == claim if noted is not None else adopt):
                holder = f"the MIG device of claim {noted.claim}" if noted else "a MIG device Tandem did not make"
                raise MigError(f"{describe(placement)} is taken by {holder}", nothing_left=True)
            if noted != Made(claim, self._instance):  # noted before it is made; or adopted
                notes[placement] = Made(claim, self._instance)
                self._owners.save(notes)
            made_gi = gi is None
            try:
                if gi is None:
                    where = nvml.c_nvmlGpuInstancePlacement_t(placement.start, placement.size)
                    gi = nvml.nvmlDeviceCreateGpuInstanceWithPlacement(gpu, placement.profile_id, ctypes.byref(where))
                    log.info("created %s", describe(placement))
                ci_profile = _whole_ci_profile(nvml, gi)
                if not _compute_instances(nvml, gi, ci_profile):
                    nvml.nvmlGpuInstanceCreateComputeInstance(gi, ci_profile)
                gi_id = int(nvml.nvmlGpuInstanceGetInfo(gi).id)
                return self._mig_device(nvml, gpu, placement, gi_id)
            except Exception as e:
                left = not made_gi or not self._undo(nvml, notes, placement)
                if isinstance(e, (NvmlError, MigError)):
                    raise MigError(f"cannot make the MIG device ({describe(placement)}): {e}", not left) from e
                raise

    def _remove(self, nvml: ModuleType, notes: dict[MigPlacement, Made], placement: MigPlacement) -> None:
        """Destroy what exists of `placement`'s MIG device, its compute instances first (NVML
        refuses the reverse with IN_USE), then its note. MigError when NVML refuses."""
        try:
            gpu = nvml.nvmlDeviceGetHandleByUUID(placement.parent_uuid)
            gi = _find_gi(nvml, gpu, placement)
            if gi is not None:
                for profile in range(int(getattr(nvml, "NVML_COMPUTE_INSTANCE_PROFILE_COUNT", _CI_PROFILE_COUNT))):
                    for ci in _compute_instances(nvml, gi, profile):
                        nvml.nvmlComputeInstanceDestroy(ci)
                nvml.nvmlGpuInstanceDestroy(gi)
                log.info("destroyed %s", describe(placement))
        except NvmlError as e:
            if e.value not in _GONE:
                why = "a process still uses it" if e.value == _ERROR_IN_USE else str(e)
                raise MigError(f"cannot destroy the MIG device ({describe(placement)}): {why}") from e
            log.warning("%s: the GPU is gone or out of MIG mode (%s); nothing to destroy", describe(placement), e)
        if notes.pop(placement, None) is not None:
            self._owners.save(notes)

    def _undo(self, nvml: ModuleType, notes: dict[MigPlacement, Made], placement: MigPlacement) -> bool:
        """`_remove`, for a GPU instance this instance holds; whether it went. If not, it stays
        noted (and the caller's record names it), and the next call finishes it."""
        try:
            self._remove(nvml, notes, placement)
        except MigError as e:
            log.error("%s; it is retried with the claim", e)
            return False
        return True

    def _mig_device(self, nvml: ModuleType, gpu: Any, placement: MigPlacement, gi: int) -> Device:
        minor = int(nvml.nvmlDeviceGetMinorNumber(gpu))
        reader = MigReader(nvml, self._proc_root)
        where = f"gpu-{minor} ({placement.parent_uuid})"
        for mig in reader.devices(where, gpu, minor, placement.parent_uuid, "", {}, dynamic=True):
            if mig.gpu is not None and mig.gpu.mig_gi == gi:
                return mig
        raise MigError(f"the MIG device of {describe(placement)} was made but NVML does not list it")


class _Nvml:
    """nvmlInit/nvmlShutdown through the one door (`driver.node.nvml`), as a context."""

    def __init__(self, driver_root: Path) -> None:
        self._driver_root = driver_root
        self._nvml: ModuleType | None = None

    def __enter__(self) -> ModuleType:
        try:
            self._nvml = init_nvml(self._driver_root)
        except Exception as e:
            raise MigError(f"NVML is not available: {e}", nothing_left=True) from e
        return self._nvml

    def __exit__(self, *exc: object) -> None:
        if self._nvml is not None:
            shutdown_nvml(self._nvml)


def _find_gi(nvml: ModuleType, gpu: Any, placement: MigPlacement) -> Any | None:
    """The GPU instance of the placement's profile at its placement, if one exists."""
    array = (nvml.c_nvmlGpuInstance_t * _MAX_INSTANCES)()
    count = ctypes.c_uint(0)
    nvml.nvmlDeviceGetGpuInstances(gpu, placement.profile_id, array, ctypes.byref(count))
    for gi in array[: count.value]:
        info = nvml.nvmlGpuInstanceGetInfo(gi)
        if (int(info.placement.start), int(info.placement.size)) == (placement.start, placement.size):
            return gi
    return None


def _whole_ci_profile(nvml: ModuleType, gi: Any) -> int:
    """The compute instance profile that spans the GPU instance (the most compute slices)."""
    best: tuple[int, int] | None = None
    for profile in range(int(getattr(nvml, "NVML_COMPUTE_INSTANCE_PROFILE_COUNT", _CI_PROFILE_COUNT))):
        try:
            info = nvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(gi, profile, _ENGINE_SHARED)
        except NvmlError:
            continue
        if best is None or int(info.sliceCount) > best[0]:
            best = (int(info.sliceCount), int(info.id))
    if best is None:
        raise MigError("the GPU instance offers no compute instance profile")
    return best[1]


def _compute_instances(nvml: ModuleType, gi: Any, profile: int) -> list[Any]:
    array = (nvml.c_nvmlComputeInstance_t * _MAX_INSTANCES)()
    count = ctypes.c_uint(0)
    try:
        nvml.nvmlGpuInstanceGetComputeInstances(gi, profile, array, ctypes.byref(count))
    except NvmlError as e:
        if e.value == ERROR_NOT_SUPPORTED:  # a profile this GPU instance does not have
            return []
        raise
    return list(array[: count.value])
