"""Tandem as a node process of the real local cluster (hack/cluster.sh), over a simulated node.

Only the hardware is simulated: the daemon's sysfs, /dev, NVIDIA driver root and NVML come from a
`SimNode` rendered under `root`, while its kubelet directories, CDI directory and API server are
the real ones, so the real kubelet registers it through its plugin watcher, the real scheduler
allocates what it publishes, and the real containerd applies the CDI specs it writes.

    python -m demo.cluster_node start --root DIR --kubeconfig FILE --node-name NAME [--gpus 8 --nics 4] [-- FLAG...]
    python -m demo.cluster_node stop --root DIR

The simulated node is rendered once and kept across restarts of the daemon (an XID raised in its
NVML state stays raised, as on a real node); `start` with a daemon already running does nothing.
Its NICs have real netdevs (veths, `demo.cluster_nics`), so the daemon reads their link facts from
netlink (`--nic-link-source netlink`), as on a real node.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from demo.node import DRIVER, SimNode
from sim.driver_files import render_driver_files
from sim.nvml import env_for
from sim.profile import NodeProfile, h100_node

KUBELET_REGISTRY = Path("/var/lib/kubelet/plugins_registry")
KUBELET_PLUGINS = Path("/var/lib/kubelet/plugins")
CDI_ROOT = Path("/var/run/cdi")
RENDERED_MARK = ".rendered"


@dataclasses.dataclass
class ClusterNode:
    """The simulated node under `root` and the daemon serving it; tests drive it through this."""

    root: Path
    kubeconfig: Path
    node_name: str
    gpus: int = 8
    nics: int = 4

    @property
    def pid_file(self) -> Path:
        return self.root / "tandem.pid"

    @property
    def log_file(self) -> Path:
        return self.root / "tandem.log"

    @property
    def nvml_state(self) -> Path:
        return self.root / "nvml-state.json"

    @property
    def data_dir(self) -> Path:
        return KUBELET_PLUGINS / DRIVER

    def sim_node(self) -> SimNode:
        """Renders the node on first use; afterwards the same files, whatever happened to them
        (rendered afresh only when the profile itself changed, as after an upgrade of this repo)."""
        profile = cluster_profile(self.node_name, self.gpus, self.nics)
        fingerprint = hashlib.sha256(profile.to_json().encode()).hexdigest()
        mark = self.root / RENDERED_MARK
        if mark.exists() and mark.read_text() != fingerprint:
            for stale in ("sys", "dev", "proc", "nvidia", "netdevs-away", "nvml-state.json"):
                path = self.root / stale
                if path.is_dir():
                    shutil.rmtree(path)
                else:
                    path.unlink(missing_ok=True)
            mark.unlink()
        if mark.exists():
            render_driver_files(self.root / "nvidia")  # idempotent: a newer simulated driver arrives
            node = SimNode(
                self.root, profile, self.root / "sys", self.root / "dev", KUBELET_REGISTRY, KUBELET_PLUGINS,
                CDI_ROOT, self.root / "nvidia", env_for(self.nvml_state),
            )  # fmt: skip
        else:
            self.root.mkdir(parents=True, exist_ok=True)
            node = SimNode.create(self.root, profile)
            mark.write_text(fingerprint)
        # The real kubelet's directories and the CDI directory containerd reads, not the SimNode's.
        for unused in ("registry", "plugins", "cdi"):
            with_path = self.root / unused
            if with_path.is_dir() and not any(with_path.iterdir()):
                with_path.rmdir()
        return dataclasses.replace(node, registry=KUBELET_REGISTRY, plugins=KUBELET_PLUGINS, cdi=CDI_ROOT)

    def pid(self) -> int | None:
        try:
            pid = int(self.pid_file.read_text())
        except (OSError, ValueError):
            return None
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        return pid

    def start(self, *extra: str) -> int:
        """Starts the daemon in a session of its own (it outlives the caller); returns its pid."""
        running = self.pid()
        if running is not None:
            return running
        node = self.sim_node()
        env = {**os.environ, **node.env}
        with open(self.log_file, "ab") as log:
            # Netlink: the NICs have real netdevs here (demo.cluster_nics), which exclusive mode moves.
            args = node.daemon_args(self.kubeconfig, "--nic-link-source", "netlink", *extra)
            proc = subprocess.Popen(
                args, env=env, stdout=log, stderr=log,
                stdin=subprocess.DEVNULL, start_new_session=True,
            )  # fmt: skip
        self.pid_file.write_text(str(proc.pid))
        return proc.pid

    def stop(self, sig: signal.Signals = signal.SIGTERM, timeout: float = 30) -> None:
        """SIGTERM drains in-flight calls and deregisters; SIGKILL is the crash tests' kill -9."""
        pid = self.pid()
        if pid is None:
            return
        os.kill(pid, sig)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            _reap(pid)
            time.sleep(0.05)
        else:
            os.kill(pid, signal.SIGKILL)
        _reap(pid)
        self.pid_file.unlink(missing_ok=True)


def cluster_profile(node_name: str, gpus: int = 8, nics: int = 4) -> NodeProfile:
    """The simulated HGX H100 of the cluster node (MIG mode off, as an H100 ships); a smaller board
    of the same make with fewer GPUs and NICs (`up --nodes 3` gives its third node 4 and 2). Its
    NICs get real netdevs on this machine (`demo.cluster_nics`), so their addresses must not clash
    with the machine's own networks: IPv6 from a ULA prefix of their own rather than fd00:<n>::/64."""
    profile = h100_node(node_name, gpus, nics, mig_capable=True)
    for j, nic in enumerate(profile.nics):
        nic.ipv6 = [f"fd7a:7a6e:{j}::{10 + j}/64"]
    return profile


def add_size_arguments(p: argparse.ArgumentParser) -> None:
    """--gpus and --nics: the node's size, which every process that renders or reads it must share."""
    p.add_argument("--gpus", type=int, default=8, help="GPUs of the simulated node")
    p.add_argument("--nics", type=int, default=4, help="RoCE NICs of the simulated node")


def _reap(pid: int) -> None:
    """A daemon this process started is its child until reaped; one started by another is not."""
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m demo.cluster_node", description=__doc__.splitlines()[0], epilog="-- FLAG...: daemon flags"
    )
    p.add_argument("action", choices=("start", "stop"))
    p.add_argument("--root", type=Path, required=True, help="where the simulated node lives")
    p.add_argument("--kubeconfig", type=Path, default=Path("/dev/null"))
    p.add_argument("--node-name", default="")
    add_size_arguments(p)
    args = sys.argv[1:] if argv is None else argv
    split = args.index("--") if "--" in args else len(args)
    a = p.parse_args(args[:split])
    flags = args[split + 1 :]
    node = ClusterNode(a.root, a.kubeconfig, a.node_name, a.gpus, a.nics)
    if a.action == "stop":
        node.stop()
        return 0
    if not a.node_name:
        p.error("start needs --node-name")
    print(node.start(*flags))
    return 0


if __name__ == "__main__":
    sys.exit(main())
