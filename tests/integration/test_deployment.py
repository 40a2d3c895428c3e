"""Deployment behaviour of the real daemon process: RBAC, rolling updates, SIGTERM, restarts.

What daemonset.yaml promises (least-privilege RBAC, `maxSurge: 1` rolling updates, a grace period
that drains in-flight calls, slices that outlive the pod) is checked here against the daemon as
a separate process, the simulated API server and the simulated kubelet.

Every HTTP request the simulated API server logs comes from the daemon: the tests, the
scheduler stand-in and KubeletSim use the server's in-process door (`srv.create`, `srv.get`,
`srv.update`, `srv.delete`), which `srv.requests` does not record.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import signal
import stat
import subprocess
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from waiting import poll

from demo.node import DRIVER, SimNode
from driver.cli import ctl_main
from driver.kubelet.registration import dra_socket_path, registration_socket_path
from sim.apiserver import RequestRecord, SimApiServer
from sim.kubelet import ClaimRef, KubeletSim, PreparedClaimResult
from sim.scheduler import Request, allocate, attribute, claim_object, published_devices

GPU = Request("gpu", "gpu.tandem.dev", lambda d: attribute(d, "type") == "gpu")
NIC = Request("nic", "nic.tandem.dev", lambda d: attribute(d, "type") == "nic")
PCIE_ROOT = "resource.kubernetes.io/pcieRoot"
DEVICES = 4  # h100_node("node-a", gpus=2, nics=2), the sim_node fixture's default
REPO = Path(__file__).resolve().parents[2]
MANIFEST = REPO / "daemonset.yaml"
SLICE_WRITE_VERBS = frozenset({"create", "update", "patch", "delete", "deletecollection"})
# The publisher writes at most every 0.5 s (PublisherOptions.min_write_interval): a pool that has
# seen neither a write nor a sync for several of those intervals has settled.
QUIET = 2.0
OLD_POD = "aaaaaaaa-0000-4000-8000-00000000000a"
NEW_POD = "bbbbbbbb-0000-4000-8000-00000000000b"


def _register(kubelet: KubeletSim, sock: Path) -> None:
    """Register as soon as the daemon answers on `sock` (it may not be listening yet)."""

    def attempt() -> bool:
        try:
            kubelet.register(sock)
        except Exception:
            return False
        return True

    assert poll(attempt, 60), f"no registration on {sock}"


def _wait_published(srv: SimApiServer, node: SimNode, count: int = DEVICES) -> None:
    assert poll(lambda: len(published_devices(srv, DRIVER, node.profile.name)) >= count, 60)


def _slices(srv: SimApiServer, node: SimNode) -> list[dict[str, Any]]:
    return [
        s
        for s in srv.list("resourceslices")
        if s["spec"]["driver"] == DRIVER and s["spec"].get("nodeName") == node.profile.name
    ]


def _claim(srv: SimApiServer, node: SimNode, name: str, *requests: Request, match: str = "") -> ClaimRef:
    claim = srv.create(claim_object("default", name, list(requests), match))
    taken = {d["device"] for c in srv.list("resourceclaims") for d in _allocated(c)}
    allocate(srv, claim, DRIVER, node.profile.name, list(requests), match, taken=taken)
    return ClaimRef("default", name, claim["metadata"]["uid"])


def _claim_of_a_missing_device(srv: SimApiServer, node: SimNode) -> ClaimRef:
    """A claim allocated a device this node does not have: its prepare fails."""
    claim = srv.create(claim_object("default", "missing", [GPU]))
    result = {"request": "gpu", "driver": DRIVER, "pool": node.profile.name, "device": "gpu-99"}
    claim["status"] = {"allocation": {"devices": {"results": [result]}}}
    srv.update(claim)
    return ClaimRef("default", "missing", claim["metadata"]["uid"])


def _event_seen(srv: SimApiServer, action: str) -> bool:
    """An Event of the last cordon or uncordon reached the API server (DeviceCordoned, ...)."""
    reason = "DeviceUncordoned" if action == "uncordon" else "DeviceCordoned"
    return any(e["reason"] == reason for e in srv.list("events"))


def _release(srv: SimApiServer, ref: ClaimRef) -> None:
    """The claim's pod is gone and the claim with it: its devices can be allocated again."""
    srv.delete("resourceclaims", ref.name, ref.namespace)


