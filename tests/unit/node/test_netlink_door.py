"""The netlink door keeps pyroute2's exceptions in: every public call that reaches pyroute2 turns
its `NetlinkError` into `NetlinkFailure`, an OSError with the kernel's errno and a Tandem
`NodeError`, so callers catch OSError alone and never import pyroute2."""

from __future__ import annotations

import errno
import inspect
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any, NoReturn

import pytest
from pyroute2.netlink.exceptions import NetlinkError

from driver.errors import NodeError
from driver.node import netlink


def _refuse(*_args: Any, **_kwargs: Any) -> NoReturn:
    raise NetlinkError(errno.EPERM, "Operation not permitted")


class _RefusingIPRoute:
    """An IPRoute that opens, but whose every request the kernel refuses, as pyroute2 reports it."""

    def __init__(self, *_args: Any, **_kwargs: Any) -> None:
        self.closed = False

    def close(self) -> None:
        self.closed = True

    def __getattr__(self, _name: str) -> Callable[..., NoReturn]:
        return _refuse


# Every public call of the door that reaches pyroute2, in another namespace (where pyroute2 makes
# even the raw sockets).
CALLS: dict[str, Callable[[], object]] = {
    "read_links": lambda: netlink.read_links([], {}, netns="tenant"),
    "restore_link": lambda: netlink.restore_link("net1", netlink.LinkHome("eth4", 9000), netns="tenant"),
    "rename_link": lambda: netlink.rename_link("net1", "eth4", netns="tenant"),
    "RouteSocket": lambda: netlink.RouteSocket("tenant"),
    "open_event_socket": lambda: netlink.open_event_socket("tenant"),
    "read_link_states": lambda: netlink.read_link_states(["eth4"], netns="tenant"),
}
NO_PYROUTE2 = {"namespace_name"}  # words for messages
VOCABULARY = {"NetlinkFailure", "Snapshot", "LinkHome"}


@pytest.fixture
def refusing_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(netlink, "IPRoute", _RefusingIPRoute)
    monkeypatch.setattr(netlink, "pyroute2_netns", SimpleNamespace(create_socket=_refuse))


@pytest.mark.parametrize("name", sorted(CALLS))
@pytest.mark.usefixtures("refusing_kernel")
def test_no_netlink_error_leaves_a_public_call(name: str) -> None:
    with pytest.raises(netlink.NetlinkFailure) as caught:
        CALLS[name]()
    e = caught.value
    assert not isinstance(e, NetlinkError)
    assert isinstance(e, OSError) and isinstance(e, NodeError) and e.kind == "node"
    assert e.errno == errno.EPERM
    assert "Operation not permitted" in str(e)
    assert isinstance(e.__cause__, NetlinkError)  # kept for the log's traceback, never raised


def test_every_public_call_is_tried() -> None:
    """A public call added to the door is added to CALLS (or said to need no pyroute2)."""
    public = {
        name
        for name, value in vars(netlink).items()
        if not name.startswith("_")
        and (inspect.isfunction(value) or inspect.isclass(value))
        and value.__module__ == netlink.__name__
    }
    assert public == set(CALLS) | NO_PYROUTE2 | VOCABULARY
