"""NVML's answers as published attribute values, within the API's per-device limits.

Shared by full GPUs and MIG devices: the brand and architecture names, NVIDIA's version numbers
as semver, memory as exact Kubernetes quantities, and the trimming that keeps list attributes
within the limits of `driver.resource_api`.
"""

from __future__ import annotations

import logging
import re

from driver.model import NUMA_NODE, AttrValue
from driver.resource_api import MAX_ATTRIBUTE_VALUES, MAX_ATTRIBUTES_AND_CAPACITIES, value_count

log = logging.getLogger(__name__)

MIB = 2**20

# NVML enum values (stable ABI) -> published strings.
BRANDS = {
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
ARCHITECTURES = {
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


def fit_limits(name: str, attrs: dict[str, AttrValue], caps: dict[str, str]) -> dict[str, AttrValue]:
    """Shorten list attributes so the device passes the API's per-device limits.

    Scalar attributes and capacities are a fixed set well under 32; only lists can grow, so they
    give way: migProfiles first, then the numaNode list (down to the device's own node).
    """
    fitted = dict(attrs)
    for key, keep_at_least in (("migProfiles", 0), (NUMA_NODE, 1)):
        value = fitted.get(key)
        over = value_count(fitted) - MAX_ATTRIBUTE_VALUES
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
