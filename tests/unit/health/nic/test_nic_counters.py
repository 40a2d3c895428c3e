"""The NIC counter reader against sysfs captured on real hosts (procfs's and node_exporter's test
fixtures, see tests/fixtures/sysfs-captures/NOTICE), then against hand-made trees: counters at and
past where they stop, garbage, files that are no plain small file, port listings that cannot be
read or hold what is no port, names that would lead out of their directory."""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from driver.health.nic.counters import (
    CONGESTION_COUNTERS,
    COUNTER_LIMITS,
    PORT_ERROR_COUNTERS,
    TRANSPORT_ERROR_COUNTERS,
    NicCounters,
    read_nic_counters,
)

ZEROS = dict.fromkeys(PORT_ERROR_COUNTERS, 0)


# The real captures, with the numbers they hold.


def test_an_mlx5_port_and_its_netdev(procfs_sys: Path) -> None:
    got = read_nic_counters(procfs_sys, "eth0", "mlx5_0")
    transport = {"out_of_sequence": 1, "packet_seq_err": 1, "local_ack_timeout_err": 131}
    assert got == NicCounters(carrier_changes=2, speed_mbps=1000, fw_ver="14.28.2006", ports={1: ZEROS | transport})


def test_counters_an_old_kernel_could_not_query_are_left_out(node_exporter_sys: Path) -> None:
    """i40iw: every counter reads `N/A (no PMA)`; the bond's speed reads -1."""
    got = read_nic_counters(node_exporter_sys, "bond0", "i40iw0")
    assert got == NicCounters(carrier_changes=2, speed_mbps=None, fw_ver="0.2", ports={1: {}})


def test_two_ports_with_the_counters_each_has(node_exporter_sys: Path) -> None:
    got = read_nic_counters(node_exporter_sys, "", "mlx4_0")
    ports = {
        1: {"link_error_recovery": 0, "link_downed": 0, "port_rcv_errors": 0},
        2: {"link_error_recovery": 0, "link_downed": 0},
    }
    assert got == NicCounters(carrier_changes=None, speed_mbps=None, fw_ver="2.31.5050", ports=ports)


def test_no_rdma_device_reads_only_the_netdev(procfs_sys: Path) -> None:
    assert read_nic_counters(procfs_sys, "eth0", "") == NicCounters(2, 1000, "", {})
    assert read_nic_counters(procfs_sys, "", "") == NicCounters(None, None, "", {})
    assert read_nic_counters(procfs_sys, "eth9", "mlx5_9") == NicCounters(None, None, "", {})


# Hand-made trees.


@pytest.fixture
def sysfs(tmp_path: Path) -> Path:
    """A netdev and an RDMA device of one port whose counters directories are empty."""
    root = tmp_path / "sys"
    (root / "class/net/eth0").mkdir(parents=True)
    for group in ("counters", "hw_counters"):
        (root / "class/infiniband/mlx5_0/ports/1" / group).mkdir(parents=True)
    return root


def _port(sysfs: Path, number: int = 1) -> Path:
    return sysfs / f"class/infiniband/mlx5_0/ports/{number}"


def _counter(sysfs: Path, name: str, content: bytes) -> None:
    group = "counters" if name in PORT_ERROR_COUNTERS else "hw_counters"
    (_port(sysfs) / group / name).write_bytes(content)


def _counters(sysfs: Path) -> dict[int, dict[str, int]]:
    return {p: dict(c) for p, c in read_nic_counters(sysfs, "", "mlx5_0").ports.items()}


def test_the_limits_of_each_counter() -> None:
    assert COUNTER_LIMITS == {
        "symbol_error": 65535,
        "link_error_recovery": 255,
        "link_downed": 255,
        "port_rcv_errors": 65535,
        "local_link_integrity_errors": 15,
        "excessive_buffer_overrun_errors": 15,
        "out_of_sequence": 2**32,
        "packet_seq_err": 2**32,
        "local_ack_timeout_err": 2**32,
        "req_transport_retries_exceeded": 2**32,
        "np_ecn_marked_roce_packets": 2**64,
        "np_cnp_sent": 2**64,
        "rp_cnp_handled": 2**64,
        "rp_cnp_ignored": 2**64,
    }
    assert set(COUNTER_LIMITS) == {*PORT_ERROR_COUNTERS, *TRANSPORT_ERROR_COUNTERS, *CONGESTION_COUNTERS}


