"""Dynamic MIG: a GPU in MIG mode published as every MIG partition it could have, made at prepare.

For a GPU the administrator put in MIG mode and named in `--dynamic-mig`, Tandem publishes
(docs/reference/resource-api.md, 'Counters and partitionable devices'; KEP-4815's MIG example):

* one counter set per GPU, `gpu-<minor>-counters`: a counter per memory slice
  (`memory-slice-<i>`, 1 each), the GPU's compute slices (`compute-slices`) and each kind of media
  engine that the compute slices do not already ration (`engine_counters`): `ofa-engines` on
  A100/H100/H200 (the unit only one "+me" media-extension instance may hold); on Blackwell, whose
  "+me.all" profile holds every decoder, encoder, JPEG and OFA engine on one compute slice,
  `decoders`, `encoders` and `jpeg-engines` too;
* one device per possible placement of every GPU instance profile NVML reports,
  `gpu-<minor>-mig-<profile label>-p<first memory slice>` (type `mig`; one label per profile,
  `driver.discovery.gpu.mig.profile_label`), consuming the memory slices of its placement, its compute
  slices and its media engines. NVML refuses a GPU instance that overlaps another's memory slices
  (nvmlDeviceGetGpuInstancePossiblePlacements) or needs engines another holds, so two placements
  the scheduler could allocate together are exactly two NVML could create together;
* the whole GPU, `gpu-<minor>` (type `gpu`), consuming all of it: the scheduler never gives it out
  with any partition. In MIG mode CUDA reaches a GPU only through a MIG device, so preparing it
  makes the GPU instance that spans the GPU (the largest profile, at slice 0). That profile's one
  placement is therefore not published a second time as a partition: one device per GPU instance,
  so an event NVML attributes to it names one device.

GPU instances that Tandem did not create (`owned`: the placements its checkpoint records or its MIG
note names, `driver.claims.gpu.mig_owners`; a lost checkpoint loses none of them) are the
administrator's: they are published as today's MIG devices (`driver.discovery.gpu.mig`) and never
destroyed; placements they overlap, or whose compute slices or engines they hold, are not published,
their share is taken out of the counters, and neither is the whole GPU while they exist. A GPU
instance Tandem made is the placement device it was made for, with the MIG device's identity
(`GpuInfo` GI/CI, capabilities) so health events find it; its published form does not change, so
carving a partition costs no slice write.

Device names stay stable before the GPU instance exists (it has no ID yet) and across its life:
`p<start>` is the placement, not an NVML ID. `parse_placement_name` inverts them.
"""

from __future__ import annotations

import ctypes
import logging
import re
from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace
from types import ModuleType
from typing import Any

from cdi import is_dns_label
from driver.discovery.gpu.attributes import MIB, binary_quantity, fit_limits
from driver.discovery.gpu.mig import gpu_instance_profiles, profile_label
from driver.model import AttrValue, CounterSet, CounterUse, Device, DeviceKind, MigPlacement
from driver.node.nvml import DeviceSkipped, NvmlError, text
from driver.resource_api import MAX_COUNTERS

log = logging.getLogger(__name__)

COMPUTE_SLICES = "compute-slices"
OFA_ENGINES = "ofa-engines"
ENGINE_COUNTERS = ("decoders", "encoders", "jpeg-engines", OFA_ENGINES)  # `GiProfile.engines`
_PLACEMENT_NAME = re.compile(r"^gpu-(\d+)-mig-([a-z0-9]+(?:-[a-z0-9]+)*?)-p(\d+)$")


def counter_set_name(minor: int) -> str:
    return f"gpu-{minor}-counters"


def memory_slice(index: int) -> str:
    return f"memory-slice-{index}"


def placement_device_name(minor: int, profile: str, start: int) -> str | None:
    """`gpu-<minor>-mig-<profile label>-p<first memory slice>`, e.g. gpu-7-mig-1g-10gb-p3; None
    for a profile without a label."""
    label = profile_label(profile)
    return None if label is None else f"gpu-{minor}-mig-{label}-p{start}"


def parse_placement_name(name: str) -> tuple[int, str, int] | None:
    """(parent minor, profile label, first memory slice) of a placement device's name, or None."""
    m = _PLACEMENT_NAME.match(name)
    return (int(m.group(1)), m.group(2), int(m.group(3))) if m else None


@dataclass(frozen=True)
class GiProfile:
    """A GPU instance profile as NVML describes it, with its possible placements."""

    id: int
    name: str
    slices: int  # compute slices
    memory_mb: int
    multiprocessors: int
    copy_engines: int
    decoders: int
    encoders: int
    jpeg: int
    ofa: int
    placements: tuple[tuple[int, int], ...]  # (start, size) in memory slices

    def engines(self) -> dict[str, int]:
        """The media engines a GPU instance of this profile holds, by counter (`ENGINE_COUNTERS`)."""
        return dict(zip(ENGINE_COUNTERS, (self.decoders, self.encoders, self.jpeg, self.ofa), strict=True))


