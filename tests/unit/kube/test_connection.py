"""driver.kube.connection against scripted HTTP/1.1 servers on loopback: connections kept and reused, a
connection the server closed noticed or (for requests safe to repeat) retried, streamed bodies,
timeouts, and both kinds of proxy."""

from __future__ import annotations

import contextlib
import http.client
import os
import resource
import socket
import threading
from collections.abc import Callable, Iterator
from types import SimpleNamespace

import pytest
from loopback_http import LoopbackServer, read_request

from driver.kube.connection import ConnectionPool, Response, Timeouts

TIMEOUTS = Timeouts(connect=2.0, read=5.0)


def _answer(body: bytes = b"{}", extra: str = "") -> bytes:
    return f"HTTP/1.1 200 OK\r\nContent-Length: {len(body)}\r\n{extra}\r\n".encode() + body


class Scripted(LoopbackServer):
    """A server whose every accepted connection runs `script(conn, index)`; it records each
    request line it reads through `requests`."""

    def __init__(self, script: Callable[[socket.socket, int, Scripted], None]) -> None:
        super().__init__()
        self.url = f"http://127.0.0.1:{self.port}"
        self.requests: list[bytes] = []
        self._script = script
        self.start()

    def request(self, conn: socket.socket) -> bytes:
        head = read_request(conn)
        if head:
            self.requests.append(head.split(b"\r\n")[0])
        return head

    def serve(self, conn: socket.socket, index: int) -> None:
        self._script(conn, index, self)


@pytest.fixture
def scripted() -> Iterator[Callable[..., Scripted]]:
    servers: list[Scripted] = []

    def make(script: Callable[[socket.socket, int, Scripted], None]) -> Scripted:
        servers.append(Scripted(script))
        return servers[-1]

    yield make
    for s in servers:
        s.close()


def _keep_alive(conn: socket.socket, _index: int, srv: Scripted) -> None:
    while srv.request(conn):
        conn.sendall(_answer())


def test_a_connection_is_kept_and_reused(scripted) -> None:
    srv = scripted(_keep_alive)
    pool = ConnectionPool(srv.url, None, None, TIMEOUTS, maxsize=4)
    for _ in range(5):
        assert pool.request("GET", "/x", None, {}).read(1024) == b"{}"
    assert srv.connections == 1 and len(srv.requests) == 5
    pool.close()


def test_a_body_is_read_up_to_the_most_asked_and_a_part_read_closes_its_connection(scripted) -> None:
    """The reader caps what a server can make it hold. A body read in part cannot carry the next
    request (its rest would be the next answer), so its connection is closed, not kept."""

    def chunked(conn: socket.socket, _index: int, srv: Scripted) -> None:
        while srv.request(conn):
            conn.sendall(
                b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n8\r\n01234567\r\n8\r\n89abcdef\r\n0\r\n\r\n"
            )

    srv = scripted(chunked)
    pool = ConnectionPool(srv.url, None, None, TIMEOUTS, maxsize=4)
    assert pool.request("GET", "/part", None, {}).read(10) == b"0123456789"
    assert pool.request("GET", "/whole", None, {}).read(1024) == b"0123456789abcdef"
    assert pool.request("GET", "/again", None, {}).read(1024) == b"0123456789abcdef"
    assert srv.connections == 2  # a new one after the part read; the one read whole was kept
    pool.close()


def test_a_body_shorter_than_its_content_length_is_an_error(scripted) -> None:
    """Read with a cap, `http.client` would return it short; a truncated object must not pass."""

    def truncated(conn: socket.socket, _index: int, srv: Scripted) -> None:
        srv.request(conn)
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{}")

    srv = scripted(truncated)
    pool = ConnectionPool(srv.url, None, None, TIMEOUTS, maxsize=4)
    with pytest.raises(http.client.IncompleteRead):
        pool.request("GET", "/x", None, {}).read(1024)


