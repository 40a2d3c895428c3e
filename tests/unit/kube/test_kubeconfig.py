"""Where the API server is and how to log in (driver.kube.kubeconfig), and KubeAPI's REST over TLS."""

from __future__ import annotations

import base64
import json
import shutil
import ssl
import subprocess
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest
import yaml

from driver.kube import kubeconfig
from driver.kube.api import ApiError, KubeAPI
from driver.kube.kubeconfig import KubeconfigError, TlsSettings, cluster_access, from_kubeconfig, in_cluster


def _write(path: Path, doc: dict) -> Path:
    path.write_text(yaml.safe_dump(doc))
    return path


def _config(server: str = "https://api.example:6443", cluster: dict | None = None, user: dict | None = None) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "c", "cluster": {"server": server, **(cluster or {})}}],
        "users": [{"name": "u", "user": user or {}}],
        "contexts": [{"name": "ctx", "context": {"cluster": "c", "user": "u"}}],
        "current-context": "ctx",
    }


def test_in_cluster_uses_the_service_account_and_rereads_a_rotated_token(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "ca.crt").write_text("CA")
    (tmp_path / "token").write_text("first\n")
    access = in_cluster({"KUBERNETES_SERVICE_HOST": "fd00::1", "KUBERNETES_SERVICE_PORT": "443"}, tmp_path)
    assert access.server == "https://[fd00::1]:443"
    assert access.tls == TlsSettings(ca_file=str(tmp_path / "ca.crt"))
    assert access.credentials.header() == "Bearer first"
    (tmp_path / "token").write_text("second\n")  # the kubelet rotated it
    assert access.credentials.header() == "Bearer first"  # read again only once a minute old
    monkeypatch.setattr(kubeconfig, "TOKEN_REREAD_SECONDS", 0.0)
    assert access.credentials.header() == "Bearer second"


