"""GPU and MIG discovery through NVML (the `pynvml` module, imported at run time only).

`GpuDiscovery.discover()` is a full, stateless rediscovery, cheap enough for a slow period and for
on-demand calls (hot-plug, MIG reconfiguration). Each call brackets its work with
`nvmlInit`/`nvmlShutdown`; the binding reference-counts these, so a health monitor holding its own
long-lived initialisation is unaffected. When `nvmlInit` fails (driver not loaded yet, library
missing) `NvmlUnavailable` is raised and retrying is the caller's job (driver.refresh).

Every NVML call about one GPU is isolated: a GPU whose identity (minor number, UUID, MIG mode)
cannot be read is skipped, an optional property that fails is left out, and both are logged in one
line naming the GPU and the error, so one broken GPU never hides the others.

Publishing (anchors.md 1.3-1.6): a full GPU is `gpu-<minor>` (the minor number is stable when an
NVML index shifts); a GPU in MIG mode is published only as its existing MIG devices,
`gpu-<minor>-mig-<profile label>-<gi>-<ci>` (see `mig_device_name`); one in MIG mode without MIG
devices publishes nothing and is logged as stranded capacity.
"""

from __future__ import annotations

import ctypes
import importlib
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from driver.discovery.topology import pci_bus_id, topology_attributes
from driver.model import NUMA_NODE, AttrValue, Device, DeviceKind, GpuInfo, Version

log = logging.getLogger(__name__)

MIB = 2**20
MAX_ATTRIBUTES_AND_CAPACITIES = 32
MAX_ATTRIBUTE_VALUES = 48
MAX_STRING = 64

# NVML enum values (stable ABI) -> published strings.
_BRANDS = {
    0: "Unknown",
    1: "Quadro",
    2: "Tesla",
    3: "NVS",
    4: "Grid",
    5: "GeForce",
    6: "Titan",
    7: "NvidiaVApps",
    8: "NvidiaVPC",
    9: "NvidiaVCS",
    10: "NvidiaVWS",
    11: "NvidiaCloudGaming",
    12: "QuadroRTX",
    13: "NvidiaRTX",
    14: "Nvidia",
    15: "GeForceRTX",
    16: "TitanRTX",
}
_ARCHITECTURES = {
    2: "Kepler",
    3: "Maxwell",
    4: "Pascal",
    5: "Volta",
    6: "Turing",
    7: "Ampere",
    8: "Ada",
    9: "Hopper",
    10: "Blackwell",
    13: "Rubin",
}
_NVML_ERROR_NOT_SUPPORTED = 3
_NVML_ERROR_INVALID_ARGUMENT = 2
_NVML_ERROR_NOT_FOUND = 6
_NVML_DEVICE_MIG_ENABLE = 1
_GPU_INSTANCE_PROFILE_COUNT = 0x12  # NVML_GPU_INSTANCE_PROFILE_COUNT in nvidia-ml-py 13


class NvmlUnavailable(Exception):
    """NVML cannot be used at all right now (no library, driver not loaded, init failed)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


# --- MIG device names ----------------------------------------------------------------------------

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_MIG_NAME = re.compile(r"^gpu-(\d+)-mig-([a-z0-9]+(?:-[a-z0-9]+)*?)-(\d+)-(\d+)$")


@dataclass(frozen=True)
class MigName:
    parent_minor: int
    profile_label: str
    gi: int
    ci: int


def profile_label(profile: str) -> str:
    """The profile as it appears in a device name: lower case, each run of other characters a dash.

    "1g.10gb" -> "1g-10gb", "1g.10gb+me" -> "1g-10gb-me", "1c.2g.20gb" -> "1c-2g-20gb".
    """
    return re.sub(r"[^a-z0-9]+", "-", profile.lower()).strip("-")


def mig_device_name(parent_minor: int, profile: str, gi: int, ci: int) -> str:
    """`gpu-<parent minor>-mig-<profile label>-<GPU instance ID>-<compute instance ID>`.

    The profile is in the name so that devices sort by size under one GPU (the scheduler takes
    the first fit); the last two numbers identify the MIG device on its GPU, so the name is stable
    for as long as the MIG device exists. `parse_mig_device_name` inverts it.
    """
    return f"gpu-{parent_minor}-mig-{profile_label(profile)}-{gi}-{ci}"


def parse_mig_device_name(name: str) -> MigName | None:
    m = _MIG_NAME.match(name)
    if not m:
        return None
    return MigName(int(m.group(1)), m.group(2), int(m.group(3)), int(m.group(4)))


# --- value conversions ---------------------------------------------------------------------------


def semver(text: str) -> str | None:
    """NVIDIA's dotted numbers as semver 2.0.0: "580.95.05" -> "580.95.5", "550.54" -> "550.54.0"."""
    parts = text.strip().split(".")
    if not 1 <= len(parts) <= 3 or not all(re.fullmatch(r"[0-9]{1,9}", p) for p in parts):
        return None
    nums = [int(p) for p in parts] + [0] * (3 - len(parts))
    return ".".join(str(n) for n in nums)


