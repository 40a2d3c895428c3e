"""Grey failures in the real cluster: a device that is up but sick is fenced like a dead one.

A GPU whose PCIe link trained at x8, a NIC whose link flaps and a NIC counting symbol errors, each
injected into the simulated node's NVML state or sysfs (`sim.grey`) while Tandem runs: the
device's NoSchedule taint reaches the ResourceSlice, the claim of a pod started on the device
before the fault gets a `DeviceUnhealthy` Event in the pod's namespace, `tandemctl devices` says
why in words, the real scheduler keeps a new pod that can only use that device Pending, and once
the device reads well again the taint goes and that pod runs. Thresholds are short here (a read a
second, a recovery of 6 s); docs/health.md has the defaults. tests/integration/test_grey_daemon.py
is the same with the daemon as a process and no cluster.
"""

from __future__ import annotations

import contextlib
import subprocess
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from kube import (
    TANDEMCTL,
    Cluster,
    attribute,
    claim_template,
    pod,
    report_script,
    request,
    wait_for,
    wait_report,
)

from sim.fstree import replace
from sim.grey import add_port_counter, flap, set_gpu_signals

THRESHOLDS = ("period=1", "window=6", "hold=3", "recovery=6", "rising-reads=2")
FLAGS = tuple(arg for t in THRESHOLDS for arg in ("--grey-threshold", t))
GREY_KEYS = frozenset(
    f"tandem.dev/{condition}"
    for condition in (
        "pcie-degraded",
        "pcie-errors",
        "clocks-slowdown",
        "nvlink-degraded",
        "link-flapping",
        "rdma-errors",
        "rdma-transport-errors",
        "link-slow",
    )
)
GPU = "gpu-6"
FLAPPING, ERRING = "mlx5_2", "mlx5_3"  # the RDMA devices of the two NICs made sick
TICK = 0.5  # how often a fault that lasts (flaps, symbol errors) is kept up while the test needs it
# From a fault's end to its taint's: it leaves the window (6 s), reads well for `recovery` (6 s),
# then a read's period and the slice's round trip.
CLEARS_WITHIN = 60


@dataclass(frozen=True)
class Fault:
    """One grey failure of one device: how it begins, is kept up and ends, and what Tandem says."""

    device: str  # the published device's name
    selector: str  # CEL that only this device matches
    key: str
    value: str
    words: str  # in the device's health message: the Event's note and tandemctl's line
    begin: Callable[[], None]
    keep: Callable[[], None] = lambda: None
    end: Callable[[], None] = lambda: None

    def template(self) -> dict[str, Any]:
        device_class = "gpu.tandem.dev" if self.device.startswith("gpu") else "nic.tandem.dev"
        return claim_template("sick", [request("dev", device_class, self.selector)])


def grey_taints(cluster: Cluster, device: str) -> list[dict[str, Any]]:
    return [t for t in cluster.devices()[device].get("taints") or [] if t["key"] in GREY_KEYS]


def nic(cluster: Cluster, rdma_device: str) -> dict[str, Any]:
    (found,) = [d for d in cluster.devices().values() if attribute(d, "rdmaDevice") == rdma_device]
    return found


def make_fault(kind: str, cluster: Cluster, tandem: Any) -> Fault:
    sysfs, state = tandem.node.root / "sys", tandem.node.nvml_state
    if kind == "pcie-degraded":
        uuid = attribute(cluster.devices()[GPU], "uuid")
        return Fault(
            GPU,
            f'device.attributes["tandem.dev"].uuid == "{uuid}"',
            "tandem.dev/pcie-degraded",
            "x8-of-x16",
            "PCIe link trained at x8 of x16",
            begin=lambda: set_gpu_signals(state, uuid, pcie_link_width=8),
            end=lambda: set_gpu_signals(state, uuid, pcie_link_width=16),
        )
    # A NIC claim that can only be met by this one NIC: its PCI address, as the GPU's by UUID.
    sick = nic(cluster, FLAPPING if kind == "link-flapping" else ERRING)
    selector = f'device.attributes["resource.kubernetes.io"].pciBusID == "{attribute(sick, "resource.kubernetes.io/pciBusID")}"'
    if kind == "link-flapping":
        ifname = attribute(sick, "ifName")
        return Fault(
            sick["name"],
            selector,
            "tandem.dev/link-flapping",
            "flapping",
            "carrier changes (a flap is two)",
            begin=lambda: flap(sysfs, ifname, times=3),
            keep=lambda: flap(sysfs, ifname, times=1),
        )
    # The counter stops at 65535 and the node's sysfs outlives a run: cleared first, as
    # `perfquery -R` clears a port's counters (Tandem takes a counter that went back as a new
    # baseline), so a run's errors can always be seen to rise.
    counter = (sysfs / "class" / "infiniband" / ERRING).resolve() / "ports" / "1" / "counters" / "symbol_error"
    replace(counter, "0\n")
    return Fault(
        sick["name"],
        selector,
        "tandem.dev/rdma-errors",
        "port1-symbol-error",
        "symbol errors on port 1",
        begin=lambda: None,
        keep=lambda: add_port_counter(sysfs, ERRING, 1, "symbol_error", 30),  # 60/s, limit 10/s
    )


