"""Dynamic MIG on the node: making the MIG device a claim was allocated, and destroying it again.

`ensure` makes the GPU instance of a `MigPlacement` with NVML (nvmlDeviceCreateGpuInstanceWithPlacement),
then one compute instance spanning it (nvmlGpuInstanceCreateComputeInstance), and returns the device
as a container gets it: the MIG device's UUID, GPU/compute instance IDs and `nvidia-caps` minors,
read back as discovery reads any MIG device (`driver.discovery.mig`). `destroy` removes the compute
instances, then the GPU instance (NVML refuses the reverse with IN_USE).

Both are idempotent, which is what makes them safe inside the two-phase checkpoint
(`driver.claims.prepare`, `driver.claims.reconcile`): the placement is recorded before `ensure` and dropped only
after `destroy`, so a kill -9 at any step leaves a record naming what may exist, and the next call
finishes the job. A GPU instance already at the placement, of the placement's profile, is the one
an interrupted call made and is adopted; a compute instance already in it likewise. A failure
after this call made the GPU instance destroys it again, so no half-made partition is left behind.
Only recorded placements are ever destroyed: a MIG device an administrator made is never touched.

NVML calls that change MIG are serialised in this process, and each bumps `generation`, which GPU
discovery uses to redo a pass that overlapped one (`driver.discovery.gpu`).
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from driver.claims.checkpoint import DeviceRecord
from driver.discovery.mig import MigReader
from driver.model import Device, MigPlacement
from driver.node.nvml import ERROR_GPU_IS_LOST, ERROR_NOT_FOUND, ERROR_NOT_SUPPORTED, init_nvml, shutdown_nvml

log = logging.getLogger(__name__)

_MAX_INSTANCES = 16  # GPU instance IDs run 0-14 on every MIG GPU; compute instances 0-7
_CI_PROFILE_COUNT = 0x9  # NVML_COMPUTE_INSTANCE_PROFILE_COUNT in nvidia-ml-py 13
_ENGINE_SHARED = 0x0  # NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED
_ERROR_IN_USE = 19
_GONE = (ERROR_GPU_IS_LOST, ERROR_NOT_FOUND, ERROR_NOT_SUPPORTED)  # GPU gone or out of MIG mode: nothing left


class MigError(Exception):
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
    """`on_change` is called (outside the lock) after every `ensure` and `destroy` that reached NVML."""

    def __init__(self, driver_root: Path, proc_root: Path, on_change: Callable[[], None] = lambda: None) -> None:
        self._driver_root = driver_root
        self._proc_root = proc_root
        self._on_change = on_change
        self._lock = threading.Lock()
        self._generation = 0

    def generation(self) -> int:
        """How many MIG changes this process started; read without the lock (an int is atomic)."""
        return self._generation

    def realise(self, devices: Sequence[Device], adopt: bool) -> list[Device]:
        """The devices as a container gets them, their MIG devices made first (`ensure`). When one
        cannot be made, a call that may not adopt destroys again those it made, and its MigError
        says whether nothing is left; a call that may adopt leaves all to the claim's record."""
        out: list[Device] = []
        try:
            for device in devices:
                out.append(self._realise(device, adopt))
        except MigError as e:
            clean = e.nothing_left and not adopt
            for made in placements_of(out) if not adopt else []:
                try:
                    self.destroy(made)
                except MigError as undo:
                    log.error("%s; it is retried with the claim", undo)
                    clean = False
            raise MigError(str(e), nothing_left=clean) from e
        return out

    def _realise(self, device: Device, adopt: bool) -> Device:
        info = device.gpu
        if info is None or info.placement is None:
            return device
        if adopt and info.mig_caps and info.mig_gi is not None:
            return device  # discovery found it made: this claim's, since its record named it first
        made = self.ensure(info.placement, adopt)
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

    def ensure(self, placement: MigPlacement, adopt: bool) -> Device:
        """The MIG device of `placement` (as `driver.discovery.mig` reads it), made if missing.

        `adopt`: a GPU instance already there may be this claim's own, made by a call a crash or a
        failure cut short (the claim's record named the placement before this call). Otherwise it
        is someone else's, made after the scheduler allocated the placement, and the claim fails.
        """
        try:
            return self._ensure(placement, adopt)
        finally:
            self._on_change()

    def destroy(self, placement: MigPlacement) -> None:
        """Destroy what exists of `placement`'s MIG device: compute instances, then the GPU instance."""
        try:
            self._destroy(placement)
        finally:
            self._on_change()

    def _ensure(self, placement: MigPlacement, adopt: bool) -> Device:
        with self._lock, _Nvml(self._driver_root) as nvml:
            self._generation += 1
            try:
                gpu = nvml.nvmlDeviceGetHandleByUUID(placement.parent_uuid)
                gi = _find_gi(nvml, gpu, placement)
            except nvml.NVMLError as e:
                raise MigError(f"cannot make the MIG device ({describe(placement)}): {e}", nothing_left=True) from e
            if gi is not None and not adopt:
                raise MigError(f"{describe(placement)} is taken by a MIG device Tandem did not make", nothing_left=True)
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
                left = not made_gi or (gi is not None and not self._undo(nvml, gi, placement))
                if isinstance(e, (nvml.NVMLError, MigError)):
                    raise MigError(f"cannot make the MIG device ({describe(placement)}): {e}", not left) from e
                raise

    def _destroy(self, placement: MigPlacement) -> None:
        with self._lock, _Nvml(self._driver_root) as nvml:
            self._generation += 1
            try:
                gpu = nvml.nvmlDeviceGetHandleByUUID(placement.parent_uuid)
                gi = _find_gi(nvml, gpu, placement)
                if gi is None:
                    return
                for profile in range(int(getattr(nvml, "NVML_COMPUTE_INSTANCE_PROFILE_COUNT", _CI_PROFILE_COUNT))):
                    for ci in _compute_instances(nvml, gi, profile):
                        nvml.nvmlComputeInstanceDestroy(ci)
                nvml.nvmlGpuInstanceDestroy(gi)
                log.info("destroyed %s", describe(placement))
            except nvml.NVMLError as e:
                if e.value in _GONE:
                    log.warning(
                        "%s: the GPU is gone or out of MIG mode (%s); nothing to destroy", describe(placement), e
                    )
                    return
                why = "a process still uses it" if e.value == _ERROR_IN_USE else str(e)
                raise MigError(f"cannot destroy the MIG device ({describe(placement)}): {why}") from e

    def _undo(self, nvml: ModuleType, gi: Any, placement: MigPlacement) -> bool:
        """Roll back a GPU instance this call made, so a failure leaves no half-made partition;
        whether it went. If not, the caller's record still names it and the next call finishes it."""
        try:
            for profile in range(int(getattr(nvml, "NVML_COMPUTE_INSTANCE_PROFILE_COUNT", _CI_PROFILE_COUNT))):
                for ci in _compute_instances(nvml, gi, profile):
                    nvml.nvmlComputeInstanceDestroy(ci)
            nvml.nvmlGpuInstanceDestroy(gi)
            log.info("rolled back %s", describe(placement))
            return True
        except nvml.NVMLError as e:
            log.error("%s could not be rolled back (%s); it is retried with the claim", describe(placement), e)
            return False

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
        except nvml.NVMLError:
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
    except nvml.NVMLError as e:
        if e.value == ERROR_NOT_SUPPORTED:  # a profile this GPU instance does not have
            return []
        raise
    return list(array[: count.value])
