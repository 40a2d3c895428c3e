"""The simulated nvidia-smi's injected fault: a GPU listed by `set_compute_policy_fault` refuses a
new time slice as a GPU that fell off the bus does, the others still take theirs, and clearing
the fault makes it work again (tests/cluster/test_hostile_tenant.py relies on all three)."""

from __future__ import annotations

from pathlib import Path

import pytest

from sim import nvml as sim_nvml
from sim.nvidia_smi import GPU_LOST, compute_policy
from sim.profile import h100_node


def test_a_faulted_gpu_refuses_its_time_slice_until_the_fault_is_cleared(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = tmp_path / "nvml.json"
    sim_nvml.write_state(h100_node("n", gpus=2, nics=0), state)
    monkeypatch.setenv(sim_nvml.STATE_ENV, str(state))
    broken, fine = (g.uuid for g in sim_nvml.read_state(state).gpus)
    sim_nvml.set_compute_policy_fault(state, broken, True)

    assert compute_policy(["-i", broken, "--set-timeslice", "3"]) == GPU_LOST
    assert compute_policy(["-i", fine, "--set-timeslice", "3"]) == 0
    assert [g.time_slice for g in sim_nvml.read_state(state).gpus] == [0, 3]

    sim_nvml.set_compute_policy_fault(state, broken, False)
    assert compute_policy(["-i", broken, "--set-timeslice", "3"]) == 0
    assert [g.time_slice for g in sim_nvml.read_state(state).gpus] == [3, 3]
