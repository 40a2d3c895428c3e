"""Fuzzing what the driver makes of the API server's answers (driver/kube/api.py, watch.py,
connection.py): the status line, headers (Content-Length, Retry-After), and bodies of objects,
lists, errors and watch streams, from the server or whatever answers in its place (a proxy, a
broken load balancer, an attacker on the path).

The property: every request returns its documented value or raises `ApiError` (the one error
`KubeAPI` documents), never anything else, and never waits on what the answer says (the deadline).
The answer is written whole into one end of a socket pair before the request is sent, and that
end closed, so the real connection, `http.client`'s parsing and the door's decoding all run, with
no server thread and no waiting. Strategies: answers shaped as the server shapes them (statuses it
sends, bodies of the objects asked for with fields mutated, watch events), their headers wrong
(lengths short or long, dates past every calendar), and any bytes.
"""

from __future__ import annotations

import http.client
import json
import shutil
import socket
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fuzzing import deep_json, fuzz, hostile_json, mutated
from hypothesis import example
from hypothesis import strategies as st

from driver.kube.api import ApiError, KubeAPI, NodeRef

BODIES: dict[str, Any] = {
    "node": {"kind": "Node", "metadata": {"name": "n", "uid": "u-1"}},
    "list": {"kind": "List", "metadata": {"resourceVersion": "7"}, "items": [{"metadata": {"name": "s"}}]},
    "status": {"kind": "Status", "code": 409, "message": "conflict: \x1b[31mred"},
    "event": {"type": "ADDED", "object": {"metadata": {"name": "s"}}},
    "error": {"type": "ERROR", "object": {"code": 410, "message": "too old"}},
}
RETRY_AFTER = [
    "5",
    "-1",
    "99999999999",
    "Wed, 21 Oct 2015 07:28:00 GMT",
    "1 Jan 99999999999999999999 00:00:00 +0000",
    "x",
]


@st.composite
def bodies(draw: st.DrawFn) -> bytes:
    """A body: the JSON of an object, list, error or watch stream (mutated), or hostile text."""
    if draw(st.booleans()):
        return draw(deep_json | hostile_json | st.binary(max_size=64))
    docs = [
        mutated(BODIES[name], draw(st.data()))
        for name in draw(st.lists(st.sampled_from(sorted(BODIES)), min_size=1, max_size=3))
    ]
    return b"\n".join(json.dumps(doc).encode() for doc in docs) + draw(st.sampled_from([b"", b"\n", b"\n\n{"]))


@st.composite
def answers(draw: st.DrawFn) -> bytes:
    """An HTTP/1.1 answer as a server writes it, with its status, headers and length fuzzed."""
    body = draw(bodies())
    status = draw(st.sampled_from([200, 201, 404, 409, 429, 503, 500, 302]) | st.integers(-1, 1000))
    headers = [b"Content-Type: application/json"]
    length = draw(st.sampled_from(["right", "right", "short", "long", "none", "junk", "chunked"]))
    if length == "chunked":
        headers.append(b"Transfer-Encoding: chunked")
        body = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body) if draw(st.booleans()) else b"zz\r\n" + body
    elif length != "none":
        value = {"right": len(body), "short": max(0, len(body) - 3), "long": len(body) + 100, "junk": "-1x"}[length]
        headers.append(f"Content-Length: {value}".encode())
    if draw(st.booleans()):
        headers.append(f"Retry-After: {draw(st.sampled_from(RETRY_AFTER))}".encode())
    head = f"HTTP/1.1 {status} {draw(st.sampled_from(['OK', '', 'x' * 70000]))}".encode()
    return head + b"\r\n" + b"\r\n".join(headers) + b"\r\n\r\n" + body


@pytest.fixture(scope="module")
def api() -> Iterator[KubeAPI]:
    directory = Path(tempfile.mkdtemp(prefix="fuzz-api-"))
    kubeconfig = directory / "kubeconfig"
    kubeconfig.write_text(
        json.dumps(
            {
                "current-context": "c",
                "contexts": [{"name": "c", "context": {"cluster": "c"}}],
                "clusters": [{"name": "c", "cluster": {"server": "http://127.0.0.1:1"}}],
            }
        )
    )
    client = KubeAPI(str(kubeconfig), (1.0, 1.0))
    yield client
    client.close()
    shutil.rmtree(directory, ignore_errors=True)


def _answered_by(api: KubeAPI, answer: bytes) -> socket.socket:
    """The next connection `api` opens reads `answer`, already written and ended (the returned
    end stays open to take the request, unread, until the caller closes it)."""
    ours, theirs = socket.socketpair()
    theirs.sendall(answer)
    theirs.shutdown(socket.SHUT_WR)
    conn = http.client.HTTPConnection("127.0.0.1", 1, timeout=1.0)
    conn.sock = ours
    api._pool._connect = lambda: conn  # type: ignore[method-assign]
    return theirs


CALLS: dict[str, Callable[[KubeAPI], object]] = {
    "get_node": lambda api: api.get_node("n"),
    "get_claim": lambda api: api.get_claim("ns", "c"),
    "list_slices": lambda api: api.list_slices("n", "tandem.dev"),
    "watch_slices": lambda api: list(api.watch_slices("n", "tandem.dev", "1", 5)),
    "delete_slice": lambda api: api.delete_slice("s", "7"),
    "create_event": lambda api: api.create_event("ns", {"kind": "Event"}),
}
RESULTS: dict[str, type | tuple[type, ...]] = {
    "get_node": NodeRef,
    "get_claim": dict,
    "list_slices": tuple,
    "watch_slices": list,
    "delete_slice": type(None),
    "create_event": type(None),
}


@example(call="get_node", answer=b'HTTP/1.1 200 OK\r\nContent-Length: 16\r\n\r\n{"metadata": []}')
@example(call="list_slices", answer=b'HTTP/1.1 200 OK\r\nContent-Length: 17\r\n\r\n{"metadata": "x"}')
@example(call="get_claim", answer=b"HTTP/1.1 503 x\r\nRetry-After: 1 Jan 99999999999999999999 00:00:00 +0000\r\n\r\n")
@fuzz(st.sampled_from(sorted(CALLS)), answers() | st.binary(max_size=200))
def test_every_answer_gives_the_calls_value_or_an_api_error(api: KubeAPI, call: str, answer: bytes) -> None:
    with _answered_by(api, answer):
        try:
            result = CALLS[call](api)
        except ApiError as e:
            assert str(e)
            return
    assert isinstance(result, RESULTS[call])
