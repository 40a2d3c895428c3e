"""A simulated node whose GPUs Tandem shares by MPS, with Tandem and its MPS control daemons as real
processes: the stage that the kill -9 tests (test_mps_crash) and the hostile-tenant tests
(test_mps_hostile) both drive. One class, so that starting and killing Tandem, making an MPS claim
and finding a GPU's live control daemons mean the same in both; the tests differ only in the
number of GPUs and what each claim asks of its GPU."""

from __future__ import annotations

import os
import signal
import uuid
from pathlib import Path

from kubelet_calls import registered
from waiting import poll

from demo.node import DRIVER
from driver.claims.gpu.mps_identity import CONTROL_PROGRAM
from sim.kubelet import ClaimRef, KubeletSim
from sim.profile import h100_node
from sim.scheduler import Request, allocate, claim_object, reserve

MPS = {"driver": DRIVER, "parameters": {"apiVersion": "tandem.dev/v1alpha1", "kind": "GpuConfig", "sharing": "MPS"}}


class MpsNode:
    """Node `node-a` with `gpus` GPUs and no NICs; every claim asks `capacity` of its GPU, shared by MPS."""

    def __init__(self, apiserver, sim_node, start_daemon, gpus: int, capacity: dict[str, str]):
        self.apiserver = apiserver
        self.node = sim_node(h100_node("node-a", gpus=gpus, nics=0))
        self.start_daemon = start_daemon
        self.kubelet = KubeletSim(self.node.registry)
        self.mps = self.node.plugins / DRIVER / "mps"
        self.gpus = [f"gpu-{i}" for i in range(gpus)]
        self.capacity = capacity

    def start(self) -> None:
        self.daemon = self.start_daemon(self.node, "--gpu-sharing", "all")
        sock = self.kubelet.wait_for_registration_socket(DRIVER, timeout=60)
        assert poll(lambda: registered(self.kubelet, sock), 60), self.daemon.log_text()

    def kill(self) -> None:
        self.daemon.proc.send_signal(signal.SIGKILL)
        self.daemon.proc.wait(timeout=30)

    def claim(self, name: str, gpu: str = "gpu-0") -> ClaimRef:
        request = Request("gpu", "gpu.tandem.dev", lambda d: d["name"] == gpu, capacity=dict(self.capacity))
        obj = claim_object("default", name, [request])
        obj["spec"]["devices"]["config"] = [{"requests": ["gpu"], "opaque": MPS}]
        claim = self.apiserver.create(obj)
        allocate(self.apiserver, claim, DRIVER, "node-a", [request])
        reserve(self.apiserver, claim, f"pod-{name}", str(uuid.uuid4()))
        return ClaimRef("default", name, claim["metadata"]["uid"])

    def prepared(self, *refs: ClaimRef) -> bool:
        results = self.kubelet.prepare(list(refs))
        return all(results[r.uid].error == "" for r in refs)

    def daemons(self, gpu: str = "gpu-0") -> list[int]:
        """The live control daemons of `gpu` (by the pipe directory in their environment)."""
        return [pid for pid, pipe in self.daemon_pipes().items() if pipe.parent == self.mps / gpu]

    def daemon_pipes(self) -> dict[int, Path]:
        """Every live control daemon of this node, and the pipe directory it was started in."""
        out = {}
        for proc in Path("/proc").iterdir():
            try:
                cmdline = (proc / "cmdline").read_bytes()
                environ = (proc / "environ").read_bytes().split(b"\0")
                state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                continue
            daemon = CONTROL_PROGRAM.encode() in cmdline and {b"-d", b"-f"} & set(cmdline.split(b"\0"))
            pipe = next((e.split(b"=", 1)[1] for e in environ if e.startswith(b"CUDA_MPS_PIPE_DIRECTORY=")), b"")
            if daemon and pipe.startswith(bytes(self.mps) + b"/") and state != "Z":
                out[int(proc.name)] = Path(pipe.decode())
        return out

    def close(self) -> None:
        """The fixture's teardown: the simulated kubelet closed, and no daemon left behind, whatever failed."""
        self.kubelet.close()
        for gpu in self.gpus:
            for pid in self.daemons(gpu):
                os.kill(pid, signal.SIGKILL)