def cuda_version(value: int) -> str | None:
    """nvmlSystemGetCudaDriverVersion's 1000*major + 10*minor as semver: 13000 -> "13.0.0"."""
    if value <= 0:
        return None
    return f"{value // 1000}.{(value % 1000) // 10}.0"


def binary_quantity(n: int) -> str:
    """Bytes as a Kubernetes quantity, exact, with the largest binary suffix that divides them."""
    for suffix, unit in (("Ei", 2**60), ("Pi", 2**50), ("Ti", 2**40), ("Gi", 2**30), ("Mi", MIB), ("Ki", 2**10)):
        if n > 0 and n % unit == 0:
            return f"{n // unit}{suffix}"
    return str(n)


def _text(value: str | bytes) -> str:
    return (value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)).strip("\x00").strip()


def _value_count(attrs: dict[str, AttrValue]) -> int:
    return sum(len(v) if isinstance(v, tuple) else 1 for v in attrs.values())


def fit_limits(name: str, attrs: dict[str, AttrValue], caps: dict[str, str]) -> dict[str, AttrValue]:
    """Shorten list attributes so the device passes the API's per-device limits.

    Scalar attributes and capacities are a fixed set well under 32; only lists can grow, so they
    give way: migProfiles first, then the numaNode list (down to the device's own node).
    """
    fitted = dict(attrs)
    for key, keep_at_least in (("migProfiles", 0), (NUMA_NODE, 1)):
        value = fitted.get(key)
        over = _value_count(fitted) - MAX_ATTRIBUTE_VALUES
        if over <= 0 or not isinstance(value, tuple):
            continue
        keep = max(len(value) - over, keep_at_least)
        log.warning("%s: %s shortened from %d to %d values to stay within the API limits", name, key, len(value), keep)
        if keep:
            fitted[key] = value[:keep]
        else:
            del fitted[key]
    if len(fitted) + len(caps) > MAX_ATTRIBUTES_AND_CAPACITIES and "migProfiles" in fitted:
        del fitted["migProfiles"]
    return fitted


class _Skip(Exception):
    """This device cannot be identified; the reason is the message."""


# --- discovery -----------------------------------------------------------------------------------


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
    ) -> None:
        self.sysfs_root = sysfs_root
        self.list_attributes = list_attributes
        self.proc_root = proc_root
        self.driver_root = driver_root
        # Last devices published per GPU (PCI address): a GPU that stops answering NVML but is
        # still on the PCI bus (fallen off after XID 79, wedged) stays published, so the health
        # monitor's gpu-lost taint stays on it and evicts its pods instead of vanishing with it.
        self._last: dict[str, list[Device]] = {}

    def discover(self) -> list[Device]:
        try:
            nvml = importlib.import_module("pynvml")
        except ImportError as e:
            raise NvmlUnavailable(f"the pynvml module cannot be imported: {e}") from e
        preload_nvml(self.driver_root)
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as e:
            raise NvmlUnavailable(f"nvmlInit failed: {e}") from e
        try:
            session = _Session(self, nvml)
            return self._keep_unreadable(session.devices(), session.read_bdfs)
        finally:
            try:
                nvml.nvmlShutdown()
            except nvml.NVMLError as e:
                log.warning("nvmlShutdown failed: %s", e)

    def _keep_unreadable(self, devices: list[Device], read_bdfs: set[str]) -> list[Device]:
        """`devices` plus the last-known devices of GPUs NVML no longer answers for but sysfs still lists."""
        kept: list[Device] = []
        for bdf, last in self._last.items():
            if bdf in read_bdfs:
                continue
            if (self.sysfs_root / "bus/pci/devices" / bdf).exists():
                log.warning("GPU %s does not answer NVML but is still on the PCI bus; keeping %s published", bdf,
                            ", ".join(d.name for d in last))  # fmt: skip
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


