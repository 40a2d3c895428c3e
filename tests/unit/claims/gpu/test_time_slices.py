"""Time-slicing a GPU: `GpuConfig.timeSliceInterval` set through the driver root's
`nvidia-smi compute-policy` (the simulated one changes the fake NVML's state, as the real one
changes the GPU), noted before it runs, the default back when the last claim goes, even after a
kill -9 in between; and the combinations that cannot work refused per claim."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from flocks import locked_elsewhere
from prepare_fakes import FakeAPI, Host, make_preparer
from test_gpu_sharing import _claim, _preparer, daemons, host  # noqa: F401  (fixtures)

from driver.claims.gpu.mps import MpsDaemons
from driver.claims.gpu.sharing import GpuSharing, time_slice_gpus
from driver.claims.gpu.time_slices import STATE_FILE, TimeSliceError, TimeSlices
from driver.claims.vocabulary import TimeSliceInterval
from driver.discovery.gpu.shared import COMPUTE, MEMORY
from sim import nvml as sim_nvml
from sim.driver_files import BIN_DIR

WHOLE = {MEMORY: "80Gi", COMPUTE: "100"}


@pytest.fixture
def state(tmp_path: Path, host: Host, monkeypatch: pytest.MonkeyPatch) -> Path:  # noqa: F811
    """The fake NVML's state file, named in the environment as on a simulated node."""
    path = tmp_path / "node" / "nvml.json"
    monkeypatch.setenv(sim_nvml.STATE_ENV, str(path))
    return path


def _slices(state: Path) -> list[int]:
    return [g.time_slice for g in sim_nvml.read_state(state).gpus]


def _in_mig_mode(state: Path, index: int) -> None:
    """The GPU switched into MIG mode (as if it were MIG-capable and an administrator did it)."""
    profile = sim_nvml.read_state(state)
    profile.gpus[index].mig_mode = True
    sim_nvml.write_state(profile, state)


