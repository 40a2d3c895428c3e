"""Fuzzing the rtnetlink decoder (driver/node/rtnl.py), which reads every message the kernel's
event sockets deliver, written by hand in place of pyroute2's reader.

The property, on any bytes: each reader returns its documented type (or None for a payload too
short to be one), never raises, never loops (the deadline), and never reads past its message:
the same message with other bytes around it decodes the same. Raw bytes find little past the
16-byte header, so most strategies are structure-aware: well-formed headers and payloads carrying
attributes of the types the decoder reads, nested ones (IFLA_LINKINFO, RTA_MULTIPATH), and
lengths cut short or running past the end.
"""

from __future__ import annotations

from fuzzing import fuzz
from hypothesis import strategies as st

from driver.node import rtnl

_ATTR_TYPES = {
    rtnl.RTM_NEWLINK: [
        rtnl.IFLA_ADDRESS,
        rtnl.IFLA_IFNAME,
        rtnl.IFLA_MTU,
        rtnl.IFLA_LINK,
        rtnl.IFLA_MASTER,
        rtnl.IFLA_OPERSTATE,
        rtnl.IFLA_LINKINFO,
        rtnl.IFLA_CARRIER,
        rtnl.IFLA_PARENT_DEV_NAME,
        rtnl.IFLA_PARENT_DEV_BUS_NAME,
    ],
    rtnl.RTM_NEWADDR: [rtnl.IFA_ADDRESS, rtnl.IFA_LOCAL],
    rtnl.RTM_NEWROUTE: [rtnl.RTA_OIF, rtnl.RTA_PRIORITY, rtnl.RTA_MULTIPATH, rtnl.RTA_TABLE],
}
_FIXED = {rtnl.RTM_NEWLINK: rtnl.IFINFO.size, rtnl.RTM_NEWADDR: rtnl.IFADDR.size, rtnl.RTM_NEWROUTE: rtnl.RTMSG.size}


def _attribute(kind: int, value: bytes, length_delta: int) -> bytes:
    """An rtattr, its length field off by `length_delta` (0: well formed), padded to 4 bytes."""
    length = max(0, min(0xFFFF, rtnl._ATTR.size + len(value) + length_delta))
    raw = rtnl._ATTR.pack(length, kind) + value
    return raw + b"\0" * (-len(raw) % 4)


@st.composite
def _values(draw: st.DrawFn, kind: int, family: int) -> bytes:
    """A value for an attribute of `kind`: its own nested attributes where it has them."""
    if family == rtnl.RTM_NEWLINK and kind == rtnl.IFLA_LINKINFO:
        return draw(_attributes([rtnl.IFLA_INFO_KIND, 2, 3], depth=1))
    if family == rtnl.RTM_NEWROUTE and kind == rtnl.RTA_MULTIPATH:
        hops = draw(st.lists(st.tuples(st.integers(-4, 64), st.integers(-(2**31), 2**31 - 1), st.binary(max_size=12))))
        out = b""
        for delta, index, tail in hops:
            length = max(0, min(0xFFFF, rtnl._RTNEXTHOP.size + len(tail) + delta))
            out += rtnl._RTNEXTHOP.pack(length, 0, 0, index) + tail
        return out
    return draw(
        st.sampled_from([b"", b"\x01", b"\x06", b"eth0\0", b"\0" * 4, b"\xff" * 4, b"\x7f\0\0\x01"])
        | st.binary(max_size=24)
    )


@st.composite
def _attributes(draw: st.DrawFn, kinds: list[int], depth: int = 0, family: int = 0) -> bytes:
    """A run of attributes, of the kinds the decoder reads or any other, some malformed."""
    out = b""
    for _ in range(draw(st.integers(0, 6))):
        kind = draw(st.sampled_from(kinds) | st.integers(0, 0xFFFF))
        value = draw(_values(kind, family)) if depth == 0 else draw(st.binary(max_size=16))
        delta = draw(st.sampled_from([0, 0, 0, 0, -1, -4, -100, 1, 3, 100, 0xFFFF]))
        out += _attribute(kind, value, delta)
    return out


