"""Fixtures of the tests that run MPS control daemons of the stand-in control program as real
processes without a node: the unit tests of hostile tenants (tests/unit/claims/gpu/test_mps_tenants)
and the integration tests of the daemons' life (tests/integration/test_mps_daemons). Here, in
tests/ (on sys.path for both), so that both build the driver root and the needed-GPU map the same
way; each keeps its own `daemons` fixture, as their teardowns differ. A test module imports them
(`from mps_fixtures import driver_root_fixture, needed_fixture  # noqa: F401`) and asks for them
by their fixture names, `driver_root` and `needed`."""

from __future__ import annotations

from pathlib import Path

import pytest

from sim.driver_files import render_driver_files


@pytest.fixture(name="driver_root")
def driver_root_fixture(tmp_path: Path) -> Path:
    """A driver root with the stand-in `nvidia-cuda-mps-control` installed as NVIDIA's is."""
    root = tmp_path / "driver"
    render_driver_files(root)
    return root


@pytest.fixture(name="needed")
def needed_fixture() -> dict[str, str | None]:
    """What `MpsDaemons` asks for: the GPUs that need a daemon (name to UUID); a test fills it."""
    return {}
