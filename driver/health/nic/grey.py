"""An RDMA NIC that is up but sick: what its sysfs readings mean, per `driver.health.grey`.

* **PCIe link** (`pcie-degraded`): the speed or width the function's link trained to below the
  most both its ends support (the function's and its port's maxima). A NIC does not lower its
  link to save power the way a GPU does, so any read counts, held for `hold`.
* **PCIe errors** (`pcie-errors`): AER of the function and the port above it, as for a GPU.
* **Flapping** (`link-flapping`): carrier changes within `window`. A flap is a change down and
  one back, so a single flap (or an `ip link set down/up`) is two and never reaches the default
  of three flaps. The counter catches flaps that happen between two reads and links that never
  settle, which the link-state debounce (`driver.health.nic.signals`) waits out by design.
* **RDMA port errors** (`rdma-errors`), per port: physical-link counters (symbol errors, link
  error recovery, link downed, receive errors, local link integrity, buffer overrun), as rates
  or counts (`driver.health.thresholds`). The transport's loss counters (out-of-sequence and
  sequence-error NAKs, ACK timeouts, retries exhausted) are `rdma-transport-errors`, effect None
  by default: a tenant's own traffic can raise them for the whole port (`driver.health.grey`). Congestion counters (ECN marks,
  CNPs) mean a busy fabric, not a sick NIC: they are exported as metrics and never taint. An
  IBTA counter stuck at its ceiling can no longer rise; the log says so once.
* **Slow link** (`link-slow`): a negotiated speed below that of the fastest NIC of the same
  model and firmware on the node, or below the configured `nic-speed-mbps`, held for `hold`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from driver.health.faults import Fault
from driver.health.grey import (
    LINK_FLAPPING,
    LINK_SLOW,
    NO_AER,
    PCIE_DEGRADED,
    RDMA_ERRORS,
    RDMA_TRANSPORT,
    GreyDevice,
    allowed_link_errors,
    judge_aer,
    total,
)
from driver.health.nic.counters import CONGESTION_COUNTERS, COUNTER_LIMITS, NicCounters, read_nic_counters
from driver.health.pcie_sysfs import AerCounts, PcieLink, read_aer, read_pcie_link
from driver.health.windows import Increase
from driver.model import NicInfo

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class NicReading:
    """One read of one NIC: its PCI function's link, the AER of both ends, its counters."""

    link: PcieLink | None
    aer: AerCounts
    port_aer: AerCounts
    counters: NicCounters


def read_nic(sysfs_root: Path, nic: NicInfo) -> NicReading:
    """A netdev moved into a pod is not the host's to read: then only its PCI function and RDMA
    ports (shared RDMA namespace mode) are."""
    link = read_pcie_link(sysfs_root, nic.pci_address)
    port_aer = read_aer(sysfs_root, link.port) if link is not None and link.port else NO_AER
    counters = read_nic_counters(sysfs_root, nic.ifname if nic.present else "", nic.rdma_device)
    return NicReading(link, read_aer(sysfs_root, nic.pci_address), port_aer, counters)


def judge_nic(dev: GreyDevice, r: NicReading, peer_speed_mbps: int | None, now: float, wall: float) -> None:
    """Feeds one reading of one NIC to its signals. `peer_speed_mbps`: the fastest speed among the
    NICs of the node with the same model and firmware, this one included."""
    t = dev.t
    link, counters = r.link, r.counters
    speed, width = (link.capable_speed(), link.capable_width()) if link is not None else (None, None)
    if link is not None and link.speed_gts is not None and link.width is not None and speed and width:
        fault = None
        if link.speed_gts < speed or link.width < width:
            words = f"PCIe link at {link.speed_gts:g} GT/s x{link.width} of {speed:g} GT/s x{width}"
            fault = Fault(f"{link.speed_gts:g}GTs-x{link.width}", words)
        dev.state(PCIE_DEGRADED, "link", fault, now, wall)
    if speed and width:
        judge_aer(dev, r.aer, r.port_aer, allowed_link_errors(speed, width, t.pcie_ber), now, wall)
    changes = dev.counter("carrier-changes", counters.carrier_changes, now)
    words = "carrier changes (a flap is two)"
    dev.count_rule(LINK_FLAPPING, "flapping", changes, 2 * t.flaps, words, now, wall)
    for port, values in sorted(counters.ports.items()):
        _judge_port(dev, port, values, now, wall)
        for name in CONGESTION_COUNTERS:
            if name in values:
                dev.record(f"port{port}/{name}", values[name])
    _judge_speed(dev, counters.speed_mbps, peer_speed_mbps, now, wall)


