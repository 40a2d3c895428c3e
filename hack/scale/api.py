"""The bench's REST client: kept-alive HTTPS connections, one per thread, with the admin's
certificate from the launcher's kubeconfig. The bench opens hundreds of requests a second from
many threads, which a client with one connection or a new one per request would throttle."""

from __future__ import annotations

import http.client
import json
import ssl
import threading
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

USER_AGENT = "tandem-bench-scale"


class ApiError(Exception):
    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"HTTP {status}: {body[:300]}")
        self.status = status


class Api:
    def __init__(self, server: str, ca: str, cert: str, key: str) -> None:
        u = urllib.parse.urlparse(server)
        self.server, self.ca = server, ca
        self.host, self.port = u.hostname or "127.0.0.1", u.port or 443
        self.ctx = ssl.create_default_context(cafile=ca)
        self.ctx.load_cert_chain(cert, key)
        self.local = threading.local()

    @classmethod
    def from_kubeconfig(cls, path: Path) -> Api:
        """The client of a kubeconfig the launcher wrote (hack/cluster/pki.sh: one cluster, one
        user with a client certificate)."""
        cfg = yaml.safe_load(path.read_text())
        cluster, user = cfg["clusters"][0]["cluster"], cfg["users"][0]["user"]
        return cls(cluster["server"], cluster["certificate-authority"], user["client-certificate"], user["client-key"])

    def _conn(self, timeout: float | None = 60) -> http.client.HTTPSConnection:
        return http.client.HTTPSConnection(self.host, self.port, context=self.ctx, timeout=timeout)

    def request(self, method: str, path: str, body: Any = None, ctype: str = "application/json") -> Any:
        data = None if body is None else json.dumps(body).encode()
        headers = {"Accept": "application/json", "User-Agent": USER_AGENT}
        if data is not None:
            headers["Content-Type"] = ctype
        for attempt in range(3):
            conn: http.client.HTTPSConnection | None = getattr(self.local, "conn", None)
            if conn is None:
                conn = self.local.conn = self._conn()
            try:
                conn.request(method, path, body=data, headers=headers)
                resp = conn.getresponse()
                raw = resp.read()
            except (OSError, http.client.HTTPException):
                conn.close()
                self.local.conn = None
                if attempt == 2:
                    raise
                continue
            if resp.status >= 300:
                raise ApiError(resp.status, raw.decode(errors="replace"))
            if not raw:
                return None
            return json.loads(raw) if raw[:1] in (b"{", b"[") else raw.decode()
        return None

    def watch(self, path: str) -> Iterator[dict[str, Any]]:
        """Events of one watch request until the server ends it."""
        conn = self._conn(timeout=None)
        try:
            conn.request("GET", path, headers={"Accept": "application/json", "User-Agent": USER_AGENT})
            resp = conn.getresponse()
            if resp.status != 200:
                raise ApiError(resp.status, resp.read().decode(errors="replace"))
            while True:
                line = resp.readline()
                if not line:
                    return
                event: dict[str, Any] = json.loads(line)
                yield event
        finally:
            conn.close()

    def metrics(self) -> str:
        conn = self._conn()
        try:
            conn.request("GET", "/metrics")
            return conn.getresponse().read().decode()
        finally:
            conn.close()


def write_token_kubeconfig(path: Path, api: Api, token: str) -> None:
    """A kubeconfig for a driver instance: the API server and CA of `api`, a bound token."""
    cfg = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "scale", "cluster": {"server": api.server, "certificate-authority": api.ca}}],
        "users": [{"name": "u", "user": {"token": token}}],
        "contexts": [{"name": "scale", "context": {"cluster": "scale", "user": "u"}}],
        "current-context": "scale",
    }
    path.write_text(json.dumps(cfg))  # JSON is YAML
    path.chmod(0o600)
