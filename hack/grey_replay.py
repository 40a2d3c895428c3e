"""A day of a healthy 8-GPU + 8-NIC node, then the same day with one grey failure of each kind,
played through the daemon's grey-failure rules (`driver.health.grey_judge`) in simulated time.

    python hack/grey_replay.py [--seed N] [--hours H] [--json]

The healthy day is what a busy training node looks like when nothing is wrong: jobs of one to six
hours with idle gaps between them (idle GPUs drop their PCIe link to Gen1 and report `GpuIdle`),
clocks moving with power capping and sync boost and, now and then, one read of hardware slowdown
during a P-state change; a trickle of PCIe replays, one replay storm during a link retrain, one
correctable AER burst on a GPU and one on a NIC, a single flap now and then, a trickle of symbol
errors and ACK timeouts, out-of-sequence packets and heavy ECN/CNP counts while jobs run. It must
taint nothing. The faulty day adds one fault of each kind at a known time for a known span;
each must be found, and cleared after it ends. The table says when, in seconds from the fault's
start (taint) and end (clear).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from driver.health.gpu.grey import GpuReading
from driver.health.grey_judge import GreyJudge, NicRead
from driver.health.nic.counters import NicCounters
from driver.health.nic.grey import NicReading
from driver.health.pcie_sysfs import AerCounts, PcieLink
from driver.health.thresholds import GreyThresholds

STEP = 30.0  # the daemon's default period
GPUS = NICS = 8
DOMAIN = "tandem.dev"
HEALTHY_LINK = PcieLink(32.0, 16, 32.0, 16, "0000:00:01.0", 32.0, 16)
NIC_COUNTERS = (
    "symbol_error", "link_error_recovery", "link_downed", "port_rcv_errors", "local_link_integrity_errors",
    "excessive_buffer_overrun_errors", "out_of_sequence", "packet_seq_err", "local_ack_timeout_err",
    "req_transport_retries_exceeded", "np_ecn_marked_roce_packets", "np_cnp_sent", "rp_cnp_handled",
)  # fmt: skip


@dataclass(frozen=True)
class Fault:
    """One injected fault: on which device, when (hours into the day), what it sets (`state`:
    reading fields held for its span) or adds at each read (`adds`: counter increments), the
    condition it must raise and those it may raise too (a flapping port also counts link-downed
    events)."""

    name: str
    kind: str  # "gpu" or "nic"
    index: int
    start_h: float
    end_h: float
    condition: str
    state: dict[str, int] = field(default_factory=dict)
    adds: dict[str, int] = field(default_factory=dict)
    also: tuple[str, ...] = ()


FAULTS = (
    Fault("GPU PCIe link x8", "gpu", 2, 2.0, 4.0, "pcie-degraded", state={"width": 8}),
    Fault("GPU PCIe link Gen3 while busy", "gpu", 3, 5.0, 6.0, "pcie-degraded", state={"gen": 3, "busy": 1}),
    Fault("GPU PCIe replays", "gpu", 4, 7.0, 7.5, "pcie-errors", adds={"replays": 100}),
    Fault("GPU power brake", "gpu", 5, 9.0, 10.0, "clocks-slowdown", state={"reasons": 0x80, "busy": 1}),
    Fault("GPU 2 NVLinks down", "gpu", 6, 11.0, 12.0, "nvlink-degraded", state={"nvlinks_up": 16}),
    Fault("GPU NVLink replays", "gpu", 1, 13.0, 13.05, "nvlink-degraded", adds={"nvlink_errors": 3}),
    Fault("GPU uncorrectable AER", "gpu", 7, 22.0, 22.02, "pcie-errors", adds={"aer_nonfatal": 2}),
    Fault(
        "NIC flapping",
        "nic",
        1,
        14.0,
        14.33,
        "link-flapping",
        adds={"carrier": 4, "link_downed": 2},
        also=("rdma-errors",),
    ),
    Fault("NIC symbol errors", "nic", 2, 16.0, 16.5, "rdma-errors", adds={"symbol_error": 1000}),
    Fault("NIC at 200G of 400G", "nic", 3, 18.0, 19.0, "link-slow", state={"speed": 200000}),
    Fault("NIC PCIe Gen4 of Gen5", "nic", 4, 19.0, 20.0, "pcie-degraded", state={"link_gts": 16}),
    Fault("NIC correctable AER", "nic", 5, 20.0, 20.5, "pcie-errors", adds={"aer_correctable": 100}),
    Fault("NIC link integrity error", "nic", 6, 21.0, 21.02, "rdma-errors", adds={"local_link_integrity_errors": 1}),
    Fault("NIC ACK timeouts", "nic", 7, 22.5, 22.83, "rdma-transport-errors", adds={"local_ack_timeout_err": 100}),
)


class Node:
    """The generator: the node's devices read by read, healthy noise plus the faults active."""

    def __init__(self, seed: int, hours: float, faults: tuple[Fault, ...]) -> None:
        self.rng = random.Random(seed)
        self.steps = int(hours * 3600 / STEP)
        self.faults = faults
        self.busy = [self._schedule() for _ in range(GPUS)]
        self.counts: dict[tuple[str, int], dict[str, int]] = {}
        # rare healthy events, each at a random read: a replay storm (link retrain), AER bursts,
        # single flaps at least two hours apart on any one NIC
        self.retrain = (self.rng.randrange(GPUS), self.rng.randrange(self.steps))
        self.gpu_burst = (self.rng.randrange(GPUS), self.rng.randrange(self.steps))
        self.nic_burst = (self.rng.randrange(NICS), self.rng.randrange(self.steps))
        self.flaps = {(j, s) for j in range(NICS) for s in range(self.rng.randrange(240), self.steps, 240 * 3)}

    def _schedule(self) -> list[bool]:
        out: list[bool] = []
        while len(out) < self.steps:
            out += [False] * int(self.rng.uniform(600, 3600) / STEP)
            out += [True] * int(self.rng.uniform(3600, 6 * 3600) / STEP)
        return out[: self.steps]

    def reads(self) -> Iterator[tuple[float, dict[str, GpuReading], dict[str, NicRead]]]:
        for s in range(self.steps):
            t = s * STEP
            active = [f for f in self.faults if f.start_h * 3600 <= t < f.end_h * 3600]
            gpus = {
                f"GPU-{i}": self._gpu(i, s, [f for f in active if (f.kind, f.index) == ("gpu", i)]) for i in range(GPUS)
            }
            nics = {
                f"0000:{0xD0 + j:02x}:00.0": self._nic(j, s, [f for f in active if (f.kind, f.index) == ("nic", j)])
                for j in range(NICS)
            }
            yield t, gpus, nics

    def _add(self, key: tuple[str, int], name: str, n: int) -> int:
        counts = self.counts.setdefault(key, {})
        counts[name] = counts.get(name, 0) + n
        return counts[name]

    def _gpu(self, i: int, s: int, faults: list[Fault]) -> GpuReading:
        rng, key = self.rng, ("gpu", i)
        state = {k: v for f in faults for k, v in f.state.items()}
        adds = {k: v for f in faults for k, v in f.adds.items()}
        busy = bool(state.get("busy", self.busy[i][s]))
        reasons = rng.choice([0x0, 0x4, 0x10, 0x14]) | (0x8 if rng.random() < 0.002 else 0) if busy else 0x1
        replays = (1 if rng.random() < 0.02 else 0) + (300 if (i, s) == self.retrain else 0)
        return GpuReading(
            gen=state.get("gen", 5) if busy else 1,
            gen_max=5,
            width=state.get("width", 16),
            width_max=16,
            reasons=reasons | state.get("reasons", 0),
            replays=self._add(key, "replays", replays + adds.get("replays", 0)),
            nvlinks=18,
            nvlinks_up=state.get("nvlinks_up", 18),
            nvlink_errors=self._add(key, "nvlink_errors", adds.get("nvlink_errors", 0)),
            nvlink_crc=self._add(key, "nvlink_crc", rng.randint(0, 3) if rng.random() < 0.01 else 0),
            aer=AerCounts(
                self._add(key, "aer_correctable", 40 if (i, s) == self.gpu_burst else 0),
                self._add(key, "aer_nonfatal", adds.get("aer_nonfatal", 0)),
                0,
            ),
            port_aer=AerCounts(0, 0, 0),
        )

    def _nic(self, j: int, s: int, faults: list[Fault]) -> NicRead:
        rng, key = self.rng, ("nic", j)
        state = {k: v for f in faults for k, v in f.state.items()}
        adds = {k: v for f in faults for k, v in f.adds.items()}
        busy = self.busy[j][s]
        flap = (j, s) in self.flaps
        noise = {
            "symbol_error": 1 if rng.random() < 0.01 else 0,
            "link_downed": 1 if flap else 0,
            "out_of_sequence": rng.randint(0, 40) if busy else 0,
            "packet_seq_err": rng.randint(0, 10) if busy else 0,
            "local_ack_timeout_err": 1 if rng.random() < 0.005 else 0,
            "np_ecn_marked_roce_packets": rng.randint(10**4, 10**6) if busy else 0,
            "np_cnp_sent": rng.randint(10**3, 10**5) if busy else 0,
            "rp_cnp_handled": rng.randint(10**3, 10**5) if busy else 0,
        }
        port = {name: self._add(key, name, noise.get(name, 0) + adds.get(name, 0)) for name in NIC_COUNTERS}
        carrier = self._add(key, "carrier", (2 if flap else 0) + adds.get("carrier", 0))
        corrected = self._add(
            key, "aer_correctable", (25 if (j, s) == self.nic_burst else 0) + adds.get("aer_correctable", 0)
        )
        link = dataclasses.replace(HEALTHY_LINK, speed_gts=float(state.get("link_gts", 32)))
        counters = NicCounters(carrier + 1, state.get("speed", 400000), "28.39.1002", {1: port})
        return NicRead(("0x15b3", "0x1021"), NicReading(link, AerCounts(corrected, 0, 0), AerCounts(0, 0, 0), counters))


