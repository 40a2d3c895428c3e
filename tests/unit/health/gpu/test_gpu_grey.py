"""What a GPU's readings mean: each grey-failure rule with numbers, and each healthy behaviour
that must taint nothing (idle link downshift, boost and power capping, one error burst)."""

from __future__ import annotations

import dataclasses

from driver.health.gpu.grey import GpuReading, judge_gpu
from driver.health.grey import GreyDevice
from driver.health.pcie_sysfs import AerCounts
from driver.health.thresholds import GreyThresholds
from driver.model import Condition, TaintEffect

PERIOD = 30
HEALTHY = GpuReading(
    gen=5,
    gen_max=5,
    width=16,
    width_max=16,
    reasons=0,
    replays=0,
    nvlinks=18,
    nvlinks_up=18,
    nvlink_errors=0,
    nvlink_crc=0,
    aer=AerCounts(0, 0, 0),
    port_aer=AerCounts(0, 0, 0),
)
IDLE = dataclasses.replace(HEALTHY, gen=1, reasons=0x1)


def play(
    reads: list[GpuReading], expected_nvlinks: int | None = 18, t: GreyThresholds | None = None
) -> list[frozenset[Condition]]:
    """The GPU's conditions after each read, one read a period."""
    dev = GreyDevice(t or GreyThresholds())
    out = []
    for i, r in enumerate(reads):
        judge_gpu(dev, r, expected_nvlinks, i * PERIOD, 1_000_000 + i * PERIOD)
        out.append(dev.conditions("tandem.dev", {}))
    return out


def keys(conditions: frozenset[Condition]) -> dict[str, str]:
    return {c.key: c.value for c in conditions}


def reads(n: int, r: GpuReading) -> list[GpuReading]:
    return [r] * n


def test_a_narrow_link_is_tainted_once_it_held_and_clears_after_recovery_even_idle() -> None:
    narrow = dataclasses.replace(HEALTHY, width=8)
    out = play(reads(11, narrow) + reads(21, IDLE))
    assert not out[9]  # 270 s seen: under the 300 s hold
    (c,) = out[10]
    assert (c.key, c.value, c.effect, c.unhealthy) == (
        "tandem.dev/pcie-degraded",
        "x8-of-x16",
        TaintEffect.NO_SCHEDULE,
        True,
    )
    assert "PCIe link trained at x8 of x16 since" in c.message
    assert out[30]  # 570 s of good reads: still tainted
    assert not out[31]  # 600 s


def test_an_idle_gpu_lowering_its_link_speed_taints_nothing() -> None:
    out = play(reads(2880, IDLE))  # a day at one read each 30 s
    assert not any(out)


def test_a_slow_link_while_busy_is_tainted_and_idle_reads_do_not_taint() -> None:
    gen3 = dataclasses.replace(HEALTHY, gen=3)
    out = play(reads(5, gen3) + reads(20, IDLE) + reads(6, gen3))
    assert keys(out[-1]) == {"tandem.dev/pcie-degraded": "gen3-of-gen5"}  # the idle reads broke no hold
    assert not out[4]


def test_a_gpu_fenced_for_a_slow_link_is_given_back_after_idling_and_caught_again_under_work() -> None:
    gen3 = dataclasses.replace(HEALTHY, gen=3)
    out = play(reads(11, gen3) + reads(21, IDLE) + reads(11, gen3))
    assert out[10] and out[30]
    assert not out[31]  # 600 s idle: given back
    assert not out[41] and keys(out[42]) == {"tandem.dev/pcie-degraded": "gen3-of-gen5"}  # 300 s of work


def test_boost_power_capping_and_sync_boost_taint_nothing() -> None:
    cycle = [dataclasses.replace(HEALTHY, reasons=r) for r in (0x0, 0x4, 0x10, 0x4, 0x0, 0x2)]
    assert not any(play(cycle * 100))


def test_hardware_slowdown_flickering_taints_nothing_but_a_held_power_brake_does() -> None:
    flicker = [dataclasses.replace(HEALTHY, reasons=0x8), HEALTHY] * 50
    assert not any(play(flicker))
    brake = dataclasses.replace(HEALTHY, reasons=0x80 | 0x4)
    out = play(reads(11, brake))
    assert keys(out[10]) == {"tandem.dev/clocks-slowdown": "clocks-held"}
    (c,) = out[10]
    assert "clocks held down by power brake" in c.message