@dataclass(frozen=True)
class GpuInstance:
    """An existing GPU instance: its ID and what it occupies."""

    id: int
    profile_id: int
    start: int
    size: int


class DynamicMigReader:
    """Reads a MIG-mode GPU's profiles, placements and GPU instances through one initialised NVML."""

    def __init__(self, nvml: ModuleType) -> None:
        self.nvml = nvml

    def profiles(self, where: str, handle: Any) -> list[GiProfile]:
        """Every GPU instance profile the GPU supports, with its placements. DeviceSkipped when NVML
        cannot say: a GPU is served dynamically only on complete knowledge."""
        nvml = self.nvml
        out: dict[int, GiProfile] = {}
        try:
            for info in gpu_instance_profiles(nvml, handle):
                pid = int(info.id)
                out[pid] = GiProfile(
                    id=pid,
                    name=text(info.name).removeprefix("MIG ").strip(),
                    slices=int(info.sliceCount),
                    memory_mb=int(info.memorySizeMB),
                    multiprocessors=int(info.multiprocessorCount),
                    copy_engines=int(info.copyEngineCount),
                    decoders=int(info.decoderCount),
                    encoders=int(info.encoderCount),
                    jpeg=int(info.jpegCount),
                    ofa=int(info.ofaCount),
                    placements=self._placements(handle, pid),
                )
        except NvmlError as e:
            raise DeviceSkipped(where, f"its MIG profiles and placements cannot be read: {e}") from e
        return sorted(out.values(), key=lambda p: (p.slices, p.memory_mb, p.name))

    def _placements(self, handle: Any, profile_id: int) -> tuple[tuple[int, int], ...]:
        nvml = self.nvml
        count = ctypes.c_uint(0)
        nvml.nvmlDeviceGetGpuInstancePossiblePlacements(handle, profile_id, None, ctypes.byref(count))
        array = (nvml.c_nvmlGpuInstancePlacement_t * count.value)()
        nvml.nvmlDeviceGetGpuInstancePossiblePlacements(handle, profile_id, array, ctypes.byref(count))
        return tuple((int(p.start), int(p.size)) for p in array[: count.value])

    def instances(self, where: str, handle: Any, profiles: Sequence[GiProfile]) -> list[GpuInstance]:
        """The GPU instances that exist now, of every profile."""
        nvml = self.nvml
        out = []
        try:
            for p in profiles:
                room = max(len(p.placements), 1)
                array = (nvml.c_nvmlGpuInstance_t * room)()
                count = ctypes.c_uint(0)
                nvml.nvmlDeviceGetGpuInstances(handle, p.id, array, ctypes.byref(count))
                for gi in array[: count.value]:
                    info = nvml.nvmlGpuInstanceGetInfo(gi)
                    out.append(
                        GpuInstance(
                            int(info.id), int(info.profileId), int(info.placement.start), int(info.placement.size)
                        )
                    )
        except NvmlError as e:
            raise DeviceSkipped(where, f"its GPU instances cannot be listed: {e}") from e
        return sorted(out, key=lambda g: g.id)


def whole_gpu_profile(profiles: Sequence[GiProfile]) -> GiProfile | None:
    """The profile whose one instance spans every memory slice (7g on A100/H100/H200)."""
    slices = memory_slices(profiles)
    spanning = [p for p in profiles if (0, slices) in p.placements]
    return max(spanning, key=lambda p: p.slices) if spanning else None


def memory_slices(profiles: Sequence[GiProfile]) -> int:
    return max((start + size for p in profiles for start, size in p.placements), default=0)


def engine_counters(profiles: Sequence[GiProfile], full: GiProfile) -> dict[str, int]:
    """The media-engine counters the GPU needs, each with how many engines of its kind the GPU has
    (the most any profile holds). A kind that every profile holds at most its share of the compute
    slices of needs none: placements that fit in the compute slices fit in its engines too. One
    that a profile holds more of (H100's "+me" the one OFA; Blackwell's "+me.all" every engine, on
    one slice) gets one, or the scheduler would pair placements NVML refuses together."""
    out = {}
    for counter in ENGINE_COUNTERS:
        total = max(p.engines()[counter] for p in profiles)
        if any(p.engines()[counter] * full.slices > total * p.slices for p in profiles):
            out[counter] = total
    return out


def tandems(uuid: str, instances: Sequence[GpuInstance], owned: Collection[MigPlacement]) -> dict[int, GpuInstance]:
    """The GPU instances (by ID) Tandem made, told by device identity: the GPU and the placement."""
    return {gi.id: gi for gi in instances if MigPlacement(uuid, gi.profile_id, gi.start, gi.size) in owned}


