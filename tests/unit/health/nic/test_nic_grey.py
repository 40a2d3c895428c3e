"""What a NIC's readings mean: flapping, RDMA port and transport errors, a slow or narrow link,
with numbers; and the healthy behaviours that must taint nothing (one flap, congestion)."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from pathlib import Path

import pytest

from driver.health.grey import GreyDevice
from driver.health.nic.counters import NicCounters
from driver.health.nic.grey import NicReading, judge_nic, read_nic
from driver.health.pcie_sysfs import AerCounts, PcieLink
from driver.health.thresholds import GreyThresholds
from driver.model import Condition, NicInfo, TaintEffect

PERIOD = 30
LINK = PcieLink(32.0, 16, 32.0, 16, "0000:17:01.0", 32.0, 16)
QUIET = {
    "symbol_error": 0, "link_error_recovery": 0, "link_downed": 0, "port_rcv_errors": 0,
    "local_link_integrity_errors": 0, "excessive_buffer_overrun_errors": 0, "out_of_sequence": 0,
    "packet_seq_err": 0, "local_ack_timeout_err": 0, "req_transport_retries_exceeded": 0,
    "np_ecn_marked_roce_packets": 0, "np_cnp_sent": 0, "rp_cnp_handled": 0, "rp_cnp_ignored": 0,
}  # fmt: skip


def reading(carrier: int = 1, speed: int | None = 400000, link: PcieLink = LINK, **port: int) -> NicReading:
    return NicReading(
        link, AerCounts(0, 0, 0), AerCounts(0, 0, 0), NicCounters(carrier, speed, "28.39.1002", {1: {**QUIET, **port}})
    )


def play(
    reads: list[NicReading], peers: int | None = 400000, t: GreyThresholds | None = None, dev: GreyDevice | None = None
) -> list[frozenset[Condition]]:
    dev = dev or GreyDevice(t or GreyThresholds())
    out = []
    for i, r in enumerate(reads):
        judge_nic(dev, r, peers, i * PERIOD, i * PERIOD)
        out.append(dev.conditions("tandem.dev", {}))
    return out


def values(conditions: frozenset[Condition]) -> dict[str, str]:
    return {c.key: c.value for c in conditions}


def rising(name: str, per_read: int, reads: int) -> list[NicReading]:
    return [reading(**{name: per_read * i}) for i in range(reads)]


def test_a_single_flap_taints_nothing() -> None:
    assert not any(play([reading(1)] * 3 + [reading(3)] * 40))


def test_an_occasional_flap_taints_nothing() -> None:
    # one flap each 10 minutes for a day: never three in a window
    reads = [reading(1 + 2 * (i // 20)) for i in range(2880)]
    assert not any(play(reads))


def test_three_flaps_in_the_window_are_tainted_at_once_and_clear_after_quiet() -> None:
    out = play([reading(1), reading(3), reading(5), reading(7)] + [reading(7)] * 40)
    assert not out[2]
    (c,) = out[3]
    assert (c.key, c.value) == ("tandem.dev/link-flapping", "flapping")
    assert "6 carrier changes (a flap is two) in 300s" in c.message
    # at 330 s the window (300 s back from the baseline read at 30 s) holds two flaps: good from
    # there, and 600 s of good reads clear it
    cleared = next(i for i, conds in enumerate(out) if i > 3 and not conds)
    assert cleared * PERIOD == 330 + 600


def test_a_link_that_never_settles_is_tainted() -> None:
    out = play([reading(1 + 4 * i) for i in range(5)])  # two flaps between every two reads
    assert values(out[2]) == {"tandem.dev/link-flapping": "flapping"}


def test_symbol_errors_read_after_read_are_tainted_and_one_burst_is_not() -> None:
    assert not any(play([reading(symbol_error=0), reading(symbol_error=5000)] + [reading(symbol_error=5000)] * 20))
    out = play(rising("symbol_error", 1500, 4))  # 50/s, 10/s allowed
    assert values(out[3]) == {"tandem.dev/rdma-errors": "port1-symbol-error"}


def test_link_integrity_errors_and_exhausted_retries_are_counted_not_rated() -> None:
    assert values(play([reading(), reading(local_link_integrity_errors=1)])[1]) == {
        "tandem.dev/rdma-errors": "port1-local-link-integrity-errors"
    }
    assert not any(play([reading(), reading(req_transport_retries_exceeded=1)]))
    (c,) = play([reading(), reading(req_transport_retries_exceeded=2)])[1]
    assert (c.key, c.value) == ("tandem.dev/rdma-transport-errors", "port1-req-transport-retries-exceeded")


def test_transport_loss_a_tenant_can_cause_is_told_but_keeps_no_work_away() -> None:
    reads = [reading(out_of_sequence=200 * i, packet_seq_err=200 * i) for i in range(4)]  # 13/s together
    (c,) = play(reads)[3]
    assert (c.key, c.value, c.effect, c.unhealthy) == (
        "tandem.dev/rdma-transport-errors",
        "port1-out-of-sequence",
        TaintEffect.NONE,
        True,
    )
    (c,) = play(rising("local_ack_timeout_err", 60, 4))[3]  # 2/s, 1/s allowed
    assert (c.key, c.effect) == ("tandem.dev/rdma-transport-errors", TaintEffect.NONE)


def test_congestion_taints_nothing_and_is_kept_for_metrics() -> None:
    dev = GreyDevice(GreyThresholds())
    reads = [
        reading(np_ecn_marked_roce_packets=10**7 * i, np_cnp_sent=10**6 * i, rp_cnp_handled=10**6 * i)
        for i in range(50)
    ]
    assert not any(play(reads, dev=dev))
    assert dev.readings["port1/np_ecn_marked_roce_packets"] == 49 * 10**7


def test_a_saturated_counter_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        play([reading(local_link_integrity_errors=15)] * 5)
    assert [r.getMessage() for r in caplog.records].count(
        "RDMA port 1: local_link_integrity_errors stuck at its ceiling 15: its rise can no longer be seen"
    ) == 1


def test_a_nic_slower_than_its_peers_or_the_expectation_is_tainted_once_it_held() -> None:
    out = play([reading(speed=200000)] * 11)
    assert not out[9]
    (c,) = out[10]
    assert (c.key, c.value) == ("tandem.dev/link-slow", "200G-of-400G")
    assert not any(play([reading(speed=200000)] * 20, peers=200000))  # every peer at 200G
    expected = GreyThresholds(nic_speed_mbps=400000)
    assert values(play([reading(speed=200000)] * 11, peers=200000, t=expected)[10]) == {
        "tandem.dev/link-slow": "200G-of-400G"
    }


def test_a_nic_whose_speed_cannot_be_read_says_nothing() -> None:
    assert not any(play([reading(speed=None)] * 20))


def test_a_pcie_link_below_what_both_ends_support_is_tainted() -> None:
    gen4 = dataclasses.replace(LINK, speed_gts=16.0)
    assert values(play([reading(link=gen4)] * 11)[10]) == {"tandem.dev/pcie-degraded": "16GTs-x16"}
    # a Gen4 slot: the port can do no more, so Gen4 is all there is
    slot = dataclasses.replace(LINK, speed_gts=16.0, port_max_speed_gts=16.0)
    assert not any(play([reading(link=slot)] * 20))


def test_an_unreadable_port_counter_says_nothing() -> None:
    ports: Mapping[int, Mapping[str, int]] = {1: {}}
    r = NicReading(LINK, AerCounts(None, None, None), AerCounts(None, None, None), NicCounters(None, None, "", ports))
    assert not any(play([r] * 20))


def test_a_nic_in_a_pod_is_not_read_for_flaps(tmp_path: Path) -> None:
    """An exclusive NIC's netdev in its pod is the tenant's to take down and up at will: its
    carrier is not read, while a host netdev of the same name would be."""
    net = tmp_path / "class" / "net" / "ens1f0np0"
    net.mkdir(parents=True)
    (net / "carrier_changes").write_text("99\n")
    (net / "speed").write_text("400000\n")
    home = NicInfo("0000:d0:00.0", "ens1f0np0", "mlx5_0")
    assert read_nic(tmp_path, home).counters.carrier_changes == 99
    in_pod = dataclasses.replace(home, present=False)
    assert read_nic(tmp_path, in_pod).counters.carrier_changes is None
    assert read_nic(tmp_path, in_pod).counters.speed_mbps is None
