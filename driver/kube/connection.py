"""Kept-alive HTTP/1.1 connections to the one API server, on the standard library's `http.client`.

Why not urllib3 (what the official client uses): a node daemon talks to one server, so a general
pool manager's per-request work (URL and retry bookkeeping, header containers, response
wrappers) bought nothing, and HTTP was a fifth of a prepare's CPU; the same request on a
kept-alive `http.client` connection costs about 60 % of urllib3's (measured with `thread_time` on
loopback). What a node daemon needs of a transport is here, and only that:

* TLS from `driver.kube.kubeconfig`'s settings, with a context made per connection, so a rotated
  client certificate or CA file is picked up by the next connection, as client-go does;
* a connect timeout and a separate read timeout (a watch gets a longer one);
* `HTTPS_PROXY`-style proxies: CONNECT tunnels to an https server, absolute URLs to an http one;
* a server URL with a path (a proxy in front of several clusters, e.g. Rancher's
  `https://rancher/k8s/clusters/c-1`): every request's path is put under it, as client-go does;
* up to `maxsize` idle connections kept, more opened when needed and closed after use;
* a body read up to a cap the caller names (`Response.read`), a Retry-After within
  `RETRY_AFTER_MAX` (`Response.retry_after`), and what failed said in words (`failure`): what a
  server answers is a stranger's word;
* a kept connection the server has closed meanwhile (idle timeout, restart) is noticed before it
  is used; if the server closes it in the instant between that check and the request, the request
  is sent again on a fresh connection when repeating it is harmless: never for a POST, which may
  have been carried out (Go's `net/http` follows the same rule).
"""

from __future__ import annotations

import base64
import email.utils
import errno
import http.client
import select
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC
from urllib.parse import SplitResult, unquote, urlsplit

from driver.kube.kubeconfig import TlsSettings
from driver.untrusted import shown

# What a kept connection closed by the server raises at the next request, before any answer.
_STALE = (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError, ConnectionAbortedError)
_CHUNK = 64 * 1024
# A request as sent: method, target, body, headers, read timeout.
_Request = tuple[str, str, bytes | None, dict[str, str], float | None]
# The longest wait a Retry-After header may ask: a server's word cannot stall the driver longer.
RETRY_AFTER_MAX = 30.0
# What failed, in words, by the exception that says so: the first that matches (the order matters:
# RemoteDisconnected is a ConnectionResetError and an HTTPException, TLS errors are OSErrors).
_FAILURES: tuple[tuple[type[BaseException], str], ...] = (
    (ssl.SSLError, "TLS failed"),
    (ConnectionRefusedError, "connection refused"),
    (http.client.RemoteDisconnected, "the server closed the connection without an answer"),
    (TimeoutError, "no answer in time"),
    (http.client.HTTPException, "not a valid HTTP answer"),
)
# Errnos of a connection no server answered that are not ConnectionErrors: no route, network down.
_NO_ROUTE = frozenset({errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EHOSTDOWN, errno.ENETDOWN})


@dataclass(frozen=True)
class Timeouts:
    """Seconds to open a connection (TCP and TLS) and to wait for any read."""

    connect: float
    read: float


class _TlsConnection(http.client.HTTPConnection):
    """TLS over `HTTPConnection`'s socket (and proxy tunnel), checked against the name the
    kubeconfig asks for (`tls-server-name`) rather than the host dialled."""

    default_port = http.client.HTTPS_PORT

    def __init__(self, host: str, port: int | None, timeout: float, tls: TlsSettings, server_name: str) -> None:
        super().__init__(host, port, timeout=timeout)
        self._tls = tls
        self._server_name = server_name

    def connect(self) -> None:
        super().connect()
        self.sock = self._tls.context().wrap_socket(self.sock, server_hostname=self._server_name)


