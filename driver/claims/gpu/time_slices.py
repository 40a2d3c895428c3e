"""The time slice of GPUs that claims share by time-slicing, set and restored crash-safely.

CUDA runs the processes of several pods on one GPU by time-slicing it; how long each gets before
the GPU switches is a setting of the whole GPU. NVML has no public call for it on a bare-metal GPU
(`nvmlDeviceSetVgpuSchedulerState` is for vGPU hosts), so Tandem does what NVIDIA's own DRA driver
does: `nvidia-smi compute-policy -i <GPU UUID> --set-timeslice <0..3>` from the NVIDIA driver
root, 0..3 being the intervals `Default`, `Short`, `Medium` and `Long`
(`driver.claims.opaque_config.TIME_SLICE_INTERVALS`). It refuses a GPU in MIG mode (nvidia-smi's "not
supported", exit code 3); Tandem refuses time-slicing on a MIG device before it gets there.

Which GPUs need which interval is what the checkpoint's records say (`needed`: device name ->
(UUID, interval), from `driver.claims.gpu.sharing.time_slice_gpus`). What Tandem has set is kept in
`<data dir>/time-slices.json`, written before `nvidia-smi` runs, so a kill -9 at any step leaves a
note of every GPU whose interval may differ from the driver's default; `sync` is the whole state
machine, run at start-up (everything applied again), after a time-sliced claim is recorded, and
after one is unprepared:

* a needed GPU gets its interval (noted first);
* a noted GPU no record needs any more gets `Default` back, then its note goes; but only while
  the records are `complete` (after the checkpoint was lost, a running pod's claim may have no
  record until start-up has rebuilt it);
* a needed GPU the inventory lacks now (its UUID unknown: NVML unanswered) is left as it is.

An interval an administrator set by hand on a GPU Tandem never time-sliced is left alone. The
compute mode is left as it is: time-slicing needs `DEFAULT`, which is the driver's default, and
Tandem's MPS works without `EXCLUSIVE_PROCESS` (`driver.claims.gpu.mps`), so nothing here changes it.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import threading
from collections.abc import Callable, Mapping
from pathlib import Path, PurePosixPath

from cdi import atomic_write
from driver.claims.opaque_config import TIME_SLICE_INTERVALS
from driver.fsutil import locked, read_json_state
from driver.node.driver_root import BINARY_DIRS, LIBRARY_DIRS, OutsideRoot, driver_program, resolve_in_root

log = logging.getLogger(__name__)

NVIDIA_SMI = "nvidia-smi"
STATE_FILE = "time-slices.json"
DEFAULT = TIME_SLICE_INTERVALS[0]
_TIMEOUT = 30.0


class TimeSliceError(Exception):
    """nvidia-smi could not set a GPU's time slice; the message says which GPU and why."""


