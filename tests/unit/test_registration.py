"""Socket naming: must match the Go kubeletplugin library byte for byte, or rolling updates collide."""

from __future__ import annotations

import base64
import hashlib
from pathlib import Path

import pytest

from driver.kubelet.registration import (
    UNIX_PATH_MAX,
    check_socket_path,
    dra_socket_path,
    registration_socket_path,
)

UID = "4f7c2a36-8a8e-4a53-9a3e-0c5b7b0e6a11"
REG = Path("/var/lib/kubelet/plugins_registry")


def test_plain_names_without_pod_uid():
    assert registration_socket_path(REG, "tandem.dev") == REG / "tandem.dev-reg.sock"
    assert dra_socket_path(Path("/var/lib/kubelet/plugins/tandem.dev")) == Path(
        "/var/lib/kubelet/plugins/tandem.dev/dra.sock"
    )


def test_rolling_update_first_candidate_embeds_the_pod_uid():
    path = registration_socket_path(REG, "tandem.dev", UID)
    assert path == REG / f"tandem.dev-{UID}-reg.sock"
    assert dra_socket_path(Path("/d"), UID) == Path(f"/d/dra-{UID}.sock")


def test_rolling_update_second_candidate_hashes_the_pod_uid():
    driver = "gpu-and-nic.driver.example.com"  # 30 characters: candidate 1 is over 108 bytes
    h8 = base64.urlsafe_b64encode(hashlib.sha256(UID.encode()).digest()[:8]).decode().rstrip("=")
    assert len(h8) == 11
    path = registration_socket_path(REG, driver, UID)
    assert path == REG / f"{driver}-{h8}-reg.sock"
    assert len(str(path).encode()) <= UNIX_PATH_MAX


def test_rolling_update_last_candidate_hashes_driver_and_uid():
    driver = "a-very-long-driver-name-for-testing-the-fallback.example.com"  # 60 characters
    h16 = base64.urlsafe_b64encode(hashlib.sha256(driver.encode() + b"\0" + UID.encode()).digest()[:16])
    path = registration_socket_path(REG, driver, UID)
    assert path == REG / f"dra-{h16.decode().rstrip('=')}-reg.sock"
    assert len(str(path).encode()) == 69


def test_overlong_socket_paths_are_a_clear_error():
    with pytest.raises(ValueError, match="108-byte limit"):
        check_socket_path(Path("/" + "x" * 120))
