"""Where the status socket is: the one fact of `driver.status.server` that `tandemctl` and the
readiness probe need, kept apart so that finding the socket does not load the server's imports."""

from __future__ import annotations

from pathlib import Path

SOCKET_NAME = "status.sock"


def status_socket_path(data_dir: Path) -> Path:
    return data_dir / SOCKET_NAME
