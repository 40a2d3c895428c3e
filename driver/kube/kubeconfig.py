"""Where the API server is and how to prove who we are to it: in-cluster, or a kubeconfig file.

Why not `kubernetes.config`: importing any part of the official client imports its whole package,
every one of its ~900 pydantic models included: about 35 MiB of the daemon's memory and a third
of a second of start-up, for the dozen requests the driver makes (`driver.kube.api`). What a node
daemon meets is covered here:

* in-cluster: the pod's service account (``KUBERNETES_SERVICE_HOST``/``_PORT``, its CA and
  token), the token re-read every minute as client-go does, because the kubelet rotates it;
* kubeconfig files (``--kubeconfig``; a ``:``-separated list is merged as kubectl merges it: the
  first file to name a cluster, user or context, or to set current-context, wins): the current
  context's server, CA (file or data, or ``insecure-skip-tls-verify``), ``tls-server-name``,
  ``proxy-url``, and a client certificate (file or data), a bearer token or ``tokenFile``, or
  basic auth. Relative file names are relative to the kubeconfig that names them.

Credential plugins (``exec``, ``auth-provider``) run cloud SDKs or browsers; a node daemon has
neither, so they are refused with an error naming them rather than half supported. Proxies from
the environment (``HTTPS_PROXY``/``NO_PROXY``) apply as for the official client.
"""

from __future__ import annotations

import base64
import ipaddress
import os
import ssl
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit
from urllib.request import getproxies, proxy_bypass

import yaml

from driver.errors import InvalidInput

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
TOKEN_REREAD_SECONDS = 60.0  # client-go re-reads a token file at most this old


class KubeconfigError(InvalidInput):
    """The configuration cannot be used; the message names the file and field."""


class Credentials:
    """The Authorization header value, or None: a fixed token or basic auth, or a token file
    re-read once its copy is a minute old (a rotated service-account token is picked up)."""

    def __init__(self, header: str | None = None, token_file: Path | None = None) -> None:
        self._header = header
        self._token_file = token_file
        self._read_at = 0.0
        self._lock = threading.Lock()
        if token_file is not None:
            self.header()  # a missing or empty token file is an error now, not at the first call

    def header(self) -> str | None:
        if self._token_file is None:
            return self._header
        with self._lock:
            if time.monotonic() - self._read_at >= TOKEN_REREAD_SECONDS or self._header is None:
                token = self._token_file.read_text().strip()
                if not token:
                    raise KubeconfigError(f"token file {self._token_file} is empty")
                self._header, self._read_at = f"Bearer {token}", time.monotonic()
            return self._header


@dataclass(frozen=True)
class TlsSettings:
    """How to check the server and prove who we are. The files are loaded into a new context for
    every connection (`context`), so a rotated certificate or CA file is used from the next one."""

    verify: bool = True  # False: insecure-skip-tls-verify
    ca_file: str | None = None  # None and no ca_data: the system's CAs
    ca_data: str | None = None  # PEM
    cert_file: str | None = None
    key_file: str | None = None
    server_name: str | None = None  # tls-server-name: the name the certificate must carry

    def context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=self.ca_file, cadata=self.ca_data)
        if not self.verify:
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        if self.cert_file is not None:
            context.load_cert_chain(self.cert_file, self.key_file)
        return context


@dataclass
class ClusterAccess:
    """Everything a connection pool needs: the server, TLS settings, proxy and credentials."""

    server: str  # scheme://host[:port], no trailing slash
    credentials: Credentials = field(default_factory=Credentials)
    tls: TlsSettings | None = None  # None for an http:// server
    proxy: str | None = None


def cluster_access(kubeconfig: str | None) -> ClusterAccess:
    """In-cluster access without a kubeconfig, else the current context of `kubeconfig`."""
    return in_cluster() if kubeconfig is None else from_kubeconfig(kubeconfig)


def in_cluster(environ: dict[str, str] | None = None, sa_dir: Path = SERVICE_ACCOUNT_DIR) -> ClusterAccess:
    env = os.environ if environ is None else environ
    host, port = env.get("KUBERNETES_SERVICE_HOST", ""), env.get("KUBERNETES_SERVICE_PORT", "")
    if not host or not port:
        raise KubeconfigError("not in a cluster: KUBERNETES_SERVICE_HOST and KUBERNETES_SERVICE_PORT are not set")
    if not (sa_dir / "ca.crt").is_file():
        raise KubeconfigError(f"service account CA {sa_dir / 'ca.crt'} does not exist")
    server = f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"
    return ClusterAccess(
        server=server,
        credentials=Credentials(token_file=sa_dir / "token"),
        tls=TlsSettings(ca_file=str(sa_dir / "ca.crt")),
        proxy=_env_proxy(server),
    )


