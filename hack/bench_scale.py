"""Tandem on N nodes of one real control plane, side by side with the Go reference driver (issue 24, part 2).

What runs (all on this machine, in a state directory of its own under /tmp, on ports of its own, so
that it never meets `hack/cluster.sh`'s cluster):

* the upstream etcd, kube-apiserver, kube-scheduler and kube-controller-manager that
  `hack/cluster.sh` builds (`~/.cache/tandem-cluster/*/bin`), with TLS, Node+RBAC authorization, the
  DRA feature gates of the real cluster, and an audit log of the two drivers' requests (who sent
  what: the API server's `apiserver_request_total` has no user-agent label);
* N Node objects (`scale-node-000` ...), each a simulated HGX H100 (`sim.profile.h100_node`: 8 GPUs
  and 8 RoCE NICs, two of each behind each of 4 PCIe switches) rendered under its own directory;
* per node, Tandem (`python -m driver run`, a real process: its own data, registration and CDI
  directories and sockets, `--nic-link-source sysfs`) with a token of the `tandem-driver` service
  account bound to its Node, under the RBAC and the admission policy of `daemonset.yaml`;
* per node, the Go reference driver of `hack/bench/` (`k8s.io/dynamic-resource-allocation`
  v0.37.2's kubeletplugin helper, mode tandem-work: checkpoint, CDI spec, device metadata, claim
  status by server-side apply) as driver `a.ref.tandem.dev` on even nodes and `z.ref.tandem.dev` on
  odd ones (REF_NAMES says why), publishing the very devices Tandem published for that node
  (`-devices-file`, attributes in the domain `ref.tandem.dev`), with a node-bound token of a
  service account of its own (`ref-driver`, the same rules);
* one kubelet stand-in process for all N nodes (`standin` below). Upstream's hollow node
  (`cmd/kubemark`) cannot serve: `cmd/kubemark/app/hollow_node.go` builds its kubelet with
  `cm.NewStubContainerManager()`, whose `PrepareDynamicResources`/`UnprepareDynamicResources` return
  nil without calling any plugin (`pkg/kubelet/cm/container_manager_stub.go`), so no DRA driver would
  ever be called. The stand-in keeps each Node Ready as the kubelet does (a Lease renewed every
  10 s, the status every 5 min), registers every driver through its registration socket
  (`sim.kubelet.KubeletSim`), watches the pods bound to its nodes, GETs each pod's claims, calls
  NodePrepareResources on the driver's real socket, marks the pod Running; after a hold it calls
  NodeUnprepareResources and marks the pod Succeeded (so the claim controller frees the devices).

Measured, in one run: time from start until every node's slices are published (all instances
started at once; Tandem first, then Go, each alone); API requests per second of each driver at idle
and during churn (audit log), writes apart; pods created at a steady rate, alternating between the
two drivers: each with a GPU+NIC pair constrained to one PCIe switch (`matchAttribute` on
`pcieSwitch`), then each with one GPU: scheduling throughput (pods bound per second), create→bound
and create→Running p50/p99 per driver; the drivers' total CPU and memory (RSS and PSS) idle and
under churn; the CPU of every other process and the machine's load, to say what limited throughput.

The pace is the bench's own: pods are created on a fixed schedule (`rate` pods per second) and each
Succeeds `hold` seconds after it ran; nothing else waits on a timer. Node count: `--nodes` or
TANDEM_SCALE_NODES (default 100; `--quick` 10).

    python hack/bench_scale.py [--quick] [--nodes N] [--pods N] [--rate R] [--keep]
    python hack/bench.py --only scale        (TANDEM_SCALE_NODES=N for fewer nodes)
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import queue
import shutil
import signal
import ssl
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import urllib.parse
from collections import Counter, defaultdict
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO))

import bench_reference  # noqa: E402

DRIVER, REF = "tandem.dev", "ref.tandem.dev"
# The scheduler's allocator tries a node's pools in the order of their drivers' names (then pool
# names; `sortPoolsByID` in k8s.io/dynamic-resource-allocation's structured allocator), testing the
# claim's class selectors on each device until its requests are met. With one reference name, one
# driver's pools come first on every node and every claim of the other rejects its 16 devices on
# each of the N nodes first: measured at 100 nodes, about 50 ms of create->Running for a GPU+NIC
# pair, which followed the name when it was swapped. So the reference runs under two names, one
# sorting before Tandem's and one after, on alternate nodes: each driver's claims meet the other's
# devices first on half the nodes. REF is the pair's family: its classes, its attribute domain.
REF_NAMES = (f"a.{REF}", f"z.{REF}")
assert REF_NAMES[0] < DRIVER < REF_NAMES[1]
NAMESPACE = "tandem-system"
USERS = {
    DRIVER: f"system:serviceaccount:{NAMESPACE}:tandem-driver",
    REF: f"system:serviceaccount:{NAMESPACE}:ref-driver",
}
PORTS = {"etcd": 32379, "etcd-peer": 32380, "etcd-metrics": 32381, "apiserver": 36443, "kcm": 30257, "scheduler": 30259}
FEATURE_GATES = (
    "DRAListTypeAttributes=true,DRAConsumableCapacity=true,DRAPartitionableDevices=true,"
    "DRADeviceBindingConditions=true,DRAExtendedResource=true,DRADeviceTaints=true,DRADeviceTaintRules=true"
)
KUBE_API_QPS = 200
WRITE_VERBS = {"create", "update", "patch", "delete", "deletecollection"}
CLK_TCK = os.sysconf("SC_CLK_TCK")
PAGE_KIB = os.sysconf("SC_PAGE_SIZE") // 1024
GPUS, NICS = 8, 8


def family(driver: str) -> str:
    """REF for either of the reference's names (REF_NAMES); any other driver as it is."""
    return REF if driver in REF_NAMES else driver


def log(msg: str) -> None:
    print(f"# scale {time.strftime('%H:%M:%S')} {msg}", file=sys.stderr, flush=True)


def now_rfc3339(micro: bool = False) -> str:
    t = datetime.now(UTC)
    return t.strftime("%Y-%m-%dT%H:%M:%S.%fZ") if micro else t.strftime("%Y-%m-%dT%H:%M:%SZ")


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return round(s[min(len(s) - 1, int(q * len(s)))], 1)


# --- a small REST client (admin certificate) -----------------------------------------------------


class ApiError(Exception):
    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"HTTP {status}: {body[:300]}")
        self.status = status