def _allocated(claim: dict[str, Any]) -> list[dict[str, Any]]:
    return ((claim.get("status") or {}).get("allocation") or {}).get("devices", {}).get("results", [])


def _slice_writes(srv: SimApiServer, since: float) -> list[RequestRecord]:
    return [
        r for r in srv.requests if r.resource == "resourceslices" and r.verb in SLICE_WRITE_VERBS and r.time >= since
    ]


def _describe(records: Iterable[RequestRecord]) -> str:
    return "\n".join(f"  {r.time:.3f} {r.method} {r.path} -> {r.status}" for r in records) or "  (none)"


def _ctl(node: SimNode, *args: str) -> tuple[int, str]:
    """`tandemctl` against the node's status socket, in this process (the same code path)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = ctl_main(["--kubelet-plugins-dir", str(node.plugins), "--driver-name", DRIVER, *args])
    return rc, out.getvalue()


def _daemon_health(node: SimNode) -> dict[str, Any]:
    """The `daemon` part of `tandemctl health --json`; {} while no daemon answers."""
    rc, out = _ctl(node, "health", "--json")
    return json.loads(out)["daemon"] if rc in (0, 1) else {}


def _settled(srv: SimApiServer, node: SimNode, instance: str | None = None, timeout: float = 30) -> dict[str, Any]:
    """Wait until `instance` (a pod UID; None: whichever) serves the status socket and is registered, and its
    publisher has synced at least once and then stayed still (no sync, no slice write) for QUIET s.

    Registration comes after the first discovery, so from then on the desired pool is final; a
    publisher that still had something to write would do it within one write interval.
    """
    deadline = time.monotonic() + timeout
    last: tuple[object, ...] | None = None
    since = time.monotonic()
    while time.monotonic() < deadline:
        info = _daemon_health(node)
        stats = info.get("slices", {})
        state = (info.get("instance"), info.get("registered"), stats, len(_slice_writes(srv, 0)))
        if state != last:
            last, since = state, time.monotonic()
        elif (
            (instance is None or str(info.get("instance", "")).startswith(f"{instance}-"))
            and info.get("registered")
            and stats.get("syncs", 0) >= 1
            and time.monotonic() - since >= QUIET
        ):
            return info
        time.sleep(0.1)
    raise AssertionError(f"instance {instance!r} did not settle; last state {last}")


def _checkpoint(node: SimNode) -> dict[str, Any]:
    path = node.plugins / DRIVER / "checkpoint.json"
    return json.loads(path.read_text())["claims"] if path.exists() else {}


def _cdi_specs(node: SimNode, ref: ClaimRef) -> list[str]:
    return sorted(p.name for p in node.cdi.iterdir() if ref.uid in p.name)


def _assert_prepared(node: SimNode, ref: ClaimRef) -> None:
    assert _checkpoint(node).get(ref.uid, {}).get("state") == "PrepareCompleted", _checkpoint(node)
    assert _cdi_specs(node, ref), f"no CDI spec for {ref.name}"


def _assert_unprepared(node: SimNode, ref: ClaimRef) -> None:
    assert ref.uid not in _checkpoint(node)
    assert _cdi_specs(node, ref) == []


# -- 1. RBAC -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ApiCall:
    """One authorization check: verb on group/resource[/subresource], optionally for a name."""

    verb: str
    api_group: str
    resource: str  # "resourceclaims/status" for a subresource, as RBAC rules spell it
    name: str = ""


# The real API server (DRAResourceClaimGranularStatusAuthorization, on by default since 1.36)
# checks every write of status.devices a second time, against the synthetic subresource
# `resourceclaims/driver` named by the driver, with the verb prefixed `associated-node:` for a
# caller whose node-bound token is on the claim's node (docs/reference/resource-api.md, 'Writing claim status' and 'Authorization'). The simulator
# does not model that check, so it is derived here from each observed status write.
_STATUS_WRITE_VERBS = ("patch", "update")


def _observed_calls(records: Iterable[RequestRecord]) -> set[ApiCall]:
    calls = set()
    for r in records:
        assert r.resource, f"non-resource request {r.method} {r.path}: no ClusterRole rule grants nonResourceURLs"
        resource = f"{r.resource}/{r.subresource}" if r.subresource else r.resource
        calls.add(ApiCall(r.verb, r.api_group, resource, r.name))
        if resource == "resourceclaims/status" and r.verb in _STATUS_WRITE_VERBS:
            calls.add(ApiCall(f"associated-node:{r.verb}", r.api_group, "resourceclaims/driver", DRIVER))
    return calls


def _manifest(*values: str) -> str:
    """daemonset.yaml, or the chart rendered with `--set` VALUES (helm is built from its Go module)."""
    if not values:
        return MANIFEST.read_text()
    if shutil.which("go") is None:
        pytest.skip("helm is built from its Go module (hack/helm.sh) and Go is not installed")
    helm = subprocess.run([REPO / "hack" / "helm.sh"], capture_output=True, text=True, timeout=1800, check=True)
    sets = [a for v in values for a in ("--set", v)]
    chart = ["template", "tandem", str(REPO / "deployments/helm/tandem"), "--namespace", "tandem-system"]
    args = [helm.stdout.strip(), *chart, "--kube-version", "1.37.0", *sets]
    return subprocess.run(args, capture_output=True, text=True, timeout=120, check=True).stdout


def _driver_rules(manifest: str) -> list[dict[str, Any]]:
    """The rules of every ClusterRole bound to the DaemonSet's service account."""
    docs = [d for d in yaml.safe_load_all(manifest) if d]
    ds = next(d for d in docs if d["kind"] == "DaemonSet")
    account = (ds["metadata"]["namespace"], ds["spec"]["template"]["spec"]["serviceAccountName"])
    roles = {
        b["roleRef"]["name"]
        for b in docs
        if b["kind"] in ("ClusterRoleBinding", "RoleBinding") and b["roleRef"]["kind"] == "ClusterRole"
        for s in b.get("subjects") or []
        if s["kind"] == "ServiceAccount" and (s.get("namespace"), s["name"]) == account
    }
    assert roles, f"no ClusterRole is bound to {account}"
    assert not any(d["kind"] == "Role" for d in docs), "namespaced Roles are not covered by this test"
    rules = [rule for d in docs if d["kind"] == "ClusterRole" and d["metadata"]["name"] in roles for rule in d["rules"]]
    assert not any("nonResourceURLs" in rule for rule in rules), "nonResourceURLs rules are not covered by this test"
    return rules


