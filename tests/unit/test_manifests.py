"""The deployment manifests: valid for Kubernetes 1.37 and consistent with the daemon they start.

Schema validation alone would accept a DaemonSet whose CDI_ROOT points at an unmounted path, or a
DeviceClass that selects another driver's devices; the tests below tie every such value to the
daemon's real flag parsing (driver/cli.py) and device vocabulary (driver/model.py), so a change on
either side that the other does not follow fails here and not on a cluster.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import textwrap
from collections.abc import Callable, Iterator
from enum import StrEnum
from pathlib import Path, PurePosixPath
from typing import Any

import kubernetes_validate
import pytest
import yaml

from driver.claims.opaque_config import (
    _CLASS_ONLY,
    _FIELDS,
    _IFNAME,
    _JSON_TYPES,
    API_VERSION,
    MAX_ADDRESSES,
    MAX_MTU,
    MAX_ROUTES,
    MIN_MTU,
    MIN_MTU_IPV6,
    opaque_entries,
    resolve,
)
from driver.cli import config_from_args, driver_parser
from driver.config import Config
from driver.discovery.nic.device import SHARES
from driver.kubelet.liveness import probe_path
from driver.kubelet.registration import registration_socket_path
from driver.model import DeviceKind
from driver.node.driver_root import DriverFiles, find_driver_files
from sim.driver_files import render_driver_files

REPO = Path(__file__).resolve().parents[2]
DAEMONSET_FILE = REPO / "daemonset.yaml"
EXAMPLE_FILES = sorted((REPO / "examples").glob("*.yaml"))
K8S_VERSION = "1.37.0"
EXAMPLES_NAMESPACE = "tandem-examples"
DRIVER_VERSION = "580.95.05"

Doc = dict[str, Any]


def _load(path: Path) -> list[Doc]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


INSTALL = _load(DAEMONSET_FILE)
EXAMPLES = {p.name: _load(p) for p in EXAMPLE_FILES}
ALL_DOCS = [(DAEMONSET_FILE.name, d) for d in INSTALL] + [(n, d) for n, docs in EXAMPLES.items() for d in docs]


def _one(docs: list[Doc], kind: str) -> Doc:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"expected exactly one {kind}, found {len(found)}"
    return found[0]


def _of_kind(docs: list[Doc], kind: str) -> list[Doc]:
    return [d for d in docs if d["kind"] == kind]


DAEMONSET = _one(INSTALL, "DaemonSet")
POD_SPEC = DAEMONSET["spec"]["template"]["spec"]
CONTAINER = POD_SPEC["containers"][0]
ENV = {e["name"]: e for e in CONTAINER["env"]}
DEVICE_CLASSES = {d["metadata"]["name"]: d for d in _of_kind(INSTALL, "DeviceClass")}

# Stand-ins for the downward-API values the kubelet fills in.
FAKE_NODE = "node-a"
FAKE_POD_UID = "0b7f7a52-2c2f-4a5e-9b43-7a1d5f0c9e11"


def _doc_id(item: tuple[str, Doc]) -> str:
    name, doc = item
    return f"{name}:{doc['kind']}/{doc['metadata'].get('name', '?')}"


@pytest.mark.parametrize("item", ALL_DOCS, ids=[_doc_id(i) for i in ALL_DOCS])
def test_document_is_valid_for_kubernetes_1_37(item: tuple[str, Doc]) -> None:
    _name, doc = item
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def _documented_objects() -> list[Doc]:
    """The whole Kubernetes objects (apiVersion and kind) in docs/deployment.md's YAML blocks, which
    admins copy as they stand; fragments of the DaemonSet (env, volumes) are left out."""
    text = (REPO / "docs" / "deployment.md").read_text()
    objects = []
    for block in re.findall(r"^( *)```yaml\n(.*?)^\1```", text, re.MULTILINE | re.DOTALL):
        body = textwrap.dedent(block[1])
        objects += [d for d in yaml.safe_load_all(body) if isinstance(d, dict) and {"apiVersion", "kind"} <= set(d)]
    return objects


def test_objects_in_the_deployment_guide_are_valid_for_kubernetes_1_37() -> None:
    objects = _documented_objects()
    assert {"ResourceQuota", "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"} <= {
        d["kind"] for d in objects
    }
    for doc in objects:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_nic_admission_policy_in_the_guide_names_the_installed_class() -> None:
    """The policy of docs/deployment.md ('Security') must name the NIC class daemonset.yaml installs."""
    (policy,) = [d for d in _documented_objects() if d["kind"] == "ValidatingAdmissionPolicy"]
    nic_classes = [n for n, c in DEVICE_CLASSES.items() if '"nic"' in c["spec"]["selectors"][0]["cel"]["expression"]]
    assert nic_classes and all(f'"{n}"' in policy["spec"]["validations"][0]["expression"] for n in nic_classes)
    (quota,) = [d for d in _documented_objects() if d["kind"] == "ResourceQuota"]
    assert {f"{n}.deviceclass.resource.k8s.io/devices" for n in nic_classes} <= set(quota["spec"]["hard"])
    extended = {DEVICE_CLASSES[n]["spec"]["extendedResourceName"] for n in nic_classes}
    assert {f"requests.{e}" for e in extended} <= set(quota["spec"]["hard"])


def test_validation_is_strict_about_unknown_fields() -> None:
    """Guards the test above: a misspelled field must fail, or the schema check proves nothing."""
    doc = yaml.safe_load(yaml.safe_dump(DAEMONSET))
    doc["spec"]["template"]["spec"]["containers"][0]["volumeMount"] = []
    with pytest.raises(kubernetes_validate.ValidationError, match="volumeMount"):
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_install_file_has_no_duplicate_objects() -> None:
    keys = [(d["kind"], d["metadata"].get("namespace", ""), d["metadata"]["name"]) for d in INSTALL]
    assert len(keys) == len(set(keys)), keys


def test_install_file_creates_its_namespace_before_namespaced_objects() -> None:
    ns = _one(INSTALL, "Namespace")["metadata"]["name"]
    first_use = next(i for i, d in enumerate(INSTALL) if d["metadata"].get("namespace"))
    assert INSTALL.index(_one(INSTALL, "Namespace")) < first_use
    assert {d["metadata"]["namespace"] for d in INSTALL if "namespace" in d["metadata"]} == {ns}


# -- the daemon's configuration, as the DaemonSet's environment produces it --------------------


def _env_value(entry: dict[str, Any]) -> str:
    if "value" in entry:
        return str(entry["value"])
    field = entry["valueFrom"]["fieldRef"]["fieldPath"]
    return {"spec.nodeName": FAKE_NODE, "metadata.uid": FAKE_POD_UID}[field]


@pytest.fixture
def daemon_config(monkeypatch: pytest.MonkeyPatch) -> Config:
    """The Config `tandem-driver run` builds inside the pod: the real parser, the pod's environment."""
    for name in ENV:
        monkeypatch.delenv(name, raising=False)
    for name, entry in ENV.items():
        monkeypatch.setenv(name, _env_value(entry))
    assert CONTAINER["args"][0] == "run"
    return config_from_args(driver_parser().parse_args(CONTAINER["args"]))