class Api:
    """Kept-alive HTTPS connections to the API server, one per thread."""

    def __init__(self, server: str, ca: str, cert: str, key: str) -> None:
        u = urllib.parse.urlparse(server)
        self.host, self.port = u.hostname or "127.0.0.1", u.port or 443
        self.ctx = ssl.create_default_context(cafile=ca)
        self.ctx.load_cert_chain(cert, key)
        self.local = threading.local()

    def _conn(self, timeout: float | None = 60) -> http.client.HTTPSConnection:
        return http.client.HTTPSConnection(self.host, self.port, context=self.ctx, timeout=timeout)

    def request(self, method: str, path: str, body: Any = None, ctype: str = "application/json") -> Any:
        data = None if body is None else json.dumps(body).encode()
        headers = {"Accept": "application/json", "User-Agent": "tandem-bench-scale"}
        if data is not None:
            headers["Content-Type"] = ctype
        for attempt in range(3):
            conn = getattr(self.local, "conn", None)
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
            conn.request("GET", path, headers={"Accept": "application/json", "User-Agent": "tandem-bench-scale"})
            resp = conn.getresponse()
            if resp.status != 200:
                raise ApiError(resp.status, resp.read().decode(errors="replace"))
            while True:
                line = resp.readline()
                if not line:
                    return
                yield json.loads(line)
        finally:
            conn.close()

    def metrics(self) -> str:
        conn = self._conn()
        try:
            conn.request("GET", "/metrics")
            return conn.getresponse().read().decode()
        finally:
            conn.close()


def api_from(state: Path) -> Api:
    pki = state / "pki"
    return Api(
        f"https://127.0.0.1:{PORTS['apiserver']}", str(pki / "ca.crt"), str(pki / "admin.crt"), str(pki / "admin.key")
    )


# --- the control plane --------------------------------------------------------------------------


def find_bin() -> Path:
    found = sorted(Path.home().glob(".cache/tandem-cluster/*/bin/kube-apiserver"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise RuntimeError("no built cluster binaries in ~/.cache/tandem-cluster (run `hack/cluster.sh up` once)")
    return found[-1].parent


def host_ip() -> str:
    out = subprocess.run(["ip", "-4", "route", "show", "default"], capture_output=True, text=True).stdout.split()
    dev = out[out.index("dev") + 1] if "dev" in out else "lo"
    addr = subprocess.run(["ip", "-4", "-o", "addr", "show", "dev", dev], capture_output=True, text=True).stdout.split()
    return addr[3].split("/")[0] if len(addr) > 3 else "127.0.0.1"


def openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def make_pki(pki: Path, ip: str) -> None:
    """One CA; etcd's and the API server's serving certificates; client certificates of the API server
    (to etcd), the controller manager, the scheduler and an admin (system:masters); the
    service-account signing key. Kubeconfigs for the three clients."""
    pki.mkdir(parents=True, mode=0o700)
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{pki}/ca.key", "-out", f"{pki}/ca.crt",
            "-days", "2", "-subj", "/CN=tandem-scale-ca", "-addext", "keyUsage=critical,keyCertSign,cRLSign")  # fmt: skip
    certs = [
        ("etcd-server", "etcd", "", "serverAuth,clientAuth", "IP:127.0.0.1,DNS:localhost"),
        ("apiserver-etcd-client", "kube-apiserver-etcd-client", "", "clientAuth", ""),
        (
            "apiserver",
            "kube-apiserver",
            "",
            "serverAuth",
            f"IP:127.0.0.1,IP:{ip},IP:10.96.0.1,DNS:localhost,DNS:kubernetes",
        ),
        ("controller-manager", "system:kube-controller-manager", "", "clientAuth", ""),
        ("scheduler", "system:kube-scheduler", "", "clientAuth", ""),
        ("admin", "tandem-scale-admin", "system:masters", "clientAuth", ""),
    ]
    for name, cn, org, usage, sans in certs:
        subj = (f"/O={org}" if org else "") + f"/CN={cn}"
        openssl("genrsa", "-out", f"{pki}/{name}.key", "2048")
        openssl("req", "-new", "-key", f"{pki}/{name}.key", "-subj", subj, "-out", f"{pki}/{name}.csr")
        ext = [
            "basicConstraints=CA:FALSE",
            "keyUsage=critical,digitalSignature,keyEncipherment",
            f"extendedKeyUsage={usage}",
        ]
        if sans:
            ext.append(f"subjectAltName={sans}")
        (pki / f"{name}.ext").write_text("\n".join(ext) + "\n")
        openssl("x509", "-req", "-in", f"{pki}/{name}.csr", "-CA", f"{pki}/ca.crt", "-CAkey", f"{pki}/ca.key",
                "-CAcreateserial", "-days", "2", "-sha256", "-extfile", f"{pki}/{name}.ext", "-out", f"{pki}/{name}.crt")  # fmt: skip
    openssl("genrsa", "-out", f"{pki}/sa.key", "2048")
    openssl("rsa", "-in", f"{pki}/sa.key", "-pubout", "-out", f"{pki}/sa.pub")
    for name in ("controller-manager", "scheduler", "admin"):
        write_kubeconfig(
            pki / f"{name}.kubeconfig",
            pki,
            {"client-certificate": f"{pki}/{name}.crt", "client-key": f"{pki}/{name}.key"},
        )


def write_kubeconfig(path: Path, pki: Path, user: dict[str, str]) -> None:
    cfg = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "scale", "cluster": {"server": f"https://127.0.0.1:{PORTS['apiserver']}",
                                                    "certificate-authority": str(pki / "ca.crt")}}],
        "users": [{"name": "u", "user": user}],
        "contexts": [{"name": "scale", "context": {"cluster": "scale", "user": "u"}}],
        "current-context": "scale",
    }  # fmt: skip
    path.write_text(json.dumps(cfg))  # JSON is YAML
    path.chmod(0o600)


AUDIT_POLICY = {
    "apiVersion": "audit.k8s.io/v1",
    "kind": "Policy",
    "omitStages": ["RequestReceived", "ResponseStarted"],
    "rules": [{"level": "Metadata", "users": list(USERS.values())}, {"level": "None"}],
}


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    started: float


