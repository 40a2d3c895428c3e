"""A simulated node on disk and the real daemon run against it as a separate process.

Shared by the demo, the integration tests and the benchmarks: `SimNode.create` renders a
`NodeProfile` into sysfs, /dev, /proc, the NVIDIA driver root and the fake NVML's state file, and
`start_daemon` runs `python -m driver run` with every path pointed into it. The /dev it renders
lacks the nodes nvidia-modprobe makes on first use (where the daemon can make them: see
`sim.sysfs`), as a node where no CUDA process ran yet does. The daemon is a
separate process, so nothing of the simulation is ever imported into it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from sim.driver_files import render_driver_files
from sim.nvml import env_for, write_state
from sim.profile import NodeProfile
from sim.sysfs import render_node

DRIVER = "tandem.dev"


@dataclass
class SimNode:
    """A rendered simulated node: directories and environment a daemon process needs."""

    root: Path
    profile: NodeProfile
    sysfs: Path
    dev: Path
    registry: Path
    plugins: Path
    cdi: Path
    nvidia_root: Path
    env: dict[str, str]

    @classmethod
    def create(cls, root: Path, profile: NodeProfile) -> SimNode:
        dirs = {name: root / name for name in ("sys", "dev", "registry", "plugins", "cdi", "nvidia")}
        for d in dirs.values():
            d.mkdir(parents=True, exist_ok=True)
        render_node(profile, dirs["sys"], dirs["dev"], root / "proc", lazy_nodes=True)
        render_driver_files(dirs["nvidia"])
        state = root / "nvml-state.json"
        write_state(profile, state, proc_root=root / "proc")
        return cls(
            root,
            profile,
            dirs["sys"],
            dirs["dev"],
            dirs["registry"],
            dirs["plugins"],
            dirs["cdi"],
            dirs["nvidia"],
            env_for(state),
        )

    @property
    def proc(self) -> Path:
        """The simulated /proc: the kernel's majors and the NVIDIA driver's proc files."""
        return self.root / "proc"

    def daemon_args(self, kubeconfig: Path, *extra: str) -> list[str]:
        return [
            sys.executable, "-m", "driver", "run",
            "--node-name", self.profile.name,
            "--driver-name", DRIVER,
            "--kubeconfig", str(kubeconfig),
            "--kubelet-registrar-dir", str(self.registry),
            "--kubelet-plugins-dir", str(self.plugins),
            "--cdi-root", str(self.cdi),
            "--sysfs-root", str(self.sysfs),
            "--dev-root", str(self.dev),
            "--proc-root", str(self.proc),
            "--nvidia-driver-root", str(self.nvidia_root),
            "--nic-link-source", "sysfs",
            *extra,
        ]  # fmt: skip

    def start_daemon(self, kubeconfig: Path, log_path: Path, *extra: str, env: dict | None = None) -> subprocess.Popen:
        full_env = {**os.environ, **self.env, **(env or {})}
        full_env["PYTHONPATH"] = os.pathsep.join(
            p for p in (self.env.get("PYTHONPATH", ""), repo_root(), os.environ.get("PYTHONPATH", "")) if p
        )
        with open(log_path, "ab") as log:
            return subprocess.Popen(self.daemon_args(kubeconfig, *extra), env=full_env, stdout=log, stderr=log)


def repo_root() -> str:
    """The directory holding `driver` (a checkout or site-packages), put first on the PYTHONPATH of
    the processes the demo starts so that a source tree runs as is."""
    return str(Path(__file__).resolve().parent.parent)


def stop_daemon(proc: subprocess.Popen, timeout: float = 20) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()