def _allows(rule: dict[str, Any], call: ApiCall) -> bool:
    def has(key: str, value: str) -> bool:
        return value in rule.get(key, ()) or "*" in rule.get(key, ())

    names = rule.get("resourceNames")
    return (
        has("apiGroups", call.api_group)
        and has("resources", call.resource)
        and has("verbs", call.verb)
        and (not names or call.name in names)
    )


def _grants(rules: list[dict[str, Any]]) -> list[tuple[dict[str, Any], ApiCall]]:
    """Each (rule, group/resource/verb) the rules grant, one by one."""
    return [
        (rule, ApiCall(verb, group, resource))
        for rule in rules
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    ]


def _narrowed(rule: dict[str, Any], grant: ApiCall) -> dict[str, Any]:
    return {**rule, "apiGroups": [grant.api_group], "resources": [grant.resource], "verbs": [grant.verb]}


@pytest.mark.parametrize(
    ("flags", "values"),
    [((), ()), (("--nic-binding-conditions",), ("nics.bindingConditions=true",))],
    ids=["daemonset.yaml", "binding-conditions"],
)
def test_rbac_grants_exactly_the_calls_the_driver_makes(apiserver, sim_node, start_daemon, flags, values):
    """With binding conditions (here on NICs; dynamic MIG turns them on too) the driver also lists
    and watches the pods nominated to its node, and the chart grants that only then: each manifest
    is checked against the daemon it runs."""
    manifest = _manifest(*values)
    node = sim_node()
    daemon = start_daemon(node, *flags)
    with KubeletSim(node.registry) as kubelet:
        _register(kubelet, registration_socket_path(node.registry, DRIVER))
        _wait_published(apiserver, node)

        ref = _claim(apiserver, node, "pair", GPU, NIC, match=PCIE_ROOT)
        assert kubelet.prepare([ref])[ref.uid].error == ""
        assert kubelet.unprepare([ref]) == {ref.uid: ""}
        # A failed prepare: an Event on the claim.
        broken = _claim_of_a_missing_device(apiserver, node)
        assert "not (or no longer) present" in kubelet.prepare([broken])[broken.uid].error
        assert poll(
            lambda: any(
                e["reason"] == "PrepareFailed" and e["regarding"]["uid"] == broken.uid and "gpu-99" in e["note"]
                for e in apiserver.list("events", "default")
            )
        )

    # Someone deletes the slice: the publisher creates it again.
    (live,) = _slices(apiserver, node)
    apiserver.delete("resourceslices", live["metadata"]["name"])
    assert poll(lambda: len(published_devices(apiserver, DRIVER, node.profile.name)) == DEVICES)
    # A stray slice in the pool (another incarnation's leftover): the publisher deletes it.
    (live,) = _slices(apiserver, node)
    stray = {**live, "metadata": {"generateName": "stray-", "ownerReferences": live["metadata"]["ownerReferences"]}}
    stray_name = apiserver.create(stray)["metadata"]["name"]
    assert poll(lambda: stray_name not in {s["metadata"]["name"] for s in _slices(apiserver, node)})
    # A device health change (a manual cordon) rewrites the slice with a taint.
    rc, out = _ctl(node, "cordon", "gpu-0", "--reason", "rbac test")
    assert rc == 0, out
    assert poll(
        lambda: any(
            d["name"] == "gpu-0" and d.get("taints") for d in published_devices(apiserver, DRIVER, node.profile.name)
        )
    )
    # Cordon events on the Node; the same one again within minutes is a series (a patch).
    for args in (("uncordon", "gpu-0"), ("cordon", "gpu-0", "--reason", "rbac test")):
        assert _ctl(node, *args)[0] == 0
        assert poll(lambda args=args: _event_seen(apiserver, args[0]))
    assert poll(lambda: any((e.get("series") or {}).get("count") == 2 for e in apiserver.list("events")))
    assert daemon.stop() == 0

    observed = _observed_calls(apiserver.requests)
    rules = _driver_rules(manifest)
    missing = sorted(str(c) for c in observed if not any(_allows(rule, c) for rule in rules))
    unused = sorted(
        f"{grant.verb} {grant.api_group or 'core'}/{grant.resource} {rule.get('resourceNames', '')}"
        for rule, grant in _grants(rules)
        if not any(_allows(_narrowed(rule, grant), c) for c in observed)
    )
    assert not missing, f"the manifest does not allow calls the driver makes: {missing}"
    assert not unused, f"the manifest grants what the driver never used in the scenario: {unused}"