class ControlPlane:
    def __init__(self, state: Path) -> None:
        self.state = state
        self.bin = find_bin()
        self.pki = state / "pki"
        self.logs = state / "logs"
        self.procs: dict[str, Proc] = {}

    def spawn(self, name: str, args: list[str], env: dict[str, str] | None = None, cwd: Path | None = None,
              log_path: Path | None = None) -> Proc:  # fmt: skip
        log_path = log_path or self.logs / f"{name}.log"
        with open(log_path, "ab") as out:
            p = subprocess.Popen(args, stdout=out, stderr=out, stdin=subprocess.DEVNULL, env=env, cwd=cwd,
                                 start_new_session=True)  # fmt: skip
        proc = Proc(name, p, time.monotonic())
        self.procs[name] = proc
        return proc

    def up(self) -> Api:
        ip = host_ip()
        self.logs.mkdir(parents=True)
        make_pki(self.pki, ip)
        (self.state / "audit-policy.json").write_text(json.dumps(AUDIT_POLICY))
        pki, b = self.pki, self.bin
        etcd_url = f"https://127.0.0.1:{PORTS['etcd']}"
        peer = f"https://127.0.0.1:{PORTS['etcd-peer']}"
        self.spawn("etcd", [
            f"{b}/etcd", "--name", "scale", "--data-dir", str(self.state / "etcd"),
            "--listen-client-urls", etcd_url, "--advertise-client-urls", etcd_url,
            "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer, "--initial-cluster", f"scale={peer}",
            "--listen-metrics-urls", f"http://127.0.0.1:{PORTS['etcd-metrics']}",
            "--cert-file", f"{pki}/etcd-server.crt", "--key-file", f"{pki}/etcd-server.key",
            "--trusted-ca-file", f"{pki}/ca.crt", "--client-cert-auth",
            "--peer-cert-file", f"{pki}/etcd-server.crt", "--peer-key-file", f"{pki}/etcd-server.key",
            "--peer-trusted-ca-file", f"{pki}/ca.crt", "--peer-client-cert-auth",
        ])  # fmt: skip
        self.spawn("kube-apiserver", [
            f"{b}/kube-apiserver", "--advertise-address", ip, "--bind-address", "127.0.0.1",
            "--secure-port", str(PORTS["apiserver"]),
            "--etcd-servers", etcd_url, "--etcd-cafile", f"{pki}/ca.crt",
            "--etcd-certfile", f"{pki}/apiserver-etcd-client.crt", "--etcd-keyfile", f"{pki}/apiserver-etcd-client.key",
            "--tls-cert-file", f"{pki}/apiserver.crt", "--tls-private-key-file", f"{pki}/apiserver.key",
            "--client-ca-file", f"{pki}/ca.crt",
            "--authorization-mode", "Node,RBAC", "--enable-admission-plugins", "NodeRestriction",
            "--anonymous-auth=false",
            "--service-account-issuer", "https://kubernetes.default.svc.cluster.local",
            "--service-account-key-file", f"{pki}/sa.pub", "--service-account-signing-key-file", f"{pki}/sa.key",
            "--service-cluster-ip-range", "10.96.0.0/16", "--allow-privileged=true",
            "--feature-gates", FEATURE_GATES, "--profiling=false",
            "--audit-policy-file", str(self.state / "audit-policy.json"),
            "--audit-log-path", str(self.state / "audit.log"), "--audit-log-format", "json",
            "--audit-log-mode", "batch", "--audit-log-maxsize", "0",
        ])  # fmt: skip
        api = api_from(self.state)
        wait_until("the API server ready", 120, lambda: _ok(lambda: api.request("GET", "/readyz")), self.procs)
        for name, port, kc in (("kube-controller-manager", PORTS["kcm"], "controller-manager"),
                               ("kube-scheduler", PORTS["scheduler"], "scheduler")):  # fmt: skip
            args = [
                f"{b}/{name}", "--kubeconfig", f"{pki}/{kc}.kubeconfig",
                "--authentication-kubeconfig", f"{pki}/{kc}.kubeconfig",
                "--authorization-kubeconfig", f"{pki}/{kc}.kubeconfig",
                "--bind-address", "127.0.0.1", "--secure-port", str(port), "--leader-elect=false",
                "--feature-gates", FEATURE_GATES, "--profiling=false",
                # Client rate limits of a large cluster's control plane: with the defaults (20 QPS for
                # each controller, 50 for the scheduler) the claim controller's PUTs wait on the
                # client's token bucket and cap the whole run near 5 pods/s, whatever the drivers do.
                "--kube-api-qps", str(KUBE_API_QPS), "--kube-api-burst", str(2 * KUBE_API_QPS),
            ]  # fmt: skip
            if name == "kube-controller-manager":
                args += ["--use-service-account-credentials", "--service-account-private-key-file", f"{pki}/sa.key",
                         "--root-ca-file", f"{pki}/ca.crt", "--cluster-signing-cert-file", f"{pki}/ca.crt",
                         "--cluster-signing-key-file", f"{pki}/ca.key"]  # fmt: skip
            self.spawn(name, args)
        return api

    def kubectl(self, *args: str, stdin: str | None = None) -> str:
        return subprocess.run(
            [str(self.bin / "kubectl"), "--kubeconfig", str(self.pki / "admin.kubeconfig"), *args],
            input=stdin,
            capture_output=True,
            text=True,
            check=True,
        ).stdout

    def down(self) -> None:
        for proc in reversed(list(self.procs.values())):
            stop(proc.popen)


def stop(p: subprocess.Popen, timeout: float = 15) -> None:
    if p.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        p.send_signal(signal.SIGTERM)
    try:
        p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()


def _ok(fn: Any) -> bool:
    try:
        fn()
        return True
    except Exception:
        return False


def wait_until(what: str, timeout: float, pred: Any, procs: dict[str, Proc] | None = None, every: float = 0.2) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        for proc in (procs or {}).values():
            if proc.popen.poll() is not None:
                raise RuntimeError(f"{proc.name} exited ({proc.popen.returncode}) while waiting for {what}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout} s")
        time.sleep(every)


# --- cluster objects ----------------------------------------------------------------------------


def ref_objects() -> list[dict[str, Any]]:
    """The Go driver's service account, the rules of Tandem's ClusterRole for its own driver name,
    and its DeviceClasses."""
    import yaml

    docs = [d for d in yaml.safe_load_all((REPO / "daemonset.yaml").read_text()) if d]
    (role,) = [d for d in docs if d["kind"] == "ClusterRole" and d["metadata"]["name"] == "tandem-driver"]
    rules = role["rules"]
    for rule in rules:
        if DRIVER in rule.get("resourceNames", ()):
            rule["resourceNames"] = list(REF_NAMES)
    out: list[dict[str, Any]] = [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "ref-driver", "namespace": NAMESPACE}},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole", "metadata": {"name": "ref-driver"}, "rules": rules},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding", "metadata": {"name": "ref-driver"},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "ref-driver"},
         "subjects": [{"kind": "ServiceAccount", "name": "ref-driver", "namespace": NAMESPACE}]},
    ]  # fmt: skip
    # Tandem's own classes with the driver's name in place of Tandem's, extended resource names
    # included (the scheduler does more for a class that has one), so both drivers' claims cost the
    # scheduler alike. nvidia.com/gpu is Tandem's; the reference's GPUs get a name of their own.
    for d in docs:
        if d["kind"] == "DeviceClass" and d["metadata"]["name"] in (f"gpu.{DRIVER}", f"nic.{DRIVER}"):
            cls = json.loads(json.dumps(d).replace(f'"{DRIVER}', f'"{REF}'))  # CEL, extended resource name
            cls["metadata"]["name"] = d["metadata"]["name"].replace(DRIVER, REF)
            for selector in cls["spec"]["selectors"]:  # either name; the attributes are REF's (ref_devices)
                cel = selector["cel"]["expression"].replace(
                    f'device.driver == "{REF}"', f"device.driver in {json.dumps(REF_NAMES)}"
                )
                assert cel != selector["cel"]["expression"], cel
                selector["cel"]["expression"] = cel
            if cls["spec"].get("extendedResourceName", "").startswith("nvidia.com/"):
                cls["spec"]["extendedResourceName"] = f"{REF}/gpu"
            out.append(cls)
    return out