_NVML_LIB_DIRS = ("usr/lib/x86_64-linux-gnu", "usr/lib/aarch64-linux-gnu", "usr/lib64", "lib64", "usr/lib")


def preload_nvml(driver_root: Path) -> Path | None:
    """Load libnvidia-ml.so.1 from the mounted host driver (e.g. /driver-root) before pynvml asks.

    pynvml dlopens the library by soname; glibc then reuses an already loaded library with that
    soname. Setting LD_LIBRARY_PATH to the host's library directory instead would pull the host's
    glibc into the container's process. With the default root `/` the normal search is right.
    """
    if driver_root == Path("/"):
        return None
    for d in _NVML_LIB_DIRS:
        candidate = driver_root / d / "libnvidia-ml.so.1"
        if candidate.exists():
            try:
                ctypes.CDLL(str(candidate), mode=ctypes.RTLD_GLOBAL)
            except OSError as e:
                log.warning("cannot load %s: %s", candidate, e)
                return None
            return candidate
    return None


class _Session:
    """One discovery pass between nvmlInit and nvmlShutdown."""

    def __init__(self, config: GpuDiscovery, nvml: ModuleType) -> None:
        self.config = config
        self.nvml = nvml
        self.read_bdfs: set[str] = set()  # GPUs NVML answered for (whatever they publish)

    def devices(self) -> list[Device]:
        nvml = self.nvml
        system = self._system_attributes()
        try:
            count = int(nvml.nvmlDeviceGetCount())
        except nvml.NVMLError as e:
            raise NvmlUnavailable(f"nvmlDeviceGetCount failed: {e}") from e
        found: dict[str, Device] = {}
        for index in range(count):
            try:
                gpu_devices = self._gpu(index, system)
            except _Skip as e:
                log.warning("GPU %s skipped: %s", e.args[0], e.args[1])
                continue
            except Exception as e:  # one GPU's bad data must not hide the others
                log.warning("GPU at NVML index %d skipped: unexpected %s: %s", index, type(e).__name__, e)
                continue
            for device in gpu_devices:
                if device.name in found:
                    log.warning("%s reported twice (NVML index %d); keeping the first", device.name, index)
                    continue
                found[device.name] = device
        return sorted(found.values(), key=_sort_key)

    def _optional(self, where: str, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        """Call NVML for a property the device can be published without; None when it fails."""
        try:
            return fn(*args)
        except self.nvml.NVMLError as e:
            log.warning("%s: %s failed (%s); publishing without %s", where, fn.__name__, e, what)
            return None

    def _system_attributes(self) -> dict[str, AttrValue]:
        nvml = self.nvml
        attrs: dict[str, AttrValue] = {}
        raw = self._optional("system", "driverVersion", nvml.nvmlSystemGetDriverVersion)
        if raw is not None:
            version = semver(_text(raw))
            if version is None:
                log.warning("driver version %r is not a dotted number; not published", raw)
            else:
                attrs["driverVersion"] = Version(version)
        get_cuda = getattr(nvml, "nvmlSystemGetCudaDriverVersion_v2", nvml.nvmlSystemGetCudaDriverVersion)
        cuda = self._optional("system", "cudaDriverVersion", get_cuda)
        if cuda is not None and (text := cuda_version(int(cuda))) is not None:
            attrs["cudaDriverVersion"] = Version(text)
        return attrs

    def _gpu(self, index: int, system: dict[str, AttrValue]) -> list[Device]:
        nvml = self.nvml
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            minor = int(nvml.nvmlDeviceGetMinorNumber(handle))
            uuid = _text(nvml.nvmlDeviceGetUUID(handle))
        except nvml.NVMLError as e:
            raise _Skip(f"at NVML index {index}", f"cannot read its identity: {e}") from e
        if not 0 < len(uuid) <= MAX_STRING:
            raise _Skip(f"at NVML index {index}", f"its UUID {uuid[:80]!r} is not publishable")
        where = f"gpu-{minor} ({uuid})"
        try:
            current, _pending = nvml.nvmlDeviceGetMigMode(handle)
            mig_capable, mig_mode = True, int(current) == _NVML_DEVICE_MIG_ENABLE
        except nvml.NVMLError as e:
            if e.value != _NVML_ERROR_NOT_SUPPORTED:
                raise _Skip(where, f"cannot read its MIG mode: {e}") from e
            mig_capable, mig_mode = False, False

        bdf = self._bus_id(where, handle)
        if bdf:
            self.read_bdfs.add(bdf)
        common = {**self._properties(where, handle), **system}
        if bdf:
            common.update(topology_attributes(self.config.sysfs_root, bdf, self.config.list_attributes))
        if mig_mode:
            return self._mig_devices(where, handle, minor, uuid, bdf, common)

        attrs: dict[str, AttrValue] = {"type": "gpu", "uuid": uuid, **common}
        if self.config.list_attributes and mig_capable:
            profiles = self._supported_profiles(where, handle)
            if profiles:
                attrs["migProfiles"] = tuple(profiles)
        caps: dict[str, str] = {}
        memory = self._optional(where, "memory", nvml.nvmlDeviceGetMemoryInfo, handle)
        if memory is not None:
            caps["memory"] = binary_quantity(int(memory.total))
        name = f"gpu-{minor}"
        return [
            Device(
                name=name,
                kind=DeviceKind.GPU,
                attributes=fit_limits(name, attrs, caps),
                capacity=caps,
                gpu=GpuInfo(minor=minor, uuid=uuid, pci_bus_id=bdf),
            )
        ]

    def _bus_id(self, where: str, handle: Any) -> str:
        info = self._optional(where, "PCI attributes", self.nvml.nvmlDeviceGetPciInfo, handle)
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
        name = self._optional(where, "productName", nvml.nvmlDeviceGetName, handle)
        if name is not None:
            text = _text(name)
            if 0 < len(text) <= MAX_STRING:
                attrs["productName"] = text
            else:
                log.warning("%s: product name %r is not publishable", where, text[:80])
        brand = self._optional(where, "brand", nvml.nvmlDeviceGetBrand, handle)
        if brand is not None:
            attrs["brand"] = _BRANDS.get(int(brand), "Unknown")
        arch = self._optional(where, "architecture", nvml.nvmlDeviceGetArchitecture, handle)
        if arch is not None and int(arch) in _ARCHITECTURES:
            attrs["architecture"] = _ARCHITECTURES[int(arch)]
        cc = self._optional(where, "cudaComputeCapability", nvml.nvmlDeviceGetCudaComputeCapability, handle)
        if cc is not None:
            major, minor = (int(x) for x in cc)
            attrs["cudaComputeCapability"] = Version(f"{major}.{minor}.0")
        return attrs

    def _supported_profiles(self, where: str, handle: Any) -> list[str]:
        """Names of the GPU instance profiles this GPU supports (e.g. "1g.10gb"), smallest first."""
        nvml = self.nvml
        count = int(getattr(nvml, "NVML_GPU_INSTANCE_PROFILE_COUNT", _GPU_INSTANCE_PROFILE_COUNT))
        found: dict[str, tuple[int, int]] = {}
        for profile_id in range(count):
            try:
                info = nvml.nvmlDeviceGetGpuInstanceProfileInfo(handle, profile_id)
            except nvml.NVMLError as e:
                if e.value in (_NVML_ERROR_NOT_SUPPORTED, _NVML_ERROR_INVALID_ARGUMENT):
                    continue
                log.warning("%s: GPU instance profile %d: %s; migProfiles may be incomplete", where, profile_id, e)
                break
            name = _text(info.name).removeprefix("MIG ").strip()
            if name and len(name) <= MAX_STRING:
                found.setdefault(name, (int(info.sliceCount), int(info.memorySizeMB)))
        return sorted(found, key=lambda n: (*found[n], n))

    def _mig_devices(
        self, where: str, handle: Any, minor: int, uuid: str, bdf: str, common: dict[str, AttrValue]
    ) -> list[Device]:
        nvml = self.nvml
        try:
            slots = int(nvml.nvmlDeviceGetMaxMigDeviceCount(handle))
        except nvml.NVMLError as e:
            raise _Skip(where, f"in MIG mode, but its MIG devices cannot be listed: {e}") from e
        devices = []
        failed = 0
        for slot in range(slots):
            try:
                mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot)
            except nvml.NVMLError as e:
                if e.value != _NVML_ERROR_NOT_FOUND:
                    failed += 1
                    log.warning("%s: MIG device slot %d: %s", where, slot, e)
                continue
            try:
                devices.append(self._mig(where, mig, minor, uuid, bdf, common))
            except _Skip as e:
                failed += 1
                log.warning("%s: MIG device skipped: %s", where, e.args[1])
        if not devices and not failed:
            log.warning("%s is in MIG mode but has no MIG devices: its capacity is stranded", where)
        return devices

    def _mig(
        self, where: str, mig: Any, minor: int, parent_uuid: str, bdf: str, common: dict[str, AttrValue]
    ) -> Device:
        nvml = self.nvml
        try:
            uuid = _text(nvml.nvmlDeviceGetUUID(mig))
            gi = int(nvml.nvmlDeviceGetGpuInstanceId(mig))
            ci = int(nvml.nvmlDeviceGetComputeInstanceId(mig))
        except nvml.NVMLError as e:
            raise _Skip(where, f"cannot read its identity: {e}") from e
        if not 0 < len(uuid) <= MAX_STRING:
            raise _Skip(where, f"MIG device UUID {uuid[:80]!r} is not publishable")
        mig_where = f"{where} MIG {uuid}"
        info = self._optional(mig_where, "capacities", nvml.nvmlDeviceGetAttributes, mig)
        profile = self._mig_profile(mig_where, mig, info)
        name = mig_device_name(minor, profile, gi, ci)
        if not _DNS_LABEL.match(name) or len(profile) > MAX_STRING:
            raise _Skip(where, f"MIG device {uuid} profile {profile!r} gives no valid device name")
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
                mig_caps=self._mig_caps(mig_where, minor, gi, ci),
            ),
        )

    def _mig_profile(self, where: str, mig: Any, info: Any) -> str:
        """The MIG profile from the device name ("... MIG 1g.10gb"), else rebuilt from its attributes."""
        name = self._optional(where, "profile from the name", self.nvml.nvmlDeviceGetName, mig)
        if name is not None:
            m = re.search(r"\bMIG\s+(\S+)$", _text(name))
            if m:
                return m.group(1)
        if info is None:
            raise _Skip(where, "its MIG profile cannot be determined")
        g, c = int(info.gpuInstanceSliceCount), int(info.computeInstanceSliceCount)
        gb = -(-int(info.memorySizeMB) // 1024)
        return f"{g}g.{gb}gb" if c in (0, g) else f"{c}c.{g}g.{gb}gb"

    def _mig_caps(self, where: str, minor: int, gi: int, ci: int) -> tuple[int, ...]:
        """The nvidia-caps minors of the GPU instance and the compute instance, in that order."""
        gi_dir = self.config.proc_root / "driver" / "nvidia" / "capabilities" / f"gpu{minor}" / "mig" / f"gi{gi}"
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


def _sort_key(device: Device) -> tuple[int, int, int, str]:
    info = device.gpu
    assert info is not None  # every device built here carries its GpuInfo
    return (info.minor, -1 if info.mig_gi is None else info.mig_gi, info.mig_ci or 0, device.name)
