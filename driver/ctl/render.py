"""`tandemctl`'s human output: the status socket's documents as tables and lines.

`-o json` prints the document itself; the default and `-o wide` tables are made here, `wide`
adding columns as kubectl's does: what names the device to other tools (the GPU UUID that
`nvidia-smi` and NVML show, the RDMA device name of `ibv_devinfo` and `rdma link`), its PCI
address, and the claims' pods in full.
"""

from __future__ import annotations

import json
from typing import Any

OUTPUTS = ("text", "wide", "json")
_NO_PODS = " (none recorded: prepared by Tandem 0.1.0, or reserved for no pod)"


def table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows)


def text(value: Any) -> str:
    if value is None or value == "" or value == []:
        return "-"
    if isinstance(value, list):
        return ",".join(str(v) for v in value)
    return str(value)


def _taint(t: dict[str, Any]) -> str:
    value = f"={t['value']}" if t.get("value") else ""
    return f"{t.get('key', '?')}{value}:{t.get('effect', '?')}"


def render_devices(doc: dict[str, Any], wide: bool) -> str:
    head = ["DEVICE", "KIND", "MODEL/IFACE", "NUMA", "PCIE-ROOT", "HEALTH", "TAINTS", "CLAIM", "POD"]
    rows = [head + (["UUID/RDMA", "PCI-BUS-ID"] if wide else [])]
    for d in doc.get("devices", []):
        row = [
            text(d.get("name")), text(d.get("kind")), text(d.get("model")), text(d.get("numaNode")),
            text(d.get("pcieRoot")), text(d.get("health")), text([_taint(t) for t in d.get("taints", [])]),
            text(d.get("claims")), text(d.get("pods")),
        ]  # fmt: skip
        if wide:
            row += [text(d.get("uuid") or d.get("rdmaDevice")), text(d.get("pciBusID"))]
        rows.append(row)
    return table(rows)


def render_claims(doc: dict[str, Any], wide: bool) -> str:
    rows = [["CLAIM", "UID", "STATE", "DEVICES", "PODS"]]
    for c in doc.get("claims", []):
        devices = [d.get("device", "?") for d in c.get("devices", [])]
        pods = [f"{c.get('namespace')}/{p}" for p in c.get("pods", [])]
        rows.append([
            f"{c.get('namespace')}/{c.get('name')}", text(c.get("uid")), text(c.get("state")), text(devices),
            text(pods),
        ])  # fmt: skip
    return table(rows)


def render_claim(doc: dict[str, Any], wide: bool) -> str:
    """One claim's story, in the order an SRE asks: who, what state, which devices, which files."""
    lines = [
        f"claim: {doc.get('namespace')}/{doc.get('name')} (uid {doc.get('uid')})",
        f"state: {doc.get('state')}",
        f"pods: {text(doc.get('pods'))}" + ("" if doc.get("pods") or doc.get("state") == "NotPrepared" else _NO_PODS),
    ]
    devices = doc.get("devices", [])
    if devices:
        lines.append("devices:")
        ready = {s.get("device"): s for s in doc.get("status", [])}
        for d in devices:
            status = ready.get(d.get("device"), {})
            net = status.get("networkData") or {}
            facts = [f"requests {text(d.get('requestNames'))}", "Ready" if status.get("ready") else "not Ready"]
            if net:
                facts.append(f"{net.get('interfaceName', '?')} {text(net.get('ips'))}")
            if wide:
                facts.append(f"cdi {text(d.get('cdiDeviceIDs'))}")
            lines.append(f"  {d.get('device')}: {', '.join(facts)}")
    files = doc.get("files", {})
    lines.append("files: " + (", ".join(f"{k} {'present' if v else 'absent'}" for k, v in files.items()) or "-"))
    error = doc.get("lastError")
    lines.append(f"last error: {error.get('error')} (at {error.get('at')})" if error else "last error: -")
    return "\n".join(lines)


def render_health(doc: dict[str, Any], wide: bool) -> str:
    lines = [str(doc.get("status", "unknown"))]
    lines += [f"  - {r}" for r in doc.get("reasons", [])]
    counts = doc.get("devices", {})
    by_health = ", ".join(f"{k} {v}" for k, v in counts.items() if k != "total")
    lines.append(f"devices: {counts.get('total', 0)} ({by_health})")
    if doc.get("unhealthy"):
        lines.append("not healthy:")
        lines += [f"  {u.get('device')}: {u.get('reason') or '-'}" for u in doc["unhealthy"]]
    if doc.get("cordoned"):
        lines.append("cordoned:")
        for c in doc["cordoned"]:
            absent = "" if c.get("present", True) else " (device absent)"
            by = f" by {c['by']}" if c.get("by") else ""
            lines.append(f"  {c.get('device')}{absent}{by} since {c.get('since')}: {c.get('reason')}")
    daemon = {k: v for k, v in doc.get("daemon", {}).items() if k not in ("problems", "unready")}
    if daemon:
        lines.append("daemon:")
        lines += [f"  {k}: {v if isinstance(v, str) else json.dumps(v)}" for k, v in daemon.items()]
    return "\n".join(lines)


RENDER = {"devices": render_devices, "claims": render_claims, "claim": render_claim, "health": render_health}
