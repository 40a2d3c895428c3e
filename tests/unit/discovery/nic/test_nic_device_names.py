"""A NIC's device name and its PCI address are one identity, either way round, and the daemon
knows which NICs are prepared from its records alone."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from driver.claims.checkpoint import Checkpoint, ClaimRecord, DeviceRecord
from driver.daemon import Daemon
from driver.discovery.nic.device import device_name, pci_address_of
from driver.inventory.store import Inventory


@pytest.mark.parametrize("address", ["0000:8a:00.0", "0000:09:00.7", "ffff:ff:1f.1"])
def test_a_device_name_gives_back_its_pci_address(address: str) -> None:
    assert pci_address_of(device_name(address)) == address


@pytest.mark.parametrize(
    "name", ["gpu-0", "gpu-0-mig-1g-10gb-p0", "pci-0000-8a-00", "pci-0000-8a-00-0-x", "pci-0000-8a-00-8"]
)
def test_other_names_have_no_pci_address(name: str) -> None:
    assert pci_address_of(name) is None


def test_prepared_nics_are_known_from_the_records_before_discovery_finds_them(tmp_path: Path) -> None:
    """After a restart the inventory is empty, and a NIC inside a pod is never found on the host:
    it must still be kept published and never be given back while its claim is prepared."""
    checkpoint = Checkpoint(tmp_path, "boot")
    with checkpoint.transaction() as claims:
        devices = (
            DeviceRecord(("nic",), "n1", "pci-0000-09-00-0", exclusive=True),
            DeviceRecord(("gpu",), "n1", "gpu-0"),
        )
        claims["uid-1"] = ClaimRecord("default", "c", "uid-1", devices=devices)
    daemon = SimpleNamespace(checkpoint=checkpoint, inventory=Inventory())
    assert Daemon._allocated_nics(daemon) == {"0000:09:00.0"}
