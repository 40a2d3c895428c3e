"""The claim side's closed sets of words, as StrEnums: how a GPU is shared and at which time slice,
a NIC's mode (a claim's opaque configuration, `driver.claims.opaque_config`), how far a prepare
got (the checkpoint, `driver.claims.checkpoint`), and what paired a GPU with its NIC (device
metadata, `driver.claims.cdi_spec`).

A StrEnum member is its string: it compares equal to it, formats as it and `json` writes it as
it, so the checkpoint and the other files and bodies Tandem writes are byte for byte what the
plain strings made. A value read from outside becomes a member where it is decoded, and one this
release does not know is refused there, with the field named, instead of flowing on as a string
no branch expects. A release that adds a member to a set written to disk raises that file's
format version, so an older release refuses the file as newer rather than misreading it.
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import StrEnum
from typing import TypeVar

from driver.untrusted import shown

_Word = TypeVar("_Word", bound=StrEnum)


def member_of(kind: type[_Word], value: str, field: str) -> _Word:
    """`value`, read from outside, as a member of `kind`; ValueError naming `field` and the
    members when it is none of them, and the right spelling when only its case is wrong (`mps`)."""
    try:
        return kind(value)
    except ValueError:
        members = [m.value for m in kind]
        raise ValueError(f"{field} must be one of {members}, got {shown(value)}{case_hint(value, members)}") from None


def case_hint(value: str, words: Iterable[str]) -> str:
    """` (did you mean 'MPS'?)` when `value` is one of `words` but for its case, else nothing."""
    return next((f" (did you mean {w!r}?)" for w in words if w.lower() == value.lower() and w != value), "")


class Sharing(StrEnum):
    """How the processes of a claim's pods share a GPU (`GpuConfig.sharing`,
    `driver.claims.gpu.sharing`); None wherever a GPU is not shared, and the claim must hold it whole."""

    MPS = "MPS"
    TIME_SLICING = "TimeSlicing"


class TimeSliceInterval(StrEnum):
    """TimeSlicing's interval (`GpuConfig.timeSliceInterval`): NVIDIA's names for the values 0..3 of
    `nvidia-smi compute-policy --set-timeslice`, in that order (`driver.claims.gpu.time_slices`)."""

    DEFAULT = "Default"
    SHORT = "Short"
    MEDIUM = "Medium"
    LONG = "Long"

    @property
    def setting(self) -> int:
        """The number `nvidia-smi compute-policy --set-timeslice` takes for it."""
        return list(TimeSliceInterval).index(self)


class NicMode(StrEnum):
    """`NicConfig.mode` (`driver.claims.nic.modes`)."""

    SHARED = "shared"  # the netdev stays in the host's namespace; the pod gets the RDMA devices
    EXCLUSIVE = "exclusive"  # the netdev moves into the pod (CDI netDevices) under its interfaceName


class PrepareState(StrEnum):
    """A checkpoint record's state (`driver.claims.prepare`, two phases)."""

    STARTED = "PrepareStarted"  # maybe half done: the owning instance redoes it, or start-up rolls it back
    COMPLETED = "PrepareCompleted"


class PairRule(StrEnum):
    """What brought a GPU and its NIC together, nearest first (`pairedBy` in the GPU's device
    metadata, `driver.claims.cdi_spec`)."""

    PCIE_SWITCH = "pcieSwitch"  # the same PCIe switch
    PCIE_BRIDGE = "pcieBridge"  # a bridge below the root complex: a switch of switches
    PCIE_ROOT = "pcieRoot"  # the same root complex
    NUMA_NODE = "numaNode"  # the same NUMA node
    NONE = "none"  # nothing