def ref_devices(devices: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Tandem's devices of a node for the reference: their attributes of Tandem's domain (a name
    without one is the publishing driver's) in REF's, which both of REF_NAMES publish, so that one
    class and one `matchAttribute` serve either."""
    out = []
    for device in devices:
        attrs = {(f"{REF}/{k.removeprefix(DRIVER + '/')}" if "/" not in k or k.startswith(DRIVER + "/") else k): v
                 for k, v in device.get("attributes", {}).items()}  # fmt: skip
        out.append({**device, "attributes": attrs})
    return out


def tandem_objects() -> list[dict[str, Any]]:
    """Everything of daemonset.yaml but the DaemonSet, as hack/cluster.sh applies it."""
    import yaml

    return [d for d in yaml.safe_load_all((REPO / "daemonset.yaml").read_text()) if d and d["kind"] != "DaemonSet"]


def template(driver: str, workload: str) -> dict[str, Any]:
    requests: list[dict[str, Any]] = [{"name": "gpu", "exactly": {"deviceClassName": f"gpu.{driver}"}}]
    spec: dict[str, Any] = {"requests": requests}
    if workload == "pair":
        requests.append({"name": "nic", "exactly": {"deviceClassName": f"nic.{driver}"}})
        spec["constraints"] = [{"requests": ["gpu", "nic"], "matchAttribute": f"{driver}/pcieSwitch"}]
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": f"{workload}-{driver.replace('.', '-')}"},
        "spec": {"spec": {"devices": spec}},
    }


def pod_object(name: str, tmpl: str, driver: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"bench-driver": driver}},
        "spec": {
            "restartPolicy": "Never",
            "automountServiceAccountToken": False,
            "terminationGracePeriodSeconds": 0,
            "resourceClaims": [{"name": "c", "resourceClaimTemplateName": tmpl}],
            "containers": [{"name": "w", "image": "busybox", "resources": {"claims": [{"name": "c"}]}}],
        },
    }


# --- the kubelet stand-in (its own process) -----------------------------------------------------


class StandIn:
    """The kubelet's part for every node: Ready nodes, plugin registration, prepare, pod status."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        from sim.kubelet import KubeletSim

        self.cfg = cfg
        self.api = api_from(Path(cfg["state"]))
        self.nodes: dict[str, dict[str, str]] = cfg["nodes"]  # node -> driver -> registry dir
        self.hold = float(cfg["hold"])
        self.plugins: dict[tuple[str, str], Any] = {}
        self._kubelet_sim = KubeletSim
        self.pool = ThreadPoolExecutor(max_workers=int(cfg.get("workers", 32)), thread_name_prefix="pod")
        self.results: dict[str, dict[str, Any]] = {}
        self.lock = threading.Lock()
        self.timers: queue.PriorityQueue[tuple[float, int, Any]] = queue.PriorityQueue()
        self.seq = 0
        self.stopping = threading.Event()

    def run(self) -> None:
        signal.signal(signal.SIGTERM, lambda *_: self.stopping.set())
        self.make_nodes()
        print("nodes-ready", flush=True)
        for target in (self.heartbeats, self.timer_loop, self.watch_pods, self.register_plugins):
            threading.Thread(target=self._guard(target), daemon=True, name=target.__name__).start()
        self.stopping.wait()
        Path(self.cfg["results"]).write_text(json.dumps(self.results))
        os._exit(0)

    def _guard(self, fn: Any) -> Any:
        def run() -> None:
            try:
                fn()
            except Exception:
                traceback.print_exc()
                sys.stderr.flush()

        return run

    # Nodes and their heartbeats, as the kubelet keeps them.
    def make_nodes(self) -> None:
        def one(node: str) -> None:
            obj = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": node, "labels": {
                "kubernetes.io/hostname": node, "kubernetes.io/os": "linux", "tandem.dev/enabled": "true"}}}  # fmt: skip
            with contextlib.suppress(ApiError):
                self.api.request("POST", "/api/v1/nodes", obj)
            self.node_status(node)
            got = self.api.request("GET", f"/api/v1/nodes/{node}")
            lease = {
                "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                "metadata": {"name": node, "namespace": "kube-node-lease", "ownerReferences": [
                    {"apiVersion": "v1", "kind": "Node", "name": node, "uid": got["metadata"]["uid"]}]},
                "spec": {"holderIdentity": node, "leaseDurationSeconds": 40, "renewTime": now_rfc3339(True)},
            }  # fmt: skip
            with contextlib.suppress(ApiError):
                self.api.request("POST", "/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases", lease)

        with ThreadPoolExecutor(8) as ex:
            list(ex.map(one, self.nodes))

    def node_status(self, node: str) -> None:
        t = now_rfc3339()
        res = {"cpu": "192", "memory": "2Ti", "pods": "110"}
        body = {"status": {
            "capacity": res, "allocatable": res,
            "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "kubelet stand-in",
                            "lastHeartbeatTime": t, "lastTransitionTime": t}],
            "nodeInfo": {"kubeletVersion": "v1.37.2", "operatingSystem": "linux", "architecture": "amd64"},
        }}  # fmt: skip
        self.api.request("PATCH", f"/api/v1/nodes/{node}/status", body, "application/strategic-merge-patch+json")

    def heartbeats(self) -> None:
        last_status = time.monotonic()
        while not self.stopping.wait(10):
            for node in self.nodes:
                with contextlib.suppress(Exception):
                    self.api.request("PATCH", f"/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/{node}",
                                     {"spec": {"renewTime": now_rfc3339(True)}}, "application/merge-patch+json")  # fmt: skip
            if time.monotonic() - last_status >= 300:
                last_status = time.monotonic()
                for node in self.nodes:
                    with contextlib.suppress(Exception):
                        self.node_status(node)

    # Plugin registration, as the kubelet's plugin watcher finds the registration sockets.
    def register_plugins(self) -> None:
        pending = [(n, d) for n, drivers in self.nodes.items() for d in drivers]
        while pending and not self.stopping.is_set():
            left = []
            for node, driver in pending:
                sim = self._kubelet_sim(self.nodes[node][driver])
                try:
                    sock = sim.wait_for_registration_socket(driver, timeout=0)
                    sim.register(sock)
                except Exception:
                    left.append((node, driver))
                    continue
                self.plugins[(node, driver)] = sim
            pending = left
            print(f"registered {len(self.plugins)}", flush=True)
            if pending:
                time.sleep(0.5)

    # Pods bound to the nodes.
    def watch_pods(self) -> None:
        sel = urllib.parse.quote("spec.nodeName!=")
        while not self.stopping.is_set():
            listed = self.api.request("GET", f"/api/v1/pods?fieldSelector={sel}")
            for pod in listed["items"]:
                self.on_pod(pod)
            rv = listed["metadata"]["resourceVersion"]
            try:
                for ev in self.api.watch(f"/api/v1/pods?watch=1&fieldSelector={sel}&resourceVersion={rv}"
                                         "&allowWatchBookmarks=true&timeoutSeconds=3600"):  # fmt: skip
                    if ev["type"] in ("ADDED", "MODIFIED"):
                        self.on_pod(ev["object"])
            except Exception:
                traceback.print_exc()

    def on_pod(self, pod: dict[str, Any]) -> None:
        md, spec, status = pod["metadata"], pod["spec"], pod.get("status") or {}
        node = spec.get("nodeName")
        if node not in self.nodes or md.get("deletionTimestamp") or status.get("phase") not in (None, "Pending"):
            return
        uid = md["uid"]
        with self.lock:
            if uid in self.results:
                return
            self.results[uid] = {"name": md["name"], "ns": md["namespace"], "node": node, "bound": time.time()}
        self.pool.submit(self._guard(lambda: self.start_pod(pod)))

    def claims_of(self, pod: dict[str, Any]) -> dict[str, list[Any]]:
        from sim.kubelet import ClaimRef

        by_driver: dict[str, list[Any]] = defaultdict(list)
        ns = pod["metadata"]["namespace"]
        for s in (pod.get("status") or {}).get("resourceClaimStatuses") or []:
            name = s.get("resourceClaimName")
            if not name:
                continue
            claim = self.api.request("GET", f"/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaims/{name}")
            drivers = {r["driver"] for r in claim["status"]["allocation"]["devices"]["results"]}
            for d in drivers:
                by_driver[d].append(ClaimRef(ns, name, claim["metadata"]["uid"]))
        return by_driver

    def start_pod(self, pod: dict[str, Any]) -> None:
        uid, node = pod["metadata"]["uid"], pod["spec"]["nodeName"]
        rec = self.results[uid]
        rec["prep_start"] = time.time()
        for attempt in range(10):
            try:
                by_driver = self.claims_of(pod)
                rec["drivers"] = sorted(by_driver)
                t0 = time.time()
                for driver, refs in by_driver.items():
                    answers = self.plugins[(node, driver)].prepare(refs)
                    errors = [r.error for r in answers.values() if r.error]
                    if errors:
                        raise RuntimeError("; ".join(errors))
                rec["prep_ms"] = (time.time() - t0) * 1000
                rec["prep_end"] = time.time()
                break
            except Exception as e:
                rec.setdefault("errors", []).append(str(e)[:300])
                print(f"prepare {rec['ns']}/{rec['name']} on {node}: {e}", file=sys.stderr, flush=True)
                time.sleep(min(2.0, 0.2 * 2**attempt))
        else:
            return
        self.set_phase(pod, "Running")
        rec["running"] = time.time()
        rec["_refs"] = by_driver
        with self.lock:
            self.seq += 1
            self.timers.put((time.monotonic() + self.hold, self.seq, pod))

    def timer_loop(self) -> None:
        while not self.stopping.is_set():
            due, _, pod = self.timers.get()
            delay = due - time.monotonic()
            if delay > 0:
                time.sleep(min(delay, 0.5))
                self.timers.put((due, _, pod))
                continue
            self.pool.submit(self._guard(lambda p=pod: self.finish_pod(p)))

    def finish_pod(self, pod: dict[str, Any]) -> None:
        uid, node = pod["metadata"]["uid"], pod["spec"]["nodeName"]
        rec = self.results[uid]
        t0 = time.time()
        for driver, refs in rec.pop("_refs").items():
            errs = self.plugins[(node, driver)].unprepare(refs)
            if any(errs.values()):
                rec.setdefault("errors", []).append(f"unprepare: {errs}")
        rec["unprep_ms"] = (time.time() - t0) * 1000
        self.set_phase(pod, "Succeeded")
        rec["done"] = time.time()
        with self.lock:  # two threads' prints interleave ("done scale-pairdone scale-pair"): one at a time
            print(f"done {rec['ns']}", flush=True)  # the bench counts these instead of listing pods

    def set_phase(self, pod: dict[str, Any], phase: str) -> None:
        t = now_rfc3339()
        running = phase == "Running"
        state = (
            {"running": {"startedAt": t}}
            if running
            else {"terminated": {"exitCode": 0, "reason": "Completed", "startedAt": t, "finishedAt": t}}
        )
        ready = "True" if running else "False"
        body = {"status": {
            "phase": phase, "hostIP": "127.0.0.1", "startTime": t,
            "conditions": [{"type": c, "status": s, "lastTransitionTime": t} for c, s in (
                ("PodReadyToStartContainers", "True"), ("Initialized", "True"), ("Ready", ready), ("ContainersReady", ready))],
            "containerStatuses": [{"name": "w", "image": "busybox", "imageID": "", "ready": running, "started": running,
                                   "restartCount": 0, "state": state}],
        }}  # fmt: skip
        md = pod["metadata"]
        self.api.request("PATCH", f"/api/v1/namespaces/{md['namespace']}/pods/{md['name']}/status", body,
                         "application/strategic-merge-patch+json")  # fmt: skip


