"""Shared fixtures: a simulated API server, a rendered simulated node, and the daemon as a real process."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import settings

from demo.node import DRIVER, SimNode, stop_daemon
from sim.apiserver import SimApiServer
from sim.kubelet import KubeletSim
from sim.profile import NodeProfile, h100_node


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """Unix socket paths must stay under 108 bytes; pytest's tmp_path can be longer than that."""
    root = Path(tempfile.mkdtemp(prefix="td-"))
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def apiserver() -> Iterator[SimApiServer]:
    with SimApiServer() as srv:
        srv.start()
        yield srv


@dataclass
class RunningDaemon:
    proc: subprocess.Popen
    node: SimNode
    log: Path
    kubeconfig: Path

    @property
    def data_dir(self) -> Path:
        return self.node.plugins / DRIVER

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> int:
        return stop_daemon(self.proc)


@pytest.fixture
def sim_node(short_tmp: Path, apiserver: SimApiServer) -> Callable[..., SimNode]:
    def make(profile: NodeProfile | None = None) -> SimNode:
        profile = profile or h100_node("node-a", gpus=2, nics=2)
        node = SimNode.create(short_tmp / profile.name, profile)
        apiserver.add_node(profile.name)
        return node

    return make


@pytest.fixture
def start_daemon(apiserver: SimApiServer, short_tmp: Path) -> Iterator[Callable[..., RunningDaemon]]:
    """Starts `tandem-driver run` as a separate process; every started daemon is stopped at teardown."""
    started: list[RunningDaemon] = []
    kubeconfig = apiserver.write_kubeconfig(short_tmp / "kubeconfig")

    def start(node: SimNode, *extra: str, env: dict[str, str] | None = None) -> RunningDaemon:
        log = node.root / f"daemon-{len(started)}.log"
        proc = node.start_daemon(kubeconfig, log, "-v", *extra, env=env)
        d = RunningDaemon(proc, node, log, kubeconfig)
        started.append(d)
        return d

    yield start
    for d in started:
        d.stop()


@pytest.fixture
def kubelet(sim_node_default: SimNode) -> Iterator[KubeletSim]:
    with KubeletSim(sim_node_default.registry) as k:
        yield k


@pytest.fixture
def sim_node_default(sim_node: Callable[..., SimNode]) -> SimNode:
    return sim_node()


# Hypothesis's per-example deadline is a timed assertion: on a loaded 2-core machine (CI building
# the cluster beside the suite) a 7 ms example can take 400 ms. Tests here assert behaviour, never
# speed (hack/bench.py measures that), so no example has a deadline.
settings.register_profile("tandem", deadline=None)
settings.load_profile("tandem")