# What each RDMA port counter means (`driver.health.thresholds` names the limits): counters
# summed, the condition, the threshold (a rate per second or minute, or a count in the window),
# and words. The physical link's counters first, then the transport's, which a tenant can raise.
_RULES = (
    (("symbol_error",), RDMA_ERRORS, "symbol_errors_per_s", "symbol errors"),
    (("link_error_recovery",), RDMA_ERRORS, "link_recoveries_per_min", "link error recoveries"),
    (("port_rcv_errors",), RDMA_ERRORS, "rcv_errors_per_s", "receive errors"),
    (("link_downed",), RDMA_ERRORS, "link_downed", "link-downed events"),
    (("local_link_integrity_errors",), RDMA_ERRORS, "integrity_errors", "local link integrity errors"),
    (("excessive_buffer_overrun_errors",), RDMA_ERRORS, "overrun_errors", "buffer overruns"),
    (("local_ack_timeout_err",), RDMA_TRANSPORT, "ack_timeouts_per_s", "ACK timeouts"),
    (("out_of_sequence", "packet_seq_err"), RDMA_TRANSPORT, "sequence_errors_per_s", "out-of-sequence packets"),
    (("req_transport_retries_exceeded",), RDMA_TRANSPORT, "retries_exceeded", "exhausted transport retries"),
)


def _judge_port(dev: GreyDevice, port: int, values: Mapping[str, int], now: float, wall: float) -> None:
    for names, condition, threshold, words in _RULES:
        signal = f"port{port}-{names[0].replace('_', '-')}"
        inc = _read(dev, port, names, values, now)
        limit = getattr(dev.t, threshold)
        words = f"{words} on port {port}"
        if threshold.endswith("_per_s"):
            dev.rate_rule(condition, signal, inc, limit, words, now, wall)
        elif threshold.endswith("_per_min"):
            dev.rate_rule(condition, signal, inc, limit / 60, words, now, wall)
        else:
            dev.count_rule(condition, signal, inc, limit, words, now, wall)


def _read(dev: GreyDevice, port: int, names: tuple[str, ...], values: Mapping[str, int], now: float) -> Increase | None:
    """Adds a read of the (summed) counters; says once when a counter is stuck at its ceiling."""
    counter = f"port{port}/{'+'.join(names)}"
    was_saturated = dev.saturated(counter)
    value = total(*(values.get(n) for n in names))
    inc = dev.counter(counter, value, now, COUNTER_LIMITS.get(names[0]) if len(names) == 1 else None)
    if dev.saturated(counter) and not was_saturated:
        log.warning("RDMA port %d: %s stuck at its ceiling %s: its rise can no longer be seen", port, names[0], value)
    return inc


def _judge_speed(dev: GreyDevice, speed: int | None, peers: int | None, now: float, wall: float) -> None:
    expected = max(peers or 0, dev.t.nic_speed_mbps)
    if speed is None or not expected:
        return
    fault = None
    if speed < expected:
        fault = Fault(f"{speed // 1000}G-of-{expected // 1000}G", f"link at {speed} Mb/s, {expected} Mb/s expected")
    dev.state(LINK_SLOW, "speed", fault, now, wall)