def standin_main(config: Path) -> int:
    StandIn(json.loads(config.read_text())).run()
    return 0


# --- processes' CPU, memory, the machine's load --------------------------------------------------


def image_like() -> dict[str, str]:
    """Tandem started from this checkout as the image starts it: with its modules' bytecode compiled
    (pip compiles at install; without it every instance compiles the whole driver again, 0.3 CPU-s,
    when PYTHONDONTWRITEBYTECODE is set as here) and its commit in TANDEM_COMMIT (the image's
    build arg; otherwise every instance asks git). Returns the environment to add."""
    fake_nvml = REPO / "sim" / "fake_pynvml"
    subprocess.run([sys.executable, "-m", "compileall", "-q", "driver", "cdi", str(fake_nvml)], cwd=REPO,
                   check=True, stdout=subprocess.DEVNULL)  # fmt: skip
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=False)
    return {"TANDEM_COMMIT": head.stdout.strip()} if head.returncode == 0 else {}


def cpu_s(pid: int) -> float:
    try:
        f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(f[11]) + int(f[12])) / CLK_TCK


def mem_kib(pid: int) -> tuple[int, int]:
    """(RSS, PSS) in KiB: PSS shares the pages many instances map (the interpreter, libraries) fairly."""
    rss = pss = 0
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Rss:"):
                rss = int(line.split()[1])
            elif line.startswith("Pss:"):
                pss = int(line.split()[1])
    return rss, pss


class Sampler:
    """CPU seconds of each group of processes between two marks, and the load average every 2 s."""

    def __init__(self, groups: dict[str, list[int]]) -> None:
        self.groups = groups
        self.loads: list[tuple[float, float]] = []
        self.stop = threading.Event()
        threading.Thread(target=self._loop, daemon=True).start()

    def _loop(self) -> None:
        while not self.stop.wait(2):
            self.loads.append((time.monotonic(), float(Path("/proc/loadavg").read_text().split()[0])))

    def mark(self) -> tuple[float, dict[str, float], float]:
        total = sum(int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:8]) / CLK_TCK
        return time.monotonic(), {g: sum(cpu_s(p) for p in pids) for g, pids in self.groups.items()}, total

    def between(
        self, a: tuple[float, dict[str, float], float], b: tuple[float, dict[str, float], float]
    ) -> dict[str, Any]:
        secs = b[0] - a[0]
        loads = [v for t, v in self.loads if a[0] <= t <= b[0]]
        return {
            "seconds": round(secs, 1),
            "cpu_cores": {g: round((b[1][g] - a[1][g]) / secs, 3) for g in self.groups},
            "machine_cpu_busy_cores": round((b[2] - a[2]) / secs, 2) if b[2] > a[2] else None,
            "load1_mean": round(statistics.mean(loads), 2) if loads else None,
            "load1_max": max(loads) if loads else None,
        }