def test_downward_api_supplies_node_name_and_pod_uid() -> None:
    assert ENV["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert ENV["POD_UID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.uid"


def test_daemon_config_takes_the_pod_environment(daemon_config: Config) -> None:
    assert daemon_config.node_name == FAKE_NODE
    assert daemon_config.pod_uid == FAKE_POD_UID, "POD_UID enables the rolling-update socket names"
    assert daemon_config.device_kinds == {DeviceKind.GPU, DeviceKind.NIC}


def _mounts() -> dict[PurePosixPath, dict[str, Any]]:
    return {PurePosixPath(m["mountPath"]): m for m in CONTAINER["volumeMounts"]}


def _volume(name: str) -> dict[str, Any]:
    return next(v for v in POD_SPEC["volumes"] if v["name"] == name)


def _mount_for(path: Path) -> dict[str, Any] | None:
    """The deepest mount that contains `path` (itself or a parent), as the kernel resolves it."""
    p = PurePosixPath(path)
    best = None
    for mount_path, mount in _mounts().items():
        if (p == mount_path or mount_path in p.parents) and (
            best is None or len(mount_path.parts) > len(PurePosixPath(best["mountPath"]).parts)
        ):
            best = mount
    return best


def _host_path_of(path: Path) -> PurePosixPath:
    mount = _mount_for(path)
    assert mount is not None, f"{path} is not on any volume mount"
    host = _volume(mount["name"]).get("hostPath")
    assert host is not None, f"{path} is mounted from volume {mount['name']!r}, which is not a hostPath"
    return PurePosixPath(host["path"]) / PurePosixPath(path).relative_to(mount["mountPath"])


@pytest.mark.parametrize("attr", ["registrar_dir", "data_dir", "cdi_root", "sysfs_root", "dev_root"])
def test_every_configured_path_is_a_mounted_host_path(daemon_config: Config, attr: str) -> None:
    _host_path_of(getattr(daemon_config, attr))


@pytest.mark.parametrize("attr", ["registrar_dir", "data_dir", "cdi_root", "dev_root"])
def test_paths_shared_with_kubelet_and_runtime_are_the_same_inside_and_out(daemon_config: Config, attr: str) -> None:
    """The kubelet dials sockets and the runtime reads CDI specs and device nodes by host path."""
    path = getattr(daemon_config, attr)
    assert _host_path_of(path) == PurePosixPath(path)


def _driver_root_mounts(driver_root: Path) -> list[dict[str, Any]]:
    """The mounts that make up the daemon's view of the NVIDIA driver root: at it or below it."""
    root = PurePosixPath(driver_root)
    return [m for p, m in _mounts().items() if p == root or root in p.parents]


def test_driver_root_is_made_of_read_only_host_paths(daemon_config: Config) -> None:
    mounts = _driver_root_mounts(daemon_config.nvidia_driver_root)
    assert mounts, f"nothing is mounted at or below {daemon_config.nvidia_driver_root}"
    for mount in mounts:
        assert mount.get("readOnly") is True, mount["name"]
        assert "hostPath" in _volume(mount["name"]), mount["name"]


def test_cdi_host_paths_of_driver_files_name_the_hosts_driver_root(daemon_config: Config) -> None:
    """The daemon reads the driver at /driver-root, but CDI mounts are resolved by the runtime on
    the host: every volume below the driver root must come from the same place below
    NVIDIA_DRIVER_ROOT_HOST, or the re-rooted host paths would name other files."""
    assert daemon_config.nvidia_driver_root_host is not None
    host_root = PurePosixPath(daemon_config.nvidia_driver_root_host)
    for mount in _driver_root_mounts(daemon_config.nvidia_driver_root):
        relative = PurePosixPath(mount["mountPath"]).relative_to(daemon_config.nvidia_driver_root)
        assert PurePosixPath(_volume(mount["name"])["hostPath"]["path"]) == host_root / relative, mount["name"]


def test_data_dir_mount_is_only_this_drivers_directory(daemon_config: Config) -> None:
    mount = _mount_for(daemon_config.data_dir)
    assert mount is not None and PurePosixPath(mount["mountPath"]) == PurePosixPath(daemon_config.data_dir)


@pytest.mark.parametrize("attr", ["sysfs_root"])
def test_host_views_are_read_only(daemon_config: Config, attr: str) -> None:
    mount = _mount_for(getattr(daemon_config, attr))
    assert mount is not None and mount.get("readOnly") is True


def test_writable_state_is_not_read_only(daemon_config: Config) -> None:
    for path in (daemon_config.registrar_dir, daemon_config.data_dir, daemon_config.cdi_root):
        mount = _mount_for(path)
        assert mount is not None and not mount.get("readOnly", False), path


def test_every_volume_is_mounted_and_every_mount_has_a_volume() -> None:
    volumes = {v["name"] for v in POD_SPEC["volumes"]}
    mounted = {m["name"] for m in CONTAINER["volumeMounts"]}
    assert volumes == mounted


# -- what the privileged driver pod sees of the host ----------------------------------------

# Host paths holding credentials or other pods' data: the kubelet's client certificates and every
# pod's volumes (secrets, service-account tokens) under /var/lib/kubelet, the control plane's and
# the kubelet's kubeconfigs and PKI, users' homes, SSH host keys, the runtime's and etcd's state.
# A hostPath volume at one of them, inside one, or above one (`/`, `/var`, `/etc`) hands them to a
# privileged pod; the only exceptions are the kubelet plugin directories the driver must write.
SECRET_HOST_PATHS = tuple(
    PurePosixPath(p)
    for p in (
        "/var/lib/kubelet",
        "/etc/kubernetes",
        "/root",
        "/home",
        "/etc/ssh",
        "/var/lib/containerd",
        "/var/lib/containers",
        "/var/lib/etcd",
    )
)


def exposed_secrets(host_path: PurePosixPath, allowed: set[PurePosixPath]) -> list[PurePosixPath]:
    """The secret-holding host paths a hostPath volume at `host_path` would expose."""
    if host_path in allowed:
        return []
    return [s for s in SECRET_HOST_PATHS if host_path == s or s in host_path.parents or host_path in s.parents]


def _host_path_volumes() -> dict[str, PurePosixPath]:
    return {v["name"]: PurePosixPath(v["hostPath"]["path"]) for v in POD_SPEC["volumes"] if "hostPath" in v}


@pytest.mark.parametrize(
    ("host_path", "exposed"),
    [
        ("/", ["/var/lib/kubelet", "/etc/kubernetes", "/root", "/home"]),
        ("/var/lib/kubelet", ["/var/lib/kubelet"]),
        ("/var/lib/kubelet/plugins", ["/var/lib/kubelet"]),
        ("/var/lib/kubelet/pods", ["/var/lib/kubelet"]),
        ("/etc", ["/etc/kubernetes", "/etc/ssh"]),
        ("/home/kubernetes/bin/nvidia", ["/home"]),
        ("/usr", []),
        ("/etc/alternatives", []),
        ("/var/lib/kubelet/plugins_registry", []),
    ],
)
def test_secret_check_flags_roots_parents_and_insides(host_path: str, exposed: list[str]) -> None:
    """Guards the test below: it must catch `/`, the whole kubelet directory and a path inside it."""
    allowed = {PurePosixPath("/var/lib/kubelet/plugins_registry")}
    found = exposed_secrets(PurePosixPath(host_path), allowed)
    assert {str(p) for p in found} >= set(exposed)
    assert bool(found) == bool(exposed)


def test_no_volume_exposes_host_secrets(daemon_config: Config) -> None:
    """The driver is privileged: whatever it mounts, a compromise of it reads (issue 11, item 10)."""
    allowed = {PurePosixPath(daemon_config.registrar_dir), PurePosixPath(daemon_config.data_dir)}
    for name, host_path in _host_path_volumes().items():
        assert not exposed_secrets(host_path, allowed), f"volume {name!r} mounts {host_path}"


def _pod_view(host: Path, pod_root: Path, driver_root: PurePosixPath) -> None:
    """Lay out under `pod_root` what the driver pod sees below `driver_root` of the machine `host`.

    Each hostPath volume below the driver root becomes a copy of the host directory (links in the
    source path resolved, as the runtime does for a bind mount; links inside copied as links, as
    the daemon finds them); a missing source becomes an empty directory (DirectoryOrCreate).
    Nothing else of the host is there.
    """
    for mount in _driver_root_mounts(Path(driver_root)):
        host_path = PurePosixPath(_volume(mount["name"])["hostPath"]["path"])
        source = Path(os.path.realpath(host / host_path.relative_to("/")))
        assert source == host or host in source.parents, f"{mount['name']}: the fake host's links leave it"
        target = pod_root / PurePosixPath(mount["mountPath"]).relative_to(driver_root)
        if source.is_dir():
            shutil.copytree(source, target, symlinks=True)
        else:
            target.mkdir(parents=True)


def _merged_usr(host: Path) -> None:
    """Debian >= 12, Ubuntu >= 20.04, RHEL >= 7: /lib, /lib64 and /bin are links into /usr."""
    for d in ("usr/lib", "usr/lib64", "usr/bin"):
        (host / d).mkdir(parents=True, exist_ok=True)
    for link in ("lib", "lib64", "bin"):
        (host / link).symlink_to(f"usr/{link}")


def _ubuntu(host: Path) -> None:
    """NVIDIA's packages and .run installer on a merged-/usr Debian or Ubuntu."""
    _merged_usr(host)
    render_driver_files(host, DRIVER_VERSION)


def _debian_split_usr(host: Path) -> None:
    """Debian 11 and older installs: /lib is a directory of its own, so is /lib/firmware."""
    render_driver_files(host, DRIVER_VERSION)


def _rhel(host: Path) -> None:
    """RHEL and its rebuilds: 64-bit libraries in /usr/lib64."""
    _merged_usr(host)
    render_driver_files(host, DRIVER_VERSION)
    for f in (host / "usr/lib/x86_64-linux-gnu").iterdir():
        os.rename(f, host / "usr/lib64" / f.name)


def _debian_packaged(host: Path) -> None:
    """Debian's own nvidia-driver packages: the real files under nvidia/current, the names the
    loader uses reached through absolute links into /etc/alternatives."""
    _merged_usr(host)
    render_driver_files(host, DRIVER_VERSION)
    libs = host / "usr/lib/x86_64-linux-gnu"
    current = libs / "nvidia/current"
    current.mkdir(parents=True)
    (host / "etc/alternatives").mkdir(parents=True)
    for lib in ("libcuda.so", "libnvidia-ml.so"):
        link, real = libs / f"{lib}.1", f"{lib}.{DRIVER_VERSION}"
        os.rename(libs / real, current / real)
        link.unlink()
        (current / link.name).symlink_to(real)
        alternative = host / "etc/alternatives" / f"nvidia--{link.name}-x86_64-linux-gnu"
        alternative.symlink_to(f"/usr/lib/x86_64-linux-gnu/nvidia/current/{link.name}")
        link.symlink_to(f"/etc/alternatives/{alternative.name}")
    smi = host / "usr/lib/nvidia/current/nvidia-smi"
    smi.parent.mkdir(parents=True)
    os.rename(host / "usr/bin/nvidia-smi", smi)
    (host / "etc/alternatives/nvidia--nvidia-smi").symlink_to("/usr/lib/nvidia/current/nvidia-smi")
    (host / "usr/bin/nvidia-smi").symlink_to("/etc/alternatives/nvidia--nvidia-smi")


def _as_host_files(files: DriverFiles, host: Path) -> dict[str, str]:
    """container path -> the host file the runtime would bind there (host paths resolved on `host`)."""
    return {c: os.path.realpath(host / PurePosixPath(h).relative_to("/")) for h, c in files.mounts}


@pytest.mark.parametrize("layout", [_ubuntu, _debian_split_usr, _rhel, _debian_packaged], ids=lambda f: f.__name__[1:])
def test_discovery_through_the_mounts_finds_what_the_whole_host_holds(
    daemon_config: Config, tmp_path: Path, layout: Callable[[Path], None]
) -> None:
    """The narrow driver-root volumes lose nothing: the daemon, seeing only them, hands containers
    the same host files at the same paths as a scan of the whole host would."""
    host, pod_root = tmp_path / "host", tmp_path / "pod"
    assert daemon_config.nvidia_driver_root_host is not None
    host_root = daemon_config.nvidia_driver_root_host
    driver_tree = host / PurePosixPath(host_root).relative_to("/")
    driver_tree.mkdir(parents=True)
    layout(driver_tree)
    (host / "etc/kubernetes/pki").mkdir(parents=True)
    (host / "etc/kubernetes/pki/ca.key").write_text("secret\n")
    _pod_view(host, pod_root, PurePosixPath(daemon_config.nvidia_driver_root))

    whole = find_driver_files(driver_tree, host_root=host_root)
    seen = find_driver_files(pod_root, host_root=host_root)
    assert whole.version == DRIVER_VERSION and whole.firmware
    assert {"/usr/bin/nvidia-smi"} <= {c for _, c in whole.binaries}
    assert any(c.endswith("/libnvidia-ml.so.1") for _, c in whole.libraries)
    assert seen.version == whole.version
    assert _as_host_files(seen, host) == _as_host_files(whole, host)
    assert not (pod_root / "etc/kubernetes").exists()


# -- pod-level settings the issue asks for --------------------------------------------------


def test_rolling_update_surges_one_pod_and_never_leaves_a_node_without_driver() -> None:
    strategy = DAEMONSET["spec"]["updateStrategy"]
    assert strategy["type"] == "RollingUpdate"
    assert strategy["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    assert "POD_UID" in ENV, "surging needs the rolling-update socket names, derived from POD_UID"


def test_pod_runs_in_host_network_as_node_critical() -> None:
    assert POD_SPEC["hostNetwork"] is True
    assert POD_SPEC["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert POD_SPEC["priorityClassName"] == "system-node-critical"
    assert POD_SPEC["terminationGracePeriodSeconds"] >= 45, "the kubelet gives a DRA call up to ~45 s"


def test_mps_daemons_can_leave_the_container() -> None:
    """An MPS control daemon outlives Tandem's container only out of its PID namespace and its
    cgroup (driver/node/cgroups.py): the host's PID namespace, and the host's cgroup tree writable
    where the daemon looks for it, below SYSFS_ROOT."""
    assert POD_SPEC["hostPID"] is True
    assert PurePosixPath(_volume("cgroup")["hostPath"]["path"]) == PurePosixPath("/sys/fs/cgroup")
    (mount,) = [m for m in CONTAINER["volumeMounts"] if m["name"] == "cgroup"]
    assert PurePosixPath(mount["mountPath"]) == PurePosixPath(ENV["SYSFS_ROOT"]["value"]) / "fs" / "cgroup"
    assert not mount.get("readOnly")


def test_pod_tolerates_gpu_taints() -> None:
    tolerations = POD_SPEC["tolerations"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists"} in tolerations


def test_resources_have_requests_and_a_memory_limit() -> None:
    res = CONTAINER["resources"]
    assert set(res["requests"]) == {"cpu", "memory"}
    assert "memory" in res["limits"]


def _probe_script(probe: str) -> str:
    command = CONTAINER[probe]["exec"]["command"]
    assert command[:2] == ["sh", "-c"] and len(command) == 3, f"{probe}: a shell test, no Python started"
    return str(command[2])


def test_probes_are_shell_tests_of_the_probe_file() -> None:
    """Readiness also needs the ResourceSlices published (`ready`); liveness and start-up never do
    (anything but `dead`): a restart brings no API server back, and stops the MPS daemons of
    running pods. tests/integration/test_probe_file_daemon.py runs these very scripts against a daemon."""
    liveness = _probe_script("livenessProbe")
    assert _probe_script("startupProbe") == liveness
    assert '[ "$verdict" != dead ]' in liveness and "ready" not in liveness.replace("read -r", "")
    assert _probe_script("readinessProbe") == liveness.replace(
        '[ "$verdict" != dead ] || { echo "not alive: $why"', '[ "$verdict" = ready ] || { echo "not ready: $why"'
    )
    assert re.findall(r"\b(python|tandem-driver|tandemctl)\b", liveness + _probe_script("readinessProbe")) == []


def _subcommands() -> set[str]:
    parser = driver_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    return set(sub.choices)


def test_container_args_name_a_real_subcommand() -> None:
    assert CONTAINER["args"][0] in _subcommands()


def test_probes_read_the_file_the_daemon_writes(daemon_config: Config) -> None:
    """The probe runs with the pod's environment; it must name the very file `run` keeps, one of
    this pod's own (two pods of a surge share the data dir), on a mounted host path."""
    first_line = _probe_script("livenessProbe").splitlines()[0]
    env = {name: _env_value(entry) for name, entry in ENV.items()}
    probed = subprocess.run(["sh", "-c", f'{first_line}; printf %s "$f"'], env=env, capture_output=True, text=True)
    assert Path(probed.stdout) == probe_path(daemon_config.data_dir, daemon_config.pod_uid)
    assert Path(probed.stdout) != probe_path(daemon_config.data_dir, ""), "this pod's own"
    assert _mount_for(Path(probed.stdout)) is not None


def test_liveness_the_daemon_runs_on_itself_finds_the_sockets_it_creates(daemon_config: Config) -> None:
    """`run` derives the registration socket of its self-check as `tandem-driver liveness` does."""
    probe = driver_parser().parse_args(["liveness"])
    probed = registration_socket_path(Path(probe.kubelet_registrar_dir), probe.driver_name, probe.pod_uid)
    served = registration_socket_path(daemon_config.registrar_dir, daemon_config.driver_name, daemon_config.pod_uid)
    assert probed == served
    plain = registration_socket_path(daemon_config.registrar_dir, daemon_config.driver_name)
    assert probed != plain, "a rolling-update name, so that two pods of a surge do not share one socket"
    assert _mount_for(probed) is not None


def test_pod_uses_the_bound_service_account_with_a_default_token() -> None:
    sa = _one(INSTALL, "ServiceAccount")
    assert POD_SPEC["serviceAccountName"] == sa["metadata"]["name"]
    assert POD_SPEC.get("automountServiceAccountToken", True) is True
    assert sa.get("automountServiceAccountToken", True) is True


# -- names that must agree across objects -------------------------------------------------------


def test_rbac_binds_the_daemonsets_service_account() -> None:
    role = _one(INSTALL, "ClusterRole")
    binding = _one(INSTALL, "ClusterRoleBinding")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "ClusterRole",
        "name": role["metadata"]["name"],
    }
    assert binding["subjects"] == [
        {
            "kind": "ServiceAccount",
            "name": POD_SPEC["serviceAccountName"],
            "namespace": DAEMONSET["metadata"]["namespace"],
        }
    ]


def _rules() -> dict[tuple[str, str], dict[str, Any]]:
    rules = {}
    for rule in _one(INSTALL, "ClusterRole")["rules"]:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                assert (group, resource) not in rules, f"{group}/{resource} granted twice"
                rules[(group, resource)] = rule
    return rules


def test_rbac_grants_what_the_driver_calls(daemon_config: Config) -> None:
    rules = _rules()
    assert set(rules["resource.k8s.io", "resourceslices"]["verbs"]) >= {"list", "watch", "create", "update", "delete"}
    assert "get" in rules["resource.k8s.io", "resourceclaims"]["verbs"]
    assert "patch" in rules["resource.k8s.io", "resourceclaims/status"]["verbs"]
    assert rules["", "nodes"]["verbs"] == ["get"]
    assert rules["events.k8s.io", "events"]["verbs"] == ["create", "patch"]  # driver/events.py
    granular = rules["resource.k8s.io", "resourceclaims/driver"]
    assert granular["resourceNames"] == [daemon_config.driver_name]
    assert "associated-node:patch" in granular["verbs"]


def test_rbac_grants_nothing_cluster_wide_beyond_the_driver() -> None:
    """Least privilege: no wildcards, no arbitrary-node status writes, no secrets, no pods: the
    default install uses no binding conditions, whose pod watch the chart renders only when they
    are on (tests/integration/test_helm_chart.py)."""
    for (group, resource), rule in _rules().items():
        assert "*" not in rule["verbs"] and "*" not in (group, resource)
        assert not any(v.startswith("arbitrary-node:") for v in rule["verbs"]), resource
    assert set(_rules()) == {
        ("resource.k8s.io", "resourceslices"),
        ("resource.k8s.io", "resourceclaims"),
        ("resource.k8s.io", "resourceclaims/status"),
        ("resource.k8s.io", "resourceclaims/driver"),
        ("", "nodes"),
        ("events.k8s.io", "events"),
    }


SLICES_POLICY, CLAIMS_POLICY = "tandem-driver-own-node-slices", "tandem-opaque-config"


def _policy_and_binding(name: str) -> tuple[Doc, Doc]:
    """The ValidatingAdmissionPolicy `name` and the one binding that binds it, denying."""
    (policy,) = [d for d in _of_kind(INSTALL, "ValidatingAdmissionPolicy") if d["metadata"]["name"] == name]
    (binding,) = [d for d in _of_kind(INSTALL, "ValidatingAdmissionPolicyBinding") if d["spec"]["policyName"] == name]
    assert binding["spec"]["validationActions"] == ["Deny"]
    return policy, binding


def test_admission_policy_restricts_the_drivers_service_account_to_its_node() -> None:
    policy, binding = _policy_and_binding(SLICES_POLICY)
    assert binding["spec"]["validationActions"] == ["Deny"]
    rule = policy["spec"]["matchConstraints"]["resourceRules"][0]
    assert rule["resources"] == ["resourceslices"]
    assert set(rule["operations"]) == {"CREATE", "UPDATE", "DELETE"}
    user = f"system:serviceaccount:{DAEMONSET['metadata']['namespace']}:{POD_SPEC['serviceAccountName']}"
    assert any(f'"{user}"' in c["expression"] for c in policy["spec"]["matchConditions"])
    text = yaml.safe_dump(policy["spec"])
    assert "authentication.kubernetes.io/node-name" in text
    assert "oldObject" in text, "DELETE must be checked against the slice being deleted"


def test_admission_policy_pins_the_slices_driver_to_this_one(daemon_config: Config) -> None:
    """Without the pin the driver's identity could create, replace or delete another DRA driver's
    slices of its own node. spec.driver is taken from the slice written (CREATE, UPDATE), the slice
    deleted (DELETE) and the slice an UPDATE replaces, and must be this driver's name in each.

    No CEL evaluator runs here (the simulated API server does not evaluate admission policies):
    the expressions are pinned as written; the real cluster's API server evaluates them in
    tests/cluster/test_daemonset.py."""
    spec = _policy_and_binding(SLICES_POLICY)[0]["spec"]
    variables = {v["name"]: " ".join(v["expression"].split()) for v in spec["variables"]}
    assert variables["objectDriver"] == (
        '(request.operation == "DELETE" ? oldObject : object).spec.?driver.orValue("")'
    )
    assert variables["oldDriver"] == (
        'request.operation == "UPDATE" ? oldObject.spec.?driver.orValue("") : variables.objectDriver'
    )
    driver = daemon_config.driver_name
    (pin,) = [v for v in spec["validations"] if "variables.objectDriver" in v["expression"]]
    assert " ".join(pin["expression"].split()) == (
        f'variables.objectDriver == "{driver}" && variables.oldDriver == "{driver}"'
    )
    assert "may not modify ResourceSlices of driver" in pin["messageExpression"]


def _claims_policy_variables() -> dict[str, str]:
    spec = _policy_and_binding(CLAIMS_POLICY)[0]["spec"]
    return {v["name"]: " ".join(v["expression"].split()) for v in spec["variables"]}


def test_claims_policy_checks_this_drivers_config_in_claims_and_templates(daemon_config: Config) -> None:
    """Both kinds a user writes config in, on CREATE and UPDATE, in every served version; the
    field named as the user wrote it in each (a template's spec is one level deeper).

    The expressions are evaluated by a real API server in tests/cluster/test_admission.py."""
    policy, _ = _policy_and_binding(CLAIMS_POLICY)
    (rule,) = policy["spec"]["matchConstraints"]["resourceRules"]
    assert rule["apiGroups"] == ["resource.k8s.io"] and rule["apiVersions"] == ["*"]
    assert set(rule["resources"]) == {"resourceclaims", "resourceclaimtemplates"}
    assert set(rule["operations"]) == {"CREATE", "UPDATE"}
    variables = _claims_policy_variables()
    assert variables["isTemplate"] == 'request.resource.resource == "resourceclaimtemplates"'
    assert "object.spec.?spec.?devices.?config" in variables["configs"]
    assert "object.spec.?devices.?config" in variables["configs"]
    tandem = f'c.?opaque.?driver.orValue("") == "{daemon_config.driver_name}"'
    assert tandem in variables["where"] and tandem in variables["params"]
    assert (
        '(variables.isTemplate ? "spec.spec" : "spec") + ".devices.config[" + string(i) + "].opaque.parameters"'
        in (variables["where"])
    )
    # An UPDATE that leaves the spec alone (a finalizer) must pass for a claim written before the policy.
    (unchanged,) = policy["spec"]["matchConditions"]
    assert unchanged["expression"] == 'request.operation == "CREATE" || object.spec != oldObject.spec'


def test_claims_policy_knows_the_fields_and_words_prepare_knows() -> None:
    """The policy repeats prepare's schema (driver/claims/opaque_config.py) in CEL: the same kinds,
    fields, JSON types, words, limits, interface-name pattern and class-only fields, so that what
    one refuses the other refuses too. A field added on one side only fails here."""
    variables = _claims_policy_variables()
    fields = json.loads(variables["fields"])
    assert fields == {
        kind: {name: _JSON_TYPES[str if issubclass(typ, StrEnum) else typ] for name, (_attr, typ) in spec.items()}
        for kind, spec in _FIELDS.items()
    }
    words = {name: [m.value for m in typ] for spec in _FIELDS.values() for name, (_a, typ) in spec.items()
             if issubclass(typ, StrEnum)}  # fmt: skip
    assert json.loads(variables["words"]) == words
    assert f'"{API_VERSION}"' in variables["typed"]
    nic = variables["nicErrors"]
    assert f'matches("^{_IFNAME.pattern}$")' in nic
    assert f"> {MAX_ADDRESSES} ?" in nic and f"> {MAX_ROUTES} ?" in nic
    assert f"p.mtu < {MIN_MTU} || p.mtu > {MAX_MTU}" in nic and f"p.mtu < {MIN_MTU_IPV6}" in nic
    for kind, name in _CLASS_ONLY:
        assert f'p.kind == "{kind}" && "{name}" in p' in variables["fieldErrors"]


def test_device_class_selectors_select_this_drivers_devices(daemon_config: Config) -> None:
    driver = daemon_config.driver_name
    for name, cls in DEVICE_CLASSES.items():
        expressions = [s["cel"]["expression"] for s in cls["spec"]["selectors"]]
        assert any(f'device.driver == "{driver}"' in e for e in expressions), name
        domains = {d for e in expressions for d in re.findall(r'device\.attributes\["([^"]+)"\]', e)}
        assert domains == {driver}, f"{name} reads attributes of {domains}"


def test_there_is_one_device_class_per_device_kind() -> None:
    types: dict[str, str] = {}
    for name, cls in DEVICE_CLASSES.items():
        for sel in cls["spec"]["selectors"]:
            m = re.search(r'\.type == "([a-z]+)"', sel["cel"]["expression"])
            if m:
                types[m.group(1)] = name
    assert set(types) == {k.value for k in DeviceKind}
    assert {types[k.value] for k in DeviceKind} == {f"{k.value}.tandem.dev" for k in DeviceKind}


_QUALIFIED_NAME = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")


def _valid_extended_resource_name(name: str) -> bool:
    """IsExtendedResourceName (docs/reference/resource-api.md, 'DeviceClass and extended resources')."""
    if "/" not in name or "kubernetes.io/" in name or name.startswith("requests."):
        return False
    prefix, _, short = name.partition("/")
    prefix_ok = len(prefix) <= 253 and re.fullmatch(
        r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*", prefix
    )
    return bool(prefix_ok) and len(short) <= 63 and bool(_QUALIFIED_NAME.match(short))


def test_extended_resource_names_are_valid_and_unique() -> None:
    names = [c["spec"]["extendedResourceName"] for c in DEVICE_CLASSES.values() if "extendedResourceName" in c["spec"]]
    assert DEVICE_CLASSES["gpu.tandem.dev"]["spec"]["extendedResourceName"] == "nvidia.com/gpu"
    assert "extendedResourceName" in DEVICE_CLASSES["nic.tandem.dev"]["spec"]
    assert len(names) == len(set(names))
    for name in names:
        assert _valid_extended_resource_name(name), name


@pytest.mark.parametrize("bad", ["gpu", "kubernetes.io/gpu", "requests.example.com/gpu", "example.com/-gpu"])
def test_extended_resource_name_check_rejects_invalid_names(bad: str) -> None:
    assert not _valid_extended_resource_name(bad)


# -- examples -------------------------------------------------------------------------------


def _walk(obj: Any) -> Iterator[dict[str, Any]]:
    if isinstance(obj, dict):
        yield obj
        for v in obj.values():
            yield from _walk(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _walk(v)


def _claim_specs(docs: list[Doc]) -> Iterator[tuple[str, dict[str, Any]]]:
    for d in docs:
        if d["kind"] == "ResourceClaimTemplate":
            yield d["metadata"]["name"], d["spec"]["spec"]
        elif d["kind"] == "ResourceClaim":
            yield d["metadata"]["name"], d["spec"]


def test_examples_cover_every_scenario() -> None:
    assert {
        "namespace.yaml",
        "gpu.yaml",
        "mig.yaml",
        "mig-on-demand.yaml",
        "nic.yaml",
        "gpu-nic-pair.yaml",
        "extended-resource.yaml",
        "opaque-config.yaml",
        "device-taint-rule.yaml",
        "gpu-nic-switch.yaml",
        "shared-nic.yaml",
        "shared-gpu.yaml",
        "time-sliced-gpu.yaml",
    } <= set(EXAMPLES)


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_example_objects_live_in_the_example_namespace(name: str) -> None:
    declared = {d["metadata"]["name"] for d in EXAMPLES["namespace.yaml"] if d["kind"] == "Namespace"}
    assert declared == {EXAMPLES_NAMESPACE}
    for d in EXAMPLES[name]:
        if d["kind"] not in ("Namespace", "DeviceTaintRule"):
            assert d["metadata"].get("namespace") == EXAMPLES_NAMESPACE, f"{d['kind']}/{d['metadata']['name']}"


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_example_device_class_names_are_installed(name: str) -> None:
    for node in _walk(EXAMPLES[name]):
        if "deviceClassName" in node:
            assert node["deviceClassName"] in DEVICE_CLASSES, node["deviceClassName"]


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_example_pods_reference_claims_that_exist(name: str) -> None:
    templates = {n for n, _ in _claim_specs(EXAMPLES[name])}
    for pod in _of_kind(EXAMPLES[name], "Pod"):
        spec = pod["spec"]
        pod_claims = {c["name"]: c for c in spec.get("resourceClaims", [])}
        for claim in pod_claims.values():
            assert (claim.get("resourceClaimTemplateName") or claim.get("resourceClaimName")) in templates
        for container in spec["containers"]:
            for ref in container.get("resources", {}).get("claims", []):
                assert ref["name"] in pod_claims, f"{pod['metadata']['name']}: {ref['name']}"


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_example_constraints_and_configs_name_existing_requests(name: str, daemon_config: Config) -> None:
    for claim, spec in _claim_specs(EXAMPLES[name]):
        requests = {r["name"] for r in spec["devices"]["requests"]}
        requests |= {
            f"{r['name']}/{s['name']}" for r in spec["devices"]["requests"] for s in r.get("firstAvailable", [])
        }
        for c in spec["devices"].get("constraints", []):
            assert set(c.get("requests", [])) <= requests, claim
        for c in spec["devices"].get("config", []):
            assert set(c.get("requests", [])) <= requests, claim
            assert c["opaque"]["driver"] == daemon_config.driver_name, claim


def test_gpu_nic_pair_matches_on_the_pcie_root() -> None:
    ((_, spec),) = _claim_specs(EXAMPLES["gpu-nic-pair.yaml"])
    classes = {r["name"]: r["exactly"]["deviceClassName"] for r in spec["devices"]["requests"]}
    assert sorted(classes.values()) == ["gpu.tandem.dev", "nic.tandem.dev"]
    assert spec["devices"]["constraints"] == [
        {"requests": sorted(classes), "matchAttribute": "resource.kubernetes.io/pcieRoot"}
    ]


def test_extended_resource_pod_asks_for_a_class_backed_resource() -> None:
    names = {c["spec"]["extendedResourceName"] for c in DEVICE_CLASSES.values() if "extendedResourceName" in c["spec"]}
    (pod,) = _of_kind(EXAMPLES["extended-resource.yaml"], "Pod")
    asked = {k for c in pod["spec"]["containers"] for k in c["resources"].get("limits", {})}
    assert "nvidia.com/gpu" in asked and asked <= names
    assert "resourceClaims" not in pod["spec"], "the scheduler creates the claim itself"


def test_opaque_config_example_decodes_with_the_drivers_decoder(daemon_config: Config) -> None:
    """The example's GpuConfig/NicConfig pass Tandem's strict decoder, as an allocation carries them."""
    ((_, spec),) = _claim_specs(EXAMPLES["opaque-config.yaml"])
    allocation = {"devices": {"config": [{"source": "FromClaim", **c} for c in spec["devices"]["config"]]}}
    entries = opaque_entries(allocation, daemon_config.driver_name)
    assert len(entries) == 2
    nic = resolve(entries, "nic").nic
    assert (nic.mode, nic.interface_name) == ("exclusive", "net1")
    assert nic.addresses and nic.routes and nic.mtu
    assert resolve(entries, "gpu").gpu.pair_nics is True


def test_device_taint_rules_select_this_drivers_devices(daemon_config: Config) -> None:
    rules = _of_kind(EXAMPLES["device-taint-rule.yaml"], "DeviceTaintRule")
    assert rules
    for rule in rules:
        selector = rule["spec"]["deviceSelector"]
        assert selector["driver"] == daemon_config.driver_name
        assert set(selector) <= {"driver", "pool", "device"}
    assert any("device" in r["spec"]["deviceSelector"] for r in rules), "the cordon-one-device form"


def test_gpu_nic_switch_falls_back_from_switch_to_root_to_numa() -> None:
    ((_, spec),) = _claim_specs(EXAMPLES["gpu-nic-switch.yaml"])
    (nic,) = [r for r in spec["devices"]["requests"] if r["name"] == "nic"]
    assert [s["name"] for s in nic["firstAvailable"]] == ["same-switch", "same-root", "same-numa"]
    assert [(c["requests"], c["matchAttribute"]) for c in spec["devices"]["constraints"]] == [
        (["gpu", "nic/same-switch"], "tandem.dev/pcieSwitch"),
        (["gpu", "nic/same-root"], "resource.kubernetes.io/pcieRoot"),
        (["gpu", "nic/same-numa"], "resource.kubernetes.io/numaNode"),
    ]


def test_shared_nic_asks_for_one_share_of_the_published_capacity() -> None:
    ((_, spec),) = _claim_specs(EXAMPLES["shared-nic.yaml"])
    (request,) = spec["devices"]["requests"]
    assert request["exactly"]["capacity"]["requests"] == {SHARES: "1"}
