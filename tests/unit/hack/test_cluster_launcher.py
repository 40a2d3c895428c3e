"""The cluster's components are started with the flags of hack/cluster/components.conf and no other
(issue 31): the cluster tests and the scale bench run on one Kubernetes, whose settings are written
once, so that a flag set anywhere else would make the two differ again without anyone deciding it.

The launcher renders every component's command line in a dry run (its `start` and `wait_for`
replaced, nothing started, state in a temporary directory), for the cluster and for the scale
bench's profile, and each must be the file's flags in the file's order. The dry run covers what the
start functions add; two static checks cover starting a component around them: in the shell
scripts every `start <component>` passes only the command `command_line` built, and no Python file
of hack/ builds a command line for a component. The feature gates are spelled in that file alone.
"""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
HACK = REPO / "hack"
SETTINGS = HACK / "cluster" / "components.conf"
COMPONENTS = (
    "etcd",
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "kubelet",
    "kube-proxy",
    "containerd",
)
START_FUNCTIONS = (
    "start_etcd",
    "start_apiserver",
    "start_controller_manager",
    "start_scheduler",
    "start_containerd",
    "start_kubelet",
    "start_kube_proxy",
)
# Sources the launcher as hack/cluster.sh does, then runs each start function with `start` printing
# the component's name and arguments (NUL-separated, a record per line) instead of starting it.
DRY_RUN = f"""
set -euo pipefail
repo="$1" here="$1/hack/cluster"
source "$here/lib.sh"
BIN=/dry-run/bin HOST_IP=192.0.2.1 KUBELET_ROOT="$STATE/kubelet-root" CDI_ROOT="$STATE/cdi"
start() {{ printf '%s\\0' "$@"; printf '\\n'; }}
wait_for() {{ :; }}
{"; ".join(START_FUNCTIONS)}
"""
PLACEHOLDER = re.compile(r"@[A-Za-z_]+@")


def _settings(profile: str) -> dict[str, list[tuple[str, str]]]:
    """Each component's (flag, value) from the file, as settings.sh reads it: the common lines,
    then the profile's."""
    common: dict[str, list[tuple[str, str]]] = {}
    extra: dict[str, list[tuple[str, str]]] = {}
    for line in SETTINGS.read_text().splitlines():
        words = line.split()
        if not words or words[0].startswith("#"):
            continue
        scope, key, value = words[0], words[1], " ".join(words[2:])
        if ":" in scope:
            wanted, _, scope = scope.partition(":")
            if wanted == profile:
                extra.setdefault(scope, []).append((key, value))
        else:
            common.setdefault(scope, []).append((key, value))
    return {scope: common.get(scope, []) + extra.get(scope, []) for scope in common.keys() | extra.keys()}


