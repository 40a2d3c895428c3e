"""GPU sharing benchmark: what MPS adds to a prepare.

The real daemon process (`--gpu-sharing all`) on a simulated node with two H100s, against the
stand-in `nvidia-cuda-mps-control` in its driver root. Per round, on GPU 0: the first MPS share's
prepare (it starts the GPU's control daemon: a private tmpfs `/dev/shm` as root, `unshare`, `-d`,
waiting for its PID file), a second share's prepare (the daemon is reused), then both unprepares
(the last one stops the daemon with `quit`); and for comparison a claim for the whole of GPU 1,
which no daemon serves. The stand-in is a Python program, so its start-up (~tens of ms) stands for
the real daemon's; the figures are Tandem's side of it.

`python hack/bench_sharing.py [--quick]` prints JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import uuid
from typing import Any

from bench_daemon import _daemon as running_daemon

from demo.node import DRIVER
from sim.apiserver import SimApiServer
from sim.kubelet import ClaimRef, KubeletSim
from sim.profile import h100_node
from sim.scheduler import Request, allocate, claim_object, reserve

MPS = {"driver": DRIVER, "parameters": {"apiVersion": "tandem.dev/v1alpha1", "kind": "GpuConfig", "sharing": "MPS"}}
SHARE = Request(
    "gpu", "gpu.tandem.dev", lambda d: d["name"] == "gpu-0", capacity={"memory": "20Gi", "computePercent": "25"}
)
WHOLE = Request("gpu", "gpu.tandem.dev", lambda d: d["name"] == "gpu-1")


def _ms(values: list[float]) -> dict[str, float]:
    return {"median_ms": round(statistics.median(values) * 1000, 2), "max_ms": round(max(values) * 1000, 2)}


def _claim(srv: SimApiServer, node: str, name: str, request: Request, config: bool) -> ClaimRef:
    obj = claim_object("default", name, [request])
    if config:
        obj["spec"]["devices"]["config"] = [{"requests": ["gpu"], "opaque": MPS}]
    claim = srv.create(obj)
    allocate(srv, claim, DRIVER, node, [request])
    reserve(srv, claim, f"pod-{name}", str(uuid.uuid4()))
    return ClaimRef("default", name, claim["metadata"]["uid"])


def _timed(kubelet: KubeletSim, op: str, ref: ClaimRef) -> float:
    start = time.perf_counter()
    result = getattr(kubelet, op)([ref])[ref.uid]
    elapsed = time.perf_counter() - start
    error = result if isinstance(result, str) else result.error
    if error:
        raise RuntimeError(f"{op} {ref.name}: {error}")
    return elapsed


def bench_sharing(quick: bool) -> dict[str, Any]:
    runs = 5 if quick else 20
    profile = h100_node("bench-share", gpus=2, nics=0)
    with running_daemon(profile, "--gpu-sharing", "all") as d:
        srv, kubelet, name = d.srv, d.kubelet, profile.name
        times: dict[str, list[float]] = {k: [] for k in (
            "first_share", "second_share", "unprepare_share", "unprepare_last_share", "whole_gpu", "unprepare_whole"
        )}  # fmt: skip
        for i in range(runs):
            a, b = _claim(srv, name, f"a-{i}", SHARE, True), _claim(srv, name, f"b-{i}", SHARE, True)
            times["first_share"].append(_timed(kubelet, "prepare", a))
            times["second_share"].append(_timed(kubelet, "prepare", b))
            times["unprepare_share"].append(_timed(kubelet, "unprepare", a))
            times["unprepare_last_share"].append(_timed(kubelet, "unprepare", b))
            w = _claim(srv, name, f"w-{i}", WHOLE, False)
            times["whole_gpu"].append(_timed(kubelet, "prepare", w))
            times["unprepare_whole"].append(_timed(kubelet, "unprepare", w))
            for ref in (a, b, w):
                srv.delete("resourceclaims", ref.name, ref.namespace)
    return {
        "runs": runs,
        "prepare_mps_first_share_starts_daemon": _ms(times["first_share"]),
        "prepare_mps_second_share_reuses_daemon": _ms(times["second_share"]),
        "unprepare_mps_share_daemon_stays": _ms(times["unprepare_share"]),
        "unprepare_mps_last_share_stops_daemon": _ms(times["unprepare_last_share"]),
        "prepare_whole_gpu_exclusive": _ms(times["whole_gpu"]),
        "unprepare_whole_gpu_exclusive": _ms(times["unprepare_whole"]),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    json.dump(bench_sharing(args.quick), sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
