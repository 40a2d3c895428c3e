"""Claim mistakes caught when the claim is written: the ValidatingAdmissionPolicy `tandem-opaque-config`
of daemonset.yaml, evaluated by the real API server; and the Events the driver's identity may write
(`tandem-driver-events`), as the driver on this node (impersonated, with the node name its token's
extra would carry).

A typo in a claim's GpuConfig or NicConfig must be refused by `kubectl apply`, naming the field as
the user wrote it, instead of leaving a pod in ContainerCreating with its devices allocated. Every
claim here is created with `--dry-run=server`: the API server admits (or refuses) it exactly as a
real one, and nothing is left to allocate or clean up.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml
from kube import DRIVER, REPO, Cluster, KubectlError, wait_for

POLICY = "tandem-opaque-config"
V = "tandem.dev/v1alpha1"
P = "spec.devices.config[0].opaque.parameters"


def _gpu(**fields: Any) -> dict[str, Any]:
    return {"apiVersion": V, "kind": "GpuConfig", **fields}


def _nic(**fields: Any) -> dict[str, Any]:
    return {"apiVersion": V, "kind": "NicConfig", **fields}


def _devices(parameters: list[Any], other_driver_first: bool) -> dict[str, Any]:
    config = [{"opaque": {"driver": "other.example.com", "parameters": {"anything": 1}}}] if other_driver_first else []
    config += [{"opaque": {"driver": DRIVER, "parameters": p}} for p in parameters]
    return {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.tandem.dev"}}], "config": config}


def _claim(parameters: list[Any], template: bool = False, other_driver_first: bool = False) -> dict[str, Any]:
    devices = _devices(parameters, other_driver_first)
    if template:
        return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate", "metadata": {"name": "t"},
                "spec": {"spec": {"devices": devices}}}  # fmt: skip
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": "c"},
            "spec": {"devices": devices}}  # fmt: skip


def _create(cluster: Cluster, namespace: str, obj: dict[str, Any]) -> str:
    """'' when the API server admits `obj`, else its refusal."""
    try:
        cluster.kubectl("create", "--dry-run=server", "-o", "name", "-n", namespace, "-f", "-", stdin=json.dumps(obj))
    except KubectlError as e:
        return str(e)
    return ""


@pytest.fixture
def policy(cluster: Cluster, namespace: str) -> str:
    """The policy and its binding as daemonset.yaml has them now (the API server accepts them), in
    force: a policy takes a moment to reach the admission chain after it is written."""
    docs = [d for d in yaml.safe_load_all((REPO / "daemonset.yaml").read_text()) if d]
    cluster.apply([d for d in docs if d["kind"].startswith("ValidatingAdmissionPolicy") and (
        d["metadata"]["name"] == POLICY)])  # fmt: skip
    wait_for("the claims policy in force", lambda: POLICY in _create(cluster, namespace, _claim([_gpu(sharing="x")])))
    return namespace


GOOD = [
    [_gpu()],
    [_gpu(sharing="MPS", pairNics=False)],
    [_gpu(sharing="TimeSlicing", timeSliceInterval="Long")],
    [_nic(mode="exclusive", interfaceName="net1", addresses=["10.9.0.5/24", "fd42::5/64"], mtu=9000,
          routes=[{"destination": "10.10.0.0/16", "via": "10.9.0.1"}, {"destination": "192.168.1.7"}])],
]  # fmt: skip


@pytest.mark.parametrize("parameters", GOOD, ids=[json.dumps(p)[:60] for p in GOOD])
@pytest.mark.parametrize("template", [False, True], ids=["claim", "template"])
def test_a_good_config_is_admitted(cluster: Cluster, policy: str, parameters: list[Any], template: bool) -> None:
    assert _create(cluster, policy, _claim(parameters, template)) == ""


BAD = [
    ([_gpu(sharing="mps")], f"{P}.sharing must be one of MPS, TimeSlicing (did you mean MPS?)"),
    ([_gpu(sharing=1)], f"{P}.sharing must be a string, got an integer"),
    ([_gpu(pairnics=True)], f"{P}.pairnics is not a field of GpuConfig (did you mean pairNics?)"),
    ([{"apiVersion": V, "kind": "gpuconfig"}], f"{P}.kind must be one of GpuConfig, NicConfig (did you mean GpuConfig?)"),
    ([{"apiVersion": "v1", "kind": "GpuConfig"}], f"{P}.apiVersion must be tandem.dev/v1alpha1"),
    ([_nic(mad=True)], f"{P}.mad is accepted only from a DeviceClass's config, not a claim's"),
    ([_nic(mode="Exclusive")], f"{P}.mode must be one of shared, exclusive (did you mean exclusive?)"),
    ([_nic(interfaceName="../../etc")], f"{P}.interfaceName must be a Linux interface name"),
    ([_nic(addresses=["10.9.0.5"])], f"{P}.addresses[0] must be an address with a prefix length (10.0.0.5/24)"),
    ([_nic(addresses=["10.9.0.5/24", "127.0.0.1/8"])], f"{P}.addresses[1] is a loopback, multicast, unspecified"),
    ([_nic(routes=[{"destination": "10.10.0.1/16"}])], f"{P}.routes[0].destination must be an address or a network"),
    ([_nic(routes=[{"destination": "10.10.0.0/16", "via": "fd00::1"}])],
     f"{P}.routes[0].via and .destination must be of the same IP version"),
    ([_nic(addresses=["fd42::5/64"], mtu=1000)], f"{P}.mtu must be 1280 to 65535 with an IPv6 address"),
    ([_gpu(), _gpu(sharing="x")], "spec.devices.config[1].opaque.parameters.sharing must be one of MPS, TimeSlicing"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("parameters", "message"), BAD, ids=[m.split(" ", 1)[0].rsplit("parameters", 1)[-1] for _p, m in BAD]
)
def test_a_mistake_is_refused_naming_the_field_as_written(
    cluster: Cluster, policy: str, parameters: list[Any], message: str
) -> None:
    refusal = _create(cluster, policy, _claim(parameters))
    assert f"ValidatingAdmissionPolicy '{POLICY}'" in refusal and message in refusal, refusal


def test_a_templates_field_is_named_where_the_template_has_it(cluster: Cluster, policy: str) -> None:
    refusal = _create(cluster, policy, _claim([_gpu(sharing="mps")], template=True))
    assert "spec.spec.devices.config[0].opaque.parameters.sharing must be one of MPS, TimeSlicing" in refusal


def test_another_drivers_entry_counts_in_the_index_and_is_not_judged(cluster: Cluster, policy: str) -> None:
    assert _create(cluster, policy, _claim([_gpu()], other_driver_first=True)) == ""
    refusal = _create(cluster, policy, _claim([_gpu(sharing="mps")], other_driver_first=True))
    assert "spec.devices.config[1].opaque.parameters.sharing" in refusal


def test_the_worst_claim_stays_within_the_cel_cost_limits(cluster: Cluster, policy: str) -> None:
    """32 entries (the most a claim holds), each wrong in every way that costs: the policy still
    answers with the errors (five, and a count), not with a cost error that would let it through."""
    worst = _nic(mode="Exclusive", interfaceName="x" * 20, addresses=[f"10.9.0.{i}/24" for i in range(1, 17)],
                 routes=[{"destination": "10.10.0.0/16", "via": "10.8.0.1"}] * 16, mtu=5)  # fmt: skip
    refusal = _create(cluster, policy, _claim([worst] * 32))
    assert f"{P}.mode must be one of shared, exclusive (did you mean exclusive?);" in refusal, refusal
    assert "; and 603 more" in refusal, refusal


# -- the driver's Events ---------------------------------------------------------------------------

EVENTS_POLICY = "tandem-driver-events"
DRIVER_USER = "system:serviceaccount:tandem-system:tandem-driver"
NODE_NAME_EXTRA = "authentication.kubernetes.io/node-name"


def _event(namespace: str, regarding: dict[str, str], node: str, **fields: Any) -> dict[str, Any]:
    """An Event as driver/events.py writes it (`_body`), with `fields` changed."""
    return {
        "apiVersion": "events.k8s.io/v1",
        "kind": "Event",
        "metadata": {"generateName": "e2e-", "namespace": namespace},
        "eventTime": "2026-01-01T00:00:00.000000Z",
        "reportingController": DRIVER,
        "reportingInstance": f"{DRIVER}-{node}",
        "action": "PrepareResources",
        "reason": "PrepareFailed",
        "type": "Warning",
        "note": "e2e",
        "regarding": regarding,
        **fields,
    }


def _claim_ref(namespace: str) -> dict[str, str]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "name": "c",
        "namespace": namespace,
        "uid": "0b7f7a52-2c2f-4a5e-9b43-7a1d5f0c9e11",
    }


def _node_ref(node: str) -> dict[str, str]:
    return {"apiVersion": "v1", "kind": "Node", "name": node}


def _as_driver(cluster: Cluster, *args: str, node: str | None = None, stdin: str | None = None) -> str:
    """'' when the API server admits the request of the driver on `node` (its token's extra; None:
    a token bound to no node), else its refusal."""
    who = ["--as", DRIVER_USER] + ([] if node is None else ["--as-user-extra", f"{NODE_NAME_EXTRA}={node}"])
    try:
        cluster.kubectl(*args, *who, stdin=stdin)
    except KubectlError as e:
        return str(e)
    return ""


def _write_event(cluster: Cluster, event: dict[str, Any], node: str | None) -> str:
    namespace = event["metadata"]["namespace"]
    return _as_driver(
        cluster,
        "create",
        "--dry-run=server",
        "-o",
        "name",
        "-n",
        namespace,
        "-f",
        "-",
        node=node,
        stdin=json.dumps(event),
    )


@pytest.fixture
def events_policy(cluster: Cluster, namespace: str) -> str:
    """The Events policy and its binding as daemonset.yaml has them now, in force."""
    docs = [d for d in yaml.safe_load_all((REPO / "daemonset.yaml").read_text()) if d]
    cluster.apply(
        [
            d
            for d in docs
            if d["kind"].startswith("ValidatingAdmissionPolicy") and (d["metadata"]["name"] == EVENTS_POLICY)
        ]
    )
    pod = _event(namespace, {"apiVersion": "v1", "kind": "Pod", "name": "p", "namespace": namespace}, cluster.node_name)
    wait_for("the Events policy in force", lambda: EVENTS_POLICY in _write_event(cluster, pod, cluster.node_name))
    return namespace


def test_the_drivers_own_events_are_admitted(cluster: Cluster, events_policy: str) -> None:
    node = cluster.node_name
    assert _write_event(cluster, _event(events_policy, _claim_ref(events_policy), node), node) == ""
    assert _write_event(cluster, _event("default", _node_ref(node), node, reason="DeviceUnhealthy"), node) == ""


def _refused_events(namespace: str, node: str) -> list[tuple[dict[str, Any], str]]:
    claim, here = _claim_ref(namespace), _node_ref(node)
    return [
        (
            _event(namespace, {"apiVersion": "v1", "kind": "Pod", "name": "p", "namespace": namespace}, node),
            "may write Events only about a ResourceClaim or its own Node, not about a Pod",
        ),
        (_event("default", claim, node), f"only in the claim's namespace '{namespace}', not in 'default'"),
        (_event("default", _node_ref("other-node"), node), "may write Events only about its own Node"),
        (_event(namespace, here, node), f"its own Node, in namespace 'default', not about Node '{node}' in"),
        (_event(namespace, claim, node, reportingController="kubelet"), "must report its Events as controller"),
        (_event(namespace, claim, "other-node"), f"instance '{DRIVER}-{node}'"),
        (_event(namespace, claim, node, related=here), "name no related object"),
    ]


@pytest.mark.parametrize(
    "case",
    range(7),
    ids=["pod", "claim-elsewhere", "other-node", "node-elsewhere", "controller", "instance", "related"],
)
def test_an_event_the_driver_never_writes_is_refused(cluster: Cluster, events_policy: str, case: int) -> None:
    event, message = _refused_events(events_policy, cluster.node_name)[case]
    refusal = _write_event(cluster, event, cluster.node_name)
    if case == 3:  # a Node's Event outside `default`: the API server's own validation refuses it first
        assert "does not match event.namespace" in refusal, refusal
        return
    assert f"ValidatingAdmissionPolicy '{EVENTS_POLICY}'" in refusal and message in refusal, refusal


def test_an_event_from_a_token_bound_to_no_node_is_refused(cluster: Cluster, events_policy: str) -> None:
    """Refused by the policy: without the token's node-name extra its node variable cannot be
    evaluated, and the policy fails closed (failurePolicy Fail)."""
    refusal = _write_event(cluster, _event(events_policy, _claim_ref(events_policy), cluster.node_name), None)
    assert f"ValidatingAdmissionPolicy '{EVENTS_POLICY}'" in refusal, refusal
