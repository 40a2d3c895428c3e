#!/usr/bin/env python3
"""A stand-in for `nvidia-smi compute-policy`, the one nvidia-smi subcommand the driver runs.

Rendered into the simulated driver root (`sim.driver_files`), where the simulated `nvidia-smi`
(a shell script, as containers run it) hands `compute-policy` to it; stdlib-only and
self-contained for that reason. It changes the fake NVML's state file (`TANDEM_SIM_NVML_STATE`,
under its `<state>.lock`, as the fake itself writes it), since the time slice is the GPU's:

* `nvidia-smi compute-policy -i <id> --set-timeslice <0..3>` (or `--set-timeslice=<n>`): sets the
  GPU's `time_slice`. `<id>` is a GPU UUID, an index or a PCI bus ID, as nvidia-smi accepts them.
  Refused as the real one refuses it: a MIG device or a GPU in MIG mode "is not supported" (exit
  3), an unknown ID is not found (exit 6), a value outside 0..3 or a missing one is an invalid
  argument (exit 2), no driver is exit 9 (nvidia-smi's return values). A GPU whose UUID is listed
  in `<state>.smi-faults` (`sim.nvml.set_compute_policy_fault`) fails as a GPU that fell off the
  bus fails (exit 15).
* `nvidia-smi compute-policy -l [-i <id>]`: each GPU's time slice, one line each.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import sys
from typing import Any

INVALID, NOT_SUPPORTED, NOT_FOUND, NO_DRIVER, GPU_LOST = 2, 3, 6, 9, 15
_NAMES = ("Default", "Short", "Medium", "Long")


def _find(gpus: list[dict[str, Any]], ident: str) -> dict[str, Any] | None:
    for g in gpus:
        bus = str(g.get("pci_bus_id", "")).lower()
        if ident in (g.get("uuid"), str(g.get("index"))) or ident.lower() in (bus, "0000" + bus[4:]):
            return g
    return None


def _faults(state: str) -> set[str]:
    try:
        with open(state + ".smi-faults", encoding="utf-8") as f:
            return set(json.load(f))
    except FileNotFoundError:
        return set()


def _args(argv: list[str]) -> tuple[str | None, str | None, bool]:
    ident = value = None
    listing = False
    i = 0
    while i < len(argv):
        a = argv[i]
        if a in ("-i", "--id") and i + 1 < len(argv):
            ident, i = argv[i + 1], i + 2
        elif a.startswith("--id="):
            ident, i = a.split("=", 1)[1], i + 1
        elif a == "--set-timeslice" and i + 1 < len(argv):
            value, i = argv[i + 1], i + 2
        elif a.startswith("--set-timeslice="):
            value, i = a.split("=", 1)[1], i + 1
        elif a in ("-l", "--list"):
            listing, i = True, i + 1
        else:
            raise ValueError(a)
    return ident, value, listing


def compute_policy(argv: list[str]) -> int:
    try:
        ident, value, listing = _args(argv)
    except ValueError as e:
        print(f"Invalid combination of input arguments: \"{e}\". Please run 'nvidia-smi -h' for help.", file=sys.stderr)
        return INVALID
    state = os.environ.get("TANDEM_SIM_NVML_STATE", "")
    if not state or not os.path.exists(state):
        print("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.", file=sys.stderr)
        return NO_DRIVER
    if value is None and not listing:
        print("compute-policy: one of --set-timeslice or -l is required.", file=sys.stderr)
        return INVALID
    fd = os.open(state + ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        with open(state, encoding="utf-8") as f:
            data = json.load(f)
        gpus = data.get("gpus", [])
        if ident is not None and ident.startswith("MIG-"):
            print(f"Setting the compute policy is not supported for MIG device {ident}.", file=sys.stderr)
            return NOT_SUPPORTED
        chosen = gpus if ident is None else [g for g in [_find(gpus, ident)] if g is not None]
        if not chosen:
            print(f"No devices were found matching {ident}.", file=sys.stderr)
            return NOT_FOUND
        if listing:
            for g in chosen:
                print(f"GPU {g['pci_bus_id']}: timeslice {_NAMES[int(g.get('time_slice', 0))]}")
            return 0
        if value not in ("0", "1", "2", "3"):
            print(f"Invalid timeslice value {value}: must be 0 (default), 1 (short), 2 (medium) or 3 (long).",
                  file=sys.stderr)  # fmt: skip
            return INVALID
        if any(g.get("mig_mode") for g in chosen):
            print("Setting the compute policy is not supported on a GPU in MIG mode.", file=sys.stderr)
            return NOT_SUPPORTED
        faults = _faults(state)
        for g in chosen:
            if g.get("uuid") in faults:
                print(f"Unable to set the timeslice for GPU {g['pci_bus_id']}: GPU is lost.", file=sys.stderr)
                return GPU_LOST
        for g in chosen:
            g["time_slice"] = int(value)
        tmp = f"{state}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2)
        os.replace(tmp, state)
        for g in chosen:
            print(f"Set timeslice to {_NAMES[int(value)]} for GPU {g['pci_bus_id']}.")
        return 0
    finally:
        with contextlib.suppress(OSError):
            os.close(fd)


def main(argv: list[str]) -> int:
    if argv[:1] == ["compute-policy"]:
        return compute_policy(argv[1:])
    print(f"simulated nvidia-smi: only compute-policy is simulated here; got {' '.join(argv)}", file=sys.stderr)
    return INVALID


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
