"""NIC modes at prepare time: what the scheduler cannot check about shared and exclusive NICs.

A NIC is published with `shares` of consumable capacity (`--nic-shares`, docs/scenarios.md,
'Shared RoCE NICs'): the scheduler gives each claim a share (its own `shareID`) and keeps the sum
within the capacity, and a request that names no amount takes all shares, the whole NIC. What it
cannot see is the opaque configuration: `NicConfig.mode: exclusive` moves the netdev into one pod
(CDI netDevices), which only a claim holding the whole NIC may do, or the pods sharing the NIC
would lose its interface under them. That is checked here, from the allocation result's
`consumedCapacity`.

Also checked here: exclusive mode moves the netdev only. The RDMA device stays where it is
(neither CDI nor the OCI runtime spec moves RDMA devices): in the kernel's shared RDMA namespace
mode (the default) every namespace can use it, so the pod can; in exclusive RDMA namespace mode
(`ib_core netns_mode=0`, published as `rdmaNetnsMode: exclusive`) it would stay in the host's
namespace, out of the pod's reach, so the claim fails instead of pretending.
"""

from __future__ import annotations

from collections.abc import Sequence

from driver.claims.allocation import ClaimError
from driver.claims.planned import PlannedDevice
from driver.discovery.nic.device import RDMA_NETNS_MODE, SHARES, RdmaNetnsMode
from driver.model import DeviceKind
from driver.resource_api import parse_quantity


def check_nic_modes(planned: Sequence[PlannedDevice]) -> None:
    """ClaimError for an exclusive-mode NIC the claim shares with others, or whose RDMA device
    the pod could not use (module docstring)."""
    for p in planned:
        d = p.device
        if d.kind != DeviceKind.NIC or not p.config.nic.exclusive:
            continue
        total = d.capacity.get(SHARES)
        if p.share_id is not None and total is not None:
            held = p.consumed.get(SHARES)
            if held is None or parse_quantity(held) != parse_quantity(total):
                raise ClaimError(
                    f"NIC {d.name!r}: NicConfig.mode exclusive moves its netdev into the pod, which needs the whole "
                    f"NIC, but this claim holds {held or 'an unknown number of'} of its {total} shares: leave out "
                    f"capacity.requests.{SHARES} (the default is the whole NIC) or ask for {total}"
                )
        if d.attributes.get(RDMA_NETNS_MODE) == RdmaNetnsMode.EXCLUSIVE:
            rdma = d.nic.rdma_device if d.nic else "its RDMA device"
            raise ClaimError(
                f"NIC {d.name!r}: NicConfig.mode exclusive moves only the netdev; the kernel's RDMA namespace mode "
                f"is exclusive (ib_core netns_mode=0), so {rdma} would stay in the host's namespace, out of the "
                "pod's reach"
            )