def audit_counts(path: Path, t0: float, t1: float) -> dict[str, Any]:
    """Requests of each driver received in [t0, t1) (wall-clock seconds), by verb and resource."""
    out: dict[str, Any] = {}
    by: dict[str, Counter[str]] = {d: Counter() for d in USERS}
    users = {u: d for d, u in USERS.items()}
    with contextlib.suppress(FileNotFoundError), open(path) as f:
        for line in f:
            ev = json.loads(line)
            d = users.get(ev.get("user", {}).get("username", ""))
            if d is None:
                continue
            ts = datetime.fromisoformat(ev["requestReceivedTimestamp"].replace("Z", "+00:00")).timestamp()
            if not t0 <= ts < t1:
                continue
            ref = ev.get("objectRef") or {}
            res = ref.get("resource", "?") + ("/" + ref["subresource"] if ref.get("subresource") else "")
            by[d][f"{ev['verb']} {res}"] += 1
    secs = t1 - t0
    for d, c in by.items():
        total = sum(c.values())
        writes = sum(n for k, n in c.items() if k.split()[0] in WRITE_VERBS)
        out[d] = {"requests": total, "writes": writes, "per_s": round(total / secs, 3),
                  "writes_per_s": round(writes / secs, 3), "by_verb": dict(c.most_common())}  # fmt: skip
    return out


