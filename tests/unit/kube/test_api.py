"""driver.kube.api as a door: whatever the server (or what answers in its place) does, callers get
`ApiError` and its subclasses only, with a message saying what failed; the server's Retry-After is
read and bounded; no answer can make the driver hold more than a bounded body."""

from __future__ import annotations

import contextlib
import email.utils
import json
import socket
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from loopback_http import LoopbackServer, read_request

from driver.kube.api import LIST_LIMIT, OBJECT_LIMIT, ApiError, Conflict, KubeAPI, NotFound
from driver.kube.connection import RETRY_AFTER_MAX

Answer = Callable[[bytes], Iterable[bytes]]  # the request's head -> what the server sends, piece by piece


class Server(LoopbackServer):
    """Loopback: one request per connection, answered by `answer` (or, `greet`, the answer sent
    at once without reading anything: what a TLS client meets at a server that is not TLS)."""

    def __init__(self, answer: Answer, greet: bool = False) -> None:
        super().__init__()
        self._answer = answer
        self._greet = greet
        self.start()

    def serve(self, conn: socket.socket, index: int) -> None:
        try:
            head = b"" if self._greet else read_request(conn)
            for piece in self._answer(head):
                conn.sendall(piece)
            if self._greet:  # until the client gives up: closing first could reset its handshake
                conn.settimeout(10)
                while conn.recv(65536):
                    pass
        except OSError:  # the client stopped reading and closed: what a cap does
            pass


def _kubeconfig(path: Path, server: str) -> str:
    cluster = {"server": server, "insecure-skip-tls-verify": True} if server.startswith("https") else {"server": server}
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": cluster}],
                "users": [{"name": "u", "user": {"token": "t"}}],
                "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "x",
            }
        )
    )
    return str(path)


@pytest.fixture
def api_for(tmp_path: Path) -> Iterator[Callable[..., KubeAPI]]:
    made: list[tuple[KubeAPI, Server | None]] = []

    def make(answer: Answer | None, scheme: str = "http", greet: bool = False) -> KubeAPI:
        server = Server(answer, greet) if answer is not None else None
        if server is not None:
            port = server.port
        else:  # a port nothing listens on: connection refused
            with socket.create_server(("127.0.0.1", 0)) as s:
                port = s.getsockname()[1]
        api = KubeAPI(_kubeconfig(tmp_path / f"kubeconfig-{len(made)}", f"{scheme}://127.0.0.1:{port}"), (2.0, 5.0))
        made.append((api, server))
        return api

    yield make
    for api, server in made:
        api.close()
        if server is not None:
            server.close()


def _http(status: str, body: bytes, *headers: str) -> Answer:
    head = "".join(f"{h}\r\n" for h in (f"HTTP/1.1 {status}", f"Content-Length: {len(body)}", *headers))
    return lambda _request: [head.encode() + b"\r\n" + body]