class TimeSlices:
    """`data_dir`: where the note of what was set lives. `needed`: device name -> (UUID, None when
    unknown now; interval). `complete`: whether the records name every prepared claim."""

    def __init__(
        self,
        data_dir: Path,
        driver_root: Path,
        needed: Callable[[], Mapping[str, tuple[str | None, str]]],
        complete: Callable[[], bool] = lambda: True,
    ) -> None:
        self.path = data_dir / STATE_FILE
        self._driver_root = driver_root
        self._needed = needed
        self._complete = complete
        # One sync at a time, in this process and on the node (the two instances of a rolling
        # update): the note and the GPUs agree, and no note is lost to a concurrent rewrite.
        self._lock = threading.Lock()
        self._lock_path = data_dir / "time-slices.lock"

    def applied(self) -> dict[str, tuple[str, str]]:
        """The note: device name -> (UUID, interval) Tandem set, or is about to set."""
        raw = read_json_state(self.path, "time slices", "gpus", dict)
        return {
            str(k): (str(v.get("uuid", "")), str(v.get("interval", DEFAULT)))
            for k, v in raw.items()
            if isinstance(v, dict)
        }

    def sync(self, everything: bool = False) -> None:
        """The intervals the records need, and `Default` where none does any more (module
        docstring). `everything`: apply every needed interval again (start-up: a kill -9 between
        the note and nvidia-smi, or a GPU reset, may have left the GPU otherwise). Raises
        TimeSliceError naming every GPU that failed; the others are done regardless."""
        self._lock_path.parent.mkdir(parents=True, exist_ok=True)
        with locked(self._lock, self._lock_path):
            needed = dict(self._needed())
            complete = self._complete()  # read after `needed`, which reads the records
            noted = self.applied()
            failed = []
            for device, (uuid, interval) in sorted(needed.items()):
                if uuid is None or (not everything and noted.get(device) == (uuid, interval)):
                    continue
                noted[device] = (uuid, interval)
                self._write(noted)  # before nvidia-smi: a crash leaves a note of what may be set
                try:
                    self._set(device, uuid, interval)
                except TimeSliceError as e:
                    failed.append(str(e))
            for device in sorted(set(noted) - set(needed) if complete else ()):
                uuid, _ = noted[device]
                try:
                    self._set(device, uuid, DEFAULT)
                except TimeSliceError as e:
                    failed.append(str(e))
                    continue
                del noted[device]
                self._write(noted)
            if failed:
                raise TimeSliceError("; ".join(failed))

    def _write(self, noted: Mapping[str, tuple[str, str]]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        doc = {"gpus": {d: {"uuid": u, "interval": i} for d, (u, i) in sorted(noted.items())}}
        # Not fsynced: a reboot, the only thing that loses it, resets every GPU's time slice too.
        atomic_write(self.path, json.dumps(doc, indent=1).encode(), 0o600, durable=False)

    def _program(self) -> Path:
        program = driver_program(self._driver_root, NVIDIA_SMI)
        if program is None:
            raise TimeSliceError(
                f"{NVIDIA_SMI} is not in {', '.join(BINARY_DIRS)} of the NVIDIA driver root {self._driver_root}"
            )
        return program

    def _env(self) -> dict[str, str]:
        """nvidia-smi with the driver root's libnvidia-ml.so.1 preloaded, as NVIDIA's driver runs
        it from a mounted driver root (`driver.node.nvml.preload_nvml` says why not a path)."""
        env = dict(os.environ)
        if self._driver_root == Path("/"):
            return env
        for d in LIBRARY_DIRS:
            name = PurePosixPath(d, "libnvidia-ml.so.1")
            if os.path.lexists(self._driver_root / name):
                try:
                    lib = resolve_in_root(self._driver_root, name)
                except OutsideRoot:
                    continue
                env["LD_PRELOAD"] = ":".join(p for p in (str(lib), env.get("LD_PRELOAD", "")) if p)
                break
        return env

    def _set(self, device: str, uuid: str, interval: str) -> None:
        if interval not in TIME_SLICE_INTERVALS:  # a record of a newer version, after a downgrade
            raise TimeSliceError(
                f"{device}: time-slice interval {interval!r} is unknown to this version; left as it is"
            )
        value = TIME_SLICE_INTERVALS.index(interval)
        cmd = [str(self._program()), "compute-policy", "-i", uuid, "--set-timeslice", str(value)]
        log.info("setting the time slice of %s (%s) to %s", device, uuid, interval, extra={"device": device})
        try:
            done = subprocess.run(cmd, env=self._env(), stdin=subprocess.DEVNULL, capture_output=True,
                                  timeout=_TIMEOUT, check=False)  # fmt: skip
        except (OSError, subprocess.TimeoutExpired) as e:
            raise TimeSliceError(f"{device}: {NVIDIA_SMI} compute-policy failed: {e}") from e
        if done.returncode != 0:
            why = (done.stdout + done.stderr).decode(errors="replace").strip()[:300]
            raise TimeSliceError(
                f"{device}: {NVIDIA_SMI} compute-policy --set-timeslice {value} exited with {done.returncode}: {why}"
            )
