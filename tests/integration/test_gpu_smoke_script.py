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