def from_kubeconfig(paths: str) -> ClusterAccess:
    merged: dict[str, dict[str, tuple[dict[str, Any], Path]]] = {"clusters": {}, "users": {}, "contexts": {}}
    current, found = "", []
    for name in (p for p in paths.split(os.pathsep) if p):
        path = Path(name).expanduser()
        try:
            doc = yaml.safe_load(path.read_text()) or {}
        except FileNotFoundError:
            continue  # kubectl skips a listed file that does not exist
        except (OSError, yaml.YAMLError, UnicodeDecodeError, RecursionError) as e:  # nested too deeply
            raise KubeconfigError(f"kubeconfig {path}: {e}") from e
        if not isinstance(doc, dict):
            raise KubeconfigError(f"kubeconfig {path}: not a mapping")
        found.append(path)
        for section, key in (("clusters", "cluster"), ("users", "user"), ("contexts", "context")):
            entries = doc.get(section) or []
            if not isinstance(entries, list):
                raise KubeconfigError(f"kubeconfig {path}: {section} is not a list")
            for entry in entries:
                if isinstance(entry, dict) and isinstance(entry.get("name"), str):
                    merged[section].setdefault(entry["name"], (entry.get(key) or {}, path.parent))
        current = current or str(doc.get("current-context") or "")
    if not found:
        raise KubeconfigError(f"no kubeconfig file found at {paths}")
    if not current:
        raise KubeconfigError(f"kubeconfig {paths}: no current-context")
    context, _ = _entry(merged, "contexts", current)
    cluster, cluster_dir = _entry(merged, "clusters", str(context.get("cluster") or ""))
    user, user_dir = _entry(merged, "users", str(context.get("user") or "")) if context.get("user") else ({}, Path())
    server = str(cluster.get("server") or "").rstrip("/")
    scheme = urlsplit(server).scheme  # lower case, as the connection reads it: `HTTPS://` is https
    if scheme not in ("http", "https") or not urlsplit(server).netloc:
        raise KubeconfigError(f"kubeconfig {paths}: cluster {context.get('cluster')!r} has no valid server URL")
    return ClusterAccess(
        server=server,
        credentials=_credentials(user, user_dir, paths),
        tls=_tls(cluster, cluster_dir, user, user_dir) if scheme == "https" else None,
        proxy=str(cluster["proxy-url"]) if cluster.get("proxy-url") else _env_proxy(server),
    )


def _entry(
    merged: dict[str, dict[str, tuple[dict[str, Any], Path]]], section: str, name: str
) -> tuple[dict[str, Any], Path]:
    try:
        entry, base = merged[section][name]
    except KeyError:
        raise KubeconfigError(f"kubeconfig: {section[:-1]} {name!r} is not defined") from None
    if not isinstance(entry, dict):
        raise KubeconfigError(f"kubeconfig: {section[:-1]} {name!r} is not a mapping")
    return entry, base


def _credentials(user: dict[str, Any], base: Path, paths: str) -> Credentials:
    for plugin in ("exec", "auth-provider"):
        if user.get(plugin):
            raise KubeconfigError(
                f"kubeconfig {paths}: the user's {plugin!r} credential plugin is not supported by "
                "tandem-driver; give it a client certificate, token or tokenFile"
            )
    if user.get("token"):
        return Credentials(header=f"Bearer {user['token']}")
    if user.get("tokenFile"):
        return Credentials(token_file=base / str(user["tokenFile"]))
    if user.get("username") and user.get("password"):
        basic = base64.b64encode(f"{user['username']}:{user['password']}".encode()).decode()
        return Credentials(header=f"Basic {basic}")
    return Credentials()


def _tls(cluster: dict[str, Any], cluster_dir: Path, user: dict[str, Any], user_dir: Path) -> TlsSettings:
    ca_file = ca_data = None
    verify = cluster.get("insecure-skip-tls-verify") is not True
    if verify and cluster.get("certificate-authority-data"):
        ca_data = _b64(cluster["certificate-authority-data"], "certificate-authority-data").decode()
    elif verify and cluster.get("certificate-authority"):
        ca_file = str(cluster_dir / str(cluster["certificate-authority"]))
    cert = _file_or_data(user, "client-certificate", user_dir)
    key = _file_or_data(user, "client-key", user_dir)
    if (cert is None) != (key is None):
        raise KubeconfigError("kubeconfig: a client certificate needs both client-certificate and client-key")
    name = str(cluster["tls-server-name"]) if cluster.get("tls-server-name") else None
    return TlsSettings(verify=verify, ca_file=ca_file, ca_data=ca_data, cert_file=cert, key_file=key, server_name=name)


def _file_or_data(user: dict[str, Any], key: str, base: Path) -> str | None:
    """A path the TLS library can load: the file named, or the inline data in an anonymous memory
    file (kept open for the life of the process), so a private key never lands on a disk."""
    if user.get(f"{key}-data"):
        fd = os.memfd_create(f"tandem-{key}", os.MFD_CLOEXEC)
        os.write(fd, _b64(user[f"{key}-data"], f"{key}-data"))
        return f"/proc/self/fd/{fd}"
    return str(base / str(user[key])) if user.get(key) else None


def _b64(value: object, what: str) -> bytes:
    try:
        return base64.b64decode(str(value), validate=True)
    except ValueError as e:
        raise KubeconfigError(f"kubeconfig: {what} is not base64: {e}") from None


def _env_proxy(server: str) -> str | None:
    """HTTPS_PROXY (or HTTP_PROXY for http) unless NO_PROXY names the server's host, by name or,
    as client-go reads it too, by an IP range: `10.96.0.0/12` keeps the in-cluster API server's
    service IP off the proxy, which urllib alone would send through it."""
    host = urlsplit(server).hostname or ""
    proxies = getproxies()
    proxy = proxies.get(urlsplit(server).scheme)
    if not proxy or proxy_bypass(host) or _in_ranges(host, proxies.get("no", "")):
        return None
    return proxy


def _in_ranges(host: str, no_proxy: str) -> bool:
    """Whether `host` is an IP address within one of the CIDR entries of `no_proxy`."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    for entry in (e.strip() for e in no_proxy.split(",")):
        try:
            if "/" in entry and ip in ipaddress.ip_network(entry, strict=False):
                return True
        except ValueError:  # a name, or nonsense: not a range
            continue
    return False
