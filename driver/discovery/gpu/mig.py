"""MIG devices: their names, and reading the MIG devices of a GPU in MIG mode from NVML.

A GPU in MIG mode is published only as its existing MIG devices,
`gpu-<minor>-mig-<profile label>-<gi>-<ci>` (see `mig_device_name`); one in MIG mode without MIG
devices publishes nothing and is logged as stranded capacity (docs/reference/drivers.md says why
this naming, and what NVIDIA's driver does instead). Access to a MIG device is granted by
`/dev/nvidia-caps` minors, read from `<proc_root>/driver/nvidia/capabilities/`.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from cdi import is_dns_label
from driver.discovery.gpu.attributes import MIB, binary_quantity, fit_limits
from driver.model import AttrValue, Device, DeviceKind, GpuInfo
from driver.node.nvml import (
    ERROR_INVALID_ARGUMENT,
    ERROR_NOT_FOUND,
    ERROR_NOT_SUPPORTED,
    DeviceSkipped,
    NvmlError,
    optional,
    text,
)
from driver.resource_api import MAX_VALUE_LENGTH

log = logging.getLogger(__name__)

_GPU_INSTANCE_PROFILE_COUNT = 0x12  # NVML_GPU_INSTANCE_PROFILE_COUNT in nvidia-ml-py 13
_MIG_NAME = re.compile(r"^gpu-(\d+)-mig-([a-z0-9]+(?:-[a-z0-9]+)*?)-(\d+)-(\d+)$")
# A MIG profile's name as NVML spells it (after "MIG "): [<c>c.]<g>g.<gb>gb[(+|-)<attribute>], an
# attribute being dot-separated words ("me", "me.all", "gfx").
_PROFILE = re.compile(r"(?:(\d+)c\.)?(\d+)g\.(\d+)gb(?:([+-])([a-z][a-z0-9]*(?:\.[a-z][a-z0-9]*)*))?")


@dataclass(frozen=True)
class MigName:
    parent_minor: int
    profile_label: str
    gi: int
    ci: int


def profile_label(profile: str) -> str | None:
    """The profile as it appears in a device name, a DNS-label-safe spelling that no other profile
    has; None for a name outside NVML's grammar, `[<c>c.]<g>g.<gb>gb[+<attribute>|-<attribute>]`.

    Dots become dashes. An attribute the profile adds ("+me" media extensions, "+me.all" every
    media engine, "+gfx" graphics) is kept; one it takes away ("-me": no media engine) becomes
    "no<attribute>", as NVIDIA's vGPU type names spell them (ME, NOME, MEALL, GFX):
    "1g.10gb" -> "1g-10gb", "1g.24gb+me" -> "1g-24gb-me", "1g.24gb-me" -> "1g-24gb-nome",
    "1g.24gb+me.all" -> "1g-24gb-me-all", "1c.2g.20gb" -> "1c-2g-20gb". One-to-one, because a
    dynamic-MIG GPU publishes one device per profile and placement under this label: two profiles
    with one label would publish one of them only (Blackwell's "+me" and "-me" did). So an added
    attribute spelt "no..." has no label (it would read as a removed one); NVML has none.
    """
    m = _PROFILE.fullmatch(profile.lower())
    if m is None:
        return None
    c, g, gb, sign, attribute = m.groups()
    if sign == "+" and attribute.startswith("no"):
        return None
    label = f"{c}c-{g}g-{gb}gb" if c else f"{g}g-{gb}gb"
    if sign is None:
        return label
    return f"{label}-{'no' if sign == '-' else ''}{attribute.replace('.', '-')}"


def mig_device_name(parent_minor: int, profile: str, gi: int, ci: int) -> str | None:
    """`gpu-<parent minor>-mig-<profile label>-<GPU instance ID>-<compute instance ID>`; None when
    the profile has no label.

    The profile is in the name so that devices sort by size under one GPU (the scheduler takes
    the first fit); the last two numbers identify the MIG device on its GPU, so the name is stable
    for as long as the MIG device exists. `parse_mig_device_name` inverts it.
    """
    label = profile_label(profile)
    return None if label is None else f"gpu-{parent_minor}-mig-{label}-{gi}-{ci}"


def parse_mig_device_name(name: str) -> MigName | None:
    m = _MIG_NAME.match(name)
    if not m:
        return None
    return MigName(int(m.group(1)), m.group(2), int(m.group(3)), int(m.group(4)))


def gpu_instance_profiles(nvml: ModuleType, handle: Any) -> Iterator[Any]:
    """nvmlGpuInstanceProfileInfo of each GPU instance profile the GPU supports (every
    NVML_GPU_INSTANCE_PROFILE_* value is asked; NVML refuses those it has not). Other failures raise."""
    for profile in range(int(getattr(nvml, "NVML_GPU_INSTANCE_PROFILE_COUNT", _GPU_INSTANCE_PROFILE_COUNT))):
        try:
            yield nvml.nvmlDeviceGetGpuInstanceProfileInfo(handle, profile)
        except NvmlError as e:
            if e.value not in (ERROR_NOT_SUPPORTED, ERROR_INVALID_ARGUMENT):
                raise


class MigReader:
    """Reads MIG devices and GPU instance profiles through one initialised NVML."""

    def __init__(self, nvml: ModuleType, proc_root: Path) -> None:
        self.nvml = nvml
        self.proc_root = proc_root

    def supported_profiles(self, where: str, handle: Any) -> list[str]:
        """Names of the GPU instance profiles this GPU supports (e.g. "1g.10gb"), smallest first."""
        found: dict[str, tuple[int, int]] = {}
        try:
            for info in gpu_instance_profiles(self.nvml, handle):
                name = text(info.name).removeprefix("MIG ").strip()
                if name and len(name) <= MAX_VALUE_LENGTH:
                    found.setdefault(name, (int(info.sliceCount), int(info.memorySizeMB)))
        except NvmlError as e:
            log.warning("%s: GPU instance profiles: %s; migProfiles may be incomplete", where, e)
        return sorted(found, key=lambda n: (*found[n], n))

    def devices(
        self,
        where: str,
        handle: Any,
        minor: int,
        uuid: str,
        bdf: str,
        common: dict[str, AttrValue],
        dynamic: bool = False,
    ) -> list[Device]:
        """The GPU's MIG devices. `dynamic`: Tandem makes them on demand, so none is no stranded capacity."""
        nvml = self.nvml
        try:
            slots = int(nvml.nvmlDeviceGetMaxMigDeviceCount(handle))
        except NvmlError as e:
            raise DeviceSkipped(where, f"in MIG mode, but its MIG devices cannot be listed: {e}") from e
        devices = []
        failed = 0
        for slot in range(slots):
            try:
                mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot)
            except NvmlError as e:
                if e.value != ERROR_NOT_FOUND:
                    failed += 1
                    log.warning("%s: MIG device slot %d: %s", where, slot, e)
                continue
            try:
                devices.append(self._device(where, mig, minor, uuid, bdf, common))
            except DeviceSkipped as e:
                failed += 1
                log.warning("%s: MIG device skipped: %s", where, e.args[1])
        if not devices and not failed and not dynamic:
            log.warning("%s is in MIG mode but has no MIG devices: its capacity is stranded", where)
        return devices

    def _device(
        self, where: str, mig: Any, minor: int, parent_uuid: str, bdf: str, common: dict[str, AttrValue]
    ) -> Device:
        nvml = self.nvml
        try:
            uuid = text(nvml.nvmlDeviceGetUUID(mig))
            gi = int(nvml.nvmlDeviceGetGpuInstanceId(mig))
            ci = int(nvml.nvmlDeviceGetComputeInstanceId(mig))
        except NvmlError as e:
            raise DeviceSkipped(where, f"cannot read its identity: {e}") from e
        if not 0 < len(uuid) <= MAX_VALUE_LENGTH:
            raise DeviceSkipped(where, f"MIG device UUID {uuid[:80]!r} is not publishable")
        mig_where = f"{where} MIG {uuid}"
        info = optional(mig_where, "capacities", nvml.nvmlDeviceGetAttributes, mig)
        profile = self._profile(mig_where, mig, info)
        name = mig_device_name(minor, profile, gi, ci)
        if name is None or not is_dns_label(name) or len(profile) > MAX_VALUE_LENGTH:
            raise DeviceSkipped(where, f"MIG device {uuid} profile {profile!r} gives no valid device name")
        attrs: dict[str, AttrValue] = {
            "type": "mig",
            "uuid": uuid,
            "parentUUID": parent_uuid,
            "profile": profile,
            **common,
        }
        caps: dict[str, str] = {}
        if info is not None:
            caps = {
                "memory": binary_quantity(int(info.memorySizeMB) * MIB),
                "multiprocessors": str(int(info.multiprocessorCount)),
                "copyEngines": str(int(info.sharedCopyEngineCount)),
                "decoders": str(int(info.sharedDecoderCount)),
                "encoders": str(int(info.sharedEncoderCount)),
                "jpegEngines": str(int(info.sharedJpegCount)),
                "ofaEngines": str(int(info.sharedOfaCount)),
            }
        return Device(
            name=name,
            kind=DeviceKind.MIG,
            attributes=fit_limits(name, attrs, caps),
            capacity=caps,
            gpu=GpuInfo(
                minor=minor,
                uuid=uuid,
                pci_bus_id=bdf,
                parent_uuid=parent_uuid,
                mig_gi=gi,
                mig_ci=ci,
                mig_caps=self._caps(mig_where, minor, gi, ci),
            ),
        )

    def _profile(self, where: str, mig: Any, info: Any) -> str:
        """The MIG profile from the device name ("... MIG 1g.10gb"), else rebuilt from its attributes."""
        name = optional(where, "profile from the name", self.nvml.nvmlDeviceGetName, mig)
        if name is not None:
            m = re.search(r"\bMIG\s+(\S+)$", text(name))
            if m:
                return m.group(1)
        if info is None:
            raise DeviceSkipped(where, "its MIG profile cannot be determined")
        g, c = int(info.gpuInstanceSliceCount), int(info.computeInstanceSliceCount)
        gb = -(-int(info.memorySizeMB) // 1024)
        return f"{g}g.{gb}gb" if c in (0, g) else f"{c}c.{g}g.{gb}gb"

    def _caps(self, where: str, minor: int, gi: int, ci: int) -> tuple[int, ...]:
        """The nvidia-caps minors of the GPU instance and the compute instance, in that order."""
        gi_dir = self.proc_root / "driver" / "nvidia" / "capabilities" / f"gpu{minor}" / "mig" / f"gi{gi}"
        caps = []
        for path in (gi_dir / "access", gi_dir / f"ci{ci}" / "access"):
            try:
                m = re.search(r"^DeviceFileMinor:\s*(\d+)\s*$", path.read_text(), re.MULTILINE)
            except OSError as e:
                log.warning("%s: cannot read %s: %s", where, path, e)
                return ()
            if m is None:
                log.warning("%s: %s has no DeviceFileMinor", where, path)
                return ()
            caps.append(int(m.group(1)))
        return tuple(caps)
