"""Fuzzing the readers of grey-failure signals in sysfs (driver/health/pcie_sysfs.py,
driver/health/nic/counters.py).

Their input is whatever a sysfs file holds, and their promise is that nothing it holds makes them
raise: any text gives a value in its range or None (the parsers), any content of any file gives a
value in its counter's range or leaves it out (the readers).
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from fuzzing import fuzz
from hypothesis import strategies as st

from driver.health.nic.counters import COUNTER_LIMITS, PORT_ERROR_COUNTERS, read_nic_counters
from driver.health.pcie_sysfs import parse_aer, parse_link_speed, read_aer, read_pcie_link

BDF = "0000:01:00.0"
DEVICE = f"devices/pci0000:00/0000:00:01.0/{BDF}"

# Digits of every kind str.isdigit and float() take, next to the ASCII ones the kernel prints.
_DIGITS = "0123456789\u00b2\u00b3\u0663\u0668\u07c0\uff18"
speeds = (
    st.sampled_from(["8.0 GT/s PCIe", "8 GT/s", "Unknown", "Unknown speed", "2.5 GT/s PCIe\n"])
    | st.from_regex(r"\A[ \t]*-?[0-9]{0,25}(\.[0-9]{0,25})?(e[0-9]{1,3})? ?(GT/s)?( PCIe)?[ \t\n]*\Z")
    | st.builds(lambda d: f"{d} GT/s PCIe", st.text(alphabet=_DIGITS + ".", max_size=12))
    | st.text(max_size=40)
)
aer_lines = st.builds(
    lambda name, sep, count: f"{name}{sep}{count}",
    st.sampled_from(["RxErr", "Receiver Error", "TOTAL_ERR_COR", "dev_cor_errs_bit[3]", ""]) | st.text(max_size=12),
    st.sampled_from([" ", "  ", "\t", ""]),
    st.text(alphabet=_DIGITS + "-+x ", max_size=24) | st.integers(-(2**70), 2**70).map(str),
)
aer_texts = st.lists(aer_lines, max_size=20).map("\n".join) | st.text(max_size=200)
contents = (
    st.sampled_from([b"", b"-1\n", b"N/A (no PMA)\n", b"4294967296\n", b"1" * 5000, b"\xff\xfe", b"8.0 GT/s PCIe\n"])
    | st.integers(-(2**70), 2**70).map(lambda n: f"{n}\n".encode())
    | st.text(alphabet=_DIGITS, max_size=30).map(str.encode)
    | st.binary(max_size=64)
)


@fuzz(speeds)
def test_a_link_speed_is_a_positive_number_of_gts_or_none(text: str) -> None:
    speed = parse_link_speed(text)
    assert speed is None or (isinstance(speed, float) and 0 < speed <= 1024)


@fuzz(aer_texts)
def test_aer_text_gives_counts_of_at_most_64_bits(text: str) -> None:
    counts = parse_aer(text)
    assert all(isinstance(n, int) and 0 <= n < 2**64 for n in counts.values())
    assert all(name and name in text for name in counts)


@pytest.fixture(scope="module")
def root() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="fuzz-grey-sysfs-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _tree(root: Path, files: dict[str, bytes]) -> Path:
    tree = root / "sys"
    shutil.rmtree(tree, ignore_errors=True)
    for rel, data in files.items():
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        (tree / rel).write_bytes(data)
    (tree / "bus/pci/devices").mkdir(parents=True)
    (tree / "bus/pci/devices" / BDF).symlink_to(f"../../../{DEVICE}")
    return tree


@fuzz(st.lists(contents, min_size=7, max_size=7))
def test_a_pcie_link_and_its_aer_read_as_values_in_range(root: Path, data: list[bytes]) -> None:
    names = ["current_link_speed", "current_link_width", "max_link_speed", "max_link_width"]
    files = {f"{DEVICE}/{name}": content for name, content in zip(names, data[:4], strict=True)}
    files |= {
        f"{DEVICE}/aer_dev_{kind}": content
        for kind, content in zip(("correctable", "nonfatal", "fatal"), data[4:], strict=True)
    }
    tree = _tree(root, files)
    link = read_pcie_link(tree, BDF)
    assert link is not None and link.port == "0000:00:01.0"
    assert all(w is None or 0 <= w <= 32 for w in (link.width, link.max_width))
    assert all(s is None or 0 < s <= 1024 for s in (link.speed_gts, link.max_speed_gts))
    aer = read_aer(tree, BDF)
    assert all(n is None or 0 <= n < 2**64 for n in (aer.correctable, aer.nonfatal, aer.fatal))


@fuzz(st.dictionaries(st.sampled_from(sorted(COUNTER_LIMITS)), contents, max_size=6), contents, contents, contents)
def test_nic_counters_read_as_values_in_range(
    root: Path, counters: dict[str, bytes], speed: bytes, carrier: bytes, fw_ver: bytes
) -> None:
    port = "class/infiniband/mlx5_0/ports/1"
    files = {
        f"{port}/{'counters' if name in PORT_ERROR_COUNTERS else 'hw_counters'}/{name}": content
        for name, content in counters.items()
    }
    files |= {
        "class/net/eth0/speed": speed,
        "class/net/eth0/carrier_changes": carrier,
        "class/infiniband/mlx5_0/fw_ver": fw_ver,
    }
    got = read_nic_counters(_tree(root, files), "eth0", "mlx5_0")
    assert set(got.ports) == ({1} if counters else set())
    for name, value in got.ports.get(1, {}).items():
        assert name in counters
        assert 0 <= value <= (COUNTER_LIMITS[name] if name in PORT_ERROR_COUNTERS else COUNTER_LIMITS[name] - 1)
    assert got.speed_mbps is None or 0 < got.speed_mbps < 2**31
    assert got.carrier_changes is None or 0 <= got.carrier_changes < 2**32
    assert got.fw_ver.isascii() and got.fw_ver.isprintable()