def apiserver_requests(api: Api) -> float:
    total = 0.0
    for line in api.metrics().splitlines():
        if line.startswith("apiserver_request_total{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


# --- the bench ----------------------------------------------------------------------------------


@dataclass
class Plan:
    nodes: int = 100
    pods: int = 1000  # per workload, alternating between the two drivers
    rate: float = 5.0  # pods created per second
    hold: float = 5.0  # seconds a pod runs before it Succeeds
    idle: float = 60.0


class SliceWatch:
    """Devices each (driver, node) has published, from a watch; when each pool was first complete."""

    def __init__(self, api: Api) -> None:
        self.api = api
        self.slices: dict[str, tuple[str, str, int]] = {}
        self.complete: dict[tuple[str, str], float] = {}
        self.expected: dict[tuple[str, str], int] = {}
        self.devices: dict[str, list[dict[str, Any]]] = {}
        self.cond = threading.Condition()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            try:
                listed = self.api.request("GET", "/apis/resource.k8s.io/v1/resourceslices")
                for s in listed["items"]:
                    self._on(s, False)
                rv = listed["metadata"]["resourceVersion"]
                for ev in self.api.watch(
                    f"/apis/resource.k8s.io/v1/resourceslices?watch=1&resourceVersion={rv}&timeoutSeconds=3600"
                ):
                    self._on(ev["object"], ev["type"] == "DELETED")
            except Exception:
                time.sleep(0.5)

    def _on(self, s: dict[str, Any], deleted: bool) -> None:
        if "spec" not in s:
            return
        t = time.monotonic()
        name, spec = s["metadata"]["name"], s["spec"]
        with self.cond:
            if deleted:
                self.slices.pop(name, None)
                self.devices.pop(name, None)
            else:
                driver = family(spec["driver"])
                self.slices[name] = (driver, spec.get("nodeName", ""), len(spec.get("devices") or []))
                self.devices[name] = spec.get("devices") or []
            counts: Counter[tuple[str, str]] = Counter()
            for d, n, c in self.slices.values():
                counts[(d, n)] += c
            for key, want in self.expected.items():
                if key not in self.complete and counts[key] >= want:
                    self.complete[key] = t
            self.cond.notify_all()

    def expect(self, driver: str, nodes: list[str], devices: dict[str, int]) -> None:
        with self.cond:
            for n in nodes:
                self.expected[(driver, n)] = devices[n]
            self._on({}, False)

    def wait(self, driver: str, nodes: list[str], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with self.cond:
            while not all((driver, n) in self.complete for n in nodes):
                left = deadline - time.monotonic()
                if left <= 0:
                    done = sum((driver, n) in self.complete for n in nodes)
                    raise TimeoutError(f"{driver}: {done}/{len(nodes)} nodes published within {timeout} s")
                self.cond.wait(min(left, 1))

    def node_devices(self, driver: str, node: str) -> list[dict[str, Any]]:
        with self.cond:
            return [
                d
                for name, (drv, n, _) in self.slices.items()
                if drv == driver and n == node
                for d in self.devices[name]
            ]


class ScaleBench:
    def __init__(self, plan: Plan, state: Path, refdriver: Path) -> None:
        self.plan, self.state, self.refdriver = plan, state, refdriver
        self.cp = ControlPlane(state)
        self.nodes = [f"scale-node-{i:03d}" for i in range(plan.nodes)]
        self.ref_name = {node: REF_NAMES[i % 2] for i, node in enumerate(self.nodes)}  # REF_NAMES says why
        self.tandem: dict[str, Proc] = {}
        self.go: dict[str, Proc] = {}
        self.standin: subprocess.Popen | None = None
        self.lines: queue.Queue[str] = queue.Queue()
        self.done: Counter[str] = Counter()  # pods Succeeded, by namespace, as the stand-in reports them
        self.done_lock = threading.Lock()
        self.out: dict[str, Any] = {"plan": plan.__dict__.copy()}

    def node_dir(self, node: str) -> Path:
        return self.state / "nodes" / node

    def run(self) -> dict[str, Any]:
        t = time.monotonic()
        api = self.api = self.cp.up()
        self.cp.kubectl("apply", "-f", "-", stdin=json.dumps({"apiVersion": "v1", "kind": "List",
                                                               "items": tandem_objects() + ref_objects()}))  # fmt: skip
        log(f"control plane up in {time.monotonic() - t:.0f} s; rendering {len(self.nodes)} simulated nodes")
        self.render_nodes()
        self.start_standin()
        self.wait_line("nodes-ready", 120)
        wait_until("nodes Ready and untainted", 120, self.nodes_ready, self.cp.procs, every=1)
        self.tokens()
        slices = SliceWatch(api)
        self.out["start"] = {}
        # Tandem: every instance at once; then the Go driver with the devices Tandem published.
        slices.expect(DRIVER, self.nodes, dict.fromkeys(self.nodes, GPUS + NICS))
        self.out["start"][DRIVER] = self.start_all(DRIVER, slices)
        for node in self.nodes:
            devs = ref_devices(slices.node_devices(DRIVER, node))
            (self.node_dir(node) / "ref" / "devices.json").write_text(json.dumps(devs))
        slices.expect(REF, self.nodes, dict.fromkeys(self.nodes, GPUS + NICS))
        self.out["start"][REF] = self.start_all(REF, slices)
        self.wait_registered()
        groups = {
            "tandem_total": [p.popen.pid for p in self.tandem.values()],
            "go_total": [p.popen.pid for p in self.go.values()],
            **{n: [p.popen.pid] for n, p in self.cp.procs.items() if n.startswith(("etcd", "kube-"))},
            "kubelet_standin": [self.standin.pid] if self.standin else [],
        }
        self.sampler = Sampler(groups)
        self.out["idle"] = self.window("idle", lambda: self.sleep_paced(self.plan.idle))
        for workload in ("pair", "gpu"):
            self.out[workload] = self.window(workload, lambda w=workload: self.churn(w))
        self.out["idle_after"] = self.window("idle_after", lambda: self.sleep_paced(min(30.0, self.plan.idle)))
        self.collect_latencies()
        return self.out

    # -- setup
    def render_nodes(self) -> None:
        from demo.node import SimNode
        from sim.profile import h100_node

        self.sim: dict[str, Any] = {}
        for node in self.nodes:
            self.sim[node] = SimNode.create(self.node_dir(node), h100_node(node, GPUS, NICS))
            for d in ("registry", "plugins", "cdi"):
                (self.node_dir(node) / "ref" / d).mkdir(parents=True, exist_ok=True)

    def start_standin(self) -> None:
        cfg = {
            "state": str(self.state),
            "nodes": {n: {DRIVER: str(self.node_dir(n) / "registry"), self.ref_name[n]: str(self.node_dir(n) / "ref" / "registry")}
                      for n in self.nodes},
            "hold": self.plan.hold,
            "results": str(self.state / "standin-results.json"),
        }  # fmt: skip
        (self.state / "standin.json").write_text(json.dumps(cfg))
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        with open(self.cp.logs / "standin.log", "ab") as err:
            self.standin = subprocess.Popen(
                [sys.executable, str(Path(__file__).resolve()), "standin", str(self.state / "standin.json")],
                stdout=subprocess.PIPE, stderr=err, text=True, env=env, start_new_session=True,
            )  # fmt: skip

        def read() -> None:
            assert self.standin and self.standin.stdout
            for line in self.standin.stdout:
                if line.startswith("done "):
                    with self.done_lock:
                        self.done[line.split()[1]] += 1
                else:
                    self.lines.put(line.strip())

        threading.Thread(target=read, daemon=True).start()

    def wait_line(self, prefix: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"the kubelet stand-in did not say {prefix!r} within {timeout} s") from None
            if line.startswith(prefix):
                return line

    def wait_registered(self) -> None:
        want = 2 * len(self.nodes)
        deadline = time.monotonic() + 300
        while True:
            line = self.wait_line("registered", max(1, deadline - time.monotonic()))
            if int(line.split()[1]) >= want:
                return

    def nodes_ready(self) -> bool:
        items = self.api.request("GET", "/api/v1/nodes?labelSelector=tandem.dev%2Fenabled%3Dtrue")["items"]
        ok = [n for n in items if not (n["spec"].get("taints")) and any(
            c["type"] == "Ready" and c["status"] == "True" for c in n["status"].get("conditions", []))]  # fmt: skip
        return len(ok) >= len(self.nodes)

    def tokens(self) -> None:
        def one(node: str) -> None:
            uid = self.api.request("GET", f"/api/v1/nodes/{node}")["metadata"]["uid"]
            for driver, sa in ((DRIVER, "tandem-driver"), (REF, "ref-driver")):
                req = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": {
                    "expirationSeconds": 86400, "boundObjectRef": {"kind": "Node", "apiVersion": "v1", "name": node, "uid": uid}}}  # fmt: skip
                tok = self.api.request("POST", f"/api/v1/namespaces/{NAMESPACE}/serviceaccounts/{sa}/token", req)
                path = self.node_dir(node) / ("kubeconfig" if driver == DRIVER else "ref/kubeconfig")
                write_kubeconfig(path, self.cp.pki, {"token": tok["status"]["token"]})

        with ThreadPoolExecutor(8) as ex:
            list(ex.map(one, self.nodes))

    def start_all(self, driver: str, slices: SliceWatch) -> dict[str, Any]:
        log(f"starting {len(self.nodes)} instances of {driver}")
        procs = self.tandem if driver == DRIVER else self.go
        as_in_image = image_like() if driver == DRIVER else {}
        t0 = time.monotonic()
        for node in self.nodes:
            d = self.node_dir(node)
            if driver == DRIVER:
                sim = self.sim[node]
                env = {**os.environ, **sim.env, **as_in_image,
                       "PYTHONPATH": os.pathsep.join([sim.env["PYTHONPATH"], str(REPO)])}  # fmt: skip
                args = sim.daemon_args(d / "kubeconfig")
                procs[node] = self.cp.spawn(f"tandem-{node}", args, env=env, log_path=d / "tandem.log")
            else:
                r = d / "ref"
                args = [str(self.refdriver), "-mode", "tandem-work", "-driver-name", self.ref_name[node], "-node-name", node,
                        "-kubeconfig", str(r / "kubeconfig"), "-kubelet-registrar-dir", str(r / "registry"),
                        "-kubelet-plugins-dir", str(r / "plugins"), "-cdi-root", str(r / "cdi"),
                        "-devices-file", str(r / "devices.json"), "-checkpoint-fsync=false"]  # fmt: skip
                procs[node] = self.cp.spawn(f"go-{node}", args, log_path=r / "refdriver.log")
        spawned = time.monotonic() - t0
        try:
            slices.wait(driver, self.nodes, 600)
        finally:
            dead = [n for n, p in procs.items() if p.popen.poll() is not None]
            if dead:
                log(f"{driver}: {len(dead)} instances exited, e.g. {dead[0]}")
        per = [slices.complete[(driver, n)] - procs[n].started for n in self.nodes]
        cpu = [cpu_s(procs[n].popen.pid) for n in self.nodes]
        return {
            # CPU each instance spent from its start until all were published: how many cores a
            # start of all N at once needs to publish within a given time.
            "cpu_s_per_instance_to_published": round(statistics.mean(cpu), 2),
            "all_published_s": round(max(slices.complete[(driver, n)] for n in self.nodes) - t0, 1),
            "spawn_all_s": round(spawned, 1),
            "per_instance_start_to_published_s": {"p50": pct(per, 0.5), "max": round(max(per), 1)},
        }

    # -- measurement windows
    def sleep_paced(self, secs: float) -> None:
        time.sleep(secs)  # an idle window: nothing to wait for, by design

    def window(self, name: str, body: Any) -> dict[str, Any]:
        log(f"window {name}")
        a, wall0, req0 = self.sampler.mark(), time.time(), apiserver_requests(self.api)
        extra = body()
        b, wall1, req1 = self.sampler.mark(), time.time(), apiserver_requests(self.api)
        out = self.sampler.between(a, b)
        out["apiserver_requests_per_s"] = round((req1 - req0) / (wall1 - wall0), 1)
        time.sleep(2)  # the audit log is written in batches (about 1 s)
        out["driver_requests"] = audit_counts(self.state / "audit.log", wall0, wall1)
        n = len(self.nodes)
        for key, procs in (("tandem", self.tandem), ("go", self.go)):
            rss, pss = map(sum, zip(*(mem_kib(p.popen.pid) for p in procs.values()), strict=True))
            cores = out["cpu_cores"][f"{key}_total"]
            out[f"{key}_memory"] = {"rss_total_mib": rss // 1024, "pss_total_mib": pss // 1024,
                                    "rss_per_instance_mib": round(rss / n / 1024, 1)}  # fmt: skip
            out[f"{key}_cpu_per_instance_pct_core"] = round(100 * cores / n, 3)
        if extra:
            out.update(extra)
        return out

    def churn(self, workload: str) -> dict[str, Any]:
        ns = f"scale-{workload}"
        self.api.request(
            "POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}}
        )
        wait_until("the default service account", 60,
                   lambda: _ok(lambda: self.api.request("GET", f"/api/v1/namespaces/{ns}/serviceaccounts/default")))  # fmt: skip
        for driver in (DRIVER, REF):
            self.api.request(
                "POST", f"/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaimtemplates", template(driver, workload)
            )
        created: dict[str, tuple[float, str]] = {}
        t0 = time.monotonic() + 0.5
        wall_off = time.time() - time.monotonic()

        def create(i: int) -> None:
            # Alternating ABBA, not ABAB: in strict alternation each driver's pods always follow
            # the other's by the same interval, and whatever recurs with that phase (the claim
            # controller's or the scheduler's work for the previous pod) falls on one driver only.
            driver = (DRIVER, REF, REF, DRIVER)[i % 4]
            name = f"{workload}-{i:05d}"
            delay = t0 + i / self.plan.rate - time.monotonic()
            if delay > 0:
                time.sleep(delay)  # the steady creation schedule
            tc = time.monotonic() + wall_off
            self.api.request("POST", f"/api/v1/namespaces/{ns}/pods",
                             pod_object(name, f"{workload}-{driver.replace('.', '-')}", driver))  # fmt: skip
            created[name] = (tc, driver)

        with ThreadPoolExecutor(8) as ex:
            list(ex.map(create, range(self.plan.pods)))
        create_s = time.monotonic() - t0
        # Until every pod Succeeded (the stand-in ran it, held it and released its claims).
        wait_until(
            f"{workload} pods done", 600, lambda: self.done_count(ns) >= self.plan.pods, self.cp.procs, every=0.2
        )
        self.created = getattr(self, "created", {})
        self.created.update({(ns, k): v for k, v in created.items()})
        return {"pods": self.plan.pods, "create_rate_per_s": round(self.plan.pods / create_s, 1)}

    def done_count(self, ns: str) -> int:
        with self.done_lock:
            return self.done[ns]

    def collect_latencies(self) -> None:
        assert self.standin
        self.standin.send_signal(signal.SIGTERM)
        self.standin.wait(60)
        results = json.loads((self.state / "standin-results.json").read_text())
        by_pod = {(r["ns"], r["name"]): r for r in results.values()}
        for workload in ("pair", "gpu"):
            ns = f"scale-{workload}"
            per: dict[str, dict[str, list[float]]] = {d: defaultdict(list) for d in (DRIVER, REF)}
            bound_times, errors = [], 0
            for (n, name), (tc, driver) in self.created.items():
                if n != ns:
                    continue
                r = by_pod.get((ns, name))
                if r is None or "running" not in r:
                    per[driver]["missing"].append(1)
                    continue
                errors += bool(r.get("errors"))
                bound_times.append(r["bound"])
                per[driver]["bound_ms"].append((r["bound"] - tc) * 1000)
                per[driver]["running_ms"].append((r["running"] - tc) * 1000)
                per[driver]["prepare_ms"].append(r["prep_ms"])
                per[driver]["standin_wait_ms"].append((r["prep_start"] - r["bound"]) * 1000)
                per[driver]["status_patch_ms"].append((r["running"] - r["prep_end"]) * 1000)
                per[driver]["unprepare_ms"].append(r.get("unprep_ms", 0))
            first = min(tc for (n, _), (tc, _d) in self.created.items() if n == ns)
            out = self.out[workload]
            out["scheduling_pods_per_s"] = (
                round(len(bound_times) / (max(bound_times) - first), 1) if bound_times else None
            )
            out["pods_with_retried_prepare"] = errors
            for d, m in per.items():
                out[d] = {
                    k: {"p50": pct(v, 0.5), "p99": pct(v, 0.99), "n": len(v)} for k, v in m.items() if k != "missing"
                }
                out[d]["missing"] = len(m.get("missing", []))
            t, g = out[DRIVER]["running_ms"]["p99"], out[REF]["running_ms"]["p99"]
            out["running_p99_tandem_over_go"] = round(t / g, 2) if t and g else None

    def close(self) -> None:
        if self.standin and self.standin.poll() is None:
            stop(self.standin)
        for group in (self.tandem, self.go):
            with ThreadPoolExecutor(16) as ex:
                list(ex.map(lambda p: stop(p.popen, 20), group.values()))
        self.cp.down()


