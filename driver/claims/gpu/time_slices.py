"""The time slice of GPUs that claims share by time-slicing, set and restored crash-safely.

CUDA runs the processes of several pods on one GPU by time-slicing it; how long each gets before
the GPU switches is a setting of the whole GPU. NVML has no public call for it on a bare-metal GPU
(`nvmlDeviceSetVgpuSchedulerState` is for vGPU hosts), so Tandem does what NVIDIA's own DRA driver
does: `nvidia-smi compute-policy -i <GPU UUID> --set-timeslice <0..3>` from the NVIDIA driver
root, 0..3 being the intervals `Default`, `Short`, `Medium` and `Long`
(`driver.claims.vocabulary.TimeSliceInterval`). It refuses a GPU in MIG mode (nvidia-smi's "not
supported", exit code 3); Tandem refuses time-slicing on a MIG device before it gets there.

Which GPUs need which interval is what the checkpoint's records say (`needed`: device name ->
(UUID, interval), from `driver.claims.gpu.sharing.time_slice_gpus`). What Tandem set, or may have
set, is noted in `<data dir>/time-slices.json`, and a step is noted as done only once it is done:

* before `nvidia-smi` runs, the GPU is noted with the interval, `pending`: from then on its
  interval may differ from the driver's default, whatever happens next;
* once `nvidia-smi` has set it, the note loses `pending`: only such a note lets a later `sync`
  skip the GPU;
* when `nvidia-smi` fails, the note stays `pending`: the claim's prepare fails, and the kubelet's
  retry runs `nvidia-smi` again instead of taking the note for done.

So a kill -9 at any step (before `nvidia-smi`, while it runs, or after it and before the note
loses `pending`) leaves a pending note: start-up's `sync(everything=True)` sets the interval again
where a record still needs it (and then notes it done), and gives a GPU no record needs any more
(the claim's PrepareStarted rolled back) the default back before its note goes. The note of a GPU
is never removed before its default is back. `sync` is the whole state machine, run at start-up
(everything applied again), after a time-sliced claim is recorded (that claim's GPUs only:
another GPU's failing `nvidia-smi` neither fails nor delays it), and after one is unprepared:

* a needed GPU gets its interval (noted first, as above);
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
from collections.abc import Callable, Collection, Mapping
from pathlib import Path, PurePosixPath
from typing import Any, NamedTuple

from cdi import atomic_write
from driver.claims.vocabulary import TimeSliceInterval
from driver.errors import DeviceError
from driver.fsutil import Upgrade, locked, read_json_state
from driver.node.driver_root import BINARY_DIRS, LIBRARY_DIRS, OutsideRoot, driver_program, resolve_in_root

log = logging.getLogger(__name__)

NVIDIA_SMI = "nvidia-smi"
STATE_FILE = "time-slices.json"
# Version 1 added `pending`. Version 0 noted an interval before nvidia-smi ran and kept the note
# when nvidia-smi failed: none of its notes says the interval is set.
FORMAT_VERSION = 1
UPGRADES: Mapping[int, Upgrade] = {0: lambda doc: {**doc, "gpus": _all_pending(doc.get("gpus"))}}
_TIMEOUT = 30.0


class _Note(NamedTuple):
    """What the note says of one GPU: the interval Tandem set on it, or is setting (`pending`)."""

    uuid: str
    interval: str
    pending: bool


def _all_pending(gpus: Any) -> Any:
    if not isinstance(gpus, dict):
        return gpus  # refused by the reader, whole
    return {k: {**v, "pending": True} if isinstance(v, dict) else v for k, v in gpus.items()}


class TimeSliceError(DeviceError):
    """nvidia-smi could not set a GPU's time slice; the message says which GPU and why."""


