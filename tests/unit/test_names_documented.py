"""The names an operator types or queries (the daemon's and tandemctl's flags, the metrics, the
chart's values) are documented where they are looked up, the docs name none that does not exist,
and every one added or removed since the last release has its CHANGELOG entry: docs and CHANGELOG
must not drift from the code (a renamed metric breaks every dashboard and alert built on it)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
FLAG_SOURCES = ("driver/flags.py", "driver/cli.py", "driver/ctl/commands.py")
DOCS = (REPO / "README.md", *sorted((REPO / "docs").glob("*.md")))
METRIC_SUFFIXES = ("_total", "_bucket", "_sum", "_count", "_created", "_info")

# What 0.1.0 had (its code at commit db9db60): flags of tandem-driver and tandemctl, and metrics.
RELEASED_FLAGS = frozenset({
    "--cdi-root", "--dev-root", "--device-kinds", "--driver-name", "--dynamic-mig", "--exclude-nics",
    "--gpu-sharing", "--health-quiet-period", "--help", "--ignored-xids", "--keep", "--kubeconfig",
    "--kubelet-plugins-dir", "--kubelet-registrar-dir", "--link-debounce", "--list-attributes", "--log-format",
    "--metrics-address", "--netns", "--nic-link-source", "--nic-shares", "--node-name", "--nvidia-driver-root",
    "--nvidia-driver-root-host", "--pod-uid", "--proc-root", "--rediscover-period", "--sysfs-root",
    "--taint-effect", "--timeout", "--verbose",
})  # fmt: skip
RELEASED_METRICS = frozenset({
    "tandem_devices", "tandem_device_health", "tandem_device_taints", "tandem_health_events", "tandem_node_calls",
    "tandem_node_call_seconds", "tandem_node_claims", "tandem_slice_errors", "tandem_slice_skipped_devices",
    "tandem_slice_syncs", "tandem_slice_watch_restarts", "tandem_slice_writes",
})  # fmt: skip


def _flags() -> set[str]:
    return {f for src in FLAG_SOURCES for f in re.findall(r'"(--[a-z][a-z0-9-]*)"', (REPO / src).read_text())}


def _metrics() -> set[str]:
    return set(re.findall(r'"(tandem_[a-z0-9_]+)"', (REPO / "driver" / "metrics.py").read_text()))


def _unreleased() -> str:
    text = (REPO / "CHANGELOG.md").read_text()
    return text[text.index("## [Unreleased]") : text.index("## [0.1.0]")]


def _named(text: str, name: str) -> bool:
    return re.search(re.escape(name) + r"(_total)?(?![A-Za-z0-9_-])", text) is not None


def test_every_flag_and_metric_added_or_removed_since_the_release_has_its_changelog_entry() -> None:
    flags, metrics = _flags(), _metrics()
    changed = (flags ^ RELEASED_FLAGS) | (metrics ^ RELEASED_METRICS)
    unreleased = _unreleased()
    missing = sorted(name for name in changed if not _named(unreleased, name))
    assert not missing, f"CHANGELOG.md's [Unreleased] says nothing of these, added or removed since 0.1.0: {missing}"


def test_the_released_names_are_what_0_1_0_had() -> None:
    """The snapshot must hold names that were real; a released one gone must be in the CHANGELOG
    (the test above), not dropped from the snapshot."""
    assert _metrics() | {n for n in RELEASED_METRICS if _named(_unreleased(), n)} >= RELEASED_METRICS


def _metric_mentions() -> Iterator[tuple[str, str]]:
    for doc in DOCS:
        for name in re.findall(r"\btandem_[a-z0-9_]*[a-z0-9]\b", doc.read_text()):  # not a prefix: `tandem_claim_gpu_*`
            yield doc.name, name


def _base_metric(name: str) -> str:
    for suffix in METRIC_SUFFIXES:
        if name.endswith(suffix) and name.removesuffix(suffix) in _metrics():
            return name.removesuffix(suffix)
    return name


def test_docs_name_only_metrics_that_exist_and_list_every_one() -> None:
    metrics = _metrics()
    unknown = sorted({f"{doc}: {name}" for doc, name in _metric_mentions() if _base_metric(name) not in metrics})
    assert not unknown, f"the docs name metrics the code does not export: {unknown}"
    table = (REPO / "docs" / "deployment.md").read_text()
    rows = {
        _base_metric(n)
        for line in table.splitlines()
        if line.startswith("| `tandem_")
        for n in re.findall(r"`(tandem_[a-z0-9_]+)`", line.split("|")[1])
    }
    assert metrics <= rows, f"docs/deployment.md's metrics table lacks: {sorted(metrics - rows)}"


def test_the_shipped_alerts_and_dashboard_name_only_metrics_that_exist() -> None:
    """A renamed metric would leave an alert that never fires and a panel that shows nothing."""
    chart = REPO / "deployments" / "helm" / "tandem"
    metrics = _metrics()
    for path in (chart / "templates" / "alerts.yaml", chart / "dashboards" / "tandem.json"):
        named = set(re.findall(r"\btandem_[a-z0-9_]*[a-z0-9]\b", path.read_text()))
        assert named, f"{path.name} names no metric: the pattern no longer finds them"
        unknown = sorted(n for n in named if _base_metric(n) not in metrics)
        assert not unknown, f"{path.name} names metrics the daemon does not export: {unknown}"


def test_readme_flag_table_names_every_daemon_flag_and_only_those() -> None:
    rows = [line for line in (REPO / "README.md").read_text().splitlines() if line.startswith("| `-")]
    listed = {f for line in rows for f in re.findall(r"(--[a-z][a-z0-9-]*)", line.split("|")[1])}
    daemon = set(re.findall(r'_flag\(\s*p,\s*"(--[a-z][a-z0-9-]*)"', (REPO / "driver" / "flags.py").read_text()))
    assert daemon, "no daemon flag found: the pattern no longer matches driver/flags.py"
    assert not daemon - listed, f"README's flag table lacks: {sorted(daemon - listed)}"
    assert not listed - _flags(), f"README's flag table names flags that do not exist: {sorted(listed - _flags())}"


def _values() -> set[str]:
    def leaves(node: dict[str, object], prefix: str) -> Iterator[str]:
        for key, value in node.items():
            if isinstance(value, dict) and value:
                yield from leaves(value, f"{prefix}{key}.")
            else:
                yield f"{prefix}{key}"

    return set(leaves(yaml.safe_load((REPO / "deployments/helm/tandem/values.yaml").read_text()), ""))


def _documented_values() -> set[str]:
    """The first column of the values table in docs/deployment.md's 'Configure': `a.b`, and `.c`
    meaning `a.c`."""
    text = (REPO / "docs" / "deployment.md").read_text()
    section = text[text.index("## Configure") : text.index("\n### ", text.index("## Configure"))]
    out: set[str] = set()
    for line in section.splitlines():
        names = re.findall(r"`(\.?[A-Za-z][\w.-]*)`", line.split("|")[1]) if line.startswith("| `") else []
        first = next((n for n in names if not n.startswith(".")), "")
        out |= {first.rsplit(".", 1)[0] + n if n.startswith(".") else n for n in names}
    return out


def test_every_chart_value_is_documented_and_the_docs_name_only_values_that_exist() -> None:
    values, documented = _values(), _documented_values()

    def covers(name: str, by: set[str]) -> bool:
        return name in by or any(name.startswith(b + ".") for b in by)

    undocumented = sorted(v for v in values if not covers(v, documented))
    assert not undocumented, f"docs/deployment.md's values table lacks: {undocumented}"
    unknown = sorted(
        d for d in documented if "." in d and d not in values and not any(v.startswith(d + ".") for v in values)
    )
    assert not unknown, f"docs/deployment.md names chart values that do not exist: {unknown}"
