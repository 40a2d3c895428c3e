"""The netlink door keeps pyroute2's exceptions in: every public call that reaches pyroute2 turns
its `NetlinkError` into `NetlinkFailure`, an OSError with the kernel's errno and a Tandem
`NodeError`, so callers catch OSError alone and never import pyroute2. And the door imports
pyroute2 only when a call needs it: never at the daemon's start, nor for reads of its own
namespace."""

from __future__ import annotations

import ast
import errno
import inspect
import subprocess
import sys
from collections.abc import Callable
from types import ModuleType, SimpleNamespace
from typing import Any, NoReturn

import pytest
from pyroute2.netlink.exceptions import NetlinkError

from driver.errors import NodeError
from driver.node import netlink, netlink_pyroute2, netlink_types


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
VOCABULARY = {"Snapshot"}
# What both halves speak: a leaf module of its own (`netlink_types`), found on `netlink` too.
SHARED = {"NetlinkFailure", "LinkHome"}
# The pyroute2 half, which the calls above reach.
HALF = {"socket_in", "restore_link", "rename_link"}


@pytest.fixture
def refusing_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(netlink_pyroute2, "IPRoute", _RefusingIPRoute)
    monkeypatch.setattr(netlink_pyroute2, "pyroute2_netns", SimpleNamespace(create_socket=_refuse))


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


def _public(module: ModuleType) -> set[str]:
    return {
        name
        for name, value in vars(module).items()
        if not name.startswith("_")
        and (inspect.isfunction(value) or inspect.isclass(value))
        and value.__module__ == module.__name__
    }


def test_every_public_call_is_tried() -> None:
    """A public call added to the door is added to CALLS (or said to need no pyroute2); the
    pyroute2 half offers only what those calls reach."""
    assert _public(netlink) == set(CALLS) | NO_PYROUTE2 | VOCABULARY
    assert _public(netlink_pyroute2) == HALF


def test_the_vocabulary_is_a_leaf_both_halves_share() -> None:
    """The names both halves speak live in `netlink_types`, which imports neither half, so the
    door has no import circle; callers still find them on `netlink`."""
    assert _public(netlink_types) == SHARED
    assert all(getattr(netlink, name) is getattr(netlink_types, name) for name in SHARED)
    imported = {
        n.module for n in ast.walk(ast.parse(inspect.getsource(netlink_types))) if isinstance(n, ast.ImportFrom)
    }
    assert not {"driver.node.netlink", "driver.node.netlink_pyroute2"} & imported


READS = """
from pathlib import Path
from driver.discovery.nic.discover import NicDiscovery
from driver.node import netlink
NicDiscovery(Path("/sys")).discover(())
with netlink.RouteSocket() as rs:
    links = rs.links()
    rs.get(index=1)
netlink.read_links(links, {link.index: link for link in links})
netlink.read_link_states(["lo"])
netlink.open_event_socket().close()
"""
WRITE = """
from driver.node import netlink
try:
    netlink.rename_link("tandem-none0", "tandem-none1")
except OSError:
    pass
"""


def _imports_pyroute2(code: str) -> bool:
    """Whether `code` leaves pyroute2 imported, run in a fresh interpreter (this one has it)."""
    code += "\nimport sys\nprint('pyroute2' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    return done.stdout.split()[-1] == "True"


def test_pyroute2_is_imported_only_when_a_call_needs_it() -> None:
    """Importing pyroute2 costs about a quarter of the daemon's start-up CPU: the daemon, and every
    read of its own namespace (NIC discovery, the watchers, health), go without it; a write loads it."""
    assert not _imports_pyroute2("import driver.daemon")
    assert not _imports_pyroute2(READS)
    assert _imports_pyroute2(WRITE)
