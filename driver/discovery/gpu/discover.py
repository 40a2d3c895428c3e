"""GPU discovery through NVML: full GPUs, and the MIG devices of GPUs in MIG mode (`mig`).

`GpuDiscovery.discover()` is a full, stateless rediscovery, cheap enough for a slow period and for
on-demand calls (hot-plug, MIG reconfiguration). Each call brackets its work with
`nvmlInit`/`nvmlShutdown` (`driver.node.nvml`). When `nvmlInit` fails (driver not loaded yet,
library missing) `NvmlUnavailable` is raised and retrying is the caller's job (driver.inventory.sources).

Every NVML call about one GPU is isolated: a GPU whose identity (minor number, UUID, MIG mode)
cannot be read is skipped, an optional property that fails is left out, and both are logged in one
line naming the GPU and the error, so one broken GPU never hides the others.

Publishing (docs/reference/drivers.md, 'NVIDIA DRA driver for GPUs'): a full GPU is `gpu-<minor>` (the
minor number is stable when an NVML index shifts); a GPU in MIG mode is published as its MIG
devices.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from dataclasses import replace
from pathlib import Path
from types import ModuleType
from typing import Any

from driver.discovery.gpu.attributes import (
    ARCHITECTURES,
    BRANDS,
    binary_quantity,
    cuda_version,
    fit_limits,
    semver,
)
from driver.discovery.gpu.dynamic_mig import DynamicMigReader, publish, tandems
from driver.discovery.gpu.mig import MigReader
from driver.discovery.gpu.shared import shareable
from driver.discovery.gpudirect import gpu_attributes, read_gpudirect
from driver.discovery.topology import Topology, pci_bus_id, topology
from driver.model import AttrValue, Device, DeviceKind, GpuInfo, MigPlacement, Version
from driver.node.nvml import (
    ERROR_NOT_SUPPORTED,
    DeviceSkipped,
    NvmlError,
    NvmlUnavailable,
    init_nvml,
    optional,
    shutdown_nvml,
    text,
)
from driver.resource_api import MAX_VALUE_LENGTH

log = logging.getLogger(__name__)

_NVML_DEVICE_MIG_ENABLE = 1


class GpuDiscovery:
    """Turns what NVML reports into `Device`s (kind GPU or MIG) with `GpuInfo` filled in.

    `proc_root` is where `driver/nvidia/capabilities/gpu<minor>/mig/gi<G>[/ci<C>]/access` are read
    to find the `/dev/nvidia-caps` minors that grant access to a MIG device.
    """

    def __init__(
        self,
        sysfs_root: Path = Path("/sys"),
        list_attributes: bool = False,
        *,
        proc_root: Path = Path("/proc"),
        driver_root: Path = Path("/"),
        dynamic_mig: Callable[[int, str], bool] = lambda minor, uuid: False,
        owned_placements: Callable[[], Collection[MigPlacement]] = frozenset,
        mig_generation: Callable[[], int] = lambda: 0,
        gpu_sharing: Callable[[int, str], bool] = lambda minor, uuid: False,
    ) -> None:
        self.sysfs_root = sysfs_root
        self.list_attributes = list_attributes
        self.proc_root = proc_root
        self.driver_root = driver_root
        # Dynamic MIG (`dynamic_mig`): which GPUs (by minor, UUID), the placements whose GPU
        # instances Tandem made (read after NVML, so an instance seen was recorded before it was
        # made), and a count of this process's MIG changes: a pass that overlapped one is redone.
        self.dynamic_mig = dynamic_mig
        self.owned_placements = owned_placements
        self.mig_generation = mig_generation
        self.gpu_sharing = gpu_sharing  # full GPUs published for sharing (`driver.discovery.gpu.shared`)
        # Last devices published per GPU (PCI address): a GPU that stops answering NVML but is
        # still on the PCI bus (fallen off after XID 79, wedged) stays published, so the health
        # monitor's gpu-lost taint stays on it and evicts its pods instead of vanishing with it.
        self._last: dict[str, list[Device]] = {}

    def discover(self) -> list[Device]:
        nvml = init_nvml(self.driver_root)
        try:
            for _ in range(3):
                generation = self.mig_generation()
                session = _Session(self, nvml)
                devices = session.devices()
                if self.mig_generation() == generation:
                    break
            return self._keep_unreadable(devices, session.read_bdfs)
        finally:
            shutdown_nvml(nvml)

    def _keep_unreadable(self, devices: list[Device], read_bdfs: set[str]) -> list[Device]:
        """`devices` plus the last-known devices of GPUs NVML could not list (in whole: one that
        answers for itself but not for its MIG devices too) but sysfs still lists."""
        kept: list[Device] = []
        for bdf, last in self._last.items():
            if bdf in read_bdfs:
                continue
            if (self.sysfs_root / "bus/pci/devices" / bdf).exists():
                log.warning(
                    "GPU %s cannot be listed by NVML but is still on the PCI bus; keeping %s published",
                    bdf,
                    ", ".join(d.name for d in last),
                )
                kept += last
            else:
                log.info("GPU %s left the PCI bus; unpublishing %s", bdf, ", ".join(d.name for d in last))
        present = {d.name for d in devices}
        result = devices + [d for d in kept if d.name not in present]
        self._last = _group_by_gpu(result)
        return sorted(result, key=_sort_key)


def _group_by_gpu(devices: list[Device]) -> dict[str, list[Device]]:
    out: dict[str, list[Device]] = {}
    for d in devices:
        if d.gpu is not None and d.gpu.pci_bus_id:
            out.setdefault(d.gpu.pci_bus_id, []).append(d)
    return out


class _Session:
    """One discovery pass between nvmlInit and nvmlShutdown."""

    def __init__(self, config: GpuDiscovery, nvml: ModuleType) -> None:
        self.config = config
        self.nvml = nvml
        # GPUs whose whole listing NVML answered (whatever they publish): the others keep their
        # last devices (`GpuDiscovery._keep_unreadable`).
        self.read_bdfs: set[str] = set()
        self.mig = MigReader(nvml, config.proc_root)

    def devices(self) -> list[Device]:
        nvml = self.nvml
        system = self._system_attributes()
        try:
            count = int(nvml.nvmlDeviceGetCount())
        except NvmlError as e:
            raise NvmlUnavailable(f"nvmlDeviceGetCount failed: {e}") from e
        found: dict[str, Device] = {}
        for index in range(count):
            try:
                bdf, gpu_devices = self._gpu(index, system)
            except DeviceSkipped as e:
                log.warning("GPU %s skipped: %s", e.args[0], e.args[1])
                continue
            except Exception as e:  # one GPU's bad data must not hide the others
                log.warning("GPU at NVML index %d skipped: unexpected %s: %s", index, type(e).__name__, e)
                continue
            if bdf:
                self.read_bdfs.add(bdf)
            for device in gpu_devices:
                if device.name in found:
                    log.warning("%s reported twice (NVML index %d); keeping the first", device.name, index)
                    continue
                found[device.name] = device
        return sorted(found.values(), key=_sort_key)

    def _system_attributes(self) -> dict[str, AttrValue]:
        nvml = self.nvml
        attrs: dict[str, AttrValue] = {}
        raw = optional("system", "driverVersion", nvml.nvmlSystemGetDriverVersion)
        if raw is not None:
            version = semver(text(raw))
            if version is None:
                log.warning("driver version %r is not a dotted number; not published", raw)
            else:
                attrs["driverVersion"] = Version(version)
        get_cuda = getattr(nvml, "nvmlSystemGetCudaDriverVersion_v2", nvml.nvmlSystemGetCudaDriverVersion)
        cuda = optional("system", "cudaDriverVersion", get_cuda)
        if cuda is not None and (cuda_text := cuda_version(int(cuda))) is not None:
            attrs["cudaDriverVersion"] = Version(cuda_text)
        attrs.update(gpu_attributes(read_gpudirect(self.config.sysfs_root, self.config.proc_root)))
        return attrs

    def _gpu(self, index: int, system: dict[str, AttrValue]) -> tuple[str, list[Device]]:
        """The GPU's PCI address ("" when NVML cannot tell) and its devices; DeviceSkipped (or
        anything else) when they cannot all be listed."""
        nvml = self.nvml
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            minor = int(nvml.nvmlDeviceGetMinorNumber(handle))
            uuid = text(nvml.nvmlDeviceGetUUID(handle))
        except NvmlError as e:
            raise DeviceSkipped(f"at NVML index {index}", f"cannot read its identity: {e}") from e
        if not 0 < len(uuid) <= MAX_VALUE_LENGTH:
            raise DeviceSkipped(f"at NVML index {index}", f"its UUID {uuid[:80]!r} is not publishable")
        where = f"gpu-{minor} ({uuid})"
        try:
            current, _pending = nvml.nvmlDeviceGetMigMode(handle)
            mig_capable, mig_mode = True, int(current) == _NVML_DEVICE_MIG_ENABLE
        except NvmlError as e:
            if e.value != ERROR_NOT_SUPPORTED:
                raise DeviceSkipped(where, f"cannot read its MIG mode: {e}") from e
            mig_capable, mig_mode = False, False

        bdf = self._bus_id(where, handle)
        common = {**self._properties(where, handle), **system}
        topo = topology(self.config.sysfs_root, bdf, self.config.list_attributes) if bdf else Topology({})
        common.update(topo.attributes)
        dynamic = mig_mode and self.config.dynamic_mig(minor, uuid)
        if mig_mode and not dynamic:
            migs = self._not_tandems(where, handle, uuid, self.mig.devices(where, handle, minor, uuid, bdf, common))
            return bdf, [replace(d, pcie_path=topo.pcie_path) for d in migs]

        attrs: dict[str, AttrValue] = {"type": "gpu", "uuid": uuid, **common}
        if self.config.list_attributes and mig_capable:
            profiles = self.mig.supported_profiles(where, handle)
            if profiles:
                attrs["migProfiles"] = tuple(profiles)
        caps: dict[str, str] = {}
        memory = optional(where, "memory", nvml.nvmlDeviceGetMemoryInfo, handle)
        if memory is not None:
            caps["memory"] = binary_quantity(int(memory.total))
        name = f"gpu-{minor}"
        whole = Device(
            name=name,
            kind=DeviceKind.GPU,
            attributes=fit_limits(name, attrs, caps),
            capacity=caps,
            gpu=GpuInfo(minor=minor, uuid=uuid, pci_bus_id=bdf),
            pcie_path=topo.pcie_path,
        )
        if dynamic:
            return bdf, self._dynamic(where, handle, whole, common)
        # Sharing (MIG mode returned above: a MIG-mode GPU's MIG devices are its partitions).
        return bdf, [shareable(whole) if self.config.gpu_sharing(minor, uuid) else whole]

    def _dynamic(self, where: str, handle: Any, whole: Device, common: dict[str, AttrValue]) -> list[Device]:
        """A dynamic-MIG GPU (`driver.discovery.gpu.dynamic_mig`); its MIG devices alone when NVML cannot
        tell its profiles, placements or instances."""
        assert whole.gpu is not None
        minor, uuid, bdf = whole.gpu.minor, whole.gpu.uuid, whole.gpu.pci_bus_id
        migs = self.mig.devices(where, handle, minor, uuid, bdf, common, dynamic=True)
        migs = [replace(d, pcie_path=whole.pcie_path) for d in migs]
        reader = DynamicMigReader(self.nvml)
        try:
            profiles = reader.profiles(where, handle)
            instances = reader.instances(where, handle, profiles)
        except DeviceSkipped as e:
            log.warning("%s: not served as dynamic MIG, only its MIG devices: %s", where, e.args[1])
            return migs
        return publish(minor, uuid, whole, profiles, instances, migs, self.config.owned_placements())

    def _not_tandems(self, where: str, handle: Any, uuid: str, migs: list[Device]) -> list[Device]:
        """The MIG devices of a GPU not served dynamically but the GPU instances Tandem made on it
        (it left `--dynamic-mig`): those stay their claims' until they are unprepared, never
        published as free. Read after the MIG devices, like the dynamic path: one listed was noted
        before it was made. A GPU whose instances cannot be listed keeps its last devices."""
        owned = {p for p in self.config.owned_placements() if p.parent_uuid == uuid}
        if not owned:
            return migs
        reader = DynamicMigReader(self.nvml)
        ours = tandems(uuid, reader.instances(where, handle, reader.profiles(where, handle)), owned)
        return [m for m in migs if m.gpu is None or m.gpu.mig_gi not in ours]

    def _bus_id(self, where: str, handle: Any) -> str:
        info = optional(where, "PCI attributes", self.nvml.nvmlDeviceGetPciInfo, handle)
        if info is None:
            return ""
        try:
            return pci_bus_id(info.busId)
        except ValueError as e:
            log.warning("%s: %s; publishing without PCI attributes", where, e)
            return ""

    def _properties(self, where: str, handle: Any) -> dict[str, AttrValue]:
        """productName, brand, architecture, cudaComputeCapability: shared by a GPU and its MIG devices."""
        nvml = self.nvml
        attrs: dict[str, AttrValue] = {}
        name = optional(where, "productName", nvml.nvmlDeviceGetName, handle)
        if name is not None:
            product = text(name)
            if 0 < len(product) <= MAX_VALUE_LENGTH:
                attrs["productName"] = product
            else:
                log.warning("%s: product name %r is not publishable", where, product[:80])
        brand = optional(where, "brand", nvml.nvmlDeviceGetBrand, handle)
        if brand is not None:
            attrs["brand"] = BRANDS.get(int(brand), "Unknown")
        arch = optional(where, "architecture", nvml.nvmlDeviceGetArchitecture, handle)
        if arch is not None and int(arch) in ARCHITECTURES:
            attrs["architecture"] = ARCHITECTURES[int(arch)]
        cc = optional(where, "cudaComputeCapability", nvml.nvmlDeviceGetCudaComputeCapability, handle)
        if cc is not None:
            major, minor = (int(x) for x in cc)
            attrs["cudaComputeCapability"] = Version(f"{major}.{minor}.0")
        return attrs


def _sort_key(device: Device) -> tuple[int, int, int, str]:
    info = device.gpu
    assert info is not None  # every device built here carries its GpuInfo
    return (info.minor, -1 if info.mig_gi is None else info.mig_gi, info.mig_ci or 0, device.name)