def bench_scale(quick: bool, nodes: int | None = None, pods: int | None = None, rate: float | None = None,
                keep: bool = False) -> dict[str, Any]:  # fmt: skip
    """The `scale` section of hack/bench.py."""
    n = nodes or int(os.environ.get("TANDEM_SCALE_NODES", "10" if quick else "100"))
    plan = Plan(nodes=n, pods=200 if quick else 1000, rate=4.0 if quick else 5.0, hold=3.0 if quick else 5.0,
                idle=20.0 if quick else 60.0)  # fmt: skip
    if pods:
        plan.pods = pods
    if rate:
        plan.rate = rate
    binary, why = bench_reference.build_reference()
    if binary is None:
        return {"skipped": f"the Go reference driver: {why}"}
    try:
        find_bin()
    except RuntimeError as e:
        return {"skipped": str(e)}
    state = Path(tempfile.mkdtemp(prefix="tandem-scale-"))
    bench = ScaleBench(plan, state, binary)
    t0, load0 = time.monotonic(), Path("/proc/loadavg").read_text().split()[:3]
    try:
        out = bench.run()
    finally:
        bench.close()
        if not keep:
            shutil.rmtree(state, ignore_errors=True)
        else:
            log(f"state kept in {state}")
    out["machine"] = {"cores": os.cpu_count(), "loadavg_before": load0, "loadavg_after": Path("/proc/loadavg").read_text().split()[:3],
                      "wall_s": round(time.monotonic() - t0)}  # fmt: skip
    return out


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "standin":
        return standin_main(Path(sys.argv[2]))
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--nodes", type=int)
    p.add_argument("--pods", type=int, help="pods per workload (half for each driver)")
    p.add_argument("--rate", type=float, help="pods created per second")
    p.add_argument("--keep", action="store_true", help="keep the state directory (logs, audit log)")
    a = p.parse_args()
    json.dump(bench_scale(a.quick, a.nodes, a.pods, a.rate, a.keep), sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
