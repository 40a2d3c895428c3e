"""The two drivers' names and the cluster objects of the bench: the reference driver's service
account, role and DeviceClasses (Tandem's own come from daemonset.yaml through the launcher), its
devices, and the workloads' claim templates and pods."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
DRIVER, REF = "tandem.dev", "ref.tandem.dev"
# The scheduler's allocator tries a node's pools in the order of their drivers' names (then pool
# names; `sortPoolsByID` in k8s.io/dynamic-resource-allocation's structured allocator), testing the
# claim's class selectors on each device until its requests are met. With one reference name, one
# driver's pools come first on every node and every claim of the other rejects its 16 devices on
# each of the N nodes first: measured at 100 nodes, about 50 ms of create->Running for a GPU+NIC
# pair, which followed the name when it was swapped. So the reference runs under two names, one
# sorting before Tandem's and one after, on alternate nodes: each driver's claims meet the other's
# devices first on half the nodes. REF is the pair's family: its classes, its attribute domain.
REF_NAMES = (f"a.{REF}", f"z.{REF}")
assert REF_NAMES[0] < DRIVER < REF_NAMES[1]
NAMESPACE = "tandem-system"
USERS = {
    DRIVER: f"system:serviceaccount:{NAMESPACE}:tandem-driver",
    REF: f"system:serviceaccount:{NAMESPACE}:ref-driver",
}
GPUS, NICS = 8, 8
# Where each kind of ref_objects is created.
PATHS = {
    "ServiceAccount": f"/api/v1/namespaces/{NAMESPACE}/serviceaccounts",
    "ClusterRole": "/apis/rbac.authorization.k8s.io/v1/clusterroles",
    "ClusterRoleBinding": "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings",
    "DeviceClass": "/apis/resource.k8s.io/v1/deviceclasses",
}


def family(driver: str) -> str:
    """REF for either of the reference's names (REF_NAMES); any other driver as it is."""
    return REF if driver in REF_NAMES else driver


def ref_objects() -> list[dict[str, Any]]:
    """The Go driver's service account, the rules of Tandem's ClusterRole for its own driver name,
    and its DeviceClasses."""
    docs = [d for d in yaml.safe_load_all((REPO / "daemonset.yaml").read_text()) if d]
    (role,) = [d for d in docs if d["kind"] == "ClusterRole" and d["metadata"]["name"] == "tandem-driver"]
    rules = role["rules"]
    for rule in rules:
        if DRIVER in rule.get("resourceNames", ()):
            rule["resourceNames"] = list(REF_NAMES)
    rbac = "rbac.authorization.k8s.io"
    out: list[dict[str, Any]] = [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "ref-driver", "namespace": NAMESPACE}},
        {"apiVersion": f"{rbac}/v1", "kind": "ClusterRole", "metadata": {"name": "ref-driver"}, "rules": rules},
        {
            "apiVersion": f"{rbac}/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": "ref-driver"},
            "roleRef": {"apiGroup": rbac, "kind": "ClusterRole", "name": "ref-driver"},
            "subjects": [{"kind": "ServiceAccount", "name": "ref-driver", "namespace": NAMESPACE}],
        },
    ]
    # Tandem's own classes with the driver's name in place of Tandem's, extended resource names
    # included (the scheduler does more for a class that has one), so both drivers' claims cost the
    # scheduler alike. nvidia.com/gpu is Tandem's; the reference's GPUs get a name of their own.
    for d in docs:
        if d["kind"] == "DeviceClass" and d["metadata"]["name"] in (f"gpu.{DRIVER}", f"nic.{DRIVER}"):
            cls = json.loads(json.dumps(d).replace(f'"{DRIVER}', f'"{REF}'))  # CEL, extended resource name
            cls["metadata"]["name"] = d["metadata"]["name"].replace(DRIVER, REF)
            for selector in cls["spec"]["selectors"]:  # either name; the attributes are REF's (ref_devices)
                cel = selector["cel"]["expression"].replace(
                    f'device.driver == "{REF}"', f"device.driver in {json.dumps(REF_NAMES)}"
                )
                assert cel != selector["cel"]["expression"], cel
                selector["cel"]["expression"] = cel
            if cls["spec"].get("extendedResourceName", "").startswith("nvidia.com/"):
                cls["spec"]["extendedResourceName"] = f"{REF}/gpu"
            out.append(cls)
    return out


def ref_devices(devices: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Tandem's devices of a node for the reference: their attributes of Tandem's domain (a name
    without one is the publishing driver's) in REF's, which both of REF_NAMES publish, so that one
    class and one `matchAttribute` serve either."""
    out = []
    for device in devices:
        attrs = {_ref_attribute(k): v for k, v in device.get("attributes", {}).items()}
        out.append({**device, "attributes": attrs})
    return out


def _ref_attribute(name: str) -> str:
    if "/" not in name or name.startswith(DRIVER + "/"):
        return f"{REF}/{name.removeprefix(DRIVER + '/')}"
    return name


def template(driver: str, workload: str) -> dict[str, Any]:
    requests: list[dict[str, Any]] = [{"name": "gpu", "exactly": {"deviceClassName": f"gpu.{driver}"}}]
    spec: dict[str, Any] = {"requests": requests}
    if workload == "pair":
        requests.append({"name": "nic", "exactly": {"deviceClassName": f"nic.{driver}"}})
        spec["constraints"] = [{"requests": ["gpu", "nic"], "matchAttribute": f"{driver}/pcieSwitch"}]
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": f"{workload}-{driver.replace('.', '-')}"},
        "spec": {"spec": {"devices": spec}},
    }


def pod_object(name: str, tmpl: str, driver: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"bench-driver": driver}},
        "spec": {
            "restartPolicy": "Never",
            "automountServiceAccountToken": False,
            "terminationGracePeriodSeconds": 0,
            "resourceClaims": [{"name": "c", "resourceClaimTemplateName": tmpl}],
            "containers": [{"name": "w", "image": "busybox", "resources": {"claims": [{"name": "c"}]}}],
        },
    }
