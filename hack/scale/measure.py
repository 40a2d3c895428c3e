"""What the bench measures beside the pods' latencies: CPU of groups of processes and the
machine's load between two marks, each driver's API requests from the audit log, and the API
server's own request count."""

from __future__ import annotations

import contextlib
import json
import statistics
import threading
import time
from collections import Counter
from datetime import datetime
from pathlib import Path
from typing import Any

from scale.api import Api
from scale.objects import USERS
from scale.procs import CLK_TCK, cpu_s

WRITE_VERBS = {"create", "update", "patch", "delete", "deletecollection"}
Mark = tuple[float, dict[str, float], float]


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return round(s[min(len(s) - 1, int(q * len(s)))], 1)


class Sampler:
    """CPU seconds of each group of processes between two marks, and the load average every 2 s."""

    def __init__(self, groups: dict[str, list[int]]) -> None:
        self.groups = groups
        self.loads: list[tuple[float, float]] = []
        self.stop = threading.Event()
        threading.Thread(target=self._loop, daemon=True).start()

    def _loop(self) -> None:
        while not self.stop.wait(2):
            self.loads.append((time.monotonic(), float(Path("/proc/loadavg").read_text().split()[0])))

    def mark(self) -> Mark:
        total = sum(int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:8]) / CLK_TCK
        return time.monotonic(), {g: sum(cpu_s(p) for p in pids) for g, pids in self.groups.items()}, total

    def between(self, a: Mark, b: Mark) -> dict[str, Any]:
        secs = b[0] - a[0]
        loads = [v for t, v in self.loads if a[0] <= t <= b[0]]
        return {
            "seconds": round(secs, 1),
            "cpu_cores": {g: round((b[1][g] - a[1][g]) / secs, 3) for g in self.groups},
            "machine_cpu_busy_cores": round((b[2] - a[2]) / secs, 2) if b[2] > a[2] else None,
            "load1_mean": round(statistics.mean(loads), 2) if loads else None,
            "load1_max": max(loads) if loads else None,
        }


def audit_counts(path: Path, t0: float, t1: float) -> dict[str, Any]:
    """Requests of each driver received in [t0, t1) (wall-clock seconds), by verb and resource."""
    out: dict[str, Any] = {}
    by: dict[str, Counter[str]] = {d: Counter() for d in USERS}
    users = {u: d for d, u in USERS.items()}
    with contextlib.suppress(FileNotFoundError), open(path) as f:
        for line in f:
            ev = json.loads(line)
            d = users.get(ev.get("user", {}).get("username", ""))
            if d is None:
                continue
            ts = datetime.fromisoformat(ev["requestReceivedTimestamp"].replace("Z", "+00:00")).timestamp()
            if not t0 <= ts < t1:
                continue
            ref = ev.get("objectRef") or {}
            res = ref.get("resource", "?") + ("/" + ref["subresource"] if ref.get("subresource") else "")
            by[d][f"{ev['verb']} {res}"] += 1
    secs = t1 - t0
    for d, c in by.items():
        total = sum(c.values())
        writes = sum(n for k, n in c.items() if k.split()[0] in WRITE_VERBS)
        out[d] = {
            "requests": total,
            "writes": writes,
            "per_s": round(total / secs, 3),
            "writes_per_s": round(writes / secs, 3),
            "by_verb": dict(c.most_common()),
        }
    return out


def apiserver_requests(api: Api) -> float:
    total = 0.0
    for line in api.metrics().splitlines():
        if line.startswith("apiserver_request_total{"):
            total += float(line.rsplit(" ", 1)[1])
    return total
