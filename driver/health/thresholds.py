"""The numbers that tell a sick device from a busy one: grey-failure thresholds, with defaults.

Each is set with `--grey-threshold NAME=VALUE` (repeatable); the defaults and where each comes
from are the table in docs/health.md. A name that does not exist, a value that is not a number,
out of range, or a combination under which a rule could never fire is refused at start-up with
a message that says which and why: a typo must not silently keep a default.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class GreyThresholds:
    """Times in seconds, rates per second unless the name says per minute, counts per `window`."""

    period: float = 30.0  # how often counters and link states are read
    window: float = 300.0  # what rates and counts are taken over
    hold: float = 300.0  # how long a state (a slow link, clocks held down) must last
    recovery: float = 600.0  # how long a signal must read well before its taint clears
    rising_reads: int = 3  # reads in the window that must each show a rate counter rising
    pcie_ber: float = 1e-12  # bit error ratio that sizes the allowed PCIe replays and AER
    aer_uncorrectable: int = 2
    flaps: int = 3
    symbol_errors_per_s: float = 10.0
    link_recoveries_per_min: float = 5.0
    link_downed: int = 3
    rcv_errors_per_s: float = 10.0
    integrity_errors: int = 1
    overrun_errors: int = 1
    ack_timeouts_per_s: float = 1.0
    sequence_errors_per_s: float = 10.0
    retries_exceeded: int = 2
    nvlink_errors: int = 1
    nvlink_crc_per_s: float = 100.0
    nic_speed_mbps: int = 0  # the speed every NIC should reach; 0: only its identical peers count

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "nic_speed_mbps":
                ok, rule = value >= 0, "zero or more"
            elif f.type == "int":
                ok, rule = value >= 1, "at least 1"
            else:
                ok, rule = value > 0, "above zero"
            if not (math.isfinite(value) and ok):
                raise ValueError(f"{_flag_name(f.name)} {value} must be a finite number, {rule}")
        if self.pcie_ber >= 1:
            raise ValueError(f"pcie-ber {self.pcie_ber} must be a ratio below 1 (e.g. 1e-12)")
        if self.window < 2 * self.period:
            raise ValueError(
                f"window {self.window} must be at least twice period {self.period}: a rate needs two reads"
            )
        if self.rising_reads > self.window / self.period:
            raise ValueError(
                f"rising-reads {self.rising_reads} is more than the {int(self.window / self.period)} reads a window of "
                f"{self.window}s holds at a period of {self.period}s: no rate could ever be reported"
            )


def _flag_name(field_name: str) -> str:
    return field_name.replace("_", "-")


NAMES = tuple(_flag_name(f.name) for f in dataclasses.fields(GreyThresholds))


def parse_thresholds(specs: Iterable[str]) -> GreyThresholds:
    """`["window=600", "flaps=5"]` (the `--grey-threshold` flag) -> thresholds; ValueError says
    what is wrong with which."""
    kinds = {_flag_name(f.name): (f.name, f.type) for f in dataclasses.fields(GreyThresholds)}
    values: dict[str, float | int] = {}
    for spec in specs:
        name, sep, text = spec.partition("=")
        if not sep:
            raise ValueError(f"grey threshold {spec!r} is not NAME=VALUE")
        if name not in kinds:
            raise ValueError(f"grey threshold {spec!r}: unknown name {name!r}; known: {', '.join(NAMES)}")
        field_name, kind = kinds[name]
        try:
            values[field_name] = int(text) if kind == "int" else float(text)
        except ValueError:
            what = "a whole number" if kind == "int" else "a number"
            raise ValueError(f"grey threshold {spec!r}: {text!r} is not {what}") from None
    return GreyThresholds(**values)  # type: ignore[arg-type]
