"""hack/gpu-smoke.sh is run by hand on real GPU machines; here it runs against the simulated node so
it cannot silently rot, and its output must be ResourceSlices the 1.37 schema accepts."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import kubernetes_validate
import yaml

from sim.nvml import env_for, write_state
from sim.profile import h100_node
from sim.sysfs import render_node

REPO = Path(__file__).resolve().parents[2]


def test_smoke_script_prints_valid_resource_slices(tmp_path: Path):
    profile = h100_node("smoke", gpus=2, nics=0)
    render_node(profile, tmp_path / "sys", tmp_path / "dev")
    state = tmp_path / "state.json"
    write_state(profile, state)
    env = {**os.environ, **env_for(state)}
    proc = subprocess.run(
        [str(REPO / "hack/gpu-smoke.sh"), "--sysfs-root", str(tmp_path / "sys"), "--node-name", "smoke"],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    docs = list(yaml.safe_load_all(proc.stdout))
    assert [d["name"] for d in docs[0]["spec"]["devices"]] == ["gpu-0", "gpu-1"]
    for doc in docs:
        doc["metadata"]["name"] = "smoke-slice"  # generateName alone is not a complete object
        kubernetes_validate.validate(doc, "1.37.0", strict=True)


def test_mig_placements_go_through_the_nvml_door(tmp_path: Path):
    """`--mig-placements` reads through the same door as the daemon: a GPU whose profiles NVML
    will not tell is reported as NVML's refusal, and the other GPUs are still listed."""
    profile = h100_node("smoke", gpus=2, nics=0, mig_capable=True)
    profile.gpus[0].nvml_errors = {"nvmlDeviceGetGpuInstanceProfileInfo": 999}  # NVML_ERROR_UNKNOWN
    render_node(profile, tmp_path / "sys", tmp_path / "dev")
    state = tmp_path / "state.json"
    write_state(profile, state)
    env = {**os.environ, **env_for(state)}
    proc = subprocess.run(
        [str(REPO / "hack/gpu-smoke.sh"), "--sysfs-root", str(tmp_path / "sys"), "--node-name", "smoke",
         "--mig-placements"],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    lines = {line.split(" ")[2]: line for line in proc.stdout.splitlines() if line.startswith("# MIG ")}
    assert "its MIG profiles and placements cannot be read" in lines["0"]
    assert '"name": "1g.10gb"' in lines["1"]