class Response:
    """One answer. Its body must be read whole (`read`) or the response closed before another
    request may use the connection; `read` hands the connection back for reuse."""

    def __init__(self, pool: ConnectionPool, conn: http.client.HTTPConnection, resp: http.client.HTTPResponse) -> None:
        self._pool = pool
        self._conn: http.client.HTTPConnection | None = conn
        self._resp = resp
        self.status = resp.status

    @property
    def length(self) -> int | None:
        """The body's length as its Content-Length declares it, None when undeclared (chunked, or
        until the server closes)."""
        return self._resp.length

    @property
    def retry_after(self) -> float:
        """The seconds the answer's Retry-After header asks to wait (RFC 9110: a number of
        seconds or an HTTP date), within 0..RETRY_AFTER_MAX; 0 when there is none or it cannot be
        read."""
        value = (self._resp.getheader("Retry-After") or "").strip()
        if value.isascii() and value.isdigit():
            seconds = float(value)
        else:
            try:
                when = email.utils.parsedate_to_datetime(value)
            except (TypeError, ValueError, OverflowError):  # OverflowError: a year past any calendar
                return 0.0
            seconds = (when if when.tzinfo else when.replace(tzinfo=UTC)).timestamp() - time.time()
        return min(max(seconds, 0.0), RETRY_AFTER_MAX)

    def read(self, most: int) -> bytes:
        """The body, its first `most` bytes at most: a server cannot make the reader hold more.
        The connection goes back to the pool when that was the whole body and the server keeps
        the connection; it is closed otherwise (the rest unread), on any failure, and when a body
        ends before its Content-Length (`http.client` would return it short)."""
        try:
            data = self._resp.read(most)
            if self._resp.length and len(data) < most:
                raise http.client.IncompleteRead(data, self._resp.length)
        except BaseException:
            self.close()
            raise
        conn, self._conn = self._conn, None
        if conn is not None:
            self._pool.put(conn, reusable=self._resp.isclosed() and not self._resp.will_close)
        return data

    def chunks(self) -> Iterator[bytes]:
        """The body as it arrives (a watch stream), until the server ends it; the connection is
        closed afterwards, never reused: a half-read stream would be the next request's answer."""
        try:
            while chunk := self._resp.read1(_CHUNK):
                yield chunk
        finally:
            self.close()

    def shutdown(self) -> None:
        """Unblock a reader in another thread at once (a stopping watch): a blocked socket read
        cannot be interrupted any other way."""
        conn = self._conn
        # Read once: the reader's thread may close the connection (sock = None) at any moment.
        sock = conn.sock if conn is not None else None
        if sock is not None:
            sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()


class Sent:
    """A request on the wire whose answer is not read yet. A prepare sends the claim-status apply,
    writes its files while the server works, then reads the answer: the overlap of a second
    thread, without handing the work to one."""

    def __init__(
        self,
        pool: ConnectionPool,
        conn: http.client.HTTPConnection,
        reused: bool,
        request: _Request,
    ) -> None:
        self._pool = pool
        self._conn: http.client.HTTPConnection | None = conn
        self._reused = reused
        self._request = request

    def response(self) -> Response:
        """The answer, its body unread; once only (the connection then belongs to the answer). A
        kept connection the server closed as the request went out is answered by sending it again
        on a new one, unless it was a POST."""
        conn, self._conn = self._conn, None
        if conn is None:
            raise RuntimeError("the answer to this request was already read")
        try:
            return Response(self._pool, conn, conn.getresponse())
        except _STALE:
            conn.close()
            if not _repeatable(self._reused, self._request[0]):
                raise
        except BaseException:
            conn.close()
            raise
        conn = self._pool._send_again(self._request)
        try:
            return Response(self._pool, conn, conn.getresponse())
        except BaseException:
            conn.close()
            raise