# -- 2. rolling update ---------------------------------------------------------------------------


def _sockets(node: SimNode, pod_uid: str) -> tuple[Path, Path]:
    """(registration socket, DRA socket) of one rolling-update instance."""
    return registration_socket_path(node.registry, DRIVER, pod_uid), dra_socket_path(node.plugins / DRIVER, pod_uid)


def test_rolling_update_hands_over_claims_without_slice_churn(apiserver, sim_node, start_daemon):
    node = sim_node()
    old_reg, old_dra = _sockets(node, OLD_POD)
    new_reg, new_dra = _sockets(node, NEW_POD)
    old = start_daemon(node, "--pod-uid", OLD_POD)
    with KubeletSim(node.registry) as via_old, KubeletSim(node.registry) as via_new:
        _register(via_old, old_reg)
        _wait_published(apiserver, node)
        _settled(apiserver, node, OLD_POD)
        names_before = {s["metadata"]["name"] for s in _slices(apiserver, node)}
        gpu_a = _claim(apiserver, node, "gpu-a", GPU)
        nic_a = _claim(apiserver, node, "nic-a", NIC)
        assert {u: r.error for u, r in via_old.prepare([gpu_a, nic_a]).items()} == {gpu_a.uid: "", nic_a.uid: ""}
        _assert_prepared(node, gpu_a)
        _assert_prepared(node, nic_a)

        surge = time.monotonic()
        start_daemon(node, "--pod-uid", NEW_POD)
        _register(via_new, new_reg)
        assert old_reg.exists() and old_dra.exists(), "the new instance took the old one's sockets"
        _settled(apiserver, node, NEW_POD)
        # The kubelet may unprepare through either instance: the new one sees what the old one did.
        assert via_new.unprepare([gpu_a]) == {gpu_a.uid: ""}
        _assert_unprepared(node, gpu_a)
        _release(apiserver, gpu_a)
        gpu_b = _claim(apiserver, node, "gpu-b", GPU)
        assert via_new.prepare([gpu_b])[gpu_b.uid].error == ""
        _assert_prepared(node, gpu_b)
        _assert_prepared(node, nic_a)

        assert old.stop() == 0
        assert not old_reg.exists() and not old_dra.exists(), "the old instance left its sockets behind"
        assert new_reg.exists() and new_dra.exists(), "the old instance removed the new one's sockets"
        assert str(_daemon_health(node).get("instance")).startswith(f"{NEW_POD}-"), (
            "the status socket went with the old instance"
        )
        _assert_prepared(node, gpu_b)
        _assert_prepared(node, nic_a)

        # The new instance keeps serving on its own.
        gpu_c = _claim(apiserver, node, "gpu-c", GPU)
        assert via_new.prepare([gpu_c])[gpu_c.uid].error == ""
        _assert_prepared(node, gpu_c)
        assert via_new.unprepare([nic_a, gpu_b, gpu_c]) == {nic_a.uid: "", gpu_b.uid: "", gpu_c.uid: ""}
        for ref in (nic_a, gpu_b, gpu_c):
            _assert_unprepared(node, ref)
        _settled(apiserver, node, NEW_POD)

    churn = _slice_writes(apiserver, surge)
    assert churn == [], f"slice writes during the rolling update:\n{_describe(churn)}"
    assert {s["metadata"]["name"] for s in _slices(apiserver, node)} == names_before


