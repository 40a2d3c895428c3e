"""`tandem-driver demo` is what a new user runs first: it must go end to end and exit 0."""

from __future__ import annotations

import subprocess
import sys


def test_demo_runs_end_to_end():
    proc = subprocess.run([sys.executable, "-m", "driver", "demo"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "12 devices in pool 'demo-node'" in out
    assert "pcieRoot=pci0000:15" in out  # GPU and NIC allocated on one PCIe root
    assert "k8s.tandem.dev/claim=" in out and "TANDEM_GPU_NIC_PAIRS=0:mlx5_0" in out
    assert "tandem.dev/xid=79:NoExecute" in out and "taint cleared" in out
    assert out.rstrip().endswith("demo finished: all steps succeeded")