class ConnectionPool:
    """Connections to `server` (scheme://host[:port][/path]); thread-safe."""

    def __init__(
        self, server: str, tls: TlsSettings | None, proxy: str | None, timeouts: Timeouts, maxsize: int
    ) -> None:
        url = urlsplit(server)
        # Where requests go, fit for messages: without a user:password the URL may carry.
        self.server = f"{url.scheme}://{url.netloc.rpartition('@')[2]}{url.path.rstrip('/')}"
        self._https = url.scheme == "https"
        self._host, self._port = url.hostname or "", url.port
        self._origin = f"{url.scheme}://{url.netloc}"
        self._prefix = url.path.rstrip("/")  # put before every request's path
        self._tls = tls or TlsSettings()
        self._proxy = _proxy_url(proxy) if proxy else None
        if self._proxy is not None and self._proxy.scheme != "http":
            raise ValueError(f"proxy {proxy!r}: only http:// proxies are supported")
        self._timeouts = timeouts
        self._maxsize = maxsize
        self._idle: list[http.client.HTTPConnection] = []
        self._lock = threading.Lock()

    def send(
        self, method: str, target: str, body: bytes | None, headers: dict[str, str], read_timeout: float | None = None
    ) -> Sent:
        """Send `method target` (path and query) now; its answer is read by `Sent.response`, so the
        caller can work while the server does. Raises what the socket, TLS or HTTP layer raises;
        the caller turns that into its own errors."""
        request = (method, self._prefix + target, body, headers, read_timeout)
        conn, reused = self._get()
        try:
            self._write(conn, *request)
        except _STALE:
            if not _repeatable(reused, method):
                raise
            conn, reused = self._send_again(request), False
        return Sent(self, conn, reused, request)

    def request(
        self, method: str, target: str, body: bytes | None, headers: dict[str, str], read_timeout: float | None = None
    ) -> Response:
        """`send`, then its answer with the body unread."""
        return self.send(method, target, body, headers, read_timeout).response()

    def put(self, conn: http.client.HTTPConnection, reusable: bool) -> None:
        with self._lock:
            if reusable and len(self._idle) < self._maxsize:
                self._idle.append(conn)
                return
        conn.close()

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    def _write(
        self,
        conn: http.client.HTTPConnection,
        method: str,
        target: str,
        body: bytes | None,
        headers: dict[str, str],
        read_timeout: float | None,
    ) -> None:
        """Put the request on the wire (connecting first when `conn` is new); `conn` is closed if that fails."""
        try:
            sock = conn.sock
            if sock is None:
                conn.connect()
                sock = conn.sock
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.settimeout(read_timeout or self._timeouts.read)
            if self._proxy is not None and not self._https:
                target = self._origin + target  # a plain-HTTP proxy takes the absolute URL
                headers = {**headers, **_proxy_auth(self._proxy)}
            conn.request(method, target, body=body, headers=headers)
        except BaseException:
            conn.close()
            raise

    def _send_again(self, request: _Request) -> http.client.HTTPConnection:
        """The server closed the kept connection as `request` went out: once more, on a new one."""
        conn = self._connect()
        self._write(conn, *request)
        return conn

    def _get(self) -> tuple[http.client.HTTPConnection, bool]:
        """A kept connection the server has not closed (and whether it was kept), or a new one."""
        while True:
            with self._lock:
                conn = self._idle.pop() if self._idle else None
            if conn is None:
                return self._connect(), False
            if conn.sock is not None and not _readable(conn.sock):
                return conn, True
            conn.close()  # closed by the server (or it sent something unasked): never reuse

    def _connect(self) -> http.client.HTTPConnection:
        """A new, not yet connected connection (it connects on first use, within the connect timeout)."""
        host, port = (self._proxy.hostname or "", self._proxy.port) if self._proxy else (self._host, self._port)
        conn: http.client.HTTPConnection
        if self._https:
            conn = _TlsConnection(host, port, self._timeouts.connect, self._tls, self._tls.server_name or self._host)
        else:
            conn = http.client.HTTPConnection(host, port, timeout=self._timeouts.connect)
        if self._proxy is not None and self._https:
            conn.set_tunnel(self._host, self._port or http.client.HTTPS_PORT, headers=_proxy_auth(self._proxy))
        return conn


def failure(exc: BaseException) -> str:
    """What a request's exception says failed, in words, then the library's own ("TLS failed:
    SSLCertVerificationError: ..."); what came from the server (an HTTP status line or header it
    cannot parse) is shown escaped and bounded."""
    failed = next((words + ": " for kind, words in _FAILURES if isinstance(exc, kind)), "")
    text = shown(str(exc), 200) if isinstance(exc, http.client.HTTPException) else str(exc)
    return f"{failed}{type(exc).__name__}: {text}"


def unreachable(exc: BaseException) -> bool:
    """Whether a request's exception says that no server answered at the address: refused, reset,
    timed out, no such name, no route. Not a TLS failure, a broken answer or an unreadable
    credential: there something answered, or the fault is this side's."""
    return isinstance(exc, (ConnectionError, TimeoutError, socket.gaierror)) or (
        isinstance(exc, OSError) and exc.errno in _NO_ROUTE
    )


def _repeatable(reused: bool, method: str) -> bool:
    """Whether a request that met a closed connection is sent again: only when the connection was
    a kept one (a new one failing is a real error), and never a POST, which may have been carried
    out (Go's `net/http` follows the same rule)."""
    return reused and method != "POST"


def _readable(sock: socket.socket) -> bool:
    """An idle kept connection with something to read has been closed (EOF) or is out of step.

    poll, not select: select refuses descriptors from 1024 on, which a busy process reaches."""
    poller = select.poll()
    try:
        poller.register(sock, select.POLLIN)
        return bool(poller.poll(0))  # POLLIN, or POLLHUP/POLLERR/POLLNVAL: closed all the same
    except (OSError, ValueError):
        return True


def _proxy_url(proxy: str) -> SplitResult:
    """A proxy URL; without a scheme ("proxy:3128") it is http://, as Go's net/http takes it."""
    url = urlsplit(proxy)
    return url if url.netloc else urlsplit("http://" + proxy)


def _proxy_auth(proxy: SplitResult) -> dict[str, str]:
    """Basic credentials for the proxy, when its URL carries them."""
    if proxy.username is None:
        return {}
    creds = f"{unquote(proxy.username)}:{unquote(proxy.password or '')}".encode()
    return {"Proxy-Authorization": "Basic " + base64.b64encode(creds).decode()}