def test_a_saturated_counter_is_read_and_one_past_its_limit_is_garbage(sysfs: Path) -> None:
    """Port counters stop at their limit; vendor counters wrap at theirs, so never show it."""
    for name in COUNTER_LIMITS:
        _counter(sysfs, name, f"{COUNTER_LIMITS[name]}\n".encode())
    got = _counters(sysfs)[1]
    assert got == {n: COUNTER_LIMITS[n] for n in PORT_ERROR_COUNTERS}
    for name in TRANSPORT_ERROR_COUNTERS + CONGESTION_COUNTERS:
        _counter(sysfs, name, f"{COUNTER_LIMITS[name] - 1}\n".encode())
    for name in PORT_ERROR_COUNTERS:
        _counter(sysfs, name, f"{COUNTER_LIMITS[name] + 1}\n".encode())
    assert _counters(sysfs)[1] == {n: COUNTER_LIMITS[n] - 1 for n in TRANSPORT_ERROR_COUNTERS + CONGESTION_COUNTERS}


@pytest.mark.parametrize(
    "content",
    [b"N/A (no PMA)\n", b"-3\n", b"\xc2\xb2\n", b"\xd9\xa3\n", b"0x10\n", b"", b"1" * 10_000, b"\xff\n", b"12 13\n"],
)
def test_a_counter_that_reads_as_no_number_is_left_out(sysfs: Path, content: bytes) -> None:
    _counter(sysfs, "symbol_error", content)
    _counter(sysfs, "link_downed", b"4\n")
    assert _counters(sysfs) == {1: {"link_downed": 4}}


def test_a_counter_that_is_a_directory_or_a_link_is_left_out(sysfs: Path, tmp_path: Path) -> None:
    (_port(sysfs) / "counters/symbol_error").mkdir()
    (tmp_path / "elsewhere").write_text("7\n")
    (_port(sysfs) / "hw_counters/out_of_sequence").symlink_to(tmp_path / "elsewhere")
    _counter(sysfs, "packet_seq_err", b"5\n")
    assert _counters(sysfs) == {1: {"packet_seq_err": 5}}


def test_counters_this_reader_does_not_know_are_not_read(sysfs: Path) -> None:
    _counter(sysfs, "port_xmit_wait", b"4294967295\n")
    _counter(sysfs, "duplicate_request", b"41\n")
    assert _counters(sysfs) == {1: {}}


def test_a_counters_directory_that_links_out_of_sysfs_is_not_read(sysfs: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "symbol_error").write_text("9\n")
    (_port(sysfs) / "counters").rmdir()
    (_port(sysfs) / "counters").symlink_to(outside)
    assert _counters(sysfs) == {1: {}}


def test_only_decimal_port_directories_are_ports(sysfs: Path, tmp_path: Path) -> None:
    ports = _port(sysfs).parent
    for name in ("2", "256", "x", "1a", "-1", "\u00b2", "\u0663"):
        (ports / name).mkdir()
    (ports / "3").write_text("")
    (tmp_path / "elsewhere").mkdir()
    (ports / "4").symlink_to(tmp_path / "elsewhere")
    assert _counters(sysfs) == {1: {}, 2: {}}


def test_the_port_listing_is_bounded(sysfs: Path) -> None:
    for number in range(2, 41):
        (_port(sysfs, number) / "counters").mkdir(parents=True)
    got = _counters(sysfs)
    assert 0 < len(got) <= 16 and set(got) <= set(range(1, 41))


