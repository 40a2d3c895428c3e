"""Fuzzing the kubeconfig reader (driver/kube/kubeconfig.py): the operator's file, or one a
node's tooling wrote, read as YAML.

The property: any file gives a `ClusterAccess` or raises what `KubeAPI` catches to turn into its
own error (`KubeconfigError`, `OSError`, `ValueError`), never anything else. Strategies: a valid
kubeconfig with its fields mutated at any depth (a section that is a number, a server URL no
parser takes, data that is no base64 or no text), and any YAML or bytes at all.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from fuzzing import fuzz, mutated, raises_only
from hypothesis import example
from hypothesis import strategies as st

from driver.kube.kubeconfig import ClusterAccess, KubeconfigError, from_kubeconfig

CAUGHT = (KubeconfigError, OSError, ValueError)  # what driver.kube.api.KubeAPI catches

KUBECONFIG = {
    "apiVersion": "v1",
    "kind": "Config",
    "current-context": "ctx",
    "contexts": [{"name": "ctx", "context": {"cluster": "c", "user": "u"}}],
    "clusters": [
        {
            "name": "c",
            "cluster": {
                "server": "https://10.0.0.1:6443",
                "certificate-authority-data": "LS0tLS1CRUdJTg==",
                "tls-server-name": "kubernetes",
                "proxy-url": "http://proxy:3128",
            },
        }
    ],
    "users": [{"name": "u", "user": {"token": "abc", "client-certificate-data": "AAAA", "client-key-data": "AAAA"}}],
}
# Nested past PyYAML's recursion (600 levels: deeper costs it up to a second to refuse, bounded).
SERVERS = ["http://[x", "https://[::1", "https://host:99999", "https://\u2100/", "ftp://x", "https://", "HTTPS://x"]


@st.composite
def kubeconfigs(draw: st.DrawFn) -> bytes:
    doc = mutated(KUBECONFIG, draw(st.data()))
    if isinstance(doc, dict) and isinstance(doc.get("clusters"), list) and draw(st.booleans()):
        doc["clusters"].append({"name": "c", "cluster": {"server": draw(st.sampled_from(SERVERS))}})
        doc["clusters"].reverse()
    return yaml.safe_dump(doc).encode()


@pytest.fixture(scope="module")
def directory() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="fuzz-kubeconfig-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@example(data=b"clusters: 5\ncurrent-context: a\n")
@example(data=b"[" * 600)
@example(
    data=b"current-context: c\ncontexts: [{name: c, context: {cluster: c}}]\nclusters: [{name: c, cluster: {server: 'HTTPS://x'}}]\n"
)
@example(
    data=b"current-context: c\ncontexts: [{name: c, context: {cluster: c}}]\nclusters: [{name: c, cluster: {server: 'http://[x'}}]\n"
)
@fuzz(kubeconfigs() | st.just(b"[" * 600) | st.text(max_size=80).map(str.encode) | st.binary(max_size=80))
def test_any_kubeconfig_gives_access_or_an_error_the_client_catches(directory: Path, data: bytes) -> None:
    path = directory / "kubeconfig"
    path.write_bytes(data)
    access = raises_only(CAUGHT, lambda: from_kubeconfig(str(path)))
    assert access is None or isinstance(access, ClusterAccess)
    if access is not None:
        # An https server (in any case: the connection reads the scheme so) is checked as its cluster says.
        scheme = access.server.partition(":")[0].lower()
        assert scheme in ("http", "https") and (access.tls is not None) == (scheme == "https")
