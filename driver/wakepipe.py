"""Waking a thread that sleeps in select() on a netlink socket.

The NIC watcher and the NIC health monitor each wait for kernel events and for a word from
another thread (a trigger, an inventory change, stop) in one select() call; a non-blocking pipe
is what select() can wait on for the latter.
"""

from __future__ import annotations

import contextlib
import os
import threading


class WakePipe:
    """A non-blocking pipe: `wake` never blocks (a full pipe already says "wake up"), and a wake
    after `close` is dropped, so a late trigger of a stopped thread is harmless."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)

    def fileno(self) -> int:
        """The read end, for select()."""
        return self._r

    def wake(self, what: bytes = b"w") -> None:
        with self._lock:
            if self._w >= 0:
                with contextlib.suppress(BlockingIOError):
                    os.write(self._w, what)

    def drain(self) -> bytes:
        """Everything written since the last drain; b"" when nothing was."""
        data = b""
        with contextlib.suppress(BlockingIOError):
            while chunk := os.read(self._r, 4096):
                data += chunk
        return data

    def close(self) -> None:
        with self._lock:
            fds, (self._r, self._w) = (self._r, self._w), (-1, -1)
        for fd in fds:
            if fd >= 0:
                os.close(fd)
