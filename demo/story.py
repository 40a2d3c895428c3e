"""`tandem-driver demo`: the whole driver on a laptop, with the simulation standing in for the world.

It starts a simulated API server and a simulated HGX H100 node (8 GPUs, 4 RoCE NICs, 2 NUMA
nodes), runs the real daemon as a separate process against them, plays the kubelet, and walks
through what an SRE would check: the published devices, a claim for a GPU and the NIC on the
same PCIe root, what the kubelet gets back on prepare, and a clean unprepare and shutdown.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from demo.node import DRIVER, SimNode, repo_root, stop_daemon
from sim.apiserver import SimApiServer
from sim.kubelet import ClaimRef, KubeletSim
from sim.nvml import append_event
from sim.profile import h100_node
from sim.scheduler import Request, allocate, attribute, claim_object, published_devices

PCIE_ROOT = "resource.kubernetes.io/pcieRoot"
NUMA = "resource.kubernetes.io/numaNode"


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows)


def device_table(devices: list[dict]) -> str:
    rows = [["DEVICE", "TYPE", "MODEL / INTERFACE", "NUMA", "PCIE ROOT", "PCI BUS ID"]]
    for d in devices:
        model = attribute(d, "productName") or attribute(d, "ifName") or ""
        rows.append([
            d["name"], str(attribute(d, "type") or ""), str(model), str(attribute(d, NUMA) if attribute(d, NUMA)
            is not None else "-"), str(attribute(d, PCIE_ROOT) or "-"),
            str(attribute(d, "resource.kubernetes.io/pciBusID") or "-"),
        ])  # fmt: skip
    return _table(rows)


def _step(text: str) -> None:
    print(f"\n== {text}", flush=True)


@contextlib.contextmanager
def _workdir(keep: bool) -> Iterator[Path]:
    root = Path(tempfile.mkdtemp(prefix="tandem-demo-"))
    try:
        yield root
    finally:
        if keep:
            print(f"\n(kept {root})")
        else:
            shutil.rmtree(root, ignore_errors=True)


def run_demo(keep: bool = False, verbose: int = 0) -> int:
    with _workdir(keep) as root, SimApiServer() as srv:
        srv.start()
        profile = h100_node("demo-node")
        node = SimNode.create(root, profile)
        srv.add_node(profile.name)
        kubeconfig = srv.write_kubeconfig(root / "kubeconfig")
        log_path = root / "daemon.log"
        _step(
            f"simulated cluster at {srv.url}; simulated node {profile.name!r}: "
            f"{len(profile.gpus)} GPUs, {len(profile.nics)} RoCE NICs, {profile.numa_nodes} NUMA nodes"
        )
        # A short quiet period so that the demo can show a health taint clearing on its own.
        proc = node.start_daemon(kubeconfig, log_path, "--health-quiet-period", "4", *(["-v"] if verbose else []))
        try:
            return _story(srv, node, proc, log_path)
        except Exception as e:
            print(f"\ndemo failed: {e}\n--- daemon log ({log_path}) ---", file=sys.stderr)
            print(log_path.read_text()[-6000:], file=sys.stderr)
            return 1
        finally:
            stop_daemon(proc)


def _taints(srv: SimApiServer, node: SimNode, device: str) -> list[dict]:
    return next((d.get("taints") or [] for d in published_devices(srv, DRIVER, node.profile.name)
                 if d["name"] == device), [])  # fmt: skip


def _tandemctl(node: SimNode, *args: str) -> str:
    cmd = [sys.executable, "-c", "import sys; from driver.cli import ctl_main; sys.exit(ctl_main())"]
    env = {**os.environ, "PYTHONPATH": repo_root()}
    out = subprocess.run([*cmd, "--kubelet-plugins-dir", str(node.plugins), *args], capture_output=True, text=True,
                         env=env, timeout=30)  # fmt: skip
    return out.stdout + out.stderr


def _health_story(srv: SimApiServer, node: SimNode, kubelet: KubeletSim) -> None:
    gpu = node.profile.gpus[3]
    name = f"gpu-{gpu.minor}"
    watch = kubelet.watch_health("v1")
    watch.next(timeout=30)
    _step(f"health: the simulated NVML raises XID 79 (GPU fallen off the bus) on {name}")
    t0 = time.monotonic()
    append_event(node.root / "nvml-state.json", gpu.uuid, 0x8, 79)  # nvmlEventTypeXidCriticalError
    if not srv.wait_for(lambda: bool(_taints(srv, node, name)), 30):
        raise RuntimeError("no taint after an XID")
    for t in _taints(srv, node, name):
        print(f"  slice taint after {(time.monotonic() - t0) * 1000:.0f} ms: {t['key']}={t['value']}:{t['effect']}")
    snap = watch.wait_for(lambda s: any(r.device == name and r.health == "UNHEALTHY" for r in s), timeout=30)
    report = next(r for r in snap if r.device == name)
    print(f"  kubelet health stream: {name} {report.health}: {report.message}")
    print("  tandemctl devices:")
    print("    " + _tandemctl(node, "devices").rstrip().replace("\n", "\n    "))
    if not srv.wait_for(lambda: not _taints(srv, node, name), 30):
        raise RuntimeError("the XID taint did not clear")
    watch.wait_for(lambda s: all(r.health == "HEALTHY" for r in s), timeout=30)
    watch.cancel()
    _step(
        f"health: no new XID for the quiet period (4 s here): taint cleared after "
        f"{time.monotonic() - t0:.1f} s without a restart; health stream says HEALTHY again"
    )


def _story(srv: SimApiServer, node: SimNode, proc: subprocess.Popen, log_path: Path) -> int:
    expected = len(node.profile.gpus) + len(node.profile.nics)
    with KubeletSim(node.registry) as kubelet:
        sock = kubelet.wait_for_registration_socket(DRIVER, timeout=30)
        info = kubelet.register(sock)
        _step(
            f"kubelet registered plugin {info.name!r}: endpoint {info.endpoint}, "
            f"services {', '.join(info.supported_versions)} (using {info.dra_version})"
        )

        if not srv.wait_for(lambda: len(published_devices(srv, DRIVER, node.profile.name)) >= expected, timeout=30):
            raise RuntimeError(
                f"expected {expected} published devices, got {len(published_devices(srv, DRIVER, node.profile.name))}"
            )
        devices = published_devices(srv, DRIVER, node.profile.name)
        slices = [s for s in srv.list("resourceslices") if s["spec"]["driver"] == DRIVER]
        _step(f"published ResourceSlices: {len(slices)} slice(s), {len(devices)} devices in pool {node.profile.name!r}")
        print(device_table(devices))

        _step("claim 'train-0': one GPU and one NIC with matchAttribute resource.kubernetes.io/pcieRoot")
        claim = srv.create(claim_object("default", "train-0", [
            Request("gpu", "gpu.tandem.dev", lambda d: attribute(d, "type") == "gpu"),
            Request("nic", "nic.tandem.dev", lambda d: attribute(d, "type") == "nic"),
        ], match_attribute=PCIE_ROOT))  # fmt: skip
        claim = allocate(srv, claim, DRIVER, node.profile.name, [
            Request("gpu", "gpu.tandem.dev", lambda d: attribute(d, "type") == "gpu"),
            Request("nic", "nic.tandem.dev", lambda d: attribute(d, "type") == "nic"),
        ], match_attribute=PCIE_ROOT)  # fmt: skip
        for r in claim["status"]["allocation"]["devices"]["results"]:
            d = next(x for x in devices if x["name"] == r["device"])
            print(f"  allocated {r['request']:<4} -> {r['device']:<18} pcieRoot={attribute(d, PCIE_ROOT)}")

        ref = ClaimRef("default", "train-0", claim["metadata"]["uid"])
        t0 = time.monotonic()
        prepared = kubelet.prepare([ref])[ref.uid]
        took = (time.monotonic() - t0) * 1000
        if prepared.error:
            raise RuntimeError(f"prepare failed: {prepared.error}")
        _step(f"NodePrepareResources ({info.dra_version}) answered in {took:.1f} ms:")
        for d in prepared.devices:
            print(
                f"  request={','.join(d.request_names):<4} pool={d.pool_name} device={d.device_name} "
                f"cdi={list(d.cdi_device_ids)}"
            )

        specs = sorted(p.name for p in node.cdi.iterdir())
        _step(f"CDI specs written to {node.cdi}: {', '.join(specs)}")
        spec = json.loads((node.cdi / next(n for n in specs if n.startswith("k8s."))).read_text())
        env = spec.get("containerEdits", {}).get("env", [])
        print(f"  cdiVersion {spec['cdiVersion']}, kind {spec['kind']}; container environment:")
        for e in env:
            print(f"    {e}")
        status = srv.get("resourceclaims", "train-0", "default").get("status", {}).get("devices", [])
        _step("claim status written by server-side apply (field manager tandem.dev):")
        for d in status:
            cond = d["conditions"][0]
            nd = d.get("networkData")
            extra = (
                f" interface={nd['interfaceName']} mac={nd.get('hardwareAddress')} ips={nd.get('ips')}" if nd else ""
            )
            print(f"  {d['device']:<18} {cond['type']}={cond['status']}{extra}")

        errors = kubelet.unprepare([ref])
        if errors[ref.uid]:
            raise RuntimeError(f"unprepare failed: {errors[ref.uid]}")
        left = sorted(p.name for p in node.cdi.iterdir())
        _step(f"NodeUnprepareResources: claim released; CDI specs left: {left or 'none'}")
        _health_story(srv, node, kubelet)

    rc = stop_daemon(proc)
    leftover = [p.name for p in (*node.registry.iterdir(), *(node.plugins / DRIVER).glob("*.sock"))]
    _step(f"daemon stopped on SIGTERM (exit code {rc}); sockets left behind: {leftover or 'none'}")
    if rc != 0 or leftover:
        raise RuntimeError("daemon did not shut down cleanly")
    print("\ndemo finished: all steps succeeded")
    return 0