def _chunked(total: int, piece: int = 2**20) -> Answer:
    """A chunked 200 whose body goes on for `total` bytes (only a cap stops a reader)."""

    def answer(_request: bytes) -> Iterator[bytes]:
        yield b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        for _ in range(total // piece):
            yield b"%x\r\n" % piece + b" " * piece + b"\r\n"
        yield b"0\r\n\r\n"

    return answer


SLICE = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"name": "s"}, "spec": {}}
# Every request the door makes, each as its caller makes it; a watch is read to its end.
CALLS: dict[str, Callable[[KubeAPI], object]] = {
    "get_node": lambda api: api.get_node("n"),
    "get_claim": lambda api: api.get_claim("ns", "c"),
    "apply_claim_status": lambda api: api.apply_claim_status("ns", "c", [], "m", uid="u"),
    "send_claim_status": lambda api: api.send_claim_status("ns", "c", [], "m", uid="u").result(),
    "list_slices": lambda api: api.list_slices("n", "d"),
    "watch_slices": lambda api: list(api.watch_slices("n", "d", "1", 5)),
    "list_nominated_pods": lambda api: api.list_nominated_pods("n"),
    "watch_nominated_pods": lambda api: list(api.watch_nominated_pods("n", "1", 5)),
    "create_slice": lambda api: api.create_slice(SLICE),
    "update_slice": lambda api: api.update_slice(SLICE),
    "delete_slice": lambda api: api.delete_slice("s"),
    "create_event": lambda api: api.create_event("ns", {}),
    "patch_event": lambda api: api.patch_event("ns", "e", {}),
}
# What a server, a proxy in its place or the network can do; each with what the error must say.
FAULTS: dict[str, tuple[dict[str, Any], str]] = {
    "connection refused": ({"answer": None}, "connection refused: ConnectionRefusedError"),
    "TLS failure": ({"answer": _http("400 Bad Request", b""), "scheme": "https", "greet": True}, "TLS failed: "),
    "not HTTP": (
        {"answer": lambda _r: [b"\x1b[2JSSH-2.0-OpenSSH\r\n"]},
        r"not a valid HTTP answer: BadStatusLine: '\x1b[2J",
    ),
    "body cut short": (
        {"answer": lambda _r: [b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{"]},
        "IncompleteRead",
    ),
    "closed without an answer": (
        {"answer": lambda _r: []},
        "the server closed the connection without an answer: RemoteDisconnected",
    ),
    "oversize, declared": (
        {"answer": lambda _r: [b"HTTP/1.1 200 OK\r\nContent-Length: 10737418240\r\n\r\n"]},
        "the answer's body of 10737418240 bytes is over the limit of",
    ),
    "oversize, streamed": (
        {"answer": _chunked(LIST_LIMIT + 2**20)},
        "the answer's body of more bytes is over the limit",
    ),
}
# What a watch meets as a stream: a body is lines of events, not one object.
WATCH_FAULTS = {"not HTTP", "connection refused", "TLS failure", "closed without an answer"}


@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("call", CALLS)
def test_nothing_but_an_api_error_leaves_the_door(api_for, call: str, fault: str) -> None:
    """Before, a body cut short or a refused body escaped delete_slice, create_event and
    patch_event as http.client's own exceptions."""
    settings, says = FAULTS[fault]
    api = api_for(**settings)
    if call.startswith("watch_") and fault not in WATCH_FAULTS:
        # A stream that ends early is a watch that ended; any failure must be an ApiError.
        with contextlib.suppress(ApiError):
            CALLS[call](api)
        return
    with pytest.raises(ApiError) as e:
        CALLS[call](api)
    assert type(e.value) in (ApiError, NotFound, Conflict)
    assert says in str(e.value)
    assert str(e.value).isprintable()


@pytest.mark.parametrize("body", [b"not json!", b"\xff\xfe", b"[" * 100_000, b"[1, 2]"])
def test_an_answer_that_is_no_json_object_is_an_api_error(api_for, body: bytes) -> None:
    api = api_for(_http("200 OK", body))
    with pytest.raises(ApiError, match=r"get node n: (the answer is not JSON|response is not a JSON object)"):
        api.get_node("n")


def test_a_list_may_be_larger_than_one_object_but_not_without_bound(api_for) -> None:
    """The list limit is not the object limit: this node's slices may together be larger."""
    items = b",".join([b'{"metadata":{"name":"s"},"pad":"' + b"x" * 2**20 + b'"}'] * 5)
    assert len(items) > OBJECT_LIMIT
    api = api_for(_http("200 OK", b'{"metadata":{"resourceVersion":"7"},"items":[' + items + b"]}"))
    slices, rv = api.list_slices("n", "d")
    assert len(slices) == 5 and rv == "7"
    with pytest.raises(ApiError, match="over the limit of 4194304"):
        api.get_node("n")


def test_a_watch_event_without_end_is_an_api_error(api_for) -> None:
    """A stream whose line never ends would have grown the watch's buffer without bound."""
    api = api_for(_chunked(OBJECT_LIMIT + 2**20))
    with pytest.raises(ApiError, match="a watch event over the limit of 4194304 bytes"):
        list(api.watch_slices("n", "d", "1", 5))


def test_the_servers_error_message_is_shown_escaped_and_bounded(api_for) -> None:
    message = "\x1b[2Jslice \u202eevil\nforged line " + "x" * 5000
    body = json.dumps({"kind": "Status", "message": message}).encode()
    api = api_for(_http("422 Whatever You Like\x1b[31m", body))
    with pytest.raises(ApiError) as e:
        api.create_slice(SLICE)
    text = str(e.value)
    assert text.startswith(r"create slice: HTTP 422 Unprocessable Entity: '\x1b[2Jslice \u202eevil\nforged line xx")
    assert text.endswith(f"... ({len(message)} characters)") and text.isprintable() and len(text) < 1000


def test_an_error_body_over_its_limit_is_not_read(api_for) -> None:
    api = api_for(_http("404 Not Found", b"x" * 2**20))
    with pytest.raises(NotFound) as e:
        api.get_node("n")
    assert str(e.value) == "get node n: HTTP 404 Not Found"


def _at(seconds: float) -> str:
    return email.utils.formatdate(time.time() + seconds, usegmt=True)


@pytest.mark.parametrize(
    ("status", "retry_after", "wait"),
    [
        ("429 Too Many Requests", "7", 7.0),
        ("503 Service Unavailable", "2", 2.0),
        ("429 Too Many Requests", "3600", RETRY_AFTER_MAX),  # a server's word stalls no retry loop longer
        ("429 Too Many Requests", _at(3600), RETRY_AFTER_MAX),  # an HTTP date
        ("503 Service Unavailable", _at(-3600), 0.0),  # a date gone by
        ("429 Too Many Requests", "soon", 0.0),
        ("429 Too Many Requests", "-5", 0.0),
        ("429 Too Many Requests", "", 0.0),
        ("500 Internal Server Error", "5", 0.0),  # honoured for throttling and overload only
    ],
)
def test_retry_after_is_read_and_bounded(api_for, status: str, retry_after: str, wait: float) -> None:
    api = api_for(_http(status, b"{}", f"Retry-After: {retry_after}"))
    with pytest.raises(ApiError) as e:
        api.get_node("n")
    assert e.value.retry_after == wait
    assert e.value.retryable


@pytest.mark.parametrize("call", ["list_slices", "list_nominated_pods"])
@pytest.mark.parametrize("body", [b'{"items": [1]}', b'{"items": {"a": {}}}'])
def test_a_list_whose_items_are_no_objects_is_a_retryable_api_error(api_for, call: str, body: bytes) -> None:
    api = api_for(_http("200 OK", body))
    with pytest.raises(ApiError, match="malformed list") as e:
        CALLS[call](api)
    assert e.value.retryable