def replays(counts: list[int]) -> list[GpuReading]:
    total, out = 0, []
    for n in counts:
        total += n
        out.append(dataclasses.replace(HEALTHY, replays=total))
    return out


def test_one_burst_of_replays_taints_nothing() -> None:
    assert not any(play(replays([0, 1000] + [0] * 30)))


def test_replays_above_the_links_budget_read_after_read_are_tainted() -> None:
    # Gen5 x16: 31 a minute allowed; 20 a read of 30 s is 40 a minute, in 3 rising reads
    out = play(replays([0, 20, 20, 20]))
    assert not out[2]  # two rising reads
    assert keys(out[3]) == {"tandem.dev/pcie-errors": "pcie-replays"}
    (c,) = out[3]
    assert "60 PCIe replays (at most 31/min allowed) in 90s" in c.message


def test_replays_within_the_budget_taint_nothing() -> None:
    assert not any(play(replays([0] + [15] * 100)))  # 30 a minute: within 31


def test_a_replay_counter_reset_is_no_error_burst() -> None:
    out = play([dataclasses.replace(HEALTHY, replays=v) for v in (4_000_000, 4_000_010, 0, 5, 10, 15)])
    assert not any(out)


def test_uncorrectable_aer_counts_from_the_gpu_and_the_port_above_it() -> None:
    one = dataclasses.replace(HEALTHY, aer=AerCounts(0, 1, 0))
    assert not any(play([HEALTHY, one, *reads(3, one)]))
    both = dataclasses.replace(HEALTHY, aer=AerCounts(0, 1, 0), port_aer=AerCounts(0, 0, 1))
    assert keys(play([HEALTHY, both])[1]) == {"tandem.dev/pcie-errors": "aer-uncorrectable"}


def test_a_correctable_aer_burst_taints_nothing() -> None:
    burst = dataclasses.replace(HEALTHY, aer=AerCounts(500, 0, 0))
    assert not any(play([HEALTHY, burst, *reads(40, burst)]))


def test_nvlinks_down_against_the_peers_and_the_links_own_count() -> None:
    down = dataclasses.replace(HEALTHY, nvlinks_up=16)
    assert keys(play(reads(11, down))[10]) == {"tandem.dev/nvlink-degraded": "nvlink-16-of-18"}
    # every GPU of the node with 16 of 18 up (a board built so): the peers agree, nothing is wrong
    assert not any(play(reads(20, down), expected_nvlinks=16))


def test_nvlink_replay_errors_are_tainted_as_dcgm_fails_them_and_crc_only_above_its_rate() -> None:
    replay = dataclasses.replace(HEALTHY, nvlink_errors=1)
    assert keys(play([HEALTHY, replay])[1]) == {"tandem.dev/nvlink-degraded": "nvlink-errors"}
    crc_low = [dataclasses.replace(HEALTHY, nvlink_crc=i * 30 * 50) for i in range(20)]  # 50/s
    assert not any(play(crc_low))
    crc_high = [dataclasses.replace(HEALTHY, nvlink_crc=i * 30 * 200) for i in range(4)]  # 200/s
    assert keys(play(crc_high)[3]) == {"tandem.dev/nvlink-degraded": "nvlink-crc"}


def test_a_gpu_without_nvlink_or_with_unread_signals_taints_nothing() -> None:
    pcie_card = GpuReading(gen=4, gen_max=4, width=16, width_max=16, reasons=0)
    assert not any(play(reads(20, pcie_card), expected_nvlinks=None))
    assert not any(play(reads(20, GpuReading()), expected_nvlinks=None))


def test_the_node_chooses_the_effect() -> None:
    dev = GreyDevice(GreyThresholds(hold=60))
    for i in range(3):
        judge_gpu(dev, dataclasses.replace(HEALTHY, width=4), 18, i * PERIOD, i * PERIOD)
    (c,) = dev.conditions("example.com", {"example.com/pcie-degraded": TaintEffect.NO_EXECUTE})
    assert (c.key, c.effect) == ("example.com/pcie-degraded", TaintEffect.NO_EXECUTE)
