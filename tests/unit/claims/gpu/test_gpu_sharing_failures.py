"""A shared GPU's failure is that GPU's claims' failure, and a failed step is never remembered as
done (issue 22, finding 3): a GPU whose MPS daemon cannot start, or whose nvidia-smi fails, fails
only the claims on it; a time slice nvidia-smi did not set fails the kubelet's retry too, until
it is set; the note of time slices is versioned, and one written before versions (noted before
nvidia-smi ran, kept when it failed) proves nothing set. Sharing the whole GPU of a dynamic-MIG
GPU (in MIG mode) is refused, naming it."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
from prepare_fakes import FakeAPI, Host
from test_gpu_sharing import _claim, _preparer, daemons, host  # noqa: F401  (fixtures)
from test_time_slices import WHOLE, _in_mig_mode, _slices, preparer, state  # noqa: F401  (fixtures)

from driver.claims.gpu.mps import MpsDaemons
from driver.claims.gpu.time_slices import STATE_FILE, TimeSlices
from driver.claims.unprepare import Unprepared
from driver.claims.vocabulary import TimeSliceInterval
from driver.discovery.gpu.shared import COMPUTE, MEMORY
from driver.model import MigPlacement
from sim import nvml as sim_nvml
from sim.driver_files import BIN_DIR

SHARE = {MEMORY: "20Gi", COMPUTE: "25"}


def _note(tmp_path: Path) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((tmp_path / "data" / STATE_FILE).read_text())
    return doc


def test_a_gpu_whose_mps_daemon_cannot_start_fails_only_its_own_claims(
    tmp_path: Path,
    host: Host,  # noqa: F811
    daemons: MpsDaemons,  # noqa: F811
) -> None:
    api = FakeAPI()
    p = _preparer(tmp_path, host, api, daemons)
    daemons.root.mkdir(parents=True)
    (daemons.root / "gpu-1").write_text("")  # its daemon's directories cannot be made
    bad = _claim(api, "bad", "gpu-1", SHARE, "MPS")
    assert "MPS: gpu-1: preparing the MPS directories failed" in p.prepare([bad])[bad.uid].error
    good = _claim(api, "good", "gpu-0", SHARE, "MPS")  # while bad's record still needs gpu-1's daemon
    assert p.prepare([good])[good.uid].error == ""
    assert daemons.running("gpu-0") is not None
    assert p.unprepare([good, bad]) == {good.uid: Unprepared(), bad.uid: Unprepared()}
    p.close()


def test_a_gpu_whose_nvidia_smi_fails_fails_only_its_own_claims(
    tmp_path: Path,
    preparer: Any,  # noqa: F811
    state: Path,  # noqa: F811
) -> None:
    """Also once its claim is gone and the default cannot be restored there: the note stays, the
    restore is retried by later unprepares, and claims on other GPUs go on."""
    _in_mig_mode(state, 3)  # behind Tandem's back: nvidia-smi refuses it
    bad = _claim(preparer.api, "bad", "gpu-3", WHOLE, "TimeSlicing", timeSliceInterval="Medium")
    assert "gpu-3: nvidia-smi compute-policy --set-timeslice 2 exited with 3" in preparer.prepare([bad])[bad.uid].error
    good = _claim(preparer.api, "good", "gpu-0", WHOLE, "TimeSlicing", timeSliceInterval="Long")
    assert preparer.prepare([good])[good.uid].error == ""
    assert preparer.unprepare([bad])[bad.uid].error == ""  # the default cannot come back on gpu-3: logged
    assert "gpu-3" in _note(tmp_path)["gpus"]
    other = _claim(preparer.api, "other", "gpu-1", WHOLE, "TimeSlicing", timeSliceInterval="Short")
    assert preparer.prepare([other])[other.uid].error == ""
    assert _slices(state)[:2] == [3, 1]


def test_a_time_slice_nvidia_smi_did_not_set_fails_the_retry_too_until_it_is_set(
    tmp_path: Path,
    preparer: Any,  # noqa: F811
    state: Path,  # noqa: F811
) -> None:
    smi = tmp_path / "node" / "driver" / BIN_DIR / "nvidia-smi"
    smi.rename(smi.with_name("away"))  # nvidia-smi cannot run
    ref = _claim(preparer.api, "a", "gpu-2", WHOLE, "TimeSlicing", timeSliceInterval="Long")
    for _ in range(2):  # the prepare, and the kubelet's retry: nothing is taken for done
        assert "time slice: nvidia-smi is not in" in preparer.prepare([ref])[ref.uid].error
    uuid = sim_nvml.read_state(state).gpus[2].uuid
    assert _note(tmp_path)["gpus"] == {"gpu-2": {"uuid": uuid, "interval": "Long", "pending": True}}
    smi.with_name("away").rename(smi)
    assert preparer.prepare([ref])[ref.uid].error == ""
    assert _slices(state)[2] == 3
    assert _note(tmp_path) == {"version": 1, "gpus": {"gpu-2": {"uuid": uuid, "interval": "Long"}}}


def test_a_note_without_a_version_proves_nothing_set(tmp_path: Path, state: Path) -> None:  # noqa: F811
    """A release before versions noted an interval before nvidia-smi ran and kept the note when it
    failed: such a note is set again, and the file rewritten at version 1."""
    uuid = sim_nvml.read_state(state).gpus[0].uuid
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / STATE_FILE).write_text(json.dumps({"gpus": {"gpu-0": {"uuid": uuid, "interval": "Long"}}}))
    slices = TimeSlices(
        tmp_path / "data", tmp_path / "node" / "driver", lambda: {"gpu-0": (uuid, TimeSliceInterval.LONG)}
    )
    slices.sync()
    assert _slices(state)[0] == 3
    assert _note(tmp_path) == {"version": 1, "gpus": {"gpu-0": {"uuid": uuid, "interval": "Long"}}}


def test_a_kill_between_noting_and_setting_is_set_again_or_restored_at_start_up(
    tmp_path: Path,
    state: Path,  # noqa: F811
) -> None:
    """kill -9 after the pending note (before nvidia-smi ran, or after it and before the note said
    done): start-up sets the interval a record still needs and notes it done; where no record needs
    it (the claim's PrepareStarted rolled back), the default comes back and the note goes."""
    uuid = sim_nvml.read_state(state).gpus[1].uuid
    (tmp_path / "data").mkdir()
    pending = {"version": 1, "gpus": {"gpu-1": {"uuid": uuid, "interval": "Short", "pending": True}}}
    (tmp_path / "data" / STATE_FILE).write_text(json.dumps(pending))
    needed: dict[str, tuple[str | None, TimeSliceInterval]] = {"gpu-1": (uuid, TimeSliceInterval.SHORT)}
    TimeSlices(tmp_path / "data", tmp_path / "node" / "driver", lambda: needed).sync(everything=True)
    assert _slices(state)[1] == 1
    assert _note(tmp_path)["gpus"] == {"gpu-1": {"uuid": uuid, "interval": "Short"}}
    (tmp_path / "data" / STATE_FILE).write_text(json.dumps(pending))
    needed.clear()
    TimeSlices(tmp_path / "data", tmp_path / "node" / "driver", lambda: needed).sync(everything=True)
    assert _slices(state)[1] == 0 and _note(tmp_path)["gpus"] == {}


@pytest.mark.parametrize("sharing", ["MPS", "TimeSlicing"])
def test_sharing_the_whole_gpu_of_a_dynamic_mig_gpu_is_refused(
    tmp_path: Path,
    host: Host,  # noqa: F811
    daemons: MpsDaemons,  # noqa: F811
    sharing: str,
) -> None:
    """In MIG mode CUDA reaches the GPU only through a MIG device: preparing its whole-GPU device
    makes the one that spans it, which neither MPS limits nor a time slice apply to."""
    gpu = host.devices["gpu-0"]
    assert gpu.gpu is not None
    spanning = MigPlacement(gpu.gpu.uuid, profile_id=0, start=0, size=8)
    host.devices["gpu-0"] = dataclasses.replace(gpu, gpu=dataclasses.replace(gpu.gpu, placement=spanning))
    api = FakeAPI()
    p = _preparer(tmp_path, host, api, daemons)
    ref = _claim(api, "c", "gpu-0", None, sharing)
    error = p.prepare([ref])[ref.uid].error
    assert (
        f"GPU 'gpu-0' is in MIG mode (dynamic MIG): preparing it makes the MIG device that spans it, and GpuConfig.sharing {sharing}"
        in error
    )
    assert ref.uid not in p._checkpoint.read() and daemons.running("gpu-0") is None
    p.close()