def _rendered(profile: str, tmp_path: Path) -> dict[str, list[str]]:
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "TANDEM_CLUSTER_STATE": str(tmp_path)}
    env["TANDEM_CLUSTER_PROFILE"] = profile
    done = subprocess.run(
        ["bash", "-c", DRY_RUN, "dry-run", str(REPO)], env=env, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
    started: dict[str, list[str]] = {}
    for record in done.stdout.splitlines():
        name, binary, *args = record.split("\0")[:-1]
        assert binary == f"/dry-run/bin/{name}"
        started[name] = args
    return started


def _matches(args: list[str], settings: list[tuple[str, str]]) -> bool:
    """Whether `args` are exactly the settings' flags and values, a placeholder standing for any value."""
    words = []
    for flag, value in settings:
        words.append(re.escape(flag))
        if value:
            words.append("[^\0]+".join(re.escape(part) for part in PLACEHOLDER.split(value)))
    return re.fullmatch("".join(w + "\0" for w in words), "".join(a + "\0" for a in args)) is not None


@pytest.mark.parametrize("profile", ["", "scale"])
def test_every_component_starts_with_the_flags_of_the_settings_file_alone(profile: str, tmp_path: Path) -> None:
    started = _rendered(profile, tmp_path)
    settings = _settings(profile)
    assert sorted(started) == sorted(COMPONENTS)
    wrong = {name: args for name, args in started.items() if not _matches(args, settings[name])}
    assert wrong == {}, f"started with flags other than components.conf's: {wrong}"


def test_the_scale_profile_adds_flags_and_moves_the_ports(tmp_path: Path) -> None:
    cluster, scale = _rendered("", tmp_path / "cluster"), _rendered("scale", tmp_path / "scale")
    assert "--audit-log-path" in scale["kube-apiserver"] and "--audit-log-path" not in cluster["kube-apiserver"]
    assert "--secure-port" in scale["kube-scheduler"]
    port = scale["kube-apiserver"][scale["kube-apiserver"].index("--secure-port") + 1]
    assert port != cluster["kube-apiserver"][cluster["kube-apiserver"].index("--secure-port") + 1]


def test_the_check_sees_a_flag_the_file_lacks() -> None:
    settings = [("--name", "tandem"), ("--data-dir", "@STATE@/etcd"), ("--client-cert-auth", "")]
    assert _matches(["--name", "tandem", "--data-dir", "/s/etcd", "--client-cert-auth"], settings)
    assert not _matches(["--name", "tandem", "--data-dir", "/s/etcd", "--client-cert-auth", "--debug"], settings)
    assert not _matches(["--name", "other", "--data-dir", "/s/etcd", "--client-cert-auth"], settings)


def _shell_starts_beside_the_file(text: str) -> list[str]:
    """The lines of a script that start a component with anything but `command_line`'s CMD."""
    start = re.compile(rf"\bstart\s+({'|'.join(COMPONENTS)})\b(.*)$")
    return [
        line.strip()
        for line in text.splitlines()
        if (m := start.search(line)) and not line.lstrip().startswith("#") and m.group(2).strip() != '"${CMD[@]}"'
    ]


def _python_commands_for_components(text: str) -> list[int]:
    """The lines of a Python file with a list or tuple whose first element names a component's binary
    and which holds a flag: a command line."""
    return [
        node.lineno
        for node in ast.walk(ast.parse(text))
        if isinstance(node, ast.List | ast.Tuple)
        and node.elts
        and _names_component(node.elts[0])
        and any(_is_flag(e) for e in node.elts[1:])
    ]


def _names_component(node: ast.expr) -> bool:
    """Whether `node` is a string (an f-string by its end) that is a component's binary or a path to one."""
    if isinstance(node, ast.JoinedStr) and node.values:
        node = node.values[-1]
    return (
        isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.rsplit("/", 1)[-1] in COMPONENTS
    )


def _is_flag(node: ast.expr) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("-")


def test_the_static_checks_see_a_component_started_beside_the_launcher() -> None:
    assert _shell_starts_beside_the_file('  start etcd "$BIN/etcd" --name x\n  start etcd "${CMD[@]}"\n') == [
        'start etcd "$BIN/etcd" --name x'
    ]
    assert _python_commands_for_components('args = [f"{b}/kube-apiserver", "--secure-port", "1"]\n') == [1]
    assert _python_commands_for_components('COMPONENTS = ("etcd", "kube-apiserver")\n') == []


def test_no_script_of_hack_starts_a_component_beside_the_launcher() -> None:
    shell = {
        str(p.relative_to(REPO)): starts
        for p in HACK.rglob("*.sh")
        if (starts := _shell_starts_beside_the_file(p.read_text()))
    }
    assert shell == {}
    python = {
        str(p.relative_to(REPO)): lines
        for p in HACK.rglob("*.py")
        if (lines := _python_commands_for_components(p.read_text()))
    }
    assert python == {}


def test_the_feature_gates_are_spelled_once_in_hack() -> None:
    gates = [key for key, _ in _settings("")["feature-gates"]]
    assert "DRADeviceBindingConditions" in gates
    spelled = {p: [g for g in gates if g in p.read_text(errors="replace")] for p in HACK.rglob("*") if p.is_file()}
    elsewhere = {str(p.relative_to(REPO)): found for p, found in spelled.items() if found and p != SETTINGS}
    assert elsewhere == {}, "the feature gates belong in hack/cluster/components.conf alone"