@pytest.fixture
def descriptors_from_1024() -> Iterator[None]:
    """The process's lowest free file descriptors are 1024 and up, as in a busy daemon."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 2048:
        pytest.skip(f"the hard limit of open files ({hard}) is too low")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 2048), hard))
    taken = [os.open(os.devnull, os.O_RDONLY)]
    try:
        while taken[-1] < 1024:
            taken.append(os.open(os.devnull, os.O_RDONLY))
        yield
    finally:
        for fd in taken:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_connection_with_a_descriptor_from_1024_on_is_kept_and_reused(scripted, descriptors_from_1024) -> None:
    """select() refuses such descriptors: a kept connection must not be taken for closed then."""
    srv = scripted(_keep_alive)
    pool = ConnectionPool(srv.url, None, None, TIMEOUTS, maxsize=4)
    for _ in range(3):
        assert pool.request("GET", "/x", None, {}).read(1024) == b"{}"
    assert srv.connections == 1
    pool.close()


@pytest.mark.parametrize("path", ["/k8s/clusters/c-1", "/k8s/clusters/c-1/"])
def test_every_request_path_is_put_under_the_server_urls_path(scripted, path: str) -> None:
    """A proxy in front of several clusters (Rancher) gives each a server URL with a path."""
    srv = scripted(_keep_alive)
    pool = ConnectionPool(srv.url + path, None, None, TIMEOUTS, maxsize=4)
    assert pool.request("GET", "/api/v1/nodes/n?x=1", None, {}).read(1024) == b"{}"
    assert srv.requests == [b"GET /k8s/clusters/c-1/api/v1/nodes/n?x=1 HTTP/1.1"]
    pool.close()


def test_a_kept_connection_the_server_closed_is_not_used(scripted) -> None:
    closed = threading.Event()

    def answer_once(conn: socket.socket, _index: int, srv: Scripted) -> None:
        srv.request(conn)
        conn.sendall(_answer())  # then closes, without saying so in the answer
        conn.close()
        closed.set()

    srv = scripted(answer_once)
    pool = ConnectionPool(srv.url, None, None, TIMEOUTS, maxsize=4)
    assert pool.request("GET", "/a", None, {}).read(1024) == b"{}"
    assert closed.wait(5)
    # A POST is never sent twice, so it goes through only because the closed connection is
    # noticed before the request is written.
    assert pool.request("POST", "/b", b"{}", {}).read(1024) == b"{}"
    assert srv.connections == 2


def _closes_at_the_second_request(conn: socket.socket, index: int, srv: Scripted) -> None:
    """The first connection answers one request, then closes when the next one arrives (the
    race of a server's idle timeout with our request); later connections answer normally."""
    srv.request(conn)
    conn.sendall(_answer())
    if index == 0:
        srv.request(conn)
        return
    _keep_alive(conn, index, srv)


def test_a_sent_request_reaches_the_server_before_its_answer_is_asked_for(scripted) -> None:
    """`send` puts the request on the wire and returns: the server works while the caller does."""
    received, answer = threading.Event(), threading.Event()

    def answers_when_told(conn: socket.socket, _index: int, srv: Scripted) -> None:
        srv.request(conn)
        received.set()
        answer.wait(5)
        conn.sendall(_answer(b'{"applied":true}'))
        _keep_alive(conn, _index, srv)

    srv = scripted(answers_when_told)
    pool = ConnectionPool(srv.url, None, None, TIMEOUTS, maxsize=4)
    sent = pool.send("PATCH", "/status", b"{}", {})
    assert received.wait(5), "the request did not reach the server before its answer was asked for"
    answer.set()
    assert sent.response().read(1024) == b'{"applied":true}'
    with pytest.raises(RuntimeError, match="already read"):
        sent.response()  # the connection is back in the pool: reading again would steal another answer
    assert pool.request("GET", "/next", None, {}).read(1024) == b"{}"
    assert srv.connections == 1, "the connection of a sent request is kept as any other"
    pool.close()


def test_a_sent_patch_is_sent_again_when_the_server_closes_as_it_arrives(scripted) -> None:
    srv = scripted(_closes_at_the_second_request)
    pool = ConnectionPool(srv.url, None, None, TIMEOUTS, maxsize=4)
    assert pool.request("GET", "/one", None, {}).read(1024) == b"{}"
    sent = pool.send("PATCH", "/two", b"{}", {})
    assert sent.response().read(1024) == b"{}"
    assert srv.requests == [b"GET /one HTTP/1.1", b"PATCH /two HTTP/1.1", b"PATCH /two HTTP/1.1"]
    pool.close()


def test_a_get_is_sent_again_when_the_server_closes_as_it_arrives(scripted) -> None:
    srv = scripted(_closes_at_the_second_request)
    pool = ConnectionPool(srv.url, None, None, TIMEOUTS, maxsize=4)
    assert pool.request("GET", "/one", None, {}).read(1024) == b"{}"
    assert pool.request("GET", "/two", None, {}).read(1024) == b"{}"
    assert srv.requests == [b"GET /one HTTP/1.1", b"GET /two HTTP/1.1", b"GET /two HTTP/1.1"]


def test_a_post_is_never_sent_twice(scripted) -> None:
    srv = scripted(_closes_at_the_second_request)
    pool = ConnectionPool(srv.url, None, None, TIMEOUTS, maxsize=4)
    assert pool.request("GET", "/one", None, {}).read(1024) == b"{}"
    with pytest.raises(http.client.RemoteDisconnected):
        pool.request("POST", "/create", b"{}", {})
    assert srv.requests == [b"GET /one HTTP/1.1", b"POST /create HTTP/1.1"]


def test_a_streamed_body_arrives_chunk_by_chunk_and_shutdown_unblocks_its_reader(scripted) -> None:
    release = threading.Event()

    def watch(conn: socket.socket, _index: int, srv: Scripted) -> None:
        srv.request(conn)
        conn.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n6\r\nline1\n\r\n")
        release.wait(10)

    srv = scripted(watch)
    pool = ConnectionPool(srv.url, None, None, TIMEOUTS, maxsize=4)
    resp = pool.request("GET", "/watch", None, {}, read_timeout=30)
    chunks = resp.chunks()
    assert next(chunks) == b"line1\n"  # before the server ends the stream
    ended = threading.Event()

    def drain() -> None:
        with contextlib.suppress(OSError, http.client.HTTPException):
            list(chunks)
        ended.set()

    threading.Thread(target=drain, daemon=True).start()
    resp.shutdown()
    assert ended.wait(5), "shutdown() did not end a blocked read"
    release.set()


class _ClosedByTheReader:
    """A connection that its reader's thread closes (`sock` becomes None) just after `sock` was
    first looked at."""

    def __init__(self, sock: socket.socket) -> None:
        self._socks: list[socket.socket | None] = [sock, None]

    @property
    def sock(self) -> socket.socket | None:
        return self._socks.pop(0) if len(self._socks) > 1 else self._socks[0]


def test_shutdown_while_the_reader_closes_the_connection_does_not_raise() -> None:
    ours, peer = socket.socketpair()
    with ours, peer:
        conn = _ClosedByTheReader(ours)
        Response(None, conn, SimpleNamespace(status=200, reason="OK")).shutdown()
        assert peer.recv(1) == b""  # the socket seen was shut down: the peer reads EOF


def test_an_unanswered_request_times_out(scripted) -> None:
    silent = threading.Event()

    def never_answers(conn: socket.socket, _index: int, srv: Scripted) -> None:
        srv.request(conn)
        silent.wait(10)

    srv = scripted(never_answers)
    pool = ConnectionPool(srv.url, None, None, Timeouts(connect=1.0, read=0.3), maxsize=4)
    with pytest.raises(TimeoutError):
        pool.request("GET", "/slow", None, {})
    silent.set()


def test_a_plain_http_proxy_gets_the_absolute_url_and_credentials(scripted) -> None:
    seen: list[bytes] = []

    def proxy(conn: socket.socket, _index: int, srv: Scripted) -> None:
        seen.append(srv.request(conn))
        conn.sendall(_answer())

    prx = scripted(proxy)
    pool = ConnectionPool(
        "http://api.example:8080", None, f"http://user:p%40ss@127.0.0.1:{prx.port}", TIMEOUTS, maxsize=4
    )
    assert pool.request("GET", "/api/v1/nodes/n", None, {}).read(1024) == b"{}"
    assert prx.requests == [b"GET http://api.example:8080/api/v1/nodes/n HTTP/1.1"]
    assert b"Proxy-Authorization: Basic dXNlcjpwQHNz" in seen[0]  # user:p@ss


@pytest.mark.parametrize("path", ["/k8s/clusters/c-1", "/k8s/clusters/c-1/"])
def test_a_plain_http_proxy_gets_the_server_urls_path_once(scripted, path: str) -> None:
    prx = scripted(_keep_alive)
    pool = ConnectionPool("http://api.example:8080" + path, None, f"http://127.0.0.1:{prx.port}", TIMEOUTS, maxsize=4)
    assert pool.request("GET", "/api/v1/nodes/n", None, {}).read(1024) == b"{}"
    assert prx.requests == [b"GET http://api.example:8080/k8s/clusters/c-1/api/v1/nodes/n HTTP/1.1"]
    pool.close()


def test_a_proxy_without_a_scheme_is_an_http_proxy(scripted) -> None:
    """HTTPS_PROXY=proxy:3128 is common, and client-go (Go's net/http) takes it as http://."""
    prx = scripted(_keep_alive)
    pool = ConnectionPool("http://api.example:8080", None, f"127.0.0.1:{prx.port}", TIMEOUTS, maxsize=4)
    assert pool.request("GET", "/api", None, {}).read(1024) == b"{}"
    assert prx.requests == [b"GET http://api.example:8080/api HTTP/1.1"]
    pool.close()


def test_an_https_server_is_reached_through_a_connect_tunnel(scripted) -> None:
    """The tunnel's CONNECT names the API server; TLS then runs end to end through it (here the
    'server' behind the tunnel is plain: what is checked is the CONNECT and that the pool wraps
    the tunnelled socket, whose handshake then fails against a non-TLS peer)."""

    def proxy(conn: socket.socket, _index: int, srv: Scripted) -> None:
        srv.request(conn)
        conn.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
        conn.recv(65536)  # the TLS ClientHello
        # closing now ends the handshake

    prx = scripted(proxy)
    pool = ConnectionPool(
        "https://api.example:6443", None, f"http://127.0.0.1:{prx.port}", Timeouts(connect=2.0, read=2.0), maxsize=4
    )
    with pytest.raises((OSError, http.client.HTTPException)):
        pool.request("GET", "/api", None, {})
    assert prx.requests == [b"CONNECT api.example:6443 HTTP/1.0"]  # http.client tunnels in 1.0


def test_only_http_proxies_are_accepted() -> None:
    with pytest.raises(ValueError, match="only http:// proxies"):
        ConnectionPool("https://api.example", None, "https://proxy.example:3128", TIMEOUTS, maxsize=4)
