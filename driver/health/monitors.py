"""The health monitors a node runs, built from the Config, and the counters they export.

One GPU monitor (NVML events and probes) and one NIC monitor (link and RDMA port state), each
for the device kinds the node serves, and one grey-failure monitor for both (counters and link
speeds read every period); the per-key taint effects of `--taint-effect` are split between them.
Their counters reach `/metrics` under `nvml_`, `nic_` and `grey_` names.
"""

from __future__ import annotations

from collections.abc import Sequence

from driver.config import Config
from driver.fsutil import boot_id
from driver.health import effects_for, parse_taint_effects
from driver.health.gpu.held import HeldResets
from driver.health.gpu.monitor import GpuHealthMonitor
from driver.health.gpu.policy import APPLICATION_XIDS, RESET_XIDS, GpuHealthPolicy
from driver.health.grey_kept import KeptVerdicts
from driver.health.grey_monitor import GreyMonitor
from driver.health.nic.monitor import NicHealthMonitor
from driver.health.thresholds import parse_thresholds
from driver.inventory.store import Inventory
from driver.model import DeviceKind

Monitor = GpuHealthMonitor | NicHealthMonitor | GreyMonitor

# The XIDs `/metrics` names one by one: those the policy knows by number (application and reset
# XIDs) and 94, contained ECC; any other is counted as "other", so a driver that reports new or
# garbage numbers cannot grow the series without bound.
KNOWN_XIDS = APPLICATION_XIDS | RESET_XIDS | {94}


def build_monitors(cfg: Config, inventory: Inventory) -> list[Monitor]:
    effects = parse_taint_effects(cfg.taint_effects, cfg.driver_name)
    monitors: list[Monitor] = []
    if DeviceKind.GPU in cfg.device_kinds:
        policy = GpuHealthPolicy(
            domain=cfg.driver_name,
            ignored_xids=cfg.ignored_xids,
            effects=effects_for(effects, "gpu", cfg.driver_name),
            xid_quiet_period=cfg.health_quiet_period,
            ecc_quiet_period=cfg.health_quiet_period,
        )
        held = HeldResets(cfg.data_dir, boot_id())
        monitors.append(GpuHealthMonitor(inventory, policy, driver_root=cfg.nvidia_driver_root, held=held))
    if DeviceKind.NIC in cfg.device_kinds:
        monitors.append(
            NicHealthMonitor(
                inventory,
                sysfs_root=cfg.sysfs_root,
                domain=cfg.driver_name,
                netns=cfg.netns or None,
                netlink=cfg.nic_link_source == "netlink",
                debounce=cfg.link_debounce,
                effects=effects_for(effects, "nic", cfg.driver_name),
            )
        )
    monitors.append(
        GreyMonitor(
            inventory,
            parse_thresholds(cfg.grey_thresholds),
            sysfs_root=cfg.sysfs_root,
            driver_root=cfg.nvidia_driver_root,
            domain=cfg.driver_name,
            kinds=cfg.device_kinds,
            effects=effects_for(effects, "grey", cfg.driver_name),
            kept=KeptVerdicts(cfg.data_dir, boot_id()),
        )
    )
    return monitors


def health_counters(monitors: Sequence[Monitor]) -> dict[str, int]:
    out: dict[str, int] = {}
    for m in monitors:
        if isinstance(m, GpuHealthMonitor):
            c = m.counters()
            out.update({f"nvml_{k}": v for k, v in c.events.items()})
            out.update({"nvml_probes": c.probes, "nvml_errors": c.errors, "nvml_single_bit_ecc": c.single_bit_ecc})
        elif isinstance(m, NicHealthMonitor):
            out.update({f"nic_{k}": v for k, v in m.counters().items()})
        else:
            out.update({f"grey_{k}": v for k, v in m.counters().items()})
    return out


def xid_counts(monitors: Sequence[Monitor]) -> dict[str, int]:
    """XIDs seen by the GPU monitor, by label value: a known XID's number, or "other"."""
    out: dict[str, int] = {}
    for m in monitors:
        if isinstance(m, GpuHealthMonitor):
            for xid, n in m.counters().xids.items():
                label = str(xid) if xid in KNOWN_XIDS else "other"
                out[label] = out.get(label, 0) + n
    return out


def device_counters(monitors: Sequence[Monitor]) -> dict[str, dict[str, int]]:
    """The grey-failure monitor's counters as last read, by device then counter."""
    return next((m.readings() for m in monitors if isinstance(m, GreyMonitor)), {})
