"""What the scripted HTTP/1.1 servers on loopback of the tests of driver.kube (test_connection,
test_api) share: listening and accepting (`LoopbackServer`) and reading one request off an accepted
connection (`read_request`). One of each, so that both suites' servers take connections and
requests the same way and differ only in what they answer."""

from __future__ import annotations

import socket
import threading


def read_request(conn: socket.socket) -> bytes:
    """One request: its head (request line and headers), its Content-Length body read past; b"" at
    EOF before a whole head."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return b""
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    while len(body) < length:
        body += conn.recv(65536)
    return head


class LoopbackServer:
    """A server on 127.0.0.1 at a free `port`: once `start`ed, each connection it accepts is handed,
    with its index (`connections` counts them), to `serve` in a thread of its own, and closed after."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.connections = 0

    def start(self) -> None:
        threading.Thread(target=self._accept, daemon=True).start()

    def serve(self, conn: socket.socket, index: int) -> None:
        raise NotImplementedError

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._serve_and_close, args=(conn, self.connections - 1), daemon=True).start()

    def _serve_and_close(self, conn: socket.socket, index: int) -> None:
        with conn:
            self.serve(conn, index)

    def close(self) -> None:
        self.sock.close()
