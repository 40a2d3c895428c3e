"""The daemon's status socket and `tandemctl` against it, in-process."""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import pytest

from driver.claims.allocation import PrepareSettings
from driver.claims.checkpoint import ClaimRecord, DeviceRecord
from driver.claims.files import ClaimFiles
from driver.claims.metadata import MetadataWriter
from driver.claims.vocabulary import PrepareState
from driver.ctl import commands as ctl
from driver.events import EventRecorder
from driver.health.cordon import CordonStore
from driver.health.gpu.release import GpuReleases
from driver.inventory.store import Inventory
from driver.kube.api import KubeAPI
from driver.model import NUMA_NODE, PCI_BUS_ID, PCIE_ROOT, Condition, Device, DeviceKind, GpuInfo, TaintEffect
from driver.node.nvml import NvmlAccess
from driver.status.documents import ClaimFacts
from driver.status.server import MAX_BODY, StatusServer
from sim.nvml import fake_pynvml_in_process, write_state
from sim.profile import h100_node

GPU0 = Device(
    name="gpu-0",
    kind=DeviceKind.GPU,
    attributes={
        "productName": "NVIDIA H100 80GB HBM3",
        "uuid": "GPU-aaaa",
        NUMA_NODE: 0,
        PCIE_ROOT: "pci0000:15",
        PCI_BUS_ID: "0000:1b:00.0",
    },
    gpu=GpuInfo(minor=0, uuid="GPU-aaaa", pci_bus_id="0000:1b:00.0"),
)
GPU1 = Device(
    name="gpu-1",
    kind=DeviceKind.GPU,
    attributes={
        "productName": "NVIDIA H100 80GB HBM3",
        NUMA_NODE: 1,
        PCIE_ROOT: "pci0000:97",
        PCI_BUS_ID: "0000:9b:00.0",
    },
    gpu=GpuInfo(minor=1, uuid="GPU-bbbb", pci_bus_id="0000:9b:00.0"),
)
NIC0 = Device(
    name="nic-0000-1d-00-0",
    kind=DeviceKind.NIC,
    attributes={
        "ifName": "ens1f0np0",
        "rdmaDevice": "mlx5_0",
        NUMA_NODE: 0,
        PCIE_ROOT: "pci0000:15",
        PCI_BUS_ID: "0000:1d:00.0",
    },
)
_PEER = f"uid {os.getuid()}, pid {os.getpid()}"  # the clients of these tests are this process
XID = Condition("tandem.dev/xid", TaintEffect.NO_EXECUTE, "79", message="XID 79: GPU has fallen off the bus")


@dataclass
class Node:
    sock: Path
    plugins_dir: Path
    inventory: Inventory
    server: StatusServer
    prepared: dict[str, ClaimRecord] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)
    events: EventRecorder | None = None  # its failed prepares are the claims' last errors

    def get(self, path: str) -> tuple[int, Any]:
        return ctl.request(self.sock, "GET", path, None, timeout=5)

    def post(self, path: str, body: dict[str, Any]) -> tuple[int, Any]:
        return ctl.request(self.sock, "POST", path, body, timeout=5)

    def ctl(self, *args: str) -> int:
        return ctl.main(["--socket", str(self.sock), *args])

    def taints(self, device: str) -> list[dict[str, str]]:
        _, doc = self.get("/devices")
        return next(d["taints"] for d in doc["devices"] if d["name"] == device)