@st.composite
def messages(draw: st.DrawFn) -> bytes:
    """A datagram of several netlink messages, most of them shaped as the kernel shapes them."""
    out = b""
    for _ in range(draw(st.integers(1, 4))):
        family = draw(st.sampled_from(list(_FIXED)))
        kind = draw(st.sampled_from([family, family + 1, rtnl.NLMSG_DONE, rtnl.NLMSG_ERROR]) | st.integers(0, 0xFFFF))
        fixed = draw(st.binary(min_size=_FIXED[family], max_size=_FIXED[family]))
        payload = fixed + draw(_attributes(_ATTR_TYPES[family], family=family))
        payload = payload[: draw(st.integers(0, len(payload)))] if draw(st.booleans()) else payload
        delta = draw(st.sampled_from([0, 0, 0, -1, -16, 1, 4, 1000]))
        length = max(0, min(0xFFFFFFFF, rtnl.HEADER.size + len(payload) + delta))
        raw = rtnl.HEADER.pack(length, kind, draw(st.integers(0, 0xFFFF)), 0, 0) + payload
        out += raw + b"\0" * (-len(raw) % 4)
    return out


datagrams = messages() | st.binary(max_size=512)
_DECODERS = (
    rtnl.decode_link,
    rtnl.decode_address,
    rtnl.decode_route,
    rtnl.peek_link,
    rtnl.peek_route,
    rtnl.address_index,
)
_RESULTS = {
    rtnl.decode_link: tuple,
    rtnl.decode_address: rtnl.Address,
    rtnl.decode_route: rtnl.Route,
    rtnl.peek_link: tuple,
    rtnl.peek_route: tuple,
    rtnl.address_index: int,
}


@fuzz(datagrams)
def test_messages_yields_only_whole_messages_within_the_datagram(datagram: bytes) -> None:
    previous_end = 0
    for _kind, _flags, start, end in rtnl.messages(datagram):
        assert previous_end <= start - rtnl.HEADER.size and start <= end <= len(datagram)
        previous_end = end


@fuzz(datagrams, st.binary(max_size=64), st.binary(max_size=64))
def test_every_decoder_returns_its_type_and_reads_only_its_message(
    datagram: bytes, before: bytes, after: bytes
) -> None:
    for kind, _, start, end in rtnl.messages(datagram):
        payload = datagram[start:end]
        for decode in _DECODERS:
            alone = decode(payload, 0, len(payload))
            assert alone is None or isinstance(alone, _RESULTS[decode]), (decode.__name__, kind, alone)
            # The same message with other bytes before and after it: read from its place alone.
            assert decode(before + payload + after, len(before), len(before) + len(payload)) == alone
        attrs = rtnl.attributes(payload, 0, len(payload))
        assert all(isinstance(v, bytes) and len(v) <= len(payload) for v in attrs.values())


@fuzz(datagrams)
def test_link_events_are_link_events_whatever_the_datagram(datagram: bytes) -> None:
    seen: list[tuple[int, str]] = []

    def wanted(index: int, name: str) -> bool:
        seen.append((index, name))
        return len(seen) % 2 == 1

    for events in (rtnl.parse_link_events(datagram), rtnl.parse_link_events(datagram, wanted)):
        assert all(isinstance(e, rtnl.LinkEvent) and isinstance(e.state.name, str) for e in events)
    assert all(isinstance(i, int) and isinstance(n, str) for i, n in seen)


@fuzz(st.binary(max_size=96), st.integers(-8, 200), st.integers(-8, 200))
def test_any_offsets_into_any_bytes_are_refused_or_read_within_bounds(data: bytes, start: int, end: int) -> None:
    """The decoders take offsets from `messages`; even offsets it never yields (past the data, end
    before start) must not raise: an IndexError there would end the event thread."""
    start, end = max(0, start), min(max(0, end), len(data))
    for decode in _DECODERS:
        decode(data, start, end)
    assert all(len(v) <= len(data) for v in rtnl.attributes(data, start, end).values())


def test_a_route_with_a_multipath_of_two_nexthops_names_both() -> None:
    """The structure-aware strategy builds what the kernel sends: this one checks it decodes."""
    hops = rtnl._RTNEXTHOP.pack(8, 0, 0, 3) + rtnl._RTNEXTHOP.pack(8, 0, 0, 4)
    payload = rtnl.RTMSG.pack(2, 0, 0, 0, 254, 0, 0, 1, 0) + _attribute(rtnl.RTA_MULTIPATH, hops, 0)
    route = rtnl.decode_route(payload, 0, len(payload))
    assert route is not None and route.nexthops == (3, 4) and route.table == 254
