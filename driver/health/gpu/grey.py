"""A GPU that is up but sick: what is read of it (NVML and its PCI function's AER counters) and
what a reading means, per `driver.health.grey`.

* **PCIe link** (`pcie-degraded`): the width and generation NVML says the link trained to,
  against the most the GPU and its slot allow (`nvmlDeviceGetMaxPcieLink*`: device and system).
  A GPU lowers its link **generation** when idle to save power and raises it under load, so a low
  generation counts only in a read where NVML does not name the GPU idle (clocks event reason
  `GpuIdle`); such a read says nothing either way. Power saving leaves the **width** alone, so a
  narrow link counts at any read.
* **PCIe errors** (`pcie-errors`): the GPU's PCIe replay counter and the correctable AER count of
  its function and of the port above it (both ends of one link), as rates against DCGM's budget
  for the link (`allowed_link_errors`); uncorrectable AER (non-fatal and fatal) as a count.
* **Clocks** (`clocks-slowdown`): hardware slowdown, hardware thermal slowdown or the power brake
  in the clocks event reasons, held for `hold`. Software power capping, sync boost and idle are
  how a healthy GPU runs and never count.
* **NVLink** (`nvlink-degraded`): fewer active links than the GPU's peers on the node with the
  same link count have (or than it has, alone); replay and recovery errors (DCGM fails any), CRC
  errors above DCGM's per-second limit.

Every NVML read is allowed to fail alone (NOT_SUPPORTED on PCIe cards without NVLink, on older
drivers): that signal is then unread this round, never a fault and never good news.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from driver.health.faults import Fault
from driver.health.grey import (
    CLOCKS_SLOWDOWN,
    GEN_SPEED,
    NO_AER,
    NVLINK_DEGRADED,
    PCIE_DEGRADED,
    PCIE_ERRORS,
    GreyDevice,
    allowed_link_errors,
    judge_aer,
    total,
)
from driver.health.pcie_sysfs import AerCounts, port_of, read_aer
from driver.node.nvml import NvmlError

GPU_IDLE = 0x1
# Clocks event reasons that mean the hardware is holding the GPU down (nvml.h): HwSlowdown,
# HwThermalSlowdown, HwPowerBrakeSlowdown. DCGM's diagnostics fail on the same (and SwThermal).
HARDWARE_REASONS = {0x8: "hardware slowdown", 0x40: "hardware thermal slowdown", 0x80: "power brake"}
FI_PCIE_REPLAY_COUNTER = 94
FI_NVLINK_LINK_COUNT = 91
FI_NVLINK_GET_STATE = 165
FI_NVLINK_CRC_TOTALS = (38, 45)  # flow-control and data CRC errors, all links
FI_NVLINK_ERROR_TOTALS = (52, 59)  # replay and recovery errors, all links
NVML_SUCCESS = 0
FEATURE_ENABLED = 1


@dataclass(frozen=True)
class GpuReading:
    """One read of one GPU; None wherever NVML or sysfs could not say."""

    gen: int | None = None
    gen_max: int | None = None
    width: int | None = None
    width_max: int | None = None
    reasons: int | None = None
    replays: int | None = None
    nvlinks: int | None = None  # links the GPU has
    nvlinks_up: int | None = None
    nvlink_errors: int | None = None  # replay + recovery, all links
    nvlink_crc: int | None = None  # CRC flit + data, all links
    aer: AerCounts = NO_AER
    port_aer: AerCounts = NO_AER


def _call(fn: Any, *args: Any) -> Any:
    try:
        return fn(*args)
    except NvmlError:
        return None


def _fields(nvml: Any, handle: Any, ids: list[int | tuple[int, int]]) -> list[int | None]:
    """Field values in one NVML call; None for each field NVML could not give."""
    values = _call(nvml.nvmlDeviceGetFieldValues, handle, ids)
    if values is None:
        return [None] * len(ids)
    out: list[int | None] = []
    for v in values:
        if v.nvmlReturn != NVML_SUCCESS:
            out.append(None)
        else:
            out.append(
                int(v.value.ullVal) if v.valueType == nvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG else int(v.value.uiVal)
            )
    return out


def read_gpu(nvml: Any, handle: Any, sysfs_root: Path, pci_bus_id: str) -> GpuReading:
    """Everything the rules read of one GPU: eight NVML calls and two AER files per end of its link."""
    replays, links, *totals = _fields(
        nvml, handle, [FI_PCIE_REPLAY_COUNTER, FI_NVLINK_LINK_COUNT, *FI_NVLINK_CRC_TOTALS, *FI_NVLINK_ERROR_TOTALS]
    )
    up = None
    if links:
        states = _fields(nvml, handle, [(FI_NVLINK_GET_STATE, link) for link in range(links)])
        up = None if None in states else sum(1 for s in states if s == FEATURE_ENABLED)
    port = port_of(sysfs_root, pci_bus_id)
    return GpuReading(
        gen=_call(nvml.nvmlDeviceGetCurrPcieLinkGeneration, handle),
        gen_max=_call(nvml.nvmlDeviceGetMaxPcieLinkGeneration, handle),
        width=_call(nvml.nvmlDeviceGetCurrPcieLinkWidth, handle),
        width_max=_call(nvml.nvmlDeviceGetMaxPcieLinkWidth, handle),
        reasons=_call(nvml.nvmlDeviceGetCurrentClocksEventReasons, handle),
        replays=replays,
        nvlinks=links,
        nvlinks_up=up,
        nvlink_crc=total(*totals[:2]),
        nvlink_errors=total(*totals[2:]),
        aer=read_aer(sysfs_root, pci_bus_id),
        port_aer=read_aer(sysfs_root, port) if port else NO_AER,
    )


def judge_gpu(dev: GreyDevice, r: GpuReading, nvlinks_expected: int | None, now: float, wall: float) -> None:
    """Feeds one reading to the GPU's signals. `nvlinks_expected`: the most active links any GPU
    of the node with the same link count has now (this one included)."""
    t = dev.t
    _judge_link(dev, r, now, wall)
    if r.gen_max in GEN_SPEED and r.width_max:
        budget = allowed_link_errors(GEN_SPEED[r.gen_max], r.width_max, t.pcie_ber)
        replays = dev.counter("pcie-replays", r.replays, now)
        words = f"PCIe replays (at most {budget * 60:.0f}/min allowed)"
        dev.rate_rule(PCIE_ERRORS, "pcie-replays", replays, budget, words, now, wall)
        judge_aer(dev, r.aer, r.port_aer, budget, now, wall)
    if r.reasons is not None:
        held = [words for bit, words in HARDWARE_REASONS.items() if r.reasons & bit]
        fault = Fault("clocks-held", f"clocks held down by {', '.join(held)}") if held else None
        dev.state(CLOCKS_SLOWDOWN, "reasons", fault, now, wall)
    _judge_nvlink(dev, r, nvlinks_expected, now, wall)


def _judge_link(dev: GreyDevice, r: GpuReading, now: float, wall: float) -> None:
    """Width at every read; generation only while busy, except that an idle read counts as well
    for a slow link already reported: a GPU fenced for it gets no work, so it would stay idle and
    fenced for ever. Given back after `recovery` idle, it is caught again within `hold` of work if
    its link is still slow."""
    if r.width is not None and r.width_max:
        fault = None
        if r.width < r.width_max:
            fault = Fault(f"x{r.width}-of-x{r.width_max}", f"PCIe link trained at x{r.width} of x{r.width_max}")
        dev.state(PCIE_DEGRADED, "width", fault, now, wall)
    if r.gen is None or not r.gen_max or r.reasons is None:
        return
    if r.reasons & GPU_IDLE:
        if dev.reported(PCIE_DEGRADED, "generation"):
            dev.state(PCIE_DEGRADED, "generation", None, now, wall)
        return
    fault = None
    if r.gen < r.gen_max:
        fault = Fault(f"gen{r.gen}-of-gen{r.gen_max}", f"PCIe link at Gen{r.gen} of Gen{r.gen_max} while busy")
    dev.state(PCIE_DEGRADED, "generation", fault, now, wall)


def _judge_nvlink(dev: GreyDevice, r: GpuReading, expected: int | None, now: float, wall: float) -> None:
    t = dev.t
    if r.nvlinks_up is not None and expected is not None:
        fault = None
        if r.nvlinks_up < expected:
            fault = Fault(f"nvlink-{r.nvlinks_up}-of-{expected}", f"{r.nvlinks_up} of {expected} NVLinks active")
        dev.state(NVLINK_DEGRADED, "links", fault, now, wall)
    errors = dev.counter("nvlink-errors", r.nvlink_errors, now)
    words = "NVLink replay and recovery errors"
    dev.count_rule(NVLINK_DEGRADED, "nvlink-errors", errors, t.nvlink_errors, words, now, wall)
    crc = dev.counter("nvlink-crc", r.nvlink_crc, now)
    dev.rate_rule(NVLINK_DEGRADED, "nvlink-crc", crc, t.nvlink_crc_per_s, "NVLink CRC errors", now, wall)
