"""The simulated API server as a separate process (`python -m sim.apiserver`), as the demo runs it."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

from kubernetes import client, config


def test_standalone_server_serves_until_sigterm(tmp_path: Path) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    proc = subprocess.Popen(
        [sys.executable, "-m", "sim.apiserver", "--kubeconfig", str(kubeconfig)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        url = proc.stdout.readline().strip()  # printed once the kubeconfig is written
        assert url.startswith("http://127.0.0.1:")
        api_client = config.new_client_from_config(config_file=str(kubeconfig))
        assert api_client.configuration.host == url
        api = client.ResourceV1Api(api_client)
        created = api.create_resource_slice(
            {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "ResourceSlice",
                "metadata": {"generateName": "00000-gpu.example.com-node-a-"},
                "spec": {
                    "driver": "gpu.example.com",
                    "nodeName": "node-a",
                    "pool": {"name": "node-a", "generation": 0, "resourceSliceCount": 1},
                    "devices": [{"name": "gpu-0", "capacity": {"memory": {"value": "81920Mi"}}}],
                },
            }
        )
        assert created.spec.devices[0].capacity["memory"].value == "80Gi"
        assert [s.metadata.name for s in api.list_resource_slice().items] == [created.metadata.name]
        api_client.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
