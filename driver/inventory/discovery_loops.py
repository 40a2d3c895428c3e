"""The discovery loops the configuration asks for: GPUs and NICs found again every period (NICs
also on netlink's word), each into its share of the inventory.

Apart from the composition root (`driver.daemon`) because what each loop must know of the rest
of the daemon comes in as callables (the GPU instances Tandem made, so that discovery tells them
from an administrator's; the NICs prepared claims hold, kept published while inside a pod; where
exclusive NICs get their home names back), so the loops' own wiring, and how a link event wakes
the NIC loop, reads in one place without the daemon's other parts.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Protocol

from driver.config import Config
from driver.discovery.gpu.discover import GpuDiscovery
from driver.discovery.nic.discover import NicDiscovery
from driver.discovery.nic.watcher import NicWatcher
from driver.inventory.sources import RefreshLoop, SourceUnavailable
from driver.inventory.store import Inventory
from driver.model import Device, DeviceKind, MigPlacement
from driver.node.nvml import NvmlReleased, NvmlUnavailable


class NicReturns(Protocol):
    """What the NIC loop needs of the exclusive NICs' return home (`driver.claims.nic.homes.NicHomes`)."""

    def home_names(self) -> dict[str, str]: ...

    def restore(self, netdevs: Mapping[str, str], held: Collection[str]) -> bool: ...


@dataclass
class DiscoveryLoops:
    """The loops, GPU first, and the watcher that wakes the NIC loop (None without NICs)."""

    loops: list[RefreshLoop]
    nic_watcher: NicWatcher | None


def discovery_loops(
    cfg: Config,
    inventory: Inventory,
    *,
    owned_placements: Callable[[], Collection[MigPlacement]],
    mig_generation: Callable[[], int],
    gpus_found: Callable[[], None],
    allocated_nics: Callable[[], set[str]],
    nic_returns: NicReturns | None,
) -> DiscoveryLoops:
    """`gpus_found`: called after each GPU discovery that NVML answered (a driver upgrade changes
    the user-space files too). `nic_returns`: None where exclusive NICs are not given back."""
    loops = []
    if DeviceKind.GPU in cfg.device_kinds:
        loops.append(_gpu_loop(cfg, inventory, owned_placements, mig_generation, gpus_found))
    watcher: NicWatcher | None = None
    if DeviceKind.NIC in cfg.device_kinds:
        use_netlink = cfg.nic_link_source == "netlink"
        nics = NicDiscovery(
            sysfs_root=cfg.sysfs_root,
            list_attributes=cfg.list_attributes,
            netns=cfg.netns or None,
            exclude=cfg.exclude_nics,
            netlink=use_netlink,
            link_hold=cfg.link_debounce,
            proc_root=cfg.proc_root,
            shares=cfg.nic_shares,
            link_events=lambda ifname: watcher.link_events(ifname) if watcher is not None else 0,
            home_names=nic_returns.home_names if nic_returns is not None else dict,
        )

        def discover_nics() -> list[Device]:
            devices = nics.discover(keep=allocated_nics)
            if nic_returns is not None and nic_returns.restore(nics.host_netdevs(), allocated_nics()):
                devices = nics.discover(keep=allocated_nics)  # as given back
            return devices

        loop = RefreshLoop("nic", discover_nics, inventory, cfg.rediscover_period, wake_at=lambda: nics.pending_until)
        loops.append(loop)
        # Link and address events that may concern a NIC, and default-route changes, rediscover
        # within a second, coalesced; the loop's period catches anything netlink did not say (so
        # the watcher keeps no timer of its own: it would only add a rediscovery per period).
        watcher = NicWatcher(
            loop.trigger,
            netns=cfg.netns or None,
            resync_period=None,
            netlink=use_netlink,
            may_be_nic=nics.may_be_nic,
            is_nic=nics.is_nic,
        )
    return DiscoveryLoops(loops, watcher)


def _gpu_loop(
    cfg: Config,
    inventory: Inventory,
    owned_placements: Callable[[], Collection[MigPlacement]],
    mig_generation: Callable[[], int],
    gpus_found: Callable[[], None],
) -> RefreshLoop:
    gpus = GpuDiscovery(
        sysfs_root=cfg.sysfs_root,
        list_attributes=cfg.list_attributes,
        proc_root=cfg.proc_root,
        driver_root=cfg.nvidia_driver_root,
        dynamic_mig=cfg.dynamic_mig.selects,
        owned_placements=owned_placements,
        mig_generation=mig_generation,
        gpu_sharing=cfg.gpu_sharing.selects,
    )
    last: list[Device] = []

    def discover_gpus() -> list[Device]:
        nonlocal last
        try:
            last = gpus.discover()
            gpus_found()
            return last
        except NvmlReleased:
            return last  # an SRE released NVML or a GPU: the devices stay as last found
        except NvmlUnavailable as e:
            raise SourceUnavailable(str(e)) from e

    return RefreshLoop("gpu", discover_gpus, inventory, cfg.rediscover_period)