def _smi(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    smi = tmp_path / "node" / "driver" / BIN_DIR / "nvidia-smi"
    return subprocess.run([str(smi), *args], capture_output=True, text=True, check=False)


@pytest.fixture
def preparer(tmp_path: Path, host: Host, state: Path) -> Iterator[Any]:  # noqa: F811
    api = FakeAPI()
    records = lambda: (d for c in p._checkpoint.read().values() for d in c.devices)  # noqa: E731
    sharing = GpuSharing(None, TimeSlices(tmp_path / "data", tmp_path / "node" / "driver",
                                          lambda: time_slice_gpus(records(), host.devices.get)))  # fmt: skip
    p = make_preparer(tmp_path / "data", tmp_path / "cdi", api, "i", host, sharing)
    p.api = api
    yield p
    p.close()


# -- the stand-in nvidia-smi, as the real one ---------------------------------------------------------


def test_the_simulated_nvidia_smi_sets_a_time_slice_and_refuses_as_the_real_one(tmp_path: Path, state: Path) -> None:
    uuid = sim_nvml.read_state(state).gpus[1].uuid
    done = _smi(tmp_path, "compute-policy", "-i", uuid, "--set-timeslice", "3")
    assert done.returncode == 0, done.stderr
    assert _slices(state) == [0, 3, 0, 0]
    assert _smi(tmp_path, "compute-policy", "-i", "1", "--set-timeslice=0").returncode == 0
    assert _slices(state) == [0, 0, 0, 0]
    assert _smi(tmp_path, "compute-policy", "-i", uuid, "--set-timeslice", "4").returncode == 2  # invalid argument
    assert _smi(tmp_path, "compute-policy", "-i", "GPU-nope", "--set-timeslice", "1").returncode == 6  # not found
    assert _smi(tmp_path, "compute-policy", "-i", "MIG-0f0e", "--set-timeslice", "1").returncode == 3  # not supported
    _in_mig_mode(state, 2)
    mig_mode = _smi(tmp_path, "compute-policy", "-i", "2", "--set-timeslice", "1")
    assert mig_mode.returncode == 3 and "MIG mode" in mig_mode.stderr
    assert _slices(state) == [0, 0, 0, 0]
    assert _smi(tmp_path).returncode == 0  # without compute-policy: the container's nvidia-smi, unchanged


# -- prepare and unprepare ------------------------------------------------------------------------


def test_a_time_sliced_claim_sets_its_interval_and_the_last_one_gone_restores_the_default(
    tmp_path: Path, preparer: Any, state: Path
) -> None:
    a = _claim(preparer.api, "a", "gpu-0", WHOLE, "TimeSlicing", timeSliceInterval="Long")
    assert preparer.prepare([a])[a.uid].error == ""
    assert _slices(state)[0] == 3
    (record,) = preparer._checkpoint.read()[a.uid].devices
    assert record.time_slice == "Long"  # recorded with the claim
    note = json.loads((tmp_path / "data" / STATE_FILE).read_text())["gpus"]
    assert note == {"gpu-0": {"uuid": sim_nvml.read_state(state).gpus[0].uuid, "interval": "Long"}}
    b = _claim(preparer.api, "b", "gpu-0", WHOLE, "TimeSlicing", timeSliceInterval="Long")
    assert preparer.prepare([b])[b.uid].error == ""  # the same interval: no conflict
    assert preparer.unprepare([a])[a.uid].error == ""
    assert _slices(state)[0] == 3  # b still holds it
    assert preparer.unprepare([b])[b.uid].error == ""
    assert _slices(state)[0] == 0
    assert json.loads((tmp_path / "data" / STATE_FILE).read_text())["gpus"] == {}


def test_time_slicing_without_an_interval_is_the_default(preparer: Any, state: Path) -> None:
    ref = _claim(preparer.api, "a", "gpu-1", WHOLE, "TimeSlicing")
    assert preparer.prepare([ref])[ref.uid].error == ""
    assert preparer._checkpoint.read()[ref.uid].devices[0].time_slice == "Default"


def test_a_claim_asking_another_interval_of_a_time_sliced_gpu_waits_for_it(preparer: Any, state: Path) -> None:
    a = _claim(preparer.api, "a", "gpu-0", WHOLE, "TimeSlicing", timeSliceInterval="Short")
    b = _claim(preparer.api, "b", "gpu-0", WHOLE, "TimeSlicing", timeSliceInterval="Long")
    assert preparer.prepare([a])[a.uid].error == ""
    error = preparer.prepare([b])[b.uid].error
    assert "asks for the time-slice interval Long, but claim default/a prepared on it set Short" in error
    assert b.uid not in preparer._checkpoint.read() and _slices(state)[0] == 1
    assert preparer.unprepare([a])[a.uid].error == ""
    assert preparer.prepare([b])[b.uid].error == ""  # the kubelet's retry, once a is gone
    assert _slices(state)[0] == 3


@pytest.mark.parametrize(
    ("sharing", "error"),
    [
        ("MPS", "timeSliceInterval Long needs sharing TimeSlicing, not MPS: MPS runs the processes"),
        ("", "timeSliceInterval Long needs sharing TimeSlicing, not none"),
    ],
)
def test_an_interval_without_time_slicing_is_refused(
    tmp_path: Path,
    host: Host,  # noqa: F811
    daemons: MpsDaemons,  # noqa: F811
    state: Path,
    sharing: str,
    error: str,
) -> None:
    api = FakeAPI()
    p = _preparer(tmp_path, host, api, daemons)
    ref = _claim(api, "c", "gpu-0", WHOLE, sharing, timeSliceInterval="Long")
    assert error in p.prepare([ref])[ref.uid].error
    assert _slices(state) == [0, 0, 0, 0]
    p.close()


def test_a_failing_nvidia_smi_fails_the_claim_with_its_reason(tmp_path: Path, preparer: Any, state: Path) -> None:
    _in_mig_mode(state, 3)  # behind Tandem's back
    ref = _claim(preparer.api, "a", "gpu-3", WHOLE, "TimeSlicing", timeSliceInterval="Medium")
    error = preparer.prepare([ref])[ref.uid].error
    assert "time slice: gpu-3: nvidia-smi compute-policy --set-timeslice 2 exited with 3" in error
    assert "not supported on a GPU in MIG mode" in error


# -- crash safety ---------------------------------------------------------------------------------


def test_a_noted_interval_no_record_needs_is_restored_at_start_up(tmp_path: Path, state: Path) -> None:
    """A kill -9 after the last claim's record went and before nvidia-smi restored the default:
    the note survives, and the start-up sync restores the GPU."""
    uuid = sim_nvml.read_state(state).gpus[2].uuid
    needed: dict[str, tuple[str | None, TimeSliceInterval]] = {"gpu-2": (uuid, TimeSliceInterval.LONG)}
    slices = TimeSlices(tmp_path / "data", tmp_path / "node" / "driver", lambda: needed)
    slices.sync()
    assert _slices(state)[2] == 3
    needed.clear()  # the record is gone; the process died before it synced
    TimeSlices(tmp_path / "data", tmp_path / "node" / "driver", lambda: needed).sync(everything=True)
    assert _slices(state)[2] == 0 and slices.applied() == {}


def test_an_interval_is_noted_before_nvidia_smi_runs(tmp_path: Path, state: Path) -> None:
    """nvidia-smi missing (or killed): the note already names the GPU, so nothing is forgotten."""
    uuid = sim_nvml.read_state(state).gpus[0].uuid
    slices = TimeSlices(tmp_path / "data", tmp_path / "nowhere", lambda: {"gpu-0": (uuid, TimeSliceInterval.SHORT)})
    with pytest.raises(TimeSliceError, match="nvidia-smi is not in usr/bin"):
        slices.sync()
    assert slices.applied() == {"gpu-0": (uuid, "Short")}


def test_an_interval_is_kept_while_its_gpu_is_unknown_or_the_records_may_be_incomplete(
    tmp_path: Path, state: Path
) -> None:
    """NVML unanswered (the GPU's UUID unknown now) or a lost checkpoint (a running pod's record
    not rebuilt yet): the pod's interval stays; the default comes back once the records say so."""
    uuid = sim_nvml.read_state(state).gpus[1].uuid
    needed: dict[str, tuple[str | None, TimeSliceInterval]] = {"gpu-1": (uuid, TimeSliceInterval.MEDIUM)}
    complete = True
    slices = TimeSlices(tmp_path / "data", tmp_path / "node" / "driver", lambda: needed, complete=lambda: complete)
    slices.sync()
    assert _slices(state)[1] == 2
    needed["gpu-1"] = (None, TimeSliceInterval.MEDIUM)
    slices.sync(everything=True)
    assert _slices(state)[1] == 2 and slices.applied() == {"gpu-1": (uuid, "Medium")}
    needed.clear()
    complete = False
    slices.sync()
    assert _slices(state)[1] == 2 and slices.applied() == {"gpu-1": (uuid, "Medium")}
    complete = True
    slices.sync()
    assert _slices(state)[1] == 0 and slices.applied() == {}


def test_a_sync_holds_the_node_wide_lock_the_other_instance_of_a_rolling_update_takes(tmp_path: Path) -> None:
    held: list[bool] = []

    def needed() -> dict[str, tuple[str | None, TimeSliceInterval]]:
        held.append(locked_elsewhere(tmp_path / "data" / "time-slices.lock"))
        return {}

    TimeSlices(tmp_path / "data", tmp_path / "nowhere", needed).sync()
    assert held == [True]
