"""etcd restored from a backup under a running Tandem, in the real cluster.

A copy of etcd's data is taken (`hack/cluster.sh etcd-save`), a GPU is cordoned, and etcd is put
back to the copy with the API server restarted on it (`hack/cluster.sh etcd-restore`): the server's
slice lacks the cordon's taint, and its resourceVersions are older than those Tandem wrote and saw
since. Tandem, never restarted, must publish the cordon again within a minute and say it is
healthy (it once kept its newer-numbered copy, dropped the server's lists as old, and stayed
`degraded` with a failed watch: driver/slices/cache.py).

The cluster works on between the copy and the cordon (`WRITES` ConfigMaps, lost with the restore),
so that the restored server's revision stays below the versions Tandem saw even after the writes
a restarted API server makes at start: the list Tandem makes then answers at a version lower than
one it met, which is the case the cache must take as a reset, and says so in the log.
"""

from __future__ import annotations

import subprocess
from typing import Any

from kube import TANDEMCTL, Cluster, wait_for

GPU = "gpu-5"
CORDONED = "tandem.dev/cordoned"
WRITES = 300


def _cordon_taints(cluster: Cluster) -> list[dict[str, Any]]:
    return [t for t in cluster.devices()[GPU].get("taints") or [] if t["key"] == CORDONED]


def _config_map(i: int) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": f"after-the-copy-{i}"}, "data": {"i": str(i)}}


def _tandemctl(*args: str) -> None:
    subprocess.run([TANDEMCTL, *args], capture_output=True, text=True, timeout=30, check=True)


def test_a_cordon_lost_to_an_etcd_restore_is_published_again_without_restarting_tandem(
    cluster: Cluster, tandem, namespace: str
) -> None:
    tandem.ensure()
    wait_for("healthy to begin with", tandem.healthy, timeout=90)
    assert not _cordon_taints(cluster), "the GPU is cordoned before the test"
    pid = tandem.node.pid()
    cluster.cluster_sh("etcd-save", timeout=180)
    try:
        wait_for(
            "the API server back after the copy",
            lambda: cluster.kubectl("get", "--raw", "/readyz", timeout=10),
            timeout=120,
        )
        wait_for("healthy after the copy", tandem.healthy, timeout=90)
        cluster.apply(*(_config_map(i) for i in range(WRITES)), namespace=namespace)
        _tandemctl("cordon", GPU, "--reason", "etcd restore test")
        wait_for("the cordon in the slice", lambda: _cordon_taints(cluster), timeout=60)
        wait_for("healthy once the cordon is published", tandem.healthy, timeout=60)

        log = tandem.node.log_file
        offset = log.stat().st_size
        cluster.cluster_sh("etcd-restore", timeout=300)
        wait_for(
            "the API server back on the restored etcd",
            lambda: cluster.kubectl("get", "--raw", "/readyz", timeout=10),
            timeout=120,
        )
        # Within a minute of the restore: the cordon published again, health clean.
        wait_for("the cordon published again", lambda: _cordon_taints(cluster), timeout=60)
        wait_for("tandemctl health clean", tandem.healthy, timeout=60)
        assert tandem.node.pid() == pid, "Tandem was restarted"
        # The restore did lose the cordon: Tandem wrote the slice again after it.
        with log.open("rb") as f:
            f.seek(offset)
            since = f.read().decode(errors="replace")
        assert "publishing pool" in since, since[-3000:]
        assert "resourceVersion went back" in since, since[-3000:]
    finally:
        _tandemctl("uncordon", GPU)
    wait_for("the cordon lifted", lambda: not _cordon_taints(cluster), timeout=60)
