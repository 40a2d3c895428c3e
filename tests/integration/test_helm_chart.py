"""The Helm chart (deployments/helm/tandem): what `helm lint` and `helm template` make of it.

daemonset.yaml is the chart rendered with its defaults (hack/gen-manifest.sh), so the checks of
tests/unit/test_manifests.py hold for the default render; here the other value sets are rendered
by the real helm (built from its Go module by hack/helm.sh), validated against the Kubernetes 1.37
schemas, and their DaemonSet's environment parsed by the daemon's own flag parser, so a value
that reaches the daemon misspelled or unparsable fails here and not on a node.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from driver.cli import driver_parser
from driver.config import Config
from driver.flags import config_from_args
from driver.health.thresholds import NAMES as GREY_THRESHOLD_NAMES

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "deployments" / "helm" / "tandem"
K8S_VERSION = "1.37.0"
NAMESPACE = "tandem-system"
PROMETHEUS_RULE = "monitoring.coreos.com/v1/PrometheusRule"
SERVICE_MONITOR = "monitoring.coreos.com/v1/ServiceMonitor"
# Stand-ins for the downward-API values the kubelet fills in.
FIELDS = {"spec.nodeName": "node-a", "metadata.uid": "0b7f7a52-2c2f-4a5e-9b43-7a1d5f0c9e11", "status.podIP": "10.0.0.7"}

Doc = dict[str, Any]


@pytest.fixture(scope="module")
def helm() -> str:
    if shutil.which("go") is None:
        pytest.skip("helm is built from its Go module (hack/helm.sh) and Go is not installed")
    done = subprocess.run([REPO / "hack" / "helm.sh"], capture_output=True, text=True, timeout=1800, check=False)
    assert done.returncode == 0, f"hack/helm.sh failed: {done.stderr}"
    return done.stdout.strip()


def _run(helm: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([helm, *args], capture_output=True, text=True, timeout=120, check=False)


def render(helm: str, *values: str, namespace: str = NAMESPACE, api_versions: tuple[str, ...] = ()) -> list[Doc]:
    """`helm template` with `--set` VALUES; a refusal fails with helm's own message."""
    args = ["template", "tandem", str(CHART), "--namespace", namespace, "--kube-version", K8S_VERSION]
    args += [a for v in values for a in ("--set", v)] + [a for v in api_versions for a in ("--api-versions", v)]
    done = _run(helm, *args)
    if done.returncode != 0:
        raise RuntimeError(done.stderr)
    return [d for d in yaml.safe_load_all(done.stdout) if d]


def refusal(helm: str, *values: str, namespace: str = NAMESPACE) -> str:
    with pytest.raises(RuntimeError) as refused:
        render(helm, *values, namespace=namespace)
    return str(refused.value)


def _one(docs: list[Doc], kind: str) -> Doc:
    (found,) = [d for d in docs if d["kind"] == kind]
    return found