@dataclass
class Seen:
    tainted_at: float
    cleared_at: float | None = None


def replay(node: Node, thresholds: GreyThresholds) -> dict[tuple[str, str], list[Seen]]:
    """Every taint the rules raised, by (device identity, condition), with when it came and went."""
    judge = GreyJudge(thresholds, DOMAIN, {})
    seen: dict[tuple[str, str], list[Seen]] = {}
    for t, gpus, nics in node.reads():
        for identity, conditions in judge.judge(gpus, nics, t, t).items():
            now = {c.key.removeprefix(f"{DOMAIN}/") for c in conditions}
            for condition in now:
                spans = seen.setdefault((identity, condition), [])
                if not spans or spans[-1].cleared_at is not None:
                    spans.append(Seen(t))
            for (who, condition), spans in seen.items():
                if who == identity and condition not in now and spans[-1].cleared_at is None:
                    spans[-1].cleared_at = t
    return seen


def identity(f: Fault) -> str:
    return f"GPU-{f.index}" if f.kind == "gpu" else f"0000:{0xD0 + f.index:02x}:00.0"


@dataclass(frozen=True)
class Row:
    fault: str
    condition: str
    time_to_taint_s: float | None  # from the fault's start; None: never tainted
    time_to_clear_s: float | None  # from the fault's end; None: never cleared
    taints: int  # times the condition came during the day