class TimeSlices:
    """`data_dir`: where the note of what was set lives. `needed`: device name -> (UUID, None when
    unknown now; interval). `complete`: whether the records name every prepared claim."""

    def __init__(
        self,
        data_dir: Path,
        driver_root: Path,
        needed: Callable[[], Mapping[str, tuple[str | None, TimeSliceInterval]]],
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
        """The note: device name -> (UUID, interval) Tandem set, or is setting or failed to set."""
        return {device: (note.uuid, note.interval) for device, note in self._notes().items()}

    def _notes(self) -> dict[str, _Note]:
        raw = read_json_state(self.path, "time slices", "gpus", dict, version=FORMAT_VERSION, upgrades=UPGRADES)
        return {
            str(k): _Note(
                str(v.get("uuid", "")), str(v.get("interval", TimeSliceInterval.DEFAULT)), v.get("pending") is True
            )
            for k, v in raw.items()
            if isinstance(v, dict)
        }

    def sync(self, everything: bool = False, devices: Collection[str] | None = None) -> None:
        """The intervals the records need, and `Default` where none does any more (module
        docstring). `everything`: apply every needed interval again (start-up: a GPU reset
        forgets it). `devices`: only these GPUs' intervals set, no default restored (a prepare's
        own GPUs). Raises TimeSliceError naming every GPU that failed; the others are done
        regardless."""
        self._lock_path.parent.mkdir(parents=True, exist_ok=True)
        with locked(self._lock, self._lock_path):
            needed = dict(self._needed())
            complete = self._complete()  # read after `needed`, which reads the records
            noted = self._notes()
            failed = []
            for device, (uuid, interval) in sorted(needed.items()):
                if uuid is None or (devices is not None and device not in devices):
                    continue
                done = _Note(uuid, interval, pending=False)
                if noted.get(device) == done and not everything:
                    continue
                self._note(noted, device, done._replace(pending=True))  # before nvidia-smi (module docstring)
                try:
                    self._set(device, uuid, interval)
                except TimeSliceError as e:
                    failed.append(str(e))  # the note stays pending: the kubelet's retry runs nvidia-smi again
                    continue
                self._note(noted, device, done)
            for device in sorted(set(noted) - set(needed) if complete and devices is None else ()):
                try:
                    self._set(device, noted[device].uuid, TimeSliceInterval.DEFAULT)
                except TimeSliceError as e:
                    failed.append(str(e))
                    continue
                del noted[device]
                self._write(noted)
            if failed:
                raise TimeSliceError("; ".join(failed))

    def _note(self, noted: dict[str, _Note], device: str, note: _Note) -> None:
        if noted.get(device) != note:
            noted[device] = note
            self._write(noted)

    def _write(self, noted: Mapping[str, _Note]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        gpus = {
            d: {"uuid": n.uuid, "interval": n.interval, **({"pending": True} if n.pending else {})}
            for d, n in sorted(noted.items())
        }
        # Not fsynced: a reboot, the only thing that loses it, resets every GPU's time slice too.
        doc = {"version": FORMAT_VERSION, "gpus": gpus}
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

    def _set(self, device: str, uuid: str, interval: TimeSliceInterval) -> None:
        value = interval.setting
        cmd = [str(self._program()), "compute-policy", "-i", uuid, "--set-timeslice", str(value)]
        log.info("setting the time slice of %s (%s) to %s", device, uuid, interval, extra={"device": device})
        try:
            done = subprocess.run(
                cmd, env=self._env(), stdin=subprocess.DEVNULL, capture_output=True, timeout=_TIMEOUT, check=False
            )
        except (OSError, subprocess.TimeoutExpired) as e:
            raise TimeSliceError(f"{device}: {NVIDIA_SMI} compute-policy failed: {e}") from e
        if done.returncode != 0:
            why = (done.stdout + done.stderr).decode(errors="replace").strip()[:300]
            raise TimeSliceError(
                f"{device}: {NVIDIA_SMI} compute-policy --set-timeslice {value} exited with {done.returncode}: {why}"
            )