def test_no_proxy_ranges_keep_the_in_cluster_api_server_off_the_proxy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NO_PROXY=10.96.0.0/12 is how clusters exempt the service IPs; names still work as before."""
    (tmp_path / "ca.crt").write_text("CA")
    (tmp_path / "token").write_text("t\n")
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy:3128")
    monkeypatch.setenv("NO_PROXY", "nonsense/x, fd00::/8,10.96.0.0/12,.internal")

    def proxy(host: str) -> str | None:
        return in_cluster({"KUBERNETES_SERVICE_HOST": host, "KUBERNETES_SERVICE_PORT": "443"}, tmp_path).proxy

    assert proxy("10.96.0.1") is None
    assert proxy("fd00::1") is None
    assert proxy("api.internal") is None
    assert proxy("10.200.0.1") == "http://proxy:3128"


def test_in_cluster_outside_a_cluster_says_so(tmp_path: Path) -> None:
    with pytest.raises(KubeconfigError, match="KUBERNETES_SERVICE_HOST"):
        in_cluster({}, tmp_path)
    with pytest.raises(KubeconfigError, match=r"ca\.crt"):
        in_cluster({"KUBERNETES_SERVICE_HOST": "10.0.0.1", "KUBERNETES_SERVICE_PORT": "443"}, tmp_path)


def test_kubeconfig_files_relative_to_it_and_inline_data(tmp_path: Path) -> None:
    (tmp_path / "ca.crt").write_text("CA")
    (tmp_path / "tok").write_text("from-file")
    doc = _config(
        cluster={"certificate-authority": "ca.crt", "tls-server-name": "kubernetes"}, user={"tokenFile": "tok"}
    )
    access = from_kubeconfig(str(_write(tmp_path / "kc", doc)))
    assert access.tls == TlsSettings(ca_file=str(tmp_path / "ca.crt"), server_name="kubernetes")
    assert access.credentials.header() == "Bearer from-file"

    key, cert = b"-----BEGIN KEY-----\n", b"-----BEGIN CERT-----\n"
    doc = _config(
        cluster={"certificate-authority-data": base64.b64encode(b"PEM CA").decode()},
        user={
            "client-certificate-data": base64.b64encode(cert).decode(),
            "client-key-data": base64.b64encode(key).decode(),
        },
    )
    access = from_kubeconfig(str(_write(tmp_path / "kc2", doc)))
    assert access.tls is not None and access.tls.ca_data == "PEM CA"
    # Inline credentials go to anonymous memory files, never to a disk.
    assert access.tls.cert_file is not None and access.tls.key_file is not None
    assert Path(access.tls.cert_file).read_bytes() == cert and Path(access.tls.key_file).read_bytes() == key
    assert access.credentials.header() is None

    doc = _config(cluster={"insecure-skip-tls-verify": True}, user={"username": "a", "password": "b"})
    insecure = from_kubeconfig(str(_write(tmp_path / "kc3", doc)))
    assert insecure.tls == TlsSettings(verify=False)
    assert insecure.credentials.header() == "Basic " + base64.b64encode(b"a:b").decode()


def test_a_list_of_kubeconfigs_is_merged_first_wins(tmp_path: Path) -> None:
    first = _write(tmp_path / "a", {"users": [{"name": "u", "user": {"token": "mine"}}], "current-context": "ctx"})
    second = _write(tmp_path / "b", {**_config(user={"token": "theirs"}), "current-context": "other"})
    access = from_kubeconfig(f"{tmp_path / 'missing'}:{first}:{second}")
    assert access.server == "https://api.example:6443" and access.credentials.header() == "Bearer mine"


def test_merged_entries_keep_paths_relative_to_the_file_that_names_them(tmp_path: Path) -> None:
    """As kubectl resolves them: a file named in a cluster or user is relative to that entry's own
    kubeconfig, not to the first file of the list."""
    (tmp_path / "mine").mkdir()
    (tmp_path / "theirs").mkdir()
    (tmp_path / "mine" / "tok").write_text("from-mine\n")
    first = _write(
        tmp_path / "mine" / "config",
        {"users": [{"name": "u", "user": {"tokenFile": "tok"}}], "current-context": "ctx"},
    )
    second = _write(tmp_path / "theirs" / "config", _config(cluster={"certificate-authority": "ca.crt"}))
    access = from_kubeconfig(f"{first}:{second}")
    assert access.credentials.header() == "Bearer from-mine"
    assert access.tls == TlsSettings(ca_file=str(tmp_path / "theirs" / "ca.crt"))


@pytest.mark.parametrize(
    ("doc", "match"),
    [
        (_config(user={"exec": {"command": "aws"}}), "'exec' credential plugin is not supported"),
        (_config(user={"auth-provider": {"name": "oidc"}}), "'auth-provider' credential plugin"),
        ({**_config(), "current-context": ""}, "no current-context"),
        ({**_config(), "current-context": "nope"}, "context 'nope' is not defined"),
        (_config(server="api.example:6443"), "no valid server URL"),
        (_config(user={"client-certificate": "c.crt"}), "needs both client-certificate and client-key"),
        (_config(cluster={"certificate-authority-data": "not base64!"}), "not base64"),
    ],
)
def test_unusable_kubeconfigs_name_what_is_wrong(tmp_path: Path, doc: dict, match: str) -> None:
    with pytest.raises(KubeconfigError, match=match):
        from_kubeconfig(str(_write(tmp_path / "kc", doc)))


def test_kubeapi_turns_a_bad_configuration_into_a_permanent_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ApiError, match="cannot load Kubernetes client configuration: no kubeconfig") as e:
        KubeAPI(str(tmp_path / "missing"))
    assert not e.value.retryable
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(KubeconfigError, match="not in a cluster"):
        cluster_access(None)  # no --kubeconfig: in-cluster, which needs the pod's environment


# --- a real TLS server that wants a client certificate ----------------------------------------------


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture
def tls_server(tmp_path: Path) -> Iterator[tuple[str, Path, list[dict]]]:
    """An HTTPS server on 127.0.0.1 with its own CA, requiring a client certificate from that CA;
    it answers every GET with a JSON object naming the client certificate's CN."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed: no certificates for the TLS test")
    ca = ("-subj", "/CN=test-ca")
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt", "-days", "1", *ca, cwd=tmp_path)  # fmt: skip
    (tmp_path / "san.cnf").write_text("subjectAltName=IP:127.0.0.1\n")
    for name, extra in (("server", ("-extfile", "san.cnf")), ("client", ())):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=tmp_path)  # fmt: skip
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial", "-out", f"{name}.crt", "-days", "1", *extra, cwd=tmp_path)  # fmt: skip
    seen: list[dict] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            peer = dict(x[0] for x in self.connection.getpeercert()["subject"])  # type: ignore[union-attr]
            seen.append({"cn": peer["commonName"], "auth": self.headers.get("Authorization"), "path": self.path})
            body = json.dumps({"metadata": {"uid": "u-1"}, "cn": peer["commonName"]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_: object) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(tmp_path / "server.crt", tmp_path / "server.key")
    context.load_verify_locations(tmp_path / "ca.crt")
    context.verify_mode = ssl.CERT_REQUIRED
    server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"https://127.0.0.1:{server.server_address[1]}", tmp_path, seen
    finally:
        server.shutdown()
        server.server_close()


def test_kubeapi_speaks_tls_with_an_inline_client_certificate(tls_server: tuple[str, Path, list[dict]]) -> None:
    url, pki, seen = tls_server
    b64 = {
        name: base64.b64encode((pki / name).read_bytes()).decode() for name in ("ca.crt", "client.crt", "client.key")
    }
    doc = _config(
        server=url,
        cluster={"certificate-authority-data": b64["ca.crt"]},
        user={"client-certificate-data": b64["client.crt"], "client-key-data": b64["client.key"]},
    )
    api = KubeAPI(str(_write(pki / "kc", doc)))
    try:
        assert api.get_node("node/a").uid == "u-1"
    finally:
        api.close()
    assert seen == [{"cn": "client", "auth": None, "path": "/api/v1/nodes/node%2Fa"}]


def test_kubeapi_refuses_a_server_its_ca_did_not_sign(tls_server: tuple[str, Path, list[dict]]) -> None:
    url, pki, seen = tls_server
    api = KubeAPI(str(_write(pki / "kc", _config(server=url, user={"token": "t"}))))  # system CAs only
    try:
        with pytest.raises(ApiError, match="get node n") as e:
            api.get_node("n")
    finally:
        api.close()
    assert e.value.retryable and e.value.status == 0 and seen == []
