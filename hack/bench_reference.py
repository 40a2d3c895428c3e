"""Tandem's prepare path side by side with two Go reference drivers (issue 13).

Why: "fast" means little for a Python driver without a yardstick, and the yardstick that matters
is a Go driver on the official `k8s.io/dynamic-resource-allocation/kubeletplugin` helper, the
library most DRA drivers use. `hack/go-reference/` holds that driver in two modes:

* minimal: the helper and one CDI spec per claim, nothing else (the floor of any Go driver);
* tandem-work: the same driver doing what Tandem does per claim (a checkpoint record before and
  after, the CDI spec, the helper's device metadata, the claim-status apply), so the difference
  to Tandem is the cost of Python and of Tandem's code, not of the work. Its checkpoint is as
  boot-scoped as Tandem's, not fsynced (driver/fsutil.py says why that protects nothing), so that
  only the helper's own metadata fsyncs remain; `--go-checkpoint-fsync` fsyncs it, as the issue
  first defined the work (Tandem then did too).

All three run at once against one simulated API server and node, each driven by its own
simulated kubelet, and are measured in interleaved blocks so that load from other processes on a
small machine falls on all of them alike. Their CDI directories are on a tmpfs (`/dev/shm`, when
it is one), as `/var/run/cdi` is on real nodes; their data directories stay on the disk. 1-GPU
claims throughout. Figures:

* sequential prepare p50/p99 and the slowest (unprepare p50/p99), over N prepare+unprepare cycles;
* CPU per prepare: the driver process's CPU time across its prepare calls, twice: the scheduler's
  exact figure summed over its threads (/proc/<pid>/task/*/schedstat), and utime+stime from
  /proc/<pid>/stat, which tick-based kernels only sample (4 ms ticks at HZ=250);
* 16 concurrent prepares (one claim per call, as for 16 pods): median wall time per round;
* fsyncs per prepare+unprepare: `strace -f -c -e trace=fsync,fdatasync` attached to the driver
  for a separate block of cycles (ptrace slows every traced call, so no timed figure comes from
  that block); without strace the row says so;
* RSS (VmRSS) after the cycles, and idle CPU of each driver over a quiet window at the end.

The Go module is built once per source and toolchain, cached under
`~/.cache/tandem-bench/<hash>/refdriver` (about 3 minutes on 2 cores the first time, from the Go
module cache or the module proxy). Without `go` (or if the build fails) Tandem is measured alone
and the output says why.

`python hack/bench_reference.py [--quick] [--json]` prints the issue's table with the ratios
Tandem / tandem-work Go and Tandem / minimal Go; `hack/bench.py --only reference` gives the JSON (and
the table on stderr).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_prepare import big_node

from demo.node import DRIVER, SimNode, stop_daemon
from sim.apiserver import SimApiServer
from sim.kubelet import ClaimRef, KubeletSim
from sim.scheduler import Request, allocate, attribute, claim_object, published_devices

GO_MODULE = Path(__file__).resolve().parent / "go-reference"
MODES = ("minimal", "tandem-work")
NODE = "bench-node"
GPUS = 16  # one per claim of a concurrent round
NICS = 8
CONCURRENCY = 16
GPU = Request("gpu", "gpu.tandem.dev", lambda d: attribute(d, "type") == "gpu")
CLK_TCK = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Plan:
    """How much to measure: the full run is the issue's; quick is for development."""

    cycles: int = 200  # sequential prepare+unprepare cycles per driver
    block: int = 25  # cycles per driver before the next driver's turn
    rounds: int = 10  # concurrent rounds per driver
    warmup: int = 5
    fsync_cycles: int = 20
    idle_seconds: float = 60.0

    @classmethod
    def quick(cls) -> Plan:
        return cls(cycles=40, block=10, rounds=3, warmup=3, fsync_cycles=5, idle_seconds=10.0)


# --- building the Go drivers --------------------------------------------------------------------


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "tandem-bench"