def publish(
    minor: int,
    uuid: str,
    whole: Device,
    profiles: Sequence[GiProfile],
    instances: Sequence[GpuInstance],
    migs: Sequence[Device],
    owned: Collection[MigPlacement],
) -> list[Device]:
    """The devices of a dynamic-MIG GPU (module docstring). Pure.

    `whole` is the GPU as a full GPU would be published, `migs` the MIG devices that exist (as
    `driver.discovery.gpu.mig` reads them), `owned` the placements Tandem created or is creating.
    """
    by_id = {p.id: p for p in profiles}
    full = whole_gpu_profile(profiles)
    if full is None:
        log.warning("gpu-%d: no MIG profile spans the whole GPU; publishing its MIG devices only", minor)
        return list(migs)
    slices = memory_slices(profiles)
    ours = tandems(uuid, instances, owned)
    theirs = [by_id[gi.profile_id] for gi in instances if gi.id not in ours and gi.profile_id in by_id]  # profiles
    busy = {s for gi in instances if gi.id not in ours for s in range(gi.start, gi.start + gi.size)}
    engines = engine_counters(profiles, full)
    left = {COMPUTE_SLICES: full.slices - sum(p.slices for p in theirs)}
    left |= {k: total - sum(p.engines()[k] for p in theirs) for k, total in engines.items()}
    totals = {memory_slice(i): 0 if i in busy else 1 for i in range(slices)} | {k: max(v, 0) for k, v in left.items()}
    if len(totals) > MAX_COUNTERS:
        log.warning(
            "gpu-%d: %d memory slices need more counters than a set holds; publishing its MIG devices only",
            minor,
            slices,
        )
        return list(migs)
    counters = CounterSet(counter_set_name(minor), _quantities(totals))
    common = {k: v for k, v in whole.attributes.items() if k not in ("type", "uuid", "migProfiles")}
    out = [m for m in migs if m.gpu is not None and m.gpu.mig_gi not in ours]
    realised = {m.gpu.mig_gi: m for m in migs if m.gpu is not None and m.gpu.mig_gi in ours}
    for p in profiles:
        needs = {COMPUTE_SLICES: p.slices} | {k: p.engines()[k] for k in engines}
        for start, size in p.placements:
            span = set(range(start, start + size))
            if span & busy or any(n > totals[k] for k, n in needs.items()) or (p, start) == (full, 0):
                continue
            made = next((gi for gi in ours.values() if (gi.profile_id, gi.start) == (p.id, start)), None)
            device = _placement_device(minor, uuid, whole, common, p, start, size, counters, needs)
            if device is not None:
                out.append(_realised(device, realised.get(made.id) if made else None))
    if not busy:
        use = {memory_slice(i): 1 for i in range(slices)} | {COMPUTE_SLICES: full.slices} | engines
        assert whole.gpu is not None
        info = replace(whole.gpu, placement=MigPlacement(uuid, full.id, 0, slices))
        made = next((gi for gi in ours.values() if (gi.profile_id, gi.start) == (full.id, 0)), None)
        device = replace(whole, gpu=info, consumes_counters=(CounterUse(counters, _quantities(use)),))
        out.append(_realised(device, realised.get(made.id) if made else None))
    return out


def _quantities(values: dict[str, int]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((k, str(v)) for k, v in values.items()))


def _placement_device(
    minor: int,
    uuid: str,
    whole: Device,
    common: dict[str, AttrValue],
    p: GiProfile,
    start: int,
    size: int,
    counters: CounterSet,
    needs: dict[str, int],
) -> Device | None:
    """`needs`: what it consumes besides its memory slices (compute slices, counted engines)."""
    name = placement_device_name(minor, p.name, start)
    if name is None or not is_dns_label(name):
        log.warning(
            "gpu-%d: MIG profile %r gives no valid device name; its placements are not published", minor, p.name
        )
        return None
    attrs: dict[str, AttrValue] = {
        "type": "mig",
        "parentUUID": uuid,
        "profile": p.name,
        "placementStart": start,
        "placementSize": size,
        **common,
    }
    caps = {
        "memory": binary_quantity(p.memory_mb * MIB),
        "multiprocessors": str(p.multiprocessors),
        "copyEngines": str(p.copy_engines),
        "decoders": str(p.decoders),
        "encoders": str(p.encoders),
        "jpegEngines": str(p.jpeg),
        "ofaEngines": str(p.ofa),
    }
    use = {memory_slice(s): 1 for s in range(start, start + size)} | {k: n for k, n in needs.items() if n}
    assert whole.gpu is not None
    return Device(
        name=name,
        kind=DeviceKind.MIG,
        attributes=fit_limits(name, attrs, caps),
        capacity=caps,
        gpu=replace(whole.gpu, uuid="", parent_uuid=uuid, placement=MigPlacement(uuid, p.id, start, size)),
        pcie_path=whole.pcie_path,
        consumes_counters=(CounterUse(counters, _quantities(use)),),
    )


def _realised(device: Device, mig: Device | None) -> Device:
    """A device whose GPU instance exists: the MIG device's identity (UUID, GPU and compute instance,
    capabilities), for health events and for a prepare that finds it made."""
    if mig is None or mig.gpu is None or device.gpu is None:
        return device
    g = mig.gpu
    info = replace(
        device.gpu, uuid=g.uuid, parent_uuid=g.parent_uuid, mig_gi=g.mig_gi, mig_ci=g.mig_ci, mig_caps=g.mig_caps
    )
    return replace(device, gpu=info)