@contextlib.contextmanager
def sustained(fault: Fault) -> Iterator[None]:
    """The fault begun, kept up every TICK while the block runs, and ended after it."""
    stop, failures = threading.Event(), []

    def keep() -> None:
        while not stop.wait(TICK):
            try:
                fault.keep()
            except Exception as e:
                failures.append(e)
                return

    fault.begin()
    thread = threading.Thread(target=keep, name="grey-fault", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(10)
        fault.end()
    assert not failures, f"keeping the fault up failed: {failures[0]!r}"


def unschedulable(cluster: Cluster, namespace: str, name: str) -> dict[str, Any] | None:
    """The pod's PodScheduled condition, while it says the scheduler cannot place the pod."""
    conditions = (cluster.get("pod", name, namespace) or {}).get("status", {}).get("conditions") or []
    return next((c for c in conditions if c["type"] == "PodScheduled" and c.get("reason") == "Unschedulable"), None)


def claim_events(cluster: Cluster, namespace: str, claim: str, reason: str) -> list[dict[str, Any]]:
    """The namespace's events.k8s.io Events with `reason` regarding the ResourceClaim `claim`."""
    return [
        e
        for e in cluster.get("events.v1.events.k8s.io", namespace=namespace)
        if e.get("reason") == reason
        and e["regarding"].get("kind") == "ResourceClaim"
        and e["regarding"]["name"] == claim
    ]


@pytest.fixture(params=["pcie-degraded", "link-flapping", "rdma-errors"])
def fault(request: pytest.FixtureRequest, cluster: Cluster, tandem: Any) -> Iterator[Fault]:
    """The fault, on a Tandem with short grey thresholds and its device free of grey taints."""
    tandem.ensure(*FLAGS)
    f = make_fault(request.param, cluster, tandem)
    wait_for(f"{f.device} free of grey taints", lambda: not grey_taints(cluster, f.device), timeout=CLEARS_WITHIN)
    yield f
    f.end()
    # Tandem keeps what it reports across a restart, and the next test's flags bring back the
    # default recovery of 10 minutes: the device leaves this test clean.
    wait_for(f"{f.device} clean again", lambda: not grey_taints(cluster, f.device), timeout=CLEARS_WITHIN)


def test_a_grey_device_is_fenced_its_holder_told_and_it_is_given_back(
    cluster: Cluster, fault: Fault, namespace: str
) -> None:
    cluster.apply(fault.template(), pod(cluster, "holder", report_script("true"), {"dev": "sick"}), namespace=namespace)
    wait_report(cluster, namespace, "holder")
    (status,) = cluster.get("pod", "holder", namespace)["status"]["resourceClaimStatuses"]
    claim = status["resourceClaimName"]

    with sustained(fault):
        (taint,) = wait_for(f"{fault.key} on {fault.device} in the slice", lambda: grey_taints(cluster, fault.device))
        assert (taint["key"], taint["value"], taint["effect"]) == (fault.key, fault.value, "NoSchedule")
        others = {
            name: keys
            for name, d in cluster.devices().items()
            if name != fault.device and (keys := [t for t in d.get("taints") or [] if t["key"] in GREY_KEYS])
        }
        assert not others, "one device's fault must taint no other"

        # The pod already on the device stays (NoSchedule) and is told, on its claim, in its namespace.
        events = wait_for(
            "DeviceUnhealthy on the holder's claim", lambda: claim_events(cluster, namespace, claim, "DeviceUnhealthy")
        )
        note = events[0]["note"]
        assert events[0]["type"] == "Warning" and note.startswith(f"{fault.device}: ") and fault.words in note, events
        assert cluster.get("pod", "holder", namespace)["status"]["phase"] == "Running"

        devices = subprocess.run([TANDEMCTL, "devices"], capture_output=True, text=True, timeout=30).stdout
        print(f"$ tandemctl devices\n{devices}")
        why = [line for line in devices.splitlines() if line.startswith(f"{fault.device}: ")]
        assert len(why) == 1 and fault.words in why[0], devices

        # The device free (the holder and its claim gone), a new pod that can only use it waits.
        cluster.kubectl("delete", "pod", "holder", "-n", namespace, "--wait=true", "--timeout=60s")
        wait_for("the holder's claim gone", lambda: cluster.get("resourceclaim", claim, namespace) is None)
        cluster.apply(pod(cluster, "waiting", report_script("true"), {"dev": "sick"}), namespace=namespace)
        refused = wait_for(
            "the scheduler to refuse the grey device", lambda: unschedulable(cluster, namespace, "waiting")
        )
        print(f"scheduler: {refused.get('message')}")
        assert not cluster.get("pod", "waiting", namespace)["spec"].get("nodeName")
        assert grey_taints(cluster, fault.device), "the taint, not something else, kept the pod away"

    wait_for(
        f"{fault.key} cleared once {fault.device} reads well",
        lambda: not grey_taints(cluster, fault.device),
        timeout=CLEARS_WITHIN,
    )
    wait_report(cluster, namespace, "waiting", timeout=120)
