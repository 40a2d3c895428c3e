"""The rtnetlink decoder and the link dump against the real kernel of this machine (the daemon's
own namespace; no root needed), compared with what iproute2 and sysfs say."""

from __future__ import annotations

import json
import shutil
import socket
import struct
import subprocess
from pathlib import Path

import pytest

from driver.node import netlink, rtnl


def _ip_links() -> dict[int, dict]:
    if shutil.which("ip") is None:
        pytest.skip("needs iproute2's `ip`")
    out = subprocess.run(["ip", "-j", "-d", "link", "show"], capture_output=True, text=True, check=True).stdout
    return {link["ifindex"]: link for link in json.loads(out)}


def test_the_link_dump_decodes_what_ip_link_shows() -> None:
    with netlink.RouteSocket() as rs:
        dumped = {link.index: link for link in rs.links()}
    shown = _ip_links()
    common = dumped.keys() & shown.keys()  # links may come and go between the two reads
    assert 1 in common, "the loopback is always there"
    for index in common:
        ours, ip = dumped[index], shown[index]
        if ours.name != ip["ifname"]:
            continue  # renamed in between
        assert ours.mac == ip.get("address", ""), ip
        assert ours.mtu == ip["mtu"]
        assert ours.operstate == ip["operstate"].lower()
        assert ours.kind == (ip.get("linkinfo") or {}).get("info_kind", "")
        assert (ours.parent_bus, ours.parent) == (ip.get("parentbus", ""), ip.get("parentdev", ""))
    assert dumped[1].loopback and not any(dumped[i].loopback for i in common if i != 1)


def test_get_and_link_states_find_links_by_index_and_name() -> None:
    with netlink.RouteSocket() as rs:
        found = rs.get(index=1)
        assert found is not None and found[0].name == "lo" and found[1].admin_up
        by_name = rs.get(name="lo")
        assert by_name is not None and by_name[0].index == 1
        assert rs.get(name="tandem-none0") is None
        assert rs.get(index=2**31 - 1) is None
    states = netlink.read_link_states(["lo", "tandem-none0"], indexes={"lo": 2**31 - 1})
    assert list(states) == ["lo"], "a stale ifindex falls back to the name"


def test_speed_is_what_sysfs_says() -> None:
    with netlink.RouteSocket() as rs:
        links = [x for x in rs.links() if not x.loopback]
        for link in links:
            try:
                text = Path(f"/sys/class/net/{link.name}/speed").read_text().strip()
            except OSError:  # no such link any more, or EINVAL: the kernel does not know
                text = "-1"
            expected = int(text) if int(text) > 0 else None
            assert rs.speed(link.name) == expected, link.name
        assert rs.speed("lo") is None and rs.speed("tandem-none0") is None


def test_truncated_and_malformed_messages_are_skipped_not_raised() -> None:
    with netlink.RouteSocket() as rs:
        seq = 4242
        request = rtnl.IFINFO.pack(socket.AF_UNSPEC, 0, 1, 0, 0)
        rs.sock.send(rtnl.HEADER.pack(rtnl.HEADER.size + len(request), rtnl.RTM_GETLINK, 1, seq, 0) + request)
        datagram = rs.sock.recv(1 << 16)
    assert [e.state.name for e in rtnl.parse_link_events(datagram)] == ["lo"]
    for cut in range(len(datagram)):
        rtnl.parse_link_events(datagram[:cut])
        for _, _, start, end in rtnl.messages(datagram[:cut]):
            rtnl.peek_link(datagram, start, end)
    garbled = bytearray(datagram)
    struct.pack_into("=H", garbled, rtnl.HEADER.size + rtnl.IFINFO.size, 2)  # attribute length < 4
    (event,) = rtnl.parse_link_events(bytes(garbled))
    assert event.state.index == 1 and event.state.name == ""


def test_address_messages_name_their_link_by_index() -> None:
    payload = struct.pack("=BBBBi", socket.AF_INET, 24, 0, 0, 7)
    message = rtnl.HEADER.pack(rtnl.HEADER.size + len(payload), rtnl.RTM_NEWADDR, 0, 0, 0) + payload
    found = [(kind, rtnl.address_index(message * 2, s, e)) for kind, _, s, e in rtnl.messages(message * 2)]
    assert found == [(rtnl.RTM_NEWADDR, 7), (rtnl.RTM_NEWADDR, 7)]
    assert rtnl.address_index(message, rtnl.HEADER.size, rtnl.HEADER.size + 4) is None
    assert rtnl.parse_link_events(message) == []


def test_peek_reads_the_name_and_a_filter_skips_the_rest() -> None:
    seq = 4243
    request = rtnl.IFINFO.pack(socket.AF_UNSPEC, 0, 1, 0, 0)
    with netlink.RouteSocket() as rs:
        rs.sock.send(rtnl.HEADER.pack(rtnl.HEADER.size + len(request), rtnl.RTM_GETLINK, 1, seq, 0) + request)
        datagram = rs.sock.recv(1 << 16)
    ((_, _, start, end),) = list(rtnl.messages(datagram))
    assert rtnl.peek_link(datagram, start, end) == (1, "lo")
    assert rtnl.parse_link_events(datagram, wanted=lambda index, name: name != "lo") == []
    assert [e.state.name for e in rtnl.parse_link_events(datagram, wanted=lambda i, n: i == 1)] == ["lo"]