def daemon_config(docs: list[Doc], monkeypatch: pytest.MonkeyPatch) -> tuple[Config, argparse.Namespace]:
    """What `tandem-driver` makes of the rendered DaemonSet's args and environment (`$(VAR)`
    references expanded as the kubelet expands them): its Config, and the parsed flags."""
    container = _one(docs, "DaemonSet")["spec"]["template"]["spec"]["containers"][0]
    env: dict[str, str] = {}
    for entry in container["env"]:
        value = entry["value"] if "value" in entry else FIELDS[entry["valueFrom"]["fieldRef"]["fieldPath"]]
        env[entry["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], str(value))
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    ns = driver_parser().parse_args(container["args"])
    return config_from_args(ns), ns


# -- the chart as a whole ------------------------------------------------------------------------


def test_chart_version_is_the_package_version() -> None:
    """Chart.yaml's version is pyproject's in SemVer's spelling (0.2.0.dev0 -> 0.2.0-dev0), and its
    appVersion, which tags the image, pyproject's own."""
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["appVersion"] == version
    semver = re.sub(r"^(\d+\.\d+\.\d+)\.?((?:a|b|rc|dev)\d+)$", r"\1-\2", version)
    assert chart["version"] == semver


def test_helm_show_readme_says_how_to_install(helm: str) -> None:
    readme = _run(helm, "show", "readme", str(CHART))
    assert readme.returncode == 0 and "helm install tandem" in readme.stdout, readme.stderr


@pytest.mark.parametrize("strict", [False, True], ids=["lint", "lint-strict"])
def test_helm_lint(helm: str, strict: bool) -> None:
    # --namespace: with helm's default namespace, `default`, the chart refuses to render (below)
    # and lint would check nothing past the refusal.
    args = ["lint", str(CHART), "--namespace", NAMESPACE, "--kube-version", K8S_VERSION]
    for values in ([], ["--set", "metrics.enabled=true", "--set", "nvidiaDriverRoot=/run/nvidia/driver"]):
        done = _run(helm, *args, *(["--strict"] if strict else []), *values)
        assert done.returncode == 0 and "0 chart(s) failed" in done.stdout, done.stdout + done.stderr
        assert "[ERROR]" not in done.stdout and "[WARNING]" not in done.stdout, done.stdout


def test_daemonset_yaml_is_the_default_render(helm: str) -> None:
    """One source of truth: the plain manifest is exactly what hack/gen-manifest.sh makes now."""
    done = subprocess.run([REPO / "hack" / "gen-manifest.sh", "-"], capture_output=True, text=True, timeout=120,
                          check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert (REPO / "daemonset.yaml").read_text() == done.stdout, (
        "daemonset.yaml differs from the chart's default render: run hack/gen-manifest.sh"
    )


# Value sets an operator would use; each renders, validates for 1.37 and parses in the daemon.
VALUE_SETS = {
    "defaults": (),
    "gpu-operator": ("nvidiaDriverRoot=/run/nvidia/driver",),
    "nic-only": ("deviceKinds={nic}", "deviceClasses.gpu.enabled=false", "deviceClasses.mig.enabled=false"),
    "sharing-and-mig": ("gpuSharing={0,1}", "dynamicMig.gpus=all", "dynamicMig.bindingConditions=false"),
    "nics-and-logs": ("nics.exclude={stor*,0000:3b:00.*}", "nics.shares=8", "nics.bindingConditions=true", "logging.verbosity=4",
                      "logging.format=text"),
    "metrics": ("metrics.enabled=true",),
    "grey-thresholds": ("health.greyThresholds.window=600", "health.greyThresholds.flaps=5",
                        "health.greyThresholds.pcie-ber=1e-13", "health.greyThresholds.nic-speed-mbps=400000"),
    "bare": ("createNamespace=false", "criticalPodsQuota=false", "admissionPolicies.ownNodeSlices=false",
             "admissionPolicies.claimConfig=false", "admissionPolicies.driverEvents=false",
             "kubeletPlugin.priorityClassName=",
             "image.digest=sha256:" + "ab" * 32),
}  # fmt: skip


@pytest.mark.parametrize("name", VALUE_SETS)
def test_renders_are_valid_for_kubernetes_1_37(helm: str, name: str) -> None:
    docs = render(helm, *VALUE_SETS[name], api_versions=(SERVICE_MONITOR,))
    for doc in docs:
        if doc["apiVersion"] != "monitoring.coreos.com/v1":  # no schema of Kubernetes' own
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    keys = [(d["kind"], d["metadata"].get("namespace", ""), d["metadata"]["name"]) for d in docs]
    assert len(keys) == len(set(keys)), keys


@pytest.mark.parametrize("name", VALUE_SETS)
def test_every_value_set_parses_in_the_daemon(helm: str, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    daemon_config(render(helm, *VALUE_SETS[name]), monkeypatch)


# -- what each value does --------------------------------------------------------------------------


def test_daemon_settings_reach_the_daemon(helm: str, monkeypatch: pytest.MonkeyPatch) -> None:
    docs = render(helm, *VALUE_SETS["sharing-and-mig"], *VALUE_SETS["nics-and-logs"], "metrics.enabled=true",
                  "metrics.port=9555", "listAttributes=true", "driverName=gpus.example.com")  # fmt: skip
    config, flags = daemon_config(docs, monkeypatch)
    assert config.gpu_sharing.gpus == frozenset({"0", "1"}) and config.dynamic_mig.everything
    assert config.exclude_nics.patterns == ("stor*", "0000:3b:00.*") and config.nic_shares == 8
    assert config.metrics_address == "10.0.0.7:9555" and config.list_attributes
    assert config.driver_name == "gpus.example.com"
    container = _one(docs, "DaemonSet")["spec"]["template"]["spec"]["containers"][0]
    assert container["args"] == ["run", "--no-binding-conditions", "--nic-binding-conditions"]
    assert not config.mig_binding_conditions and config.nic_binding_conditions
    assert flags.verbose == 4 and flags.log_format == "text"
    # The port is the node's: a hostPort would keep the surge pod of a rolling update off the node.
    assert "ports" not in container


def test_the_schema_knows_every_grey_threshold_and_no_other() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    grey = schema["properties"]["health"]["properties"]["greyThresholds"]
    assert list(grey["properties"]) == list(GREY_THRESHOLD_NAMES)


def test_grey_thresholds_reach_the_daemon(helm: str, monkeypatch: pytest.MonkeyPatch) -> None:
    config, _ = daemon_config(render(helm, *VALUE_SETS["grey-thresholds"]), monkeypatch)
    assert config.grey_thresholds == ("flaps=5", "nic-speed-mbps=400000", "pcie-ber=1e-13", "window=600")


def test_driver_name_reaches_every_place_that_must_agree(helm: str) -> None:
    docs = render(helm, "driverName=gpus.example.com")
    text = yaml.safe_dump_all(docs)
    assert 'tandem.dev"' not in text and "plugins/tandem.dev" not in text
    assert {d["metadata"]["name"] for d in docs if d["kind"] == "DeviceClass"} == {
        "gpu.gpus.example.com", "mig.gpus.example.com", "nic.gpus.example.com"}  # fmt: skip
    classes = {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "DeviceClass"}
    assert classes["nic.gpus.example.com"]["extendedResourceName"] == "gpus.example.com/rdma"
    assert classes["gpu.gpus.example.com"]["extendedResourceName"] == "nvidia.com/gpu"
    rules = _one(docs, "ClusterRole")["rules"]
    assert [r["resourceNames"] for r in rules if "resourceNames" in r] == [["gpus.example.com"]]


def test_gpu_operator_driver_root_is_one_propagated_mount(helm: str) -> None:
    spec = _one(render(helm, *VALUE_SETS["gpu-operator"]), "DaemonSet")["spec"]["template"]["spec"]
    container = spec["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["NVIDIA_DRIVER_ROOT"] == "/driver-root" and env["NVIDIA_DRIVER_ROOT_HOST"] == "/run/nvidia/driver"
    mounts = [m for m in container["volumeMounts"] if m["mountPath"].startswith("/driver-root")]
    assert mounts == [{"name": "driver-root", "mountPath": "/driver-root", "readOnly": True,
                       "mountPropagation": "HostToContainer"}]  # fmt: skip
    (volume,) = [v for v in spec["volumes"] if v["name"] == "driver-root"]
    assert volume["hostPath"]["path"] == "/run/nvidia/driver"
    assert not [v for v in spec["volumes"] if v["name"].startswith("driver-root-")]


def test_nic_only_nodes_mount_no_driver_root(helm: str) -> None:
    docs = render(helm, *VALUE_SETS["nic-only"])
    spec = _one(docs, "DaemonSet")["spec"]["template"]["spec"]
    assert not [v for v in spec["volumes"] if v["name"].startswith("driver-root")]
    assert [d["metadata"]["name"] for d in docs if d["kind"] == "DeviceClass"] == ["nic.tandem.dev"]


def test_metrics_service_and_service_monitor(helm: str) -> None:
    assert not [d for d in render(helm) if d["kind"] in ("Service", "ServiceMonitor")]
    without_crd = render(helm, "metrics.enabled=true")
    service = _one(without_crd, "Service")
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["ports"][0]["port"] == 9400
    selector = _one(without_crd, "DaemonSet")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= selector.items()
    assert not [d for d in without_crd if d["kind"] == "ServiceMonitor"]  # its CRD is not served
    monitor = _one(render(helm, "metrics.enabled=true", api_versions=(SERVICE_MONITOR,)), "ServiceMonitor")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["endpoints"][0]["port"] == service["spec"]["ports"][0]["name"]
    # Per-pod GPU series keep their pod's `namespace` and `pod`, not the driver pod's.
    assert monitor["spec"]["endpoints"][0]["honorLabels"] is True


def test_alerts_and_dashboard_ship_with_metrics(helm: str) -> None:
    assert not [d for d in render(helm, api_versions=(PROMETHEUS_RULE,)) if d["kind"] == "PrometheusRule"]
    docs = render(helm, "metrics.enabled=true", api_versions=(PROMETHEUS_RULE,))
    (group,) = _one(docs, "PrometheusRule")["spec"]["groups"]
    assert {r["alert"] for r in group["rules"]} == {
        "TandemDeviceUnhealthy", "TandemGreyFailure", "TandemResetHeld", "TandemPrepareErrors",
        "TandemSlicesNotConfirmed", "TandemBindingFailures",
    }  # fmt: skip
    assert all(
        "{{ $labels." in r["annotations"]["summary"] for r in group["rules"] if "$labels" in r["annotations"]["summary"]
    )
    assert not [
        d for d in render(helm, "metrics.enabled=true") if d["kind"] == "PrometheusRule"
    ]  # its CRD is not served
    dashboard = _one(docs, "ConfigMap")
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    panels = json.loads(dashboard["data"]["tandem.json"])["panels"]
    assert panels and all(p["targets"][0]["expr"] for p in panels)


def test_switches_turn_their_objects_off(helm: str) -> None:
    docs = render(helm, *VALUE_SETS["bare"], "deviceClasses.gpu.extendedResourceName=")
    kinds = {d["kind"] for d in docs}
    assert not kinds & {"Namespace", "ResourceQuota", "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"}
    spec = _one(docs, "DaemonSet")["spec"]["template"]["spec"]
    assert "priorityClassName" not in spec
    assert spec["containers"][0]["image"] == "tandem-driver@sha256:" + "ab" * 32
    assert "extendedResourceName" not in _one([d for d in docs if d["metadata"]["name"].startswith("gpu.")],
                                              "DeviceClass")["spec"]  # fmt: skip


def test_names_follow_the_release(helm: str) -> None:
    """Two releases never fight over one cluster-wide object (the DeviceClasses follow driverName)."""
    done = _run(helm, "template", "other", str(CHART), "--namespace", "other-ns", "--kube-version", K8S_VERSION)
    docs = [d for d in yaml.safe_load_all(done.stdout) if d]
    cluster_wide = {
        d["metadata"]["name"] for d in docs if "namespace" not in d["metadata"] and d["kind"] != "DeviceClass"
    }
    assert cluster_wide == {
        "other-ns",
        "other-tandem-driver",
        "other-tandem-driver-own-node-slices",
        "other-tandem-opaque-config",
        "other-tandem-driver-events",
    }
    policy = next(d for d in docs if d["kind"] == "ValidatingAdmissionPolicy" and "own-node" in d["metadata"]["name"])
    assert "system:serviceaccount:other-ns:other-tandem-driver" in policy["spec"]["matchConditions"][0]["expression"]


# -- labels and selectors --------------------------------------------------------------------------

# The labels _helpers.tpl alone writes (tandem.labels, tandem.selectorLabels); a template adds a
# component of its own at most.
STANDARD_LABELS = (
    "app.kubernetes.io/name",
    "app.kubernetes.io/instance",
    "app.kubernetes.io/version",
    "app.kubernetes.io/managed-by",
    "helm.sh/chart",
)
# 0.1.0's DaemonSet selector (its daemonset.yaml, commit db9db60). A DaemonSet's selector is
# immutable: tests/cluster/test_upgrade.py upgrades that DaemonSet with this chart and replaces it
# back, so the chart's must stay exactly this (docs/deployment.md, 'Labels and selectors').
PREVIOUS_SELECTOR = {"app.kubernetes.io/name": "tandem", "app.kubernetes.io/component": "kubelet-plugin"}


def test_labels_and_the_probe_script_are_written_once() -> None:
    """Every template takes its labels from _helpers.tpl and none spells one out by hand, and the
    probes' shell script is one definition (tandem.probe) the three probes include."""
    helpers = (CHART / "templates" / "_helpers.tpl").read_text()
    for template in sorted((CHART / "templates").iterdir()):
        if template.name == "_helpers.tpl":
            continue
        text = template.read_text()
        by_hand = [
            (n, line.strip())
            for n, line in enumerate(text.splitlines(), 1)
            if any(f"{label}:" in line for label in STANDARD_LABELS)
        ]
        assert not by_hand, f"{template.name} writes labels that _helpers.tpl's tandem.labels should: {by_hand}"
        assert "verdict expired" not in text and "$KUBELET_PLUGINS_DIRECTORY_PATH" not in text, (
            f"{template.name}: the probe script belongs in _helpers.tpl (tandem.probe)"
        )
    assert helpers.count("verdict expired") == 1
    for label in STANDARD_LABELS:
        assert f"{label}:" in helpers, label


def test_every_object_carries_the_standard_labels(helm: str) -> None:
    docs = render(helm, "metrics.enabled=true", api_versions=(SERVICE_MONITOR,))
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    expected = {
        "helm.sh/chart": f"tandem-{chart['version']}",
        "app.kubernetes.io/name": "tandem",
        "app.kubernetes.io/instance": "tandem",
        "app.kubernetes.io/version": chart["appVersion"],
        "app.kubernetes.io/managed-by": "Helm",
    }
    pods = [d["spec"]["template"] for d in docs if d["kind"] == "DaemonSet"]
    for doc in [*docs, *pods]:
        labels = doc["metadata"].get("labels") or {}
        assert labels.items() >= expected.items(), (doc.get("kind", "pod template"), labels)
    ds = _one(docs, "DaemonSet")
    assert ds["metadata"]["labels"]["app.kubernetes.io/component"] == "kubelet-plugin"
    assert _one(docs, "Service")["metadata"]["labels"]["app.kubernetes.io/component"] == "metrics"
    # The namespace keeps its Pod Security label beside them.
    assert _one(docs, "Namespace")["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"


def test_the_daemonset_selector_is_the_immutable_one_of_0_1_0(helm: str) -> None:
    """Whatever the release and the values, the selector is 0.1.0's, which the pods match."""
    for release, values in (("tandem", ()), ("other", ("nameOverride=gpus", "fullnameOverride=x"))):
        args = ["template", release, str(CHART), "--namespace", NAMESPACE, "--kube-version", K8S_VERSION]
        done = _run(helm, *args, *[a for v in values for a in ("--set", v)])
        assert done.returncode == 0, done.stderr
        ds = _one([d for d in yaml.safe_load_all(done.stdout) if d], "DaemonSet")
        assert ds["spec"]["selector"] == {"matchLabels": PREVIOUS_SELECTOR}, release
        assert ds["spec"]["template"]["metadata"]["labels"].items() >= PREVIOUS_SELECTOR.items()
    # Where the history is at hand, the constant is checked against 0.1.0's manifest itself.
    shown = subprocess.run(
        ["git", "-C", str(REPO), "show", "db9db60:daemonset.yaml"], capture_output=True, text=True, check=False
    )
    if shown.returncode == 0:
        previous = _one([d for d in yaml.safe_load_all(shown.stdout) if d], "DaemonSet")
        assert previous["spec"]["selector"] == {"matchLabels": PREVIOUS_SELECTOR}


def _selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return selector.items() <= labels.items()


def test_two_releases_in_one_namespace_select_only_their_own(helm: str) -> None:
    """The metrics Service of one release lists only its own driver pods, and its ServiceMonitor
    only its own Service, with another release of the chart in the same namespace."""
    renders = {}
    for release, driver in (("tandem", "tandem.dev"), ("other", "other.example.com")):
        args = [
            "template",
            release,
            str(CHART),
            "--namespace",
            NAMESPACE,
            "--kube-version",
            K8S_VERSION,
            "--api-versions",
            SERVICE_MONITOR,
            "--set",
            "metrics.enabled=true",
            "--set",
            f"driverName={driver}",
        ]
        done = _run(helm, *args)
        assert done.returncode == 0, done.stderr
        renders[release] = [d for d in yaml.safe_load_all(done.stdout) if d]
    for mine, theirs in (("tandem", "other"), ("other", "tandem")):
        own_pods = _one(renders[mine], "DaemonSet")["spec"]["template"]["metadata"]["labels"]
        other_pods = _one(renders[theirs], "DaemonSet")["spec"]["template"]["metadata"]["labels"]
        service, other_service = _one(renders[mine], "Service"), _one(renders[theirs], "Service")
        assert _selects(service["spec"]["selector"], own_pods)
        assert not _selects(service["spec"]["selector"], other_pods), f"{mine}'s Service selects {theirs}'s pods"
        monitor = _one(renders[mine], "ServiceMonitor")["spec"]["selector"]["matchLabels"]
        assert _selects(monitor, service["metadata"]["labels"])
        assert not _selects(monitor, other_service["metadata"]["labels"]), f"{mine}'s ServiceMonitor selects {theirs}'s"
        assert own_pods["app.kubernetes.io/instance"] == mine


# -- what the chart refuses ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (("nics.shares=many",), "at '/nics/shares': got string, want null or integer"),
        (("listAttributes=yes",), "at '/listAttributes': got string, want boolean"),
        (("metrics.port=70000",), "at '/metrics/port': maximum"),
        (("deviceKinds={gpu,fpga}",), "at '/deviceKinds/1': value must be one of 'gpu', 'nic'"),
        (("driverName=Tandem_Dev",), "at '/driverName': 'Tandem_Dev' does not match pattern"),
        (("gpuSharing=some",), "at '/gpuSharing': 'oneOf' failed"),
        (("nvidiaDriverRoot=run/nvidia/driver",), "at '/nvidiaDriverRoot'"),
        (("image.pullPolicy=Sometimes",), "at '/image/pullPolicy'"),
        (("kubeletPlugin.tolerations=none",), "at '/kubeletPlugin/tolerations': got string, want array"),
        (("gpuSharig=all",), "additional properties 'gpuSharig' not allowed"),
        (
            ("kubeletPlugin.resources.limits.memory=320",),
            "at '/kubeletPlugin/resources/limits/memory': got number, want string",
        ),
        (
            ("kubeletPlugin.resources.requests.memory=128MB",),
            "at '/kubeletPlugin/resources/requests/memory': '128MB' does not match",
        ),
        (
            ("kubeletPlugin.resources.requests.cpu=lots",),
            "at '/kubeletPlugin/resources/requests/cpu': 'lots' does not match",
        ),
        (
            ("health.greyThresholds.windw=600",),
            "at '/health/greyThresholds': additional properties 'windw' not allowed",
        ),
        (("health.greyThresholds.window=soon",), "at '/health/greyThresholds/window': 'soon' does not match pattern"),
        (("health.greyThresholds.flaps=-1",), "at '/health/greyThresholds/flaps': minimum"),
    ],
)
def test_schema_refuses_wrong_types(helm: str, values: tuple[str, ...], message: str) -> None:
    assert message in refusal(helm, *values)


@pytest.mark.parametrize(
    ("values", "namespace", "message"),
    [
        ((), "default", 'namespace "default": Tandem\'s namespace must admit privileged pods'),
        ((), "kube-system", 'namespace "kube-system"'),
        (("driverName=gpu.nvidia.com",), NAMESPACE, 'driverName "gpu.nvidia.com" belongs to another DRA driver'),
        (("driverName=resource.k8s.io",), NAMESPACE, "Kubernetes-reserved domain"),
        (("deviceKinds={nic}", "gpuSharing=all", "deviceClasses.gpu.extendedResourceName="), NAMESPACE,
         'gpuSharing and dynamicMig.gpus need "gpu" in deviceKinds'),
        (("deviceKinds={nic}",), NAMESPACE, "pods asking for nvidia.com/gpu would wait for GPUs Tandem never publishes"),
    ],
)  # fmt: skip
def test_unsafe_combinations_fail_with_a_reason(
    helm: str, values: tuple[str, ...], namespace: str, message: str
) -> None:
    assert message in refusal(helm, *values, namespace=namespace)


# -- what the driver's identity may do -------------------------------------------------------------

PODS_RULE = {"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch"]}


def _rules(docs: list[Doc]) -> list[Doc]:
    return _one(docs, "ClusterRole")["rules"]


@pytest.mark.parametrize(
    ("values", "watches"),
    [
        ((), False),
        (("dynamicMig.gpus=all",), True),
        (("dynamicMig.gpus={0}", "dynamicMig.bindingConditions=false"), False),
        (("nics.bindingConditions=true",), True),
        (("dynamicMig.gpus=all", "dynamicMig.bindingConditions=false", "nics.bindingConditions=true"), True),
    ],
    ids=["defaults", "dynamic-mig", "dynamic-mig-without-binding-conditions", "nic-binding-conditions", "both"],
)
def test_pods_are_granted_only_where_the_daemon_watches_them(helm: str, values: tuple[str, ...], watches: bool) -> None:
    """Listing pods reads every pod's spec in the cluster (RBAC cannot narrow it to the pods
    nominated to one node), and only binding conditions need it: dynamic MIG with its binding
    conditions, or NIC binding conditions. tests/integration/test_deployment.py checks each
    manifest against the calls of the daemon it runs."""
    rules = _rules(render(helm, *values))
    assert (PODS_RULE in rules) == watches
    assert [r for r in rules if "pods" in r["resources"] and r != PODS_RULE] == []


EVENTS_POLICY = "tandem-driver-events"


def _events_policy(docs: list[Doc]) -> tuple[Doc, dict[str, str], list[Doc]]:
    """The Events policy, its variables (whitespace as one space) and its validations."""
    (policy,) = [d for d in docs if d["kind"] == "ValidatingAdmissionPolicy" and d["metadata"]["name"] == EVENTS_POLICY]
    spec = policy["spec"]
    variables = {v["name"]: " ".join(v["expression"].split()) for v in spec["variables"]}
    return policy, variables, spec["validations"]


def test_the_drivers_events_are_held_to_what_it_writes(helm: str) -> None:
    """RBAC grants Events in every namespace about anything; the policy admits only those
    driver/events.py writes: about a ResourceClaim (in its namespace) or the driver's own Node (in
    `default`), reported as this driver from the node its token names, with no related object
    (so an UPDATE too: events.k8s.io/v1 keeps those fields immutable). Through events.k8s.io in every version (core/v1 Events are
    the same resource, matched as equivalent), for the driver's service account only.

    No CEL evaluator runs here: the expressions are pinned as written, and the real API server
    evaluates them against sample Events in tests/cluster/test_admission.py."""
    docs = render(helm, "driverName=gpus.example.com")
    policy, variables, validations = _events_policy(docs)
    spec = policy["spec"]
    assert spec["failurePolicy"] == "Fail"
    (rule,) = spec["matchConstraints"]["resourceRules"]
    assert rule == {
        "apiGroups": ["events.k8s.io"],
        "apiVersions": ["*"],
        "operations": ["CREATE", "UPDATE"],
        "resources": ["events"],
    }
    (binding,) = [
        d
        for d in docs
        if d["kind"] == "ValidatingAdmissionPolicyBinding" and (d["spec"]["policyName"] == EVENTS_POLICY)
    ]
    assert binding["spec"]["validationActions"] == ["Deny"]
    (account,) = [d for d in docs if d["kind"] == "ServiceAccount"]
    user = f"system:serviceaccount:{NAMESPACE}:{account['metadata']['name']}"
    assert [" ".join(c["expression"].split()) for c in spec["matchConditions"]] == [
        f'request.userInfo.username == "{user}"'
    ]
    assert variables["userNodeName"] == (
        "request.userInfo.extra[?'authentication.kubernetes.io/node-name'][0].orValue('')"
    )
    # driver/events.py: reportingInstance is "<driver>-<node>", cut to the API's 128 characters.
    assert variables["reporter"] == '"gpus.example.com-" + variables.userNodeName'
    assert variables["instance"] == (
        "size(variables.reporter) > 128 ? variables.reporter.substring(0, 128) : variables.reporter"
    )
    checks = [" ".join(v["expression"].split()) for v in validations]
    assert checks == [
        'variables.userNodeName != ""',
        "variables.aboutClaim || variables.aboutNode",
        '!variables.aboutClaim || object.regarding.?namespace.orValue("") == request.namespace',
        '!variables.aboutNode || object.regarding.?name.orValue("") == variables.userNodeName && '
        'request.namespace == "default"',
        'object.?reportingController.orValue("") == "gpus.example.com" && '
        'object.?reportingInstance.orValue("") == variables.instance',
        "!has(object.related)",
    ]
    assert variables["aboutClaim"] == (
        'variables.kind == "ResourceClaim" && object.regarding.?apiVersion.orValue("").startsWith("resource.k8s.io/")'
    )
    assert variables["aboutNode"] == 'variables.kind == "Node" && object.regarding.?apiVersion.orValue("") == "v1"'
