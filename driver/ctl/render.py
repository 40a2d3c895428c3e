"""`tandemctl`'s human output: the status socket's documents as tables and lines.

`-o json` prints the document itself; the default and `-o wide` tables are made here, `wide`
adding columns as kubectl's does: what names the device to other tools (the GPU UUID that
`nvidia-smi` and NVML show, the RDMA device name of `ibv_devinfo` and `rdma link`), its PCI
address, and the claims' pods in full. Each renderer takes its document as its TypedDict
(`driver.status.shapes`), checked when it was read (`driver.ctl.commands`).
"""

from __future__ import annotations

from driver.status.shapes import NOT_PREPARED, ClaimDoc, ClaimsDoc, DevicesDoc, HealthDoc, TaintDoc

OUTPUTS = ("text", "wide", "json")
_NO_PODS = " (none recorded: prepared by Tandem 0.1.0, or reserved for no pod)"


def table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows)


def text(value: object) -> str:
    if value is None or value == "" or value == []:
        return "-"
    if isinstance(value, list):
        return ",".join(str(v) for v in value)
    return str(value)


def _taint(t: TaintDoc) -> str:
    value = f"={t['value']}" if t["value"] else ""
    return f"{t['key']}{value}:{t['effect']}"


def render_devices(doc: DevicesDoc, wide: bool) -> str:
    head = ["DEVICE", "KIND", "MODEL/IFACE", "NUMA", "PCIE-ROOT", "HEALTH", "TAINTS", "CLAIM", "POD"]
    rows = [head + (["UUID/RDMA", "PCI-BUS-ID"] if wide else [])]
    for d in doc["devices"]:
        row = [
            text(d["name"]),
            text(d["kind"]),
            text(d["model"]),
            text(d["numaNode"]),
            text(d["pcieRoot"]),
            text(d["health"]),
            text([_taint(t) for t in d["taints"]]),
            text(d["claims"]),
            text(d["pods"]),
        ]
        if wide:
            row += [text(d["uuid"] or d["rdmaDevice"]), text(d["pciBusID"])]
        rows.append(row)
    # A taint says which rule, not why: each device that is not plainly healthy gets its words.
    why = [f"{d['name']}: {d['healthMessage']}" for d in doc["devices"] if d["healthMessage"]]
    return table(rows) + ("\n\n" + "\n".join(why) if why else "")


def render_claims(doc: ClaimsDoc, wide: bool) -> str:
    rows = [["CLAIM", "UID", "STATE", "DEVICES", "PODS"]]
    for c in doc["claims"]:
        devices = [d["device"] for d in c["devices"]]
        pods = [f"{c['namespace']}/{p}" for p in c.get("pods", [])]
        rows.append([f"{c['namespace']}/{c['name']}", text(c["uid"]), text(c["state"]), text(devices), text(pods)])
    return table(rows)


def render_claim(doc: ClaimDoc, wide: bool) -> str:
    """One claim's story, in the order an SRE asks: who, what state, which devices, which files."""
    pods_note = "" if doc["pods"] or doc["state"] == NOT_PREPARED else _NO_PODS
    lines = [
        f"claim: {doc['namespace']}/{doc['name']} (uid {doc['uid']})",
        f"state: {doc['state']}",
        f"pods: {text(doc['pods'])}{pods_note}",
    ]
    if doc["devices"]:
        lines.append("devices:")
        status = {s["device"]: s for s in doc["status"]}
        for d in doc["devices"]:
            applied = status.get(d["device"])
            facts = [f"requests {text(d['requestNames'])}", "Ready" if applied and applied["ready"] else "not Ready"]
            net = applied.get("networkData") if applied else None
            if net:
                facts.append(f"{net.get('interfaceName', '?')} {text(net.get('ips'))}")
            if wide:
                facts.append(f"cdi {text(d.get('cdiDeviceIDs'))}")
            lines.append(f"  {d['device']}: {', '.join(facts)}")
    files = ", ".join(f"{k} {'present' if v else 'absent'}" for k, v in doc["files"].items())
    lines.append(f"files: {files or '-'}")
    error = doc["lastError"]
    lines.append(f"last error: {error['error']} (at {error['at']})" if error else "last error: -")
    return "\n".join(lines)


def render_health(doc: HealthDoc, wide: bool) -> str:
    lines: list[str] = [doc["status"]]
    lines += [f"  - {r}" for r in doc["reasons"]]
    counts = doc["devices"]
    by_health = ", ".join(f"{k} {v}" for k, v in counts.items() if k != "total")
    lines.append(f"devices: {counts['total']} ({by_health})")
    if doc["unhealthy"]:
        lines.append("not healthy:")
        lines += [f"  {u['device']}: {u['reason'] or '-'}" for u in doc["unhealthy"]]
    if doc["cordoned"]:
        lines.append("cordoned:")
        for c in doc["cordoned"]:
            absent = "" if c["present"] else " (device absent)"
            by = f" by {c['by']}" if c["by"] else ""
            lines.append(f"  {c['device']}{absent}{by} since {c['since']}: {c['reason']}")
    daemon = {k: v for k, v in doc["daemon"].items() if k not in ("problems", "unready")}
    if daemon:
        lines.append("daemon:")
        lines += [f"  {k}: {_words(v)}" for k, v in daemon.items()]
    return "\n".join(lines)


def _words(value: object) -> str:
    """A fact of the daemon as a person reads it: `published 3, writes 7`, not a JSON object."""
    if isinstance(value, dict):
        return ", ".join(f"{k} {_words(v)}" for k, v in value.items()) or "-"
    if isinstance(value, list):
        return ", ".join(_words(v) for v in value) or "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return text(value)
