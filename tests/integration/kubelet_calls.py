"""Driving the daemon as the kubelet does, for tests that kill it in the middle of a call."""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path

from sim.kubelet import ClaimRef, KubeletSim, KubeletSimError


def registered(kubelet: KubeletSim, sock: Path) -> bool:
    """Whether the daemon behind `sock` answers the registration handshake yet."""
    try:
        kubelet.register(sock)
        return True
    except Exception:
        return False


def call_in_background(kubelet: KubeletSim, method: str, ref: ClaimRef) -> threading.Thread:
    """`prepare` or `unprepare` of one claim in a thread of its own: the test kills the daemon under
    it, and the kubelet sees an RPC error, as a real one would."""

    def call() -> None:
        with contextlib.suppress(KubeletSimError):
            getattr(kubelet, method)([ref])

    t = threading.Thread(target=call, daemon=True)
    t.start()
    return t