# -- 3. SIGTERM drains in-flight calls -----------------------------------------------------------


def test_sigterm_lets_an_in_flight_prepare_finish(apiserver, sim_node, start_daemon):
    node = sim_node()
    daemon = start_daemon(node)
    reg_sock = registration_socket_path(node.registry, DRIVER)
    with KubeletSim(node.registry) as kubelet:
        _register(kubelet, reg_sock)
        _wait_published(apiserver, node)
        ref = _claim(apiserver, node, "slow", GPU, NIC, match=PCIE_ROOT)
        arrived = apiserver.faults.inject(method="GET", path=f"/resourceclaims/{ref.name}$", status=0, delay=2.0)
        outcome: list[PreparedClaimResult | BaseException] = []

        def prepare() -> None:
            try:
                outcome.append(kubelet.prepare([ref])[ref.uid])
            except BaseException as e:  # reported by the assertion below
                outcome.append(e)

        caller = threading.Thread(target=prepare, daemon=True)
        caller.start()
        assert arrived.wait(30), "the prepare never asked for the claim"
        daemon.proc.send_signal(signal.SIGTERM)
        caller.join(60)

    assert len(outcome) == 1, "the prepare call did not return"
    result = outcome[0]
    assert isinstance(result, PreparedClaimResult), f"the in-flight prepare failed: {result!r}"
    assert result.error == "" and len(result.devices) == 2
    assert daemon.proc.wait(timeout=30) == 0
    assert not reg_sock.exists() and not (node.plugins / DRIVER / "dra.sock").exists()
    _assert_prepared(node, ref)
    status = apiserver.get("resourceclaims", ref.name, "default").get("status", {})
    assert len(status.get("devices", [])) == 2, "the drained prepare did not write the claim status"


# -- 4. restart ----------------------------------------------------------------------------------


def test_slices_survive_a_restart_without_churn(apiserver, sim_node, start_daemon):
    node = sim_node()
    reg_sock = registration_socket_path(node.registry, DRIVER)
    first = start_daemon(node)
    with KubeletSim(node.registry) as kubelet:
        _register(kubelet, reg_sock)
        _wait_published(apiserver, node)
        _settled(apiserver, node)
        before = {s["metadata"]["name"]: s["metadata"]["resourceVersion"] for s in _slices(apiserver, node)}
        assert first.stop() == 0
        assert {s["metadata"]["name"] for s in _slices(apiserver, node)} == set(before), "slices deleted on stop"

        restart = time.monotonic()
        start_daemon(node)
        _register(kubelet, reg_sock)
        info = _settled(apiserver, node)  # the first instance's status socket went with it
    churn = _slice_writes(apiserver, restart)
    assert churn == [], f"slice writes after the restart:\n{_describe(churn)}"
    assert info["slices"]["writes"] == 0
    after = {s["metadata"]["name"]: s["metadata"]["resourceVersion"] for s in _slices(apiserver, node)}
    assert after == before