@pytest.fixture
def unlistable_ports(sysfs: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """`ports/` refuses to be listed (EACCES), as permissions would for a user other than root."""
    real = os.scandir
    refused = os.path.realpath(_port(sysfs).parent)

    def scandir(path: str) -> Iterator[os.DirEntry[str]]:
        if os.path.realpath(path) == refused:
            raise PermissionError(errno.EACCES, "Permission denied", path)
        return real(path)

    monkeypatch.setattr(os, "scandir", scandir)
    yield


@pytest.mark.usefixtures("unlistable_ports")
def test_a_port_listing_that_cannot_be_read_gives_no_ports(sysfs: Path) -> None:
    (sysfs / "class/infiniband/mlx5_0/fw_ver").write_text("28.39.1002\n")
    assert read_nic_counters(sysfs, "", "mlx5_0") == NicCounters(None, None, "28.39.1002", {})


def test_ports_that_is_a_file_gives_no_ports(sysfs: Path) -> None:
    ports = _port(sysfs).parent
    (_port(sysfs) / "counters").rmdir()
    (_port(sysfs) / "hw_counters").rmdir()
    _port(sysfs).rmdir()
    ports.rmdir()
    ports.write_text("1\n")
    assert read_nic_counters(sysfs, "", "mlx5_0").ports == {}


@pytest.mark.parametrize(
    ("content", "mbps"),
    [
        (b"400000\n", 400000),
        (b"1000\n", 1000),
        (b"-1\n", None),
        (b"0\n", None),
        (b"65535\n", None),
        (b"4294967295\n", None),
        (b"\xd9\xa4\xd9\xa0\n", None),
        (b"fast\n", None),
    ],
)
def test_speed_known_or_none(sysfs: Path, content: bytes, mbps: int | None) -> None:
    (sysfs / "class/net/eth0/speed").write_bytes(content)
    assert read_nic_counters(sysfs, "eth0", "").speed_mbps == mbps


def test_carrier_changes_in_range_or_none(sysfs: Path) -> None:
    carrier = sysfs / "class/net/eth0/carrier_changes"
    carrier.write_text("4294967295\n")
    assert read_nic_counters(sysfs, "eth0", "").carrier_changes == 2**32 - 1
    carrier.write_text("4294967296\n")
    assert read_nic_counters(sysfs, "eth0", "").carrier_changes is None
    carrier.unlink()
    carrier.mkdir()
    assert read_nic_counters(sysfs, "eth0", "").carrier_changes is None


@pytest.mark.parametrize("content", [b"1.0\x1b[31m\n", b"\xff\n", b"1." * 200])
def test_a_firmware_version_that_is_no_short_printable_text_is_empty(sysfs: Path, content: bytes) -> None:
    (sysfs / "class/infiniband/mlx5_0/fw_ver").write_bytes(content)
    assert read_nic_counters(sysfs, "", "mlx5_0").fw_ver == ""


@pytest.mark.parametrize("name", ["..", ".", "../net/eth0", "eth0/..", "eth0\0"])
def test_a_name_that_is_no_single_directory_entry_is_not_followed(sysfs: Path, name: str) -> None:
    (sysfs / "class/carrier_changes").write_text("5\n")  # what class/net/.. would reach
    (sysfs / "class/net/carrier_changes").write_text("6\n")  # what class/net/. would reach
    (sysfs / "class/net/eth0/carrier_changes").write_text("7\n")
    (sysfs / "class/infiniband/fw_ver").write_text("1.2.3\n")
    assert read_nic_counters(sysfs, name, name) == NicCounters(None, None, "", {})


def test_a_device_that_links_out_of_sysfs_is_not_read(sysfs: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    (outside / "ports/1/counters").mkdir(parents=True)
    (outside / "fw_ver").write_text("9.9.9\n")
    (outside / "carrier_changes").write_text("3\n")
    (sysfs / "class/infiniband/mlx9").symlink_to(outside)
    (sysfs / "class/net/eth9").symlink_to(outside)
    assert read_nic_counters(sysfs, "eth9", "mlx9") == NicCounters(None, None, "", {})


def test_a_device_linked_within_sysfs_is_read_as_the_kernel_links_it(sysfs: Path) -> None:
    """class/infiniband/<dev> and class/net/<if> are links into devices/ on a real host."""
    device = sysfs / "devices/pci0000:00/0000:00:01.0/0000:01:00.0"
    (device / "infiniband/mlx5_1/ports/1/counters").mkdir(parents=True)
    (device / "infiniband/mlx5_1/ports/1/counters/link_downed").write_text("2\n")
    (device / "net/eth1").mkdir(parents=True)
    (device / "net/eth1/carrier_changes").write_text("8\n")
    (sysfs / "class/infiniband/mlx5_1").symlink_to(
        "../../devices/pci0000:00/0000:00:01.0/0000:01:00.0/infiniband/mlx5_1"
    )
    (sysfs / "class/net/eth1").symlink_to("../../devices/pci0000:00/0000:00:01.0/0000:01:00.0/net/eth1")
    assert read_nic_counters(sysfs, "eth1", "mlx5_1") == NicCounters(8, None, "", {1: {"link_downed": 2}})
