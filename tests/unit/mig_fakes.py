"""A simulated node with an H100 in MIG mode and the fake NVML initialised in this process, shared
by the dynamic-MIG tests."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

from sim import nvml as sim_nvml
from sim.profile import NodeProfile, h100_node
from sim.sysfs import render_node


@contextlib.contextmanager
def h100_in_mig_mode(root: Path) -> Iterator[tuple[ModuleType, Path, NodeProfile]]:
    """Two MIG-capable H100s, the first in MIG mode, rendered under `root` (with /proc, where the fake
    makes MIG capabilities); yields the fake `pynvml` (initialised), its state file and the node."""
    profile = h100_node(gpus=2, nics=0, mig_capable=True)
    profile.gpus[0].mig_mode = True
    state = root / "nvml.json"
    render_node(profile, root / "sys", root / "dev", root / "proc")
    sim_nvml.write_state(profile, state, proc_root=root / "proc")
    with sim_nvml.fake_pynvml_in_process(state) as pynvml:
        pynvml.nvmlInit()
        try:
            yield pynvml, state, profile
        finally:
            pynvml.nvmlShutdown()
