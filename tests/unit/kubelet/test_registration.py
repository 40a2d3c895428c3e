"""Socket naming: must match the Go kubeletplugin library byte for byte, or rolling updates collide."""

from __future__ import annotations

import base64
import hashlib
import shutil
import tempfile
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from driver.kubelet.registration import (
    UNIX_PATH_MAX,
    check_socket_path,
    dra_socket_path,
    grpc_unix_address,
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
    with pytest.raises(ValueError, match="107-byte limit"):
        check_socket_path(Path("/" + "x" * 120))


def _registry_dir(root: Path, candidate_1_bytes: int, driver: str) -> Path:
    """A registry directory under `root` that makes candidate 1 exactly `candidate_1_bytes` long."""
    tail = len(f"/{driver}-{UID}-reg.sock")
    pad = candidate_1_bytes - tail - len(str(root)) - 1
    assert pad > 0, "the temporary directory is too long for this test"
    return root / ("r" * pad)


def _binds(address: str) -> bool:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    try:
        return server.add_insecure_port(address) != 0
    except RuntimeError:  # grpcio raises where the C core refuses the address
        return False
    finally:
        server.stop(None)


def test_grpc_binds_107_bytes_written_unix_colon_path_and_no_more():
    """The premise of the 107-byte rule (docs/reference/kubelet-plugin.md, 'Rolling-update names'),
    and why the daemon binds `unix:<path>`: written `unix://<path>`, 106 bytes already fail."""
    root = Path(tempfile.mkdtemp(prefix="td-", dir="/tmp"))
    try:
        paths = {size: root / ("s" * (size - len(str(root)) - 1)) for size in (105, 106, 107, 108)}
        assert all(len(str(p).encode()) == size for size, p in paths.items())
        assert [_binds(grpc_unix_address(paths[n])) for n in (107, 108)] == [True, False]
        assert [_binds(f"unix://{paths[n]}") for n in (105, 106)] == [True, False]
    finally:
        shutil.rmtree(root)


def test_a_108_byte_candidate_is_skipped_and_the_next_one_binds():
    """Go takes candidate 1 at exactly 108 bytes; gRPC core cannot bind it, so Tandem takes the
    next candidate that fits 107 (still unique per pod); shorter paths match Go byte for byte."""
    root = Path(tempfile.mkdtemp(prefix="td-", dir="/tmp"))
    try:
        driver = "tandem.dev"
        h8 = base64.urlsafe_b64encode(hashlib.sha256(UID.encode()).digest()[:8]).decode().rstrip("=")
        at_108 = _registry_dir(root, 108, driver)
        chosen = registration_socket_path(at_108, driver, UID)
        assert chosen == at_108 / f"{driver}-{h8}-reg.sock"
        at_107 = _registry_dir(root, 107, driver)
        assert registration_socket_path(at_107, driver, UID) == at_107 / f"{driver}-{UID}-reg.sock"

        at_108.mkdir()
        assert _binds(grpc_unix_address(chosen))
    finally:
        shutil.rmtree(root)


def test_a_108_byte_socket_path_is_refused_before_grpc_sees_it():
    check_socket_path(Path("/" + "x" * 106))  # 107 bytes
    with pytest.raises(ValueError, match="107-byte limit"):
        check_socket_path(Path("/" + "x" * 107))
