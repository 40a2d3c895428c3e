"""One allocated device of a claim as prepare plans it: what every later step reads.

The CDI spec, the sharing rules, the NIC modes, the metadata and the claim status all take the
same planned device, so it sits below all of them in a leaf of its own; were it kept with the CDI
spec, the per-kind steps in `gpu/` and `nic/` that the spec uses would import the spec back.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import cdi
from driver.claims.opaque_config import RequestConfig
from driver.model import Device


@dataclass(frozen=True)
class PlannedDevice:
    device: Device  # from the inventory (attributes, gpu/nic info)
    request_names: tuple[str, ...]
    config: RequestConfig
    share_id: str | None = None
    # Consumable capacity: what this share consumed, and the environment and mounts its sharing
    # strategy adds to the device (MPS limits and pipe directory, `driver.claims.gpu.sharing`).
    consumed: dict[str, str] = field(default_factory=dict)
    share_env: tuple[tuple[str, str], ...] = ()
    share_mounts: tuple[cdi.Mount, ...] = ()
