"""The private `/dev/shm` of each MPS control daemon: a tmpfs of its own, bound in a mount namespace.

An MPS server and its clients exchange work through POSIX shared memory in `/dev/shm`, so they
must see the same one. As NVIDIA's DRA driver does, each daemon gets a private one: a tmpfs at
`<data dir>/mps/<device>/shm` (half the node's memory at most, as a container's default), bound
over `/dev/shm` in a mount namespace of the daemon's own (`unshare`), so the servers it starts
inherit it; the claims' CDI specs mount the same tmpfs at the containers' `/dev/shm`. Like its
pipe directory (`driver.claims.gpu.mps_pipes`), each start of a daemon gets a new one, never one
a tenant has had: the one before is unmounted lazily, so the containers that have it keep it,
and containers made after the start get the new one. Then no pod sees the host's `/dev/shm` or
another GPU's clients, and the host's is not filled by them. It takes CAP_SYS_ADMIN (the
DaemonSet's Tandem is privileged, and the data dir is mounted `Bidirectional` so the runtime sees
the tmpfs); without it (tests run unprivileged) the daemon keeps the host's `/dev/shm` and says
so in the log. Apart from the daemons' supervision
(`driver.claims.gpu.mps`) because it is a mount's life, not a process's.
"""

from __future__ import annotations

import logging
import os
import subprocess
from pathlib import Path

log = logging.getLogger(__name__)

_MOUNT_TIMEOUT = 10.0


def with_private_shm(device: str, shm: Path, cmd: list[str]) -> list[str]:
    """`cmd` run with a new tmpfs at `shm` as its `/dev/shm`, mounted first. Raises OSError when the
    mount fails."""
    if os.geteuid() != 0:
        log.warning("MPS control daemon of %s: not root, so it shares the host's /dev/shm", device)
        return cmd
    release_shm(shm)  # a new tmpfs for each start: the old one's tenants may have left anything there
    options = f"rw,nosuid,nodev,noexec,size={_shm_size()}"
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tandem-mps-shm", str(shm)],
        capture_output=True,
        timeout=_MOUNT_TIMEOUT,
        check=False,
    )
    if mounted.returncode != 0:
        raise OSError(f"mounting a tmpfs at {shm} failed: {mounted.stderr.decode(errors='replace')[:200]}")
    bind = 'mount --bind "$0" /dev/shm && exec "$@"'
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", bind, str(shm), *cmd]


def release_shm(shm: Path) -> None:
    """Unmount the tmpfs at `shm`, lazily: a client that has not gone yet keeps it."""
    if os.path.ismount(shm):
        subprocess.run(["umount", "-l", str(shm)], capture_output=True, timeout=_MOUNT_TIMEOUT, check=False)


def _shm_size() -> str:
    """Half the node's memory, as NVIDIA's driver sizes the MPS tmpfs (and the kernel a tmpfs)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return f"{int(line.split()[1]) // 2}k"
    except (OSError, ValueError, IndexError):
        pass
    return "65536k"