def build_reference() -> tuple[Path | None, str]:
    """The reference driver binary, built unless cached; (None, why) when it cannot be had.

    The cache key covers the sources, go.mod/go.sum and the toolchain's version, so a changed
    driver or Go is rebuilt and an unchanged one costs nothing."""
    go = shutil.which("go")
    if go is None:
        return None, "go is not on PATH"
    try:
        version = subprocess.run([go, "version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        return None, f"`go version` failed: {e}"
    digest = hashlib.sha256(version.encode())
    for path in sorted([*GO_MODULE.glob("*.go"), GO_MODULE / "go.mod", GO_MODULE / "go.sum"]):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    binary = _cache_dir() / digest.hexdigest()[:16] / "refdriver"
    if binary.exists():
        return binary, ""
    binary.parent.mkdir(parents=True, exist_ok=True)
    tmp = binary.with_name(f".refdriver.{os.getpid()}.tmp")
    print(f"# building the Go reference drivers into {binary} (minutes the first time)", file=sys.stderr, flush=True)
    proc = subprocess.run(
        [go, "build", "-trimpath", "-buildvcs=false", "-o", str(tmp), "."],
        cwd=GO_MODULE,
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        return None, f"go build failed: {proc.stderr.strip()[-800:]}"
    os.replace(tmp, binary)
    return binary, ""


# --- the drivers under test ---------------------------------------------------------------------


@dataclass
class Subject:
    """One driver process and the simulated kubelet that drives it."""

    label: str
    driver: str
    proc: subprocess.Popen[bytes]
    kubelet: KubeletSim
    prepare_ms: list[float] = field(default_factory=list)
    unprepare_ms: list[float] = field(default_factory=list)
    prepare_cpu: tuple[float, float] = (0.0, 0.0)  # (stat, schedstat) seconds over the prepares
    round_ms: list[float] = field(default_factory=list)
    round_cpu: tuple[float, float] = (0.0, 0.0)

    def cpu_seconds(self) -> float:
        """utime + stime of every thread of the process, from /proc/<pid>/stat. Counted in clock
        ticks, and on a kernel with tick-based accounting (CONFIG_TICK_CPU_ACCOUNTING) sampled at
        each tick: right on average over many calls, not for one."""
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / CLK_TCK

    def run_seconds(self) -> float:
        """The scheduler's exact on-CPU time (ns) summed over the process's threads, from
        /proc/<pid>/task/*/schedstat; a thread that exits takes its share with it, so this is for
        deltas across calls during which the driver's threads stay (as both drivers' pools do)."""
        total = 0
        for task in Path(f"/proc/{self.proc.pid}/task").iterdir():
            try:
                total += int((task / "schedstat").read_text().split()[0])
            except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
                continue
        return total / 1e9

    def cpu(self) -> tuple[float, float]:
        return self.cpu_seconds(), self.run_seconds()

    def status_kib(self, key: str) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
        return 0


class SideBySide:
    """One simulated API server and node; Tandem and (with a binary) the two Go drivers on it."""

    def __init__(self, root: Path, binary: Path | None, go_checkpoint_fsync: bool = False) -> None:
        self.root = root
        self.go_checkpoint_fsync = go_checkpoint_fsync
        self.cdi_base = _tmpfs_dir() or root
        self.srv = SimApiServer().start()
        self.srv.add_node(NODE)
        self.kubeconfig = root / "kubeconfig"
        self.srv.write_kubeconfig(self.kubeconfig)
        self.subjects: list[Subject] = []
        self.counter = 0
        self.pool = ThreadPoolExecutor(max_workers=CONCURRENCY, thread_name_prefix="bench-kubelet")
        try:
            if binary is not None:
                for mode in MODES:
                    self._start_go(binary, mode)
            self._start_tandem()
        except BaseException:
            self.close()
            raise

    def _start_go(self, binary: Path, mode: str) -> None:
        driver = f"{mode}.ref.tandem.dev"
        base = self.root / mode
        registry, plugins, cdi = base / "registry", base / "plugins", self.cdi_base / f"cdi-{mode}"
        for d in (registry, plugins, cdi):
            d.mkdir(parents=True)
        with open(base / "driver.log", "ab") as log:
            args = [str(binary), "-mode", mode, "-driver-name", driver, "-node-name", NODE]
            args += ["-kubeconfig", str(self.kubeconfig), "-kubelet-registrar-dir", str(registry)]
            args += ["-kubelet-plugins-dir", str(plugins), "-cdi-root", str(cdi), "-gpus", str(GPUS)]
            args.append(f"-checkpoint-fsync={str(self.go_checkpoint_fsync).lower()}")
            proc = subprocess.Popen(args, stdout=log, stderr=log)
        self._register(f"{mode} Go", driver, proc, registry, GPUS)

    def _start_tandem(self) -> None:
        node = SimNode.create(self.root / "tandem", big_node(NODE, GPUS, NICS))
        cdi = self.cdi_base / "cdi-tandem"
        cdi.mkdir()
        proc = node.start_daemon(self.kubeconfig, self.root / "tandem" / "daemon.log", "--cdi-root", str(cdi))
        self._register("Tandem", DRIVER, proc, node.registry, GPUS + NICS)

    def _register(self, label: str, driver: str, proc: subprocess.Popen[bytes], registry: Path, devices: int) -> None:
        subject = Subject(label, driver, proc, KubeletSim(registry))
        self.subjects.append(subject)  # from now on close() stops it, even if it never registers
        subject.kubelet.register(subject.kubelet.wait_for_registration_socket(driver, timeout=60))
        if not self.srv.wait_for(lambda: len(published_devices(self.srv, driver, NODE)) >= devices, 120):
            raise RuntimeError(f"{label}: devices were not published")

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        for s in self.subjects:
            s.kubelet.close()
            stop_daemon(s.proc)
        self.srv.stop()
        if self.cdi_base != self.root:
            shutil.rmtree(self.cdi_base, ignore_errors=True)

    # --- claims ---------------------------------------------------------------------------------

    def claims(self, subject: Subject, count: int, distinct: bool) -> list[ClaimRef]:
        """Allocated 1-GPU claims; `distinct`: each on its own GPU (they are prepared at once)."""
        refs: list[ClaimRef] = []
        taken: set[str] = set()
        for _ in range(count):
            self.counter += 1
            name = f"ref-{self.counter}"
            claim = self.srv.create(claim_object("default", name, [GPU]))
            claim = allocate(self.srv, claim, subject.driver, NODE, [GPU], taken=taken if distinct else None)
            if distinct:
                taken |= {r["device"] for r in claim["status"]["allocation"]["devices"]["results"]}
            refs.append(ClaimRef("default", name, claim["metadata"]["uid"]))
        return refs

    def drop(self, refs: Sequence[ClaimRef]) -> None:
        for ref in refs:
            self.srv.delete("resourceclaims", ref.name, ref.namespace)

    # --- measurements ---------------------------------------------------------------------------

    @staticmethod
    def _prepare(subject: Subject, ref: ClaimRef) -> float:
        t0 = time.perf_counter()
        result = subject.kubelet.prepare([ref])[ref.uid]
        if result.error:
            raise RuntimeError(f"{subject.label}: prepare failed: {result.error}")
        return time.perf_counter() - t0

    @staticmethod
    def _unprepare(subject: Subject, ref: ClaimRef) -> float:
        t0 = time.perf_counter()
        error = subject.kubelet.unprepare([ref])[ref.uid]
        if error:
            raise RuntimeError(f"{subject.label}: unprepare failed: {error}")
        return time.perf_counter() - t0

    def cycles(self, subject: Subject, count: int, record: bool = True) -> None:
        """Sequential prepare+unprepare cycles, claims made beforehand so that only the calls run
        while the clock does."""
        refs = self.claims(subject, count, distinct=False)
        for ref in refs:
            c0 = subject.cpu()
            prep = self._prepare(subject, ref)
            c1 = subject.cpu()
            unprep = self._unprepare(subject, ref)
            if record:
                subject.prepare_ms.append(prep * 1000)
                subject.unprepare_ms.append(unprep * 1000)
                subject.prepare_cpu = _add(subject.prepare_cpu, c0, c1)
        self.drop(refs)

    def concurrent_round(self, subject: Subject, record: bool = True) -> None:
        refs = self.claims(subject, CONCURRENCY, distinct=True)
        c0, t0 = subject.cpu(), time.perf_counter()
        list(self.pool.map(lambda r: self._prepare(subject, r), refs))
        wall, c1 = time.perf_counter() - t0, subject.cpu()
        list(self.pool.map(lambda r: self._unprepare(subject, r), refs))
        if record:
            subject.round_ms.append(wall * 1000)
            subject.round_cpu = _add(subject.round_cpu, c0, c1)
        self.drop(refs)

    def fsyncs(self, subject: Subject, cycles: int) -> tuple[float, float] | None:
        """(fsync+fdatasync calls per prepare+unprepare, mean ms per call), counted by strace
        attached to every thread of the driver for `cycles` cycles; None without strace. The time
        per call is inflated a little by ptrace, but says what a durable write costs on this disk."""
        strace = shutil.which("strace")
        if strace is None:
            return None
        out, err = self.root / f"strace-{subject.driver}.out", self.root / f"strace-{subject.driver}.err"
        with open(err, "wb") as err_file:
            tracer = subprocess.Popen(
                [strace, "-f", "-c", "-e", "trace=fsync,fdatasync", "-o", str(out), "-p", str(subject.proc.pid)],
                stderr=err_file,
            )
        try:
            deadline = time.monotonic() + 10
            while b"attached" not in err.read_bytes():
                if tracer.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"strace did not attach: {err.read_text()[-400:]}")
                time.sleep(0.05)
            time.sleep(0.2)  # every thread attached
            self.cycles(subject, cycles, record=False)
        finally:
            tracer.send_signal(signal.SIGINT)
            tracer.wait(timeout=30)
        calls, seconds = _strace_calls(out.read_text(), ("fsync", "fdatasync"))
        return calls / cycles, (seconds * 1000 / calls if calls else 0.0)

    def idle(self, seconds: float) -> dict[str, tuple[float, float]]:
        """Each driver's CPU over the same quiet window, in percent of one core: (schedstat, stat)."""
        t0, c0 = time.monotonic(), {s.label: s.cpu() for s in self.subjects}
        time.sleep(seconds)
        wall = time.monotonic() - t0
        out = {}
        for s in self.subjects:
            stat, sched = _add((0.0, 0.0), c0[s.label], s.cpu())
            out[s.label] = (round(sched / wall * 100, 2), round(stat / wall * 100, 2))
        return out


def _tmpfs_dir() -> Path | None:
    """A new directory on /dev/shm when that is a tmpfs (the CDI directories go there), else None."""
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return None
    if not any(m.split()[1:3] == ["/dev/shm", "tmpfs"] for m in mounts if len(m.split()) > 2):
        return None
    return Path(tempfile.mkdtemp(prefix="tb-ref-cdi-", dir="/dev/shm"))


def _add(acc: tuple[float, float], before: tuple[float, float], after: tuple[float, float]) -> tuple[float, float]:
    return acc[0] + after[0] - before[0], acc[1] + after[1] - before[1]


def _strace_calls(summary: str, names: Sequence[str]) -> tuple[int, float]:
    """(calls, seconds) of `names` in an `strace -c` summary (columns: % time, seconds,
    usecs/call, calls, [errors,] syscall)."""
    calls, seconds = 0, 0.0
    for line in summary.splitlines():
        parts = line.split()
        if len(parts) >= 5 and parts[-1] in names:
            calls += int(parts[3])
            seconds += float(parts[1])
    return calls, seconds


def _percentile(samples: Sequence[float], p: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


def _load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def measure(plan: Plan, binary: Path | None, go_checkpoint_fsync: bool = False) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="tb-ref-"))
    bench = SideBySide(root, binary, go_checkpoint_fsync)
    load_before = _load()
    try:
        subjects = bench.subjects
        for s in subjects:
            bench.cycles(s, plan.warmup, record=False)
            bench.concurrent_round(s, record=False)
        done = 0
        while done < plan.cycles:  # interleaved: each driver's block in turn
            n = min(plan.block, plan.cycles - done)
            for s in subjects:
                bench.cycles(s, n)
            done += n
        for _ in range(plan.rounds):
            for s in subjects:
                bench.concurrent_round(s)
        fsyncs = {s.label: bench.fsyncs(s, plan.fsync_cycles) for s in subjects}
        rss = {s.label: s.status_kib("VmRSS") for s in subjects}
        hwm = {s.label: s.status_kib("VmHWM") for s in subjects}
        idle = bench.idle(plan.idle_seconds)
        drivers = {}
        for s in subjects:
            fsync = fsyncs[s.label]
            drivers[s.label] = {
                "driver": s.driver,
                "prepare_p50_ms": round(_percentile(s.prepare_ms, 50), 2),
                "prepare_p99_ms": round(_percentile(s.prepare_ms, 99), 2),
                "prepare_max_ms": round(max(s.prepare_ms), 2),
                "unprepare_p50_ms": round(_percentile(s.unprepare_ms, 50), 2),
                "unprepare_p99_ms": round(_percentile(s.unprepare_ms, 99), 2),
                "cpu_ms_per_prepare": round(s.prepare_cpu[1] * 1000 / len(s.prepare_ms), 2),
                "cpu_ms_per_prepare_stat": round(s.prepare_cpu[0] * 1000 / len(s.prepare_ms), 2),
                "concurrent_wall_ms_median": round(statistics.median(s.round_ms), 1),
                "concurrent_wall_ms_min_max": [round(min(s.round_ms), 1), round(max(s.round_ms), 1)],
                "concurrent_cpu_ms_per_prepare": round(s.round_cpu[1] * 1000 / (plan.rounds * CONCURRENCY), 2),
                "concurrent_cpu_ms_per_prepare_stat": round(s.round_cpu[0] * 1000 / (plan.rounds * CONCURRENCY), 2),
                "fsyncs_per_cycle": None if fsync is None else round(fsync[0], 2),
                "fsync_ms_mean": None if fsync is None else round(fsync[1], 2),
                "rss_mib": round(rss[s.label] / 1024, 1),
                "rss_peak_mib": round(hwm[s.label] / 1024, 1),
                "idle_cpu_percent": idle[s.label][0],
                "idle_cpu_percent_stat": idle[s.label][1],
                "cycles": len(s.prepare_ms),
            }
        return {
            "machine": {"cpus": os.cpu_count(), "load_before": load_before, "load_after": _load()},
            "plan": {
                "sequential_cycles": plan.cycles,
                "concurrent_rounds": plan.rounds,
                "concurrency": CONCURRENCY,
                "fsync_cycles": plan.fsync_cycles,
                "idle_seconds": plan.idle_seconds,
                "fsync_method": "strace -f -c -e trace=fsync,fdatasync -p PID" if shutil.which("strace") else "none",
                "go_checkpoint_fsync": go_checkpoint_fsync,
            },
            "drivers": drivers,
        }
    finally:
        bench.close()
        shutil.rmtree(root, ignore_errors=True)


def bench_reference(quick: bool = False, go_checkpoint_fsync: bool = False) -> dict[str, Any]:
    """The side-by-side run: build (or find) the Go drivers, measure, add the table."""
    binary, why = build_reference()
    out = measure(Plan.quick() if quick else Plan(), binary, go_checkpoint_fsync)
    if binary is None:
        out["go_reference"] = f"not run: {why}"
    out["table"] = table(out)
    return out


# --- the table --------------------------------------------------------------------------

ROWS: list[tuple[str, Callable[[dict[str, Any]], list[float | None]], str]] = [
    (
        "sequential prepare p50 / p99 / slowest (ms)",
        lambda d: [d["prepare_p50_ms"], d["prepare_p99_ms"], d["prepare_max_ms"]],
        "{:.1f}",
    ),
    ("sequential unprepare p50 / p99 (ms)", lambda d: [d["unprepare_p50_ms"], d["unprepare_p99_ms"]], "{:.1f}"),
    (
        "CPU per prepare (ms; schedstat / stat)",
        lambda d: [d["cpu_ms_per_prepare"], d["cpu_ms_per_prepare_stat"]],
        "{:.2f}",
    ),
    ("CPU per prepare, 16 concurrent (ms)", lambda d: [d["concurrent_cpu_ms_per_prepare"]], "{:.2f}"),
    ("16 concurrent, wall per round (ms, median)", lambda d: [d["concurrent_wall_ms_median"]], "{:.0f}"),
    ("fsyncs per prepare+unprepare", lambda d: [d["fsyncs_per_cycle"]], "{:.1f}"),
    ("RSS (MiB)", lambda d: [d["rss_mib"]], "{:.0f}"),
    (
        "idle CPU (% of a core; schedstat / stat)",
        lambda d: [d["idle_cpu_percent"], d["idle_cpu_percent_stat"]],
        "{:.2f}",
    ),
]


def _cell(values: list[float | None] | None, fmt: str) -> str:
    if values is None:
        return "n/a"
    return " / ".join("n/a" if v is None else fmt.format(v) for v in values)


def _ratio(num: list[float | None] | None, den: list[float | None] | None) -> str:
    if num is None or den is None:
        return "n/a"
    parts = []
    for a, b in zip(num, den, strict=True):
        if a is None or b is None:
            parts.append("n/a")
        elif b <= 0.05 * a or b == 0:  # Go at (or within rounding of) zero: a ratio would be noise
            parts.append("Go ~0" if a else "=")
        else:
            parts.append(f"{a / b:.2f}x")
    return " / ".join(parts)


def table(result: dict[str, Any]) -> str:
    drivers = result["drivers"]
    plan, machine = result["plan"], result["machine"]
    go_min, go_work, tandem = (drivers.get(k) for k in ("minimal Go", "tandem-work Go", "Tandem"))
    lines = [
        f"1-GPU claims; {plan['sequential_cycles']} sequential cycles, {plan['concurrent_rounds']} rounds of "
        f"{plan['concurrency']} concurrent prepares, fsyncs over {plan['fsync_cycles']} cycles "
        f"({plan['fsync_method']}), idle over {plan['idle_seconds']:.0f} s; {machine['cpus']} CPUs, "
        f"load {machine['load_before']} before, {machine['load_after']} after; tandem-work Go's checkpoint "
        + ("fsynced (unlike Tandem's)" if plan.get("go_checkpoint_fsync") else "not fsynced (as Tandem's)"),
    ]
    if "go_reference" in result:
        lines.append(f"Go reference drivers {result['go_reference']}; Tandem's figures alone.")
    lines += [
        "",
        "| | minimal Go | tandem-work Go | Tandem | Tandem / tandem-work Go | Tandem / minimal Go |",
        "|---|---|---|---|---|---|",
    ]
    for title, pick, fmt in ROWS:
        a, b, t = (pick(d) if d else None for d in (go_min, go_work, tandem))
        lines.append(
            f"| {title} | {_cell(a, fmt)} | {_cell(b, fmt)} | {_cell(t, fmt)} | {_ratio(t, b)} | {_ratio(t, a)} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer cycles and a shorter idle window")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON after the table")
    parser.add_argument(
        "--go-checkpoint-fsync", action="store_true", help="tandem-work Go: fsync its checkpoint (Tandem does not)"
    )
    args = parser.parse_args(argv)
    result = bench_reference(args.quick, go_checkpoint_fsync=args.go_checkpoint_fsync)
    print(result["table"])
    if args.json:
        json.dump({k: v for k, v in result.items() if k != "table"}, sys.stdout, indent=2)
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