@dataclass(frozen=True)
class Result:
    hours: float
    healthy_taints: list[str]  # every taint of the healthy day: must be none
    faults: list[Row]
    other_taints: list[str]  # taints of the faulty day no injected fault explains


def _spans(seen: dict[tuple[str, str], list[Seen]]) -> list[str]:
    return [f"{who} {c} at {s.tainted_at:.0f}s" for (who, c), spans in seen.items() for s in spans]


def run(seed: int, hours: float) -> Result:
    thresholds = GreyThresholds()
    healthy = replay(Node(seed, hours, ()), thresholds)
    faulty = replay(Node(seed, hours, FAULTS), thresholds)
    rows = []
    for f in FAULTS:
        for condition in f.also:
            faulty.pop((identity(f), condition), None)
        spans = faulty.pop((identity(f), f.condition), [])
        first = spans[0] if spans else None
        taint = None if first is None else first.tainted_at - f.start_h * 3600
        clear = None if first is None or first.cleared_at is None else first.cleared_at - f.end_h * 3600
        rows.append(Row(f.name, f.condition, taint, clear, len(spans)))
    return Result(hours, _spans(healthy), rows, _spans(faulty))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--hours", type=float, default=24.0)
    parser.add_argument("--json", action="store_true", help="print the result as JSON instead of a table")
    args = parser.parse_args()
    result = run(args.seed, args.hours)
    if args.json:
        json.dump(dataclasses.asdict(result), sys.stdout, indent=2)
        print()
        return 0
    print(
        f"healthy day ({args.hours:g} h, seed {args.seed}): {len(result.healthy_taints)} taints {result.healthy_taints}"
    )
    print(f"{'fault':32} {'condition':24} {'to taint':>9} {'to clear':>9}")
    for row in result.faults:
        print(f"{row.fault:32} {row.condition:24} {_secs(row.time_to_taint_s):>9} {_secs(row.time_to_clear_s):>9}")
    print(f"other taints on the faulty day: {result.other_taints or 'none'}")
    return 0


def _secs(value: float | None) -> str:
    return "never" if value is None else f"{value:.0f} s"


if __name__ == "__main__":
    sys.exit(main())
