"""The PCIe link and AER readers against sysfs captured on real hosts (procfs's and node_exporter's
test fixtures, see tests/fixtures/sysfs-captures/NOTICE), then against hand-made trees for what
no capture shows: the other speed spelling, garbage, files that are no plain small file, links
that lead out of sysfs."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from driver.health.pcie_sysfs import AerCounts, PcieLink, parse_aer, parse_link_speed, read_aer, read_pcie_link

NVME = "0000:01:00.0"
FUNCTION = "0000:01:00.0"  # of the hand-made trees, below root port 0000:00:01.0


def _list_in_bus(sysfs: Path, bdf: str, device_dir: str) -> None:
    """The `bus/pci/devices` link the kernel makes for every function; procfs's capture has it
    only for three of the functions it holds."""
    (sysfs / "bus/pci/devices" / bdf).symlink_to(f"../../../devices/{device_dir}")


# The real captures, with the numbers they hold.


def test_a_bridge_trained_narrower_than_it_can_sits_on_the_root_bus(procfs_sys: Path) -> None:
    link = read_pcie_link(procfs_sys, "0000:00:02.1")
    assert link == PcieLink(8.0, 4, 8.0, 8, None, None, None)
    assert (link.capable_speed(), link.capable_width()) == (8.0, 8)


def test_the_nvme_below_it_reads_its_port_as_the_other_end_of_its_link(procfs_sys: Path) -> None:
    link = read_pcie_link(procfs_sys, NVME)
    assert link == PcieLink(8.0, 4, 8.0, 4, "0000:00:02.1", 8.0, 8)
    assert (link.capable_speed(), link.capable_width()) == (8.0, 4)


def test_a_root_port_at_half_its_width_and_the_device_below_it(procfs_sys: Path) -> None:
    assert read_pcie_link(procfs_sys, "0000:00:03.0") is None  # the capture does not list it in bus/pci
    _list_in_bus(procfs_sys, "0000:00:03.0", "pci0000:00/0000:00:03.0")
    _list_in_bus(procfs_sys, "0000:03:00.0", "pci0000:00/0000:00:03.0/0000:03:00.0")
    root = read_pcie_link(procfs_sys, "0000:00:03.0")
    assert root == PcieLink(8.0, 8, 8.0, 16, None, None, None)
    assert root.capable_width() == 16
    sas = read_pcie_link(procfs_sys, "0000:03:00.0")
    assert sas == PcieLink(8.0, 8, 8.0, 8, "0000:00:03.0", 8.0, 16)
    assert (sas.capable_speed(), sas.capable_width()) == (8.0, 8)


def test_a_gen4_nic_directly_on_its_own_root_bus(procfs_sys: Path) -> None:
    assert read_pcie_link(procfs_sys, "0000:a2:00.0") == PcieLink(16.0, 8, 16.0, 8, None, None, None)


def test_a_function_without_link_files_reads_as_all_unknown(procfs_sys: Path) -> None:
    _list_in_bus(procfs_sys, "0000:00:1f.6", "pci0000:00/0000:00:1f.6")
    link = read_pcie_link(procfs_sys, "0000:00:1f.6")
    assert link == PcieLink(None, None, None, None, None, None, None)
    assert (link.capable_speed(), link.capable_width()) == (None, None)


def test_a_function_sysfs_does_not_list_reads_as_none(procfs_sys: Path) -> None:
    assert read_pcie_link(procfs_sys, "0000:99:00.0") is None
    assert read_aer(procfs_sys, "0000:99:00.0") == AerCounts(None, None, None)


def test_a_device_slower_than_it_can_be_is_held_back_by_its_port(node_exporter_sys: Path) -> None:
    """16 GT/s NVMe at 8 GT/s: its port tops out at 8, so the link is as fast as it can be."""
    link = read_pcie_link(node_exporter_sys, NVME)
    assert link == PcieLink(8.0, 4, 16.0, 4, "0000:00:02.1", 8.0, 8)
    assert (link.capable_speed(), link.capable_width()) == (8.0, 4)


def test_a_port_without_link_files_leaves_the_functions_maxima(node_exporter_sys: Path) -> None:
    link = read_pcie_link(node_exporter_sys, "0000:45:00.0")
    assert link == PcieLink(5.0, 4, 5.0, 4, "0000:40:01.3", None, None)
    assert (link.capable_speed(), link.capable_width()) == (5.0, 4)


def test_aer_totals_of_a_device_with_errors(procfs_sys: Path) -> None:
    """The capture's non-fatal file ends in `TOTAL_ERR_FATAL 48` (edited by hand there; the kernel
    writes TOTAL_ERR_NONFATAL): a total is looked up by its name, so there is none."""
    _list_in_bus(procfs_sys, "0000:00:1f.6", "pci0000:00/0000:00:1f.6")
    assert read_aer(procfs_sys, "0000:00:1f.6") == AerCounts(correctable=9, nonfatal=None, fatal=28)


def test_aer_files_parse_to_every_named_count(procfs_sys: Path) -> None:
    device = procfs_sys / "devices/pci0000:00/0000:00:1f.6"
    assert parse_aer((device / "aer_dev_correctable").read_text()) == {
        "RxErr": 1,
        "BadTLP": 2,
        "BadDLLP": 3,
        "Rollover": 4,
        "Timeout": 5,
        "NonFatalErr": 6,
        "CorrIntErr": 7,
        "HeaderOF": 8,
        "TOTAL_ERR_COR": 9,
    }
    fatal = parse_aer((device / "aer_dev_fatal").read_text())
    assert len(fatal) == 19 and (fatal["Undefined"], fatal["PoisonTLPBlocked"], fatal["TOTAL_ERR_FATAL"]) == (
        10,
        27,
        28,
    )


def test_aer_of_healthy_devices_and_of_one_without_the_files(procfs_sys: Path, node_exporter_sys: Path) -> None:
    _list_in_bus(procfs_sys, "0000:00:03.0", "pci0000:00/0000:00:03.0")
    zeros = AerCounts(0, 0, 0)
    assert read_aer(procfs_sys, NVME) == zeros
    assert read_aer(procfs_sys, "0000:00:03.0") == zeros
    assert read_aer(procfs_sys, "0000:a2:00.0") == zeros
    assert read_aer(node_exporter_sys, "0000:45:00.0") == zeros
    assert read_aer(procfs_sys, "0000:00:02.1") == AerCounts(None, None, None)


# Parsers, by hand.


@pytest.mark.parametrize(
    ("text", "gts"),
    [
        ("8.0 GT/s PCIe", 8.0),
        ("8 GT/s", 8.0),
        ("2.5 GT/s PCIe\n", 2.5),
        ("2.5 GT/s", 2.5),
        ("5 GT/s", 5.0),
        ("32.0 GT/s PCIe", 32.0),
        ("64.0 GT/s PCIe", 64.0),
        ("Unknown", None),
        ("Unknown speed", None),
        ("", None),
        ("8.0 GT/s PCIe x16", None),
        ("8.0 Gb/s", None),
        ("-8 GT/s", None),
        ("0 GT/s", None),
        ("0.0 GT/s PCIe", None),
        ("9999 GT/s", None),
        ("1e3 GT/s", None),
        ("99999999999999999999 GT/s", None),
        ("\u00b2 GT/s", None),  # superscript two
        ("\u0668 GT/s", None),  # Arabic-Indic eight, which float() takes
        ("8.0 GT/s PCIe" * 300, None),
    ],
)
def test_link_speed_in_both_kernel_spellings(text: str, gts: float | None) -> None:
    assert parse_link_speed(text) == gts


def test_aer_lines_split_on_their_last_space() -> None:
    text = "Receiver Error 2\nRELAY_NUM Rollover 0\ndev_cor_errs_bit[5] 3\n  RxErr 4  \nTOTAL_ERR_COR 7\n"
    assert parse_aer(text) == {
        "Receiver Error": 2,
        "RELAY_NUM Rollover": 0,
        "dev_cor_errs_bit[5]": 3,
        "RxErr": 4,
        "TOTAL_ERR_COR": 7,
    }


def test_aer_lines_without_a_count_are_skipped() -> None:
    lines = [
        "Negative -1",
        "Super \u00b2",
        "Arabic \u0663",
        "Hex 0x10",
        "Trailing 1x",
        "TooBig 18446744073709551616",
        "Long " + "1" * 5000,
        "NoCount",
        " 5",
        "",
        "Largest 18446744073709551615",
    ]
    assert parse_aer("\n".join(lines)) == {"Largest": 2**64 - 1}


# Readers, on hand-made trees.


@pytest.fixture
def sysfs(tmp_path: Path) -> Path:
    """A function below a root port, both with the link files of a healthy Gen4 x16 link."""
    root = tmp_path / "sys"
    port = root / "devices/pci0000:00/0000:00:01.0"
    for directory in (port, port / FUNCTION):
        directory.mkdir(parents=True)
        for name, value in (("current_link_speed", "16.0 GT/s PCIe"), ("max_link_speed", "16.0 GT/s PCIe")):
            (directory / name).write_text(f"{value}\n")
        for name in ("current_link_width", "max_link_width"):
            (directory / name).write_text("16\n")
    (root / "bus/pci/devices").mkdir(parents=True)
    _list_in_bus(root, FUNCTION, f"pci0000:00/0000:00:01.0/{FUNCTION}")
    return root


def _function(sysfs: Path) -> Path:
    return sysfs / "devices/pci0000:00/0000:00:01.0" / FUNCTION


def test_the_old_spelling_on_both_ends(sysfs: Path) -> None:
    for directory in (_function(sysfs), _function(sysfs).parent):
        (directory / "max_link_speed").write_text("8 GT/s\n")
    (_function(sysfs) / "current_link_speed").write_text("Unknown speed\n")
    assert read_pcie_link(sysfs, FUNCTION) == PcieLink(None, 16, 8.0, 16, "0000:00:01.0", 8.0, 16)


@pytest.mark.parametrize(
    ("content", "width"),
    [
        (b"16\n", 16),
        (b"0\n", 0),
        (b"32\n", 32),
        (b"63\n", None),
        (b"-1\n", None),
        (b"x16\n", None),
        (b"\xd9\xa8\n", None),
    ],
)
def test_current_width_in_range_or_unknown(sysfs: Path, content: bytes, width: int | None) -> None:
    """0 (the link is down) is a width; 63 (all ones) and beyond 32 lanes are not."""
    (_function(sysfs) / "current_link_width").write_bytes(content)
    link = read_pcie_link(sysfs, FUNCTION)
    assert link is not None and link.width == width


def test_a_maximum_of_zero_lanes_is_unknown(sysfs: Path) -> None:
    (_function(sysfs) / "max_link_width").write_text("0\n")
    link = read_pcie_link(sysfs, FUNCTION)
    assert link is not None and (link.max_width, link.capable_width()) == (None, 16)


def test_files_that_are_no_small_regular_file_read_as_unknown(sysfs: Path, tmp_path: Path) -> None:
    function = _function(sysfs)
    (function / "current_link_speed").unlink()
    (function / "current_link_speed").mkdir()
    (function / "max_link_speed").write_text("16.0 GT/s PCIe" + " " * 100_000)
    (tmp_path / "elsewhere").write_text("4\n")
    (function / "current_link_width").unlink()
    (function / "current_link_width").symlink_to(tmp_path / "elsewhere")
    (function / "max_link_width").write_bytes(b"\xff\xfe1\n")
    assert read_pcie_link(sysfs, FUNCTION) == PcieLink(None, None, None, None, "0000:00:01.0", 16.0, 16)


def test_an_aer_file_larger_than_a_page_or_not_ascii_is_unread(sysfs: Path) -> None:
    function = _function(sysfs)
    (function / "aer_dev_correctable").write_text("RxErr 0\n" * 600 + "TOTAL_ERR_COR 1\n")
    (function / "aer_dev_nonfatal").write_bytes(b"TLP \xd9\xa3\nTOTAL_ERR_NONFATAL 2\n")
    (function / "aer_dev_fatal").write_text("Undefined 0\nTOTAL_ERR_FATAL 3\n")
    assert read_aer(sysfs, FUNCTION) == AerCounts(None, None, 3)


def test_a_bus_link_that_leads_out_of_devices_is_not_followed(sysfs: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "current_link_speed").write_text("8.0 GT/s PCIe\n")
    link = sysfs / "bus/pci/devices" / FUNCTION
    for target in (str(outside), f"../../../../outside/{FUNCTION}"):
        link.unlink()
        link.symlink_to(target)
        assert read_pcie_link(sysfs, FUNCTION) is None
        assert read_aer(sysfs, FUNCTION) == AerCounts(None, None, None)


def test_a_function_not_listed_is_no_warning_but_a_broken_link_is(
    sysfs: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A function gone from the bus is read at every poll until its device goes: no news."""
    with caplog.at_level(logging.WARNING):
        assert read_pcie_link(sysfs, "0000:99:00.0") is None
    assert caplog.records == []
    (sysfs / "bus/pci/devices" / FUNCTION).unlink()
    (sysfs / "bus/pci/devices" / FUNCTION).symlink_to("/elsewhere")
    with caplog.at_level(logging.WARNING):
        assert read_pcie_link(sysfs, FUNCTION) is None
    assert "absolute" in caplog.text


def test_a_device_directory_that_links_out_of_sysfs_is_not_read(sysfs: Path, tmp_path: Path) -> None:
    """The bus link spells a path below devices/, but a link on that path leads elsewhere."""
    outside = tmp_path / "outside"
    os.rename(sysfs / "devices/pci0000:00", outside)
    (sysfs / "devices/pci0000:00").symlink_to(outside)
    (outside / "0000:00:01.0" / FUNCTION / "aer_dev_fatal").write_text("TOTAL_ERR_FATAL 1\n")
    assert (_function(sysfs) / "current_link_speed").exists()  # the path itself does reach the files
    assert read_pcie_link(sysfs, FUNCTION) is None
    assert read_aer(sysfs, FUNCTION) == AerCounts(None, None, None)


def test_capable_values_come_from_whichever_end_is_known() -> None:
    port_only = PcieLink(2.5, 16, None, None, "0000:00:01.0", 16.0, 8)
    assert (port_only.capable_speed(), port_only.capable_width()) == (16.0, 8)
    function_lower = PcieLink(2.5, 16, 8.0, 4, "0000:00:01.0", 16.0, 16)
    assert (function_lower.capable_speed(), function_lower.capable_width()) == (8.0, 4)