# -- 5. kubelet restart --------------------------------------------------------------------------


def test_kubelet_restart_registers_again_and_its_slice_wipe_is_repaired(apiserver, sim_node, start_daemon):
    node = sim_node()
    start_daemon(node)
    with KubeletSim(node.registry) as kubelet:
        _register(kubelet, registration_socket_path(node.registry, DRIVER))
        _wait_published(apiserver, node)
        before = {s["metadata"]["name"] for s in _slices(apiserver, node)}

    # The restarted kubelet rescans its registry directory and registers what it finds.
    with KubeletSim(node.registry) as restarted:
        sock = restarted.wait_for_registration_socket(DRIVER, timeout=10)
        info = restarted.register(sock)  # GetInfo, then NotifyRegistrationStatus
        assert info.name == DRIVER
        ref = _claim(apiserver, node, "after-restart", GPU)
        assert restarted.prepare([ref])[ref.uid].error == ""
        _assert_prepared(node, ref)

        # On start-up the kubelet deletes all of its node's slices; the driver publishes again.
        wipe = time.monotonic()
        for name in before:
            apiserver.delete("resourceslices", name)
        assert poll(lambda: len(published_devices(apiserver, DRIVER, node.profile.name)) == DEVICES, 10), (
            f"not published again after the wipe; requests since:\n{_describe(_slice_writes(apiserver, wipe))}"
        )
        assert {s["metadata"]["name"] for s in _slices(apiserver, node)}.isdisjoint(before)
        assert restarted.unprepare([ref]) == {ref.uid: ""}


# -- 6. the data directory as the node has it ---------------------------------------------------


def test_a_data_dir_others_could_write_is_made_tandems_alone_at_start(sim_node, start_daemon):
    """The kubelet's `hostPath: DirectoryOrCreate` makes the data dir (0755) before Tandem starts,
    and anyone may have made it 0777: the daemon starts and the directory ends 0750, a state
    directory in it loses the group and other write bits, and what was there stays."""
    node = sim_node()
    data = node.plugins / DRIVER
    (data / "instances").mkdir(parents=True)
    for d in (data, data / "instances"):
        os.chmod(d, 0o777)
    (data / "cordons.json").write_text('{"version": 1, "cordons": {}}')
    daemon = start_daemon(node)
    assert poll(lambda: dra_socket_path(data).exists() or daemon.proc.poll() is not None, 60), daemon.log_text()
    assert daemon.proc.poll() is None, daemon.log_text()
    assert stat.S_IMODE(data.stat().st_mode) == 0o750
    assert stat.S_IMODE((data / "instances").stat().st_mode) == 0o755
    assert (data / "cordons.json").exists()
    assert "was writable by group or others (mode 0777), now 0750" in daemon.log_text()
    assert daemon.stop() == 0


def _foreign(data: Path, elsewhere: Path) -> str:
    """The data dir given to nobody (65534): root only, as Tandem runs on a node."""
    if os.geteuid() != 0:
        pytest.skip("giving the data dir to another user needs root")
    data.mkdir(parents=True)
    os.chown(data, 65534, 65534)
    return f"{data} belongs to user 65534, not to Tandem's (0)"


def _symlinked(data: Path, elsewhere: Path) -> str:
    """The data dir a link to a directory whoever made the link chose."""
    data.parent.mkdir(parents=True, exist_ok=True)
    data.symlink_to(elsewhere)
    return f"{data} is a symlink (to {elsewhere}), not a directory"


@pytest.mark.parametrize("attack", [_symlinked, _foreign], ids=["symlink", "foreign-owner"])
def test_a_data_dir_that_is_not_tandems_is_refused_and_nothing_is_written(tmp_path, sim_node, start_daemon, attack):
    """Refused at start with a message that says what to do; nothing is written to where the
    link leads, and the daemon never registers with the kubelet."""
    node = sim_node()
    data = node.plugins / DRIVER
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    message = attack(data, elsewhere)
    daemon = start_daemon(node)
    assert daemon.proc.wait(timeout=60) == 1, daemon.log_text()
    assert message in daemon.log_text() and "start Tandem again" in daemon.log_text()
    assert list(elsewhere.iterdir()) == []
    assert not registration_socket_path(node.registry, DRIVER).exists()