@pytest.fixture
def tmp_short() -> Iterator[Path]:
    """Unix socket paths are limited to 107 bytes; pytest's tmp_path can be longer."""
    path = Path(tempfile.mkdtemp(prefix="td-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _facts(
    data_dir: Path, prepared: Callable[[], dict[str, ClaimRecord]] = dict, events: EventRecorder | None = None
) -> ClaimFacts:
    """The claims side of the socket: `prepared`, their files under `data_dir`, `events`' failures."""
    settings = PrepareSettings("tandem.dev", "node-a", data_dir / "cdi", data_dir / "dev")
    files = ClaimFiles(settings, MetadataWriter(data_dir, data_dir / "cdi", "tandem.dev"))
    if events is None:
        return ClaimFacts(prepared, files, lambda _uid: None, list)
    return ClaimFacts(prepared, files, events.last_failure, events.failures)


def _releases(data_dir: Path, inv: Inventory, access: NvmlAccess | None = None) -> GpuReleases:
    """Releases with NVML access of their own: the process-wide one is not these tests' to change."""
    return GpuReleases(data_dir, inv, access=access or NvmlAccess(), timeout=0.2)


@pytest.fixture
def node(tmp_short: Path) -> Iterator[Node]:
    data_dir = tmp_short / "tandem.dev"
    data_dir.mkdir()
    inv = Inventory()
    inv.replace("gpu", [GPU0, GPU1])
    inv.replace("nic", [NIC0])
    prepared: dict[str, ClaimRecord] = {}
    info: dict[str, Any] = {}
    cordons = CordonStore(data_dir, inv)
    cordons.load()
    releases = _releases(data_dir, inv)
    events = EventRecorder(cast(KubeAPI, None), "tandem.dev", "node-a", list)  # never started: remembers only
    facts = _facts(data_dir, lambda: prepared, events)
    server = StatusServer(data_dir / "status.sock", inv, facts, cordons, releases, lambda: info)
    server.start()
    yield Node(data_dir / "status.sock", tmp_short, inv, server, prepared, info, events)
    server.stop()


def _claim(
    ns: str, name: str, *devices: str, state: str = "PrepareCompleted", pods: tuple[str, ...] = ()
) -> ClaimRecord:
    recs = tuple(DeviceRecord(request_names=("r",), pool="node-a", device=d) for d in devices)
    return ClaimRecord(namespace=ns, name=name, uid=f"uid-{name}", state=state, devices=recs, pods=pods)


# --- the endpoint ------------------------------------------------------------------------------


def test_socket_is_root_only(node: Node) -> None:
    st = node.sock.lstat()
    assert stat.S_ISSOCK(st.st_mode)
    assert stat.S_IMODE(st.st_mode) == 0o600
    assert list(node.sock.parent.glob(".st-*")) == []  # the private bind dir is gone


def test_speaks_plain_http_1_1(node: Node) -> None:
    """So `curl --unix-socket` works without tandemctl."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(5)
        s.connect(str(node.sock))
        s.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    assert b"content-type: application/json" in head.lower()
    assert json.loads(body)["status"] == "healthy"


def test_devices(node: Node) -> None:
    node.prepared["u1"] = _claim("ml", "train", "gpu-0", "nic-0000-1d-00-0", pods=("train-0",))
    node.prepared["u2"] = _claim("ml", "eval", "gpu-0")  # recorded by an older release: no pods
    node.inventory.set_conditions("gpu", "gpu-1", [XID])
    status, doc = node.get("/devices")
    assert status == 200
    by_name = {d["name"]: d for d in doc["devices"]}
    assert list(by_name) == ["gpu-0", "gpu-1", "nic-0000-1d-00-0"]
    assert by_name["gpu-0"] == {
        "name": "gpu-0",
        "kind": "gpu",
        "model": "NVIDIA H100 80GB HBM3",
        "uuid": "GPU-aaaa",
        "rdmaDevice": None,
        "numaNode": 0,
        "pcieRoot": "pci0000:15",
        "pciBusID": "0000:1b:00.0",
        "health": "Healthy",
        "healthMessage": "",
        "taints": [],
        "claims": ["ml/eval", "ml/train"],
        "pods": ["ml/train-0"],
    }
    assert by_name["gpu-1"]["health"] == "Unhealthy"
    assert by_name["gpu-1"]["healthMessage"] == XID.message
    assert by_name["gpu-1"]["taints"] == [{"key": "tandem.dev/xid", "value": "79", "effect": "NoExecute"}]
    assert by_name["nic-0000-1d-00-0"]["model"] == "ens1f0np0"
    assert by_name["nic-0000-1d-00-0"]["claims"] == ["ml/train"]
    assert by_name["nic-0000-1d-00-0"]["rdmaDevice"] == "mlx5_0" and by_name["nic-0000-1d-00-0"]["uuid"] is None


def test_claims(node: Node) -> None:
    node.prepared["u1"] = _claim("ml", "train", "gpu-0")
    node.prepared["u0"] = _claim("dev", "half", "gpu-1", state=PrepareState.STARTED)
    status, doc = node.get("/claims")
    assert status == 200
    assert [(c["uid"], c["namespace"], c["name"], c["state"]) for c in doc["claims"]] == [
        ("u0", "dev", "half", PrepareState.STARTED),
        ("u1", "ml", "train", "PrepareCompleted"),
    ]
    assert doc["claims"][1]["devices"] == [{"requestNames": ["r"], "pool": "node-a", "device": "gpu-0"}]


def test_health_summary(node: Node) -> None:
    node.info.update(registered=True)
    status, doc = node.get("/health")
    assert status == 200
    assert doc["status"] == "healthy" and doc["reasons"] == []
    assert doc["devices"] == {"total": 3, "Healthy": 3, "Unhealthy": 0, "Unknown": 0}
    assert doc["daemon"] == {"registered": True}

    node.inventory.set_conditions("gpu", "gpu-1", [XID])
    _, doc = node.get("/health")
    assert doc["status"] == "degraded"
    assert doc["unhealthy"] == [{"device": "gpu-1", "reason": XID.message}]
    assert doc["devices"]["Unhealthy"] == 1
    assert any("gpu-1" in r for r in doc["reasons"])


def test_health_daemon_problems_degrade(node: Node) -> None:
    node.info["problems"] = ["slice publisher: 3 failed writes"]
    _, doc = node.get("/health")
    assert doc["status"] == "degraded"
    assert doc["reasons"] == ["slice publisher: 3 failed writes"]


def test_health_survives_a_failing_info(node: Node) -> None:
    def broken() -> dict[str, Any]:
        raise RuntimeError("registration state lost")

    node.server._info = broken
    status, doc = node.get("/health")
    assert status == 200
    assert doc["status"] == "degraded"
    assert any("registration state lost" in r for r in doc["reasons"])
    assert doc["ready"] is False, "without the daemon's facts, nothing says the slices are published"


UNPUBLISHED = (
    "no ResourceSlices published: the API server at https://10.0.0.1:6443 cannot be reached: get node n: "
    "connection refused: ConnectionRefusedError: [Errno 111] Connection refused "
    "(since 2025-01-02T12:03:01Z, 14 failed attempt(s))"
)


def test_unpublished_slices_make_the_node_unhealthy_and_not_ready(node: Node) -> None:
    node.info.update(registered=True)
    _, doc = node.get("/health")
    assert (doc["status"], doc["ready"]) == ("healthy", True)

    node.info.update(unready=[UNPUBLISHED], problems=["the kubelet has not confirmed the registration"])
    _, doc = node.get("/health")
    assert (doc["status"], doc["ready"]) == ("unhealthy", False)
    assert doc["reasons"] == [UNPUBLISHED, "the kubelet has not confirmed the registration"], "invisibility first"


def test_a_degraded_node_is_still_ready(node: Node) -> None:
    """A tainted device or slices that stopped following health are the scheduler's to work around;
    the pod is not ready only while its devices may be invisible to it."""
    node.inventory.set_conditions("gpu", "gpu-1", [XID])
    node.info["problems"] = ["ResourceSlices not confirmed since 2025-01-02T12:00:00Z: ..."]
    _, doc = node.get("/health")
    assert (doc["status"], doc["ready"]) == ("degraded", True)


def test_no_devices_is_degraded(node: Node) -> None:
    node.inventory.replace("gpu", [])
    node.inventory.replace("nic", [])
    _, doc = node.get("/health")
    assert doc["status"] == "degraded" and doc["reasons"] == ["no devices discovered"]


def test_cordon_is_not_degradation_but_is_listed(node: Node) -> None:
    status, doc = node.post("/cordon", {"device": "gpu-0", "reason": "fan swap", "by": "alice"})
    assert status == 200
    assert doc["cordon"]["device"] == "gpu-0" and doc["cordon"]["by"] == f"alice ({_PEER})"
    assert node.taints("gpu-0") == [{"key": "tandem.dev/cordoned", "value": "manual", "effect": "NoSchedule"}]
    _, health = node.get("/health")
    assert health["status"] == "healthy"
    assert [(c["device"], c["reason"], c["by"], c["present"]) for c in health["cordoned"]] == [
        ("gpu-0", "fan swap", f"alice ({_PEER})", True)
    ]

    status, doc = node.post("/uncordon", {"device": "gpu-0"})
    assert (status, doc) == (200, {"device": "gpu-0", "changed": True})
    assert node.taints("gpu-0") == []
    assert node.post("/uncordon", {"device": "gpu-0"}) == (200, {"device": "gpu-0", "changed": False})


def test_cordon_without_author_records_the_peer(node: Node) -> None:
    """Under `kubectl exec` no name is set: the kernel's word on the client (SO_PEERCRED) is what is
    known, and it is kept with any name given, which the client chose and may be anything."""
    _, doc = node.post("/cordon", {"device": "gpu-0", "reason": "x"})
    assert doc["cordon"]["by"] == _PEER
    status, doc = node.post("/cordon", {"device": "gpu-1", "reason": "x", "by": "m" * 65})
    assert (status, doc["error"]) == (400, "by is 65 characters, over the limit of 64")
    assert node.post("/cordon", {"device": "gpu-1", "reason": "x", "by": "m" * 64})[0] == 200


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "error"),
    [
        ("POST", "/cordon", {"device": "gpu-9", "reason": "x"}, 404, "unknown device 'gpu-9'"),
        ("POST", "/cordon", {"device": "gpu-0", "reason": ""}, 400, "reason must not be empty"),
        ("POST", "/cordon", {"device": "gpu-0", "reason": 5}, 400, "'reason' must be a string"),
        ("GET", "/cordon", None, 405, "GET is not allowed"),
        ("POST", "/devices", {}, 405, "POST is not allowed"),
        ("POST", "/release", {"device": "gpu-9", "reason": "x"}, 404, "unknown device 'gpu-9'"),
        ("POST", "/release", {"device": "nic-0000-1d-00-0", "reason": "x"}, 400, "not a GPU"),
        ("POST", "/release", {"device": "gpu-0", "all": True, "reason": "x"}, 400, "name one device, or all"),
        ("POST", "/release", {"reason": "x"}, 400, "name one device, or all"),
        ("POST", "/release", {"all": "yes", "reason": "x"}, 400, "'all' must be true or false"),
        ("POST", "/release", {"device": "gpu-0"}, 400, "reason must not be empty"),
        ("POST", "/reacquire", {}, 400, "name one device, or all"),
        ("GET", "/nope", None, 404, "no such endpoint"),
    ],
)
def test_request_errors(node: Node, method: str, path: str, body: Any, status: int, error: str) -> None:
    got_status, doc = ctl.request(node.sock, method, path, body, timeout=5)
    assert got_status == status
    assert error in doc["error"]
    assert node.taints("gpu-0") == []


def _raw(sock: Path, request: bytes) -> tuple[bytes, Any]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(5)
        s.connect(str(sock))
        s.sendall(request)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return head.split(b"\r\n", 1)[0], json.loads(body)


def test_bad_bodies_are_refused(node: Node) -> None:
    line, doc = _raw(node.sock, b"POST /cordon HTTP/1.1\r\nContent-Length: 5\r\n\r\n{nope")
    assert line.startswith(b"HTTP/1.1 400") and "not JSON" in doc["error"]
    line, doc = _raw(node.sock, b"POST /cordon HTTP/1.1\r\nContent-Length: 2\r\n\r\n[]")
    assert line.startswith(b"HTTP/1.1 400") and "object" in doc["error"]
    # Too large is refused from the header alone; the server never reads the body.
    line, doc = _raw(node.sock, f"POST /cordon HTTP/1.1\r\nContent-Length: {MAX_BODY + 1}\r\n\r\n".encode())
    assert line.startswith(b"HTTP/1.1 413")
    line, doc = _raw(node.sock, b"POST /cordon HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n")
    assert line.startswith(b"HTTP/1.1 411")


def test_stale_socket_is_replaced_and_stop_removes_it(tmp_short: Path) -> None:
    path = tmp_short / "status.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as stale:
        stale.bind(str(path))  # left behind by a killed daemon
    inv = Inventory()
    server = StatusServer(path, inv, _facts(tmp_short), CordonStore(tmp_short, inv), _releases(tmp_short, inv), dict)
    server.start()
    try:
        assert ctl.request(path, "GET", "/devices", None, timeout=5) == (200, {"devices": []})
    finally:
        server.stop()
    assert not path.exists()


def test_refuses_to_replace_a_non_socket(tmp_short: Path) -> None:
    path = tmp_short / "status.sock"
    path.write_text("precious")
    inv = Inventory()
    with pytest.raises(RuntimeError, match="not a socket"):
        StatusServer(path, inv, _facts(tmp_short), CordonStore(tmp_short, inv), _releases(tmp_short, inv), dict).start()
    assert path.read_text() == "precious"


def test_stopping_old_instance_keeps_the_new_ones_socket(tmp_short: Path) -> None:
    """Rolling update: the old daemon's stop must not unlink the name the new one now serves."""
    path = tmp_short / "status.sock"
    old_inv, new_inv = Inventory(), Inventory()
    new_inv.replace("gpu", [GPU0])
    old = StatusServer(
        path, old_inv, _facts(tmp_short), CordonStore(tmp_short, old_inv), _releases(tmp_short, old_inv), dict
    )
    new = StatusServer(
        path, new_inv, _facts(tmp_short), CordonStore(tmp_short, new_inv), _releases(tmp_short, new_inv), dict
    )
    old.start()
    new.start()
    try:
        old.stop()
        _, doc = ctl.request(path, "GET", "/devices", None, timeout=5)
        assert [d["name"] for d in doc["devices"]] == ["gpu-0"]
    finally:
        new.stop()
    assert not path.exists()


def test_path_too_long_is_a_clear_error(tmp_short: Path) -> None:
    inv = Inventory()
    path = tmp_short / ("x" * 120) / "status.sock"
    with pytest.raises(RuntimeError, match="byte limit"):
        StatusServer(path, inv, _facts(tmp_short), CordonStore(tmp_short, inv), _releases(tmp_short, inv), dict).start()
    # Fits, but not with the private directory it is bound in first.
    room = 107 - len(str(tmp_short / "status.sock").encode())
    parent = tmp_short / ("x" * (room - 1))
    parent.mkdir()
    with pytest.raises(RuntimeError, match="too long"):
        StatusServer(
            parent / "status.sock", inv, _facts(tmp_short), CordonStore(tmp_short, inv), _releases(tmp_short, inv), dict
        ).start()
    assert list(parent.iterdir()) == []


# --- tandemctl ---------------------------------------------------------------------------------


def test_ctl_devices_table(node: Node, capsys: pytest.CaptureFixture[str]) -> None:
    node.prepared["u1"] = _claim("ml", "train", "gpu-0")
    node.inventory.set_conditions("gpu", "gpu-1", [XID])
    assert node.ctl("devices") == 0
    table, why = capsys.readouterr().out.split("\n\n")
    lines = table.splitlines()
    assert lines[0].split() == [
        "DEVICE",
        "KIND",
        "MODEL/IFACE",
        "NUMA",
        "PCIE-ROOT",
        "HEALTH",
        "TAINTS",
        "CLAIM",
        "POD",
    ]
    rows = {line.split()[0]: line for line in lines[1:]}
    assert set(rows) == {"gpu-0", "gpu-1", "nic-0000-1d-00-0"}
    assert "NVIDIA H100 80GB HBM3" in rows["gpu-0"] and rows["gpu-0"].split()[-2:] == ["ml/train", "-"]
    assert rows["gpu-1"].split()[-4:] == ["Unhealthy", "tandem.dev/xid=79:NoExecute", "-", "-"]
    assert "ens1f0np0" in rows["nic-0000-1d-00-0"]
    # Columns are aligned: every row's HEALTH column starts where the header's does.
    col = lines[0].index("HEALTH")
    assert all(line[col:].split()[0] in ("Healthy", "Unhealthy") for line in lines[1:])
    # Then why, in words, for each device that is not plainly healthy.
    assert why.splitlines() == [f"gpu-1: {XID.message}"]


def test_ctl_json_is_the_endpoint_document(node: Node, capsys: pytest.CaptureFixture[str]) -> None:
    node.prepared["u1"] = _claim("ml", "train", "gpu-0")
    for command, path in (("devices", "/devices"), ("claims", "/claims"), ("health", "/health")):
        assert node.ctl(command, "--json") == 0
        assert json.loads(capsys.readouterr().out) == node.get(path)[1]


def test_ctl_claims_table(node: Node, capsys: pytest.CaptureFixture[str]) -> None:
    node.prepared["u1"] = _claim("ml", "train", "gpu-0", "nic-0000-1d-00-0")
    assert node.ctl("claims") == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["CLAIM", "UID", "STATE", "DEVICES", "PODS"]
    assert lines[1].split() == ["ml/train", "u1", "PrepareCompleted", "gpu-0,nic-0000-1d-00-0", "-"]


def test_ctl_pod_tells_the_claims_a_pod_holds(node: Node, capsys: pytest.CaptureFixture[str]) -> None:
    """An SRE has `ml/train-0`, not its claims' names."""
    node.prepared["u1"] = _claim("ml", "train", "gpu-0", pods=("train-0",))
    node.prepared["u2"] = _claim("ml", "scratch", "nic-0000-1d-00-0", pods=("train-0", "train-1"))
    node.prepared["u3"] = _claim("other", "train", "gpu-1", pods=("train-0",))  # same pod name, another namespace
    assert node.ctl("pod", "ml/train-0") == 0
    out = capsys.readouterr().out
    assert "claim: ml/train (uid u1)" in out and "claim: ml/scratch (uid u2)" in out and "other/train" not in out
    assert node.ctl("pod", "ml/train-1", "--json") == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["pod"] == "ml/train-1" and [c["uid"] for c in doc["claims"]] == ["u2"]
    assert node.ctl("pod", "ml/nobody") == ctl.EXIT_DEGRADED
    assert "no claim prepared on this node is reserved for pod ml/nobody" in capsys.readouterr().err
    assert node.ctl("pod", "train-0") == ctl.EXIT_USAGE
    assert "is not NAMESPACE/NAME" in capsys.readouterr().err


def test_ctl_health_tells_the_daemon_in_words_not_json(node: Node, capsys: pytest.CaptureFixture[str]) -> None:
    node.info.update(registered=True, slices={"published": 3, "writes": 7}, binding=[])
    assert node.ctl("health") == 0
    out = capsys.readouterr().out
    assert "  slices: published 3, writes 7" in out and "  registered: yes" in out and "  binding: -" in out
    assert "{" not in out and "[" not in out


def test_ctl_health_exit_codes(node: Node, capsys: pytest.CaptureFixture[str]) -> None:
    assert node.ctl("health") == 0
    assert capsys.readouterr().out.startswith("healthy")

    node.inventory.set_conditions("gpu", "gpu-1", [XID])
    assert node.ctl("health") == 1
    out = capsys.readouterr().out
    assert out.startswith("degraded") and "gpu-1: XID 79" in out
    assert node.ctl("health", "--json") == 1


def test_ctl_health_says_unhealthy_with_the_reason(node: Node, capsys: pytest.CaptureFixture[str]) -> None:
    node.info.update(registered=True, unready=[UNPUBLISHED])
    assert node.ctl("health") == ctl.EXIT_DEGRADED
    out = capsys.readouterr().out
    assert out.splitlines()[:2] == ["unhealthy", f"  - {UNPUBLISHED}"]
    assert "unready" not in out, "the reason is told once, not again among the daemon's facts"


def test_readiness_asks_the_status_socket(node: Node, tmp_short: Path) -> None:
    node.info.update(registered=True)
    assert ctl.unready_reason(node.sock, 5) is None
    node.info["unready"] = [UNPUBLISHED]
    assert ctl.unready_reason(node.sock, 5) == UNPUBLISHED
    assert "no daemon socket" in (ctl.unready_reason(tmp_short / "none.sock", 5) or "")


def test_ctl_health_unreachable_without_socket(tmp_short: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert ctl.main(["--kubelet-plugins-dir", str(tmp_short), "health"]) == ctl.EXIT_UNREACHABLE
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no daemon socket" in err and "Traceback" not in err


def test_ctl_unreachable_when_nobody_listens(tmp_short: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_short / "dead.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.bind(str(path))  # bound, never listening: connect is refused
        assert ctl.main(["--socket", str(path), "devices"]) == ctl.EXIT_UNREACHABLE
    assert "cannot talk to the daemon" in capsys.readouterr().err


def test_ctl_unreachable_on_timeout(tmp_short: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_short / "mute.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.bind(str(path))
        s.listen(1)  # accepts the connection in the kernel, never answers
        assert ctl.main(["--socket", str(path), "--timeout", "0.2", "health"]) == ctl.EXIT_UNREACHABLE
    assert "no answer" in capsys.readouterr().err


def test_ctl_finds_socket_from_driver_name_and_plugins_dir(node: Node, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KUBELET_PLUGINS_DIRECTORY_PATH", str(node.plugins_dir))
    monkeypatch.setenv("DRIVER_NAME", "tandem.dev")
    assert ctl.main(["health"]) == 0
    assert ctl.main(["--driver-name", "other.dev", "health"]) == ctl.EXIT_UNREACHABLE


def test_ctl_cordon_round_trip(node: Node, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SUDO_USER", "carol")
    assert node.ctl("cordon", "nic-0000-1d-00-0", "--reason", "cable swap") == 0
    assert "cordoned" in capsys.readouterr().out
    assert node.taints("nic-0000-1d-00-0") == [
        {"key": "tandem.dev/cordoned", "value": "manual", "effect": "NoSchedule"}
    ]
    assert node.get("/health")[1]["cordoned"][0]["by"] == f"carol ({_PEER})"

    assert node.ctl("devices") == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("nic-"))
    assert "tandem.dev/cordoned=manual:NoSchedule" in row

    assert node.ctl("health") == 0  # a cordon is a choice, not a fault
    assert "cable swap" in capsys.readouterr().out

    assert node.ctl("uncordon", "nic-0000-1d-00-0") == 0
    assert "uncordoned" in capsys.readouterr().out
    assert node.taints("nic-0000-1d-00-0") == []


def test_ctl_cordon_refused(node: Node, capsys: pytest.CaptureFixture[str]) -> None:
    assert node.ctl("cordon", "gpu0", "--reason", "x") == 1
    err = capsys.readouterr().err
    assert err.startswith("tandemctl: unknown device 'gpu0'") and "gpu-0" in err and err.count("\n") == 1
    assert node.ctl("cordon", "gpu-0", "--reason", " ") == 1
    assert "reason must not be empty" in capsys.readouterr().err
    assert node.taints("gpu-0") == []


def test_release_taints_degrades_and_reacquire_clears(node: Node) -> None:
    status, doc = node.post("/release", {"device": "gpu-1", "reason": "nvidia-smi -r", "by": "alice"})
    assert (status, doc) == (200, {"released": "gpu-1", "devices": ["gpu-1"]})
    assert node.taints("gpu-1") == [{"key": "tandem.dev/released", "value": "gpu", "effect": "NoSchedule"}]
    assert node.taints("gpu-0") == [{"key": "tandem.dev/unmonitored", "value": "", "effect": "None"}]
    assert node.taints("nic-0000-1d-00-0") == []
    _, health = node.get("/health")
    assert health["status"] == "degraded" and any("nvidia-smi -r" in r for r in health["reasons"])
    assert [(r["device"], r["gpu"], r["by"]) for r in health["released"]] == [("gpu-1", "GPU-bbbb", f"alice ({_PEER})")]
    assert "tandemctl reacquire gpu-1" in node.inventory.get("gpu-1").health_message  # type: ignore[union-attr]

    status, doc = node.post("/release", {"all": True, "reason": "driver upgrade"})
    assert (status, doc) == (200, {"released": "nvml", "devices": ["gpu-0", "gpu-1"]})
    assert node.taints("gpu-0") == [{"key": "tandem.dev/released", "value": "nvml", "effect": "NoSchedule"}]

    status, doc = node.post("/reacquire", {"device": "gpu-1"})
    assert status == 200 and [r["device"] for r in doc["reacquired"]] == ["gpu-1"]
    assert [r["gpu"] for r in doc["released"]] == [""]  # NVML as a whole is still released
    assert node.taints("gpu-1") == [{"key": "tandem.dev/released", "value": "nvml", "effect": "NoSchedule"}]
    status, doc = node.post("/reacquire", {"all": True})
    assert status == 200 and doc["released"] == []
    assert node.taints("gpu-0") == node.taints("gpu-1") == []
    assert node.get("/health")[1]["status"] == "healthy"


def test_a_release_that_did_not_let_go_in_time_is_503(tmp_short: Path) -> None:
    inv = Inventory()
    inv.replace("gpu", [GPU0])
    access = NvmlAccess()
    state = tmp_short / "nvml.json"
    write_state(h100_node(gpus=1, nics=0), state)
    with fake_pynvml_in_process(state):
        held = access.init(Path("/"))  # a session nobody closes
        server = StatusServer(tmp_short / "s.sock", inv, _facts(tmp_short), CordonStore(tmp_short, inv),
                              _releases(tmp_short, inv, access), dict)  # fmt: skip
        server.start()
        try:
            status, doc = ctl.request(tmp_short / "s.sock", "POST", "/release", {"device": "gpu-0", "reason": "x"}, 5)
        finally:
            server.stop()
            access.shutdown(held)
    assert status == 503 and "do not reset yet" in doc["error"] and "1 NVML session(s)" in doc["error"]
    assert inv.get("gpu-0").taints[0].key == "tandem.dev/released"  # type: ignore[union-attr]  # still released


def test_ctl_release_round_trip(
    node: Node, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SUDO_USER", "carol")
    assert node.ctl("release", "gpu-0", "--reason", "reset") == 0
    out = capsys.readouterr().out
    assert "gpu-0 released" in out and "tandemctl reacquire gpu-0" in out
    assert node.get("/health")[1]["released"][0]["by"] == f"carol ({_PEER})"
    assert node.ctl("health") == 1
    assert node.ctl("reacquire", "gpu-0") == 0
    assert "gpu-0 reacquired" in capsys.readouterr().out
    assert node.ctl("reacquire", "gpu-0") == 0
    assert "gpu-0 was not released" in capsys.readouterr().out
    assert node.ctl("release", "--all", "--reason", "upgrade") == 0
    assert "tandemctl reacquire --all" in capsys.readouterr().out
    assert node.ctl("reacquire", "gpu-0") == 0
    assert "still released: NVML" in capsys.readouterr().out
    assert node.ctl("reacquire", "--all") == 0
    assert node.ctl("release", "nic-0000-1d-00-0", "--reason", "x") == 1
    assert "not a GPU" in capsys.readouterr().err
    with pytest.raises(SystemExit) as usage:
        node.ctl("release", "gpu-0", "--all", "--reason", "x")
    assert usage.value.code == 2


# --- the 3 a.m. questions ----------------------------------------------------------------------


def test_ctl_wide_names_the_gpu_uuid_the_rdma_device_and_the_pods(
    node: Node, capsys: pytest.CaptureFixture[str]
) -> None:
    node.prepared["u1"] = _claim("ml", "train", "gpu-0", "nic-0000-1d-00-0", pods=("train-0",))
    assert node.ctl("devices", "-o", "wide") == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[-4:] == ["CLAIM", "POD", "UUID/RDMA", "PCI-BUS-ID"]
    rows = {line.split()[0]: line.split() for line in lines[1:]}
    assert rows["gpu-0"][-4:] == ["ml/train", "ml/train-0", "GPU-aaaa", "0000:1b:00.0"]
    assert rows["nic-0000-1d-00-0"][-4:] == ["ml/train", "ml/train-0", "mlx5_0", "0000:1d:00.0"]
    assert node.ctl("claims") == 0
    assert capsys.readouterr().out.splitlines()[1].split()[-1] == "ml/train-0"


def test_ctl_output_json_and_its_alias_print_the_endpoint_document(
    node: Node, capsys: pytest.CaptureFixture[str]
) -> None:
    node.prepared["u1"] = _claim("ml", "train", "gpu-0", pods=("train-0",))
    for flags in (["-o", "json"], ["--json"], ["--output", "json"]):
        assert node.ctl("devices", *flags) == 0
        assert json.loads(capsys.readouterr().out) == node.get("/devices")[1]


@pytest.mark.parametrize(
    "argv",
    [["devices", "-o", "yaml"], ["devices", "--json", "-o", "wide"], ["cordon", "gpu-0"], ["claim"], []],
)
def test_usage_errors_exit_2_apart_from_unhealthy_1_and_unreachable_3(
    argv: list[str], tmp_short: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as e:
        ctl.main(["--socket", str(tmp_short / "none.sock"), *argv])
    assert e.value.code == ctl.EXIT_USAGE == 2
    assert "usage:" in capsys.readouterr().err
    assert len({ctl.EXIT_DEGRADED, ctl.EXIT_USAGE, ctl.EXIT_UNREACHABLE}) == 3


def test_ctl_claim_tells_record_pods_files_status_and_last_error(
    node: Node, capsys: pytest.CaptureFixture[str]
) -> None:
    uid = "0b6e0c02-3f0b-4a43-9a4e-5b8a1c2d3e4f"
    node.prepared[uid] = ClaimRecord(
        namespace="ml", name="train", uid=uid, pods=("train-0",),
        devices=(DeviceRecord(("gpu",), "node-a", "gpu-0", ("tandem.dev/claim=gpu-0",)),),
    )  # fmt: skip
    assert node.events is not None
    node.events.claim_failed("ml", "train", uid, "claim ml/train: not allocated on this node")
    (node.plugins_dir / "tandem.dev" / "cdi").mkdir()
    (node.plugins_dir / "tandem.dev" / "cdi" / f"k8s.tandem.dev-claim_{uid}.json").write_text("{}")
    for key in (uid, "ml/train"):
        status, doc = node.get(f"/claims/{key}")
        assert status == 200
        assert (doc["uid"], doc["state"], doc["pods"]) == (uid, "PrepareCompleted", ["ml/train-0"])
        assert doc["status"] == [{"device": "gpu-0", "ready": True}]
        assert doc["files"] == {"cdiSpec": True, "metadataSpecs": False, "metadataDir": False}
        assert doc["lastError"]["error"] == "claim ml/train: not allocated on this node"
    assert node.ctl("claim", "ml/train") == 0
    out = capsys.readouterr().out.splitlines()
    assert out[:3] == [f"claim: ml/train (uid {uid})", "state: PrepareCompleted", "pods: ml/train-0"]
    assert (
        "  gpu-0: requests gpu, Ready" in out
        and "files: cdiSpec present, metadataSpecs absent, metadataDir absent" in out
    )
    assert out[-1].startswith("last error: claim ml/train: not allocated on this node (at ")


def test_a_claim_that_never_prepared_is_told_by_its_last_error_and_an_unknown_one_is_404(
    node: Node, capsys: pytest.CaptureFixture[str]
) -> None:
    """The pod hangs in ContainerCreating: no record, but the failure is remembered."""
    uid = "1b6e0c02-3f0b-4a43-9a4e-5b8a1c2d3e4f"
    assert node.events is not None
    node.events.claim_failed("ml", "eval", uid, "first error")
    node.events.claim_failed("ml", "eval", uid, "unknown field 'sharingg'")
    _, doc = node.get("/claims/ml/eval")
    assert (doc["uid"], doc["state"], doc["devices"]) == (uid, "NotPrepared", [])
    assert doc["lastError"]["error"] == "unknown field 'sharingg'"
    assert node.ctl("claim", "ml/other") == ctl.EXIT_DEGRADED
    assert "claim ml/other is not prepared on this node" in capsys.readouterr().err
    status, doc = node.get("/claims/..%2Fetc")
    assert (status, doc["error"]) == (400, "'../etc' is neither a claim UID nor NAMESPACE/NAME")


def test_cordon_under_kubectl_exec_names_the_process(
    node: Node, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """No $USER, $LOGNAME or $SUDO_USER there: the daemon still says who (uid and pid)."""
    for name in ("SUDO_USER", "LOGNAME", "USER"):
        monkeypatch.delenv(name, raising=False)
    assert node.ctl("cordon", "gpu-0", "--reason", "fan") == 0
    assert node.get("/health")[1]["cordoned"][0]["by"] == _PEER
    monkeypatch.setenv("LOGNAME", "dave")
    assert node.ctl("cordon", "gpu-1", "--reason", "fan") == 0
    assert node.get("/health")[1]["cordoned"][1]["by"] == f"dave ({_PEER})"
