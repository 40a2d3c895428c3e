"""What a NIC's link and RDMA port state mean for its health, and how long a fault must hold.

Pure: states come in as values and time as arguments, so a test drives every transition with
numbers. A fault's `value` becomes the taint value and its `reason` the condition's message.

Debounce: a signal's reported fault follows its observed one only once that has held for
`debounce` seconds, both ways. A link flapping faster than that changes nothing until it settles,
so a flap storm costs at most a condition change or two, and the slice writes that come with them.
A link that never settles is therefore never reported here: the grey-failure rules count its
carrier changes instead (`driver.health.nic.grey`, `link-flapping`).
"""

from __future__ import annotations

from driver.health.faults import Fault, label
from driver.node.rtnl import LinkState

LINK_DOWN = "link-down"
RDMA_PORT_DOWN = "rdma-port-down"
NIC_LOST = "nic-lost"
BAD_OPERSTATES = frozenset({"down", "lowerlayerdown", "notpresent"})
GOOD_PORT_STATES = frozenset({"ACTIVE", "ACTIVE_DEFER"})
GOOD_PHYS_STATES = frozenset({"LinkUp"})


class Debounced:
    """One signal whose reported fault follows the observed one only after it has held for
    `debounce` seconds. Pure: time comes in as arguments, so a test drives it with numbers."""

    def __init__(self, debounce: float, now: float) -> None:
        self.debounce = debounce
        self.observed: Fault | None = None
        self.observed_since = now
        self.reported: Fault | None = None
        self.reported_since_wall = 0.0  # wall time the reported fault began

    def observe(self, fault: Fault | None, now: float) -> bool:
        """Records what the signal says now; True when that is a change (a transition)."""
        if fault == self.observed:
            return False
        self.observed, self.observed_since = fault, now
        return True

    def due(self) -> float | None:
        """When `settle` would change the reported fault if nothing is observed until then."""
        return None if self.observed == self.reported else self.observed_since + self.debounce

    def settle(self, now: float, wall: float) -> bool:
        """Reports the observed fault if it has held long enough; True when the report changed."""
        due = self.due()
        if due is None or now < due:
            return False
        self.reported = self.observed
        self.reported_since_wall = wall - (now - self.observed_since)
        return True


# The PCI function has left sysfs (`bus/pci/devices/<bdf>`): hot-removed, or a VF whose PF's
# `sriov_numvfs` was lowered. Its netdev moving into a pod leaves the function where it is.
FUNCTION_GONE = Fault("", "PCI function gone from the bus")


def link_fault(state: LinkState) -> Fault | None:
    """Why a link cannot pass traffic, most specific reason first; None when it can."""
    if not state.admin_up:
        return Fault("admin-down", "administratively down")
    if not state.carrier:
        return Fault("carrier", "no carrier")
    if state.operstate in BAD_OPERSTATES:
        return Fault(label(f"operstate-{state.operstate}"), f"operstate {state.operstate}")
    return None


def port_fault(port: int, state: str, phys_state: str | None) -> Fault | None:
    """Why an RDMA port is not usable, from the names in its `state` and `phys_state` files."""
    if state not in GOOD_PORT_STATES:
        return Fault(label(f"port{port}-{state.lower()}"), f"RDMA port {port} is {state}")
    if phys_state is not None and phys_state not in GOOD_PHYS_STATES:
        return Fault(label(f"port{port}-phys-{phys_state.lower()}"), f"RDMA port {port} physical state {phys_state}")
    return None
