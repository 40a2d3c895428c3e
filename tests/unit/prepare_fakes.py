"""A claim API fake and Preparers over a rendered simulated node, shared by the prepare tests.

The devices are discovered from a simulated HGX H100 node (real sysfs tree, `/dev` entries, the
fake NVML), so the CDI specs the Preparer writes are the ones a real node would get. The API is a
fake whose status apply can be held, so a test decides exactly when another party acts; it also
notices two calls about one claim in flight at once, which the per-claim locks must prevent.
"""

from __future__ import annotations

import copy
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from driver.claims.allocation import ClaimRef, PrepareSettings
from driver.claims.checkpoint import Checkpoint, InstanceLock
from driver.claims.files import ClaimFiles
from driver.claims.gpu.mig import MigPartitions
from driver.claims.gpu.mig_owners import MigOwners
from driver.claims.gpu.sharing import GpuSharing
from driver.claims.metadata import MetadataWriter
from driver.claims.prepare import Preparer
from driver.claims.reconcile import Reconciler
from driver.discovery.gpu.discover import GpuDiscovery
from driver.discovery.nic.discover import NicDiscovery
from driver.kube.api import ApiError, NotFound
from driver.model import Device
from driver.node.driver_root import DriverFiles, find_driver_files
from sim import nvml as sim_nvml
from sim.driver_files import render_driver_files
from sim.profile import h100_node
from sim.sysfs import render_node

DRIVER, NODE = "tandem.dev", "n1"
# Long enough for another thread to run into the same claim, as a slow API server would let it.
API_LATENCY = 0.002


@dataclass(frozen=True)
class Host:
    """A rendered node: `/dev`, the discovered devices, the NVIDIA driver files."""

    dev: Path
    devices: dict[str, Device]
    files: DriverFiles


def render_host(root: Path) -> Host:
    """4 GPUs (gpu-0..3) and 2 NICs: mlx5_0 on GPU 0's PCIe root, mlx5_1 on GPU 2's."""
    state = root / "nvml.json"
    profile = h100_node(NODE, gpus=4, nics=2)
    render_node(profile, root / "sys", root / "dev", root / "proc")
    render_driver_files(root / "driver")
    with sim_nvml.fake_pynvml_in_process(state):
        sim_nvml.write_state(profile, state)
        devices = GpuDiscovery(root / "sys", proc_root=root / "proc").discover()
    devices += NicDiscovery(root / "sys", netlink=False).discover()
    return Host(root / "dev", {d.name: d for d in devices}, find_driver_files(root / "driver"))


def nic_name(host: Host, rdma: str) -> str:
    return next(n for n, d in host.devices.items() if d.nic is not None and d.nic.rdma_device == rdma)


class FakeAPI:
    def __init__(self) -> None:
        self.claims: dict[tuple[str, str], dict[str, Any]] = {}
        self.hold = threading.Event()
        self.held = threading.Event()
        self.hold.set()
        self.applies: list[tuple[str, str, str, int]] = []
        self.overlaps: list[str] = []
        self.down = False  # every call fails as with an unreachable API server
        self._busy = Counter[str]()
        self._mutex = threading.Lock()

    def add(
        self, namespace: str, name: str, uid: str, *devices: tuple[str, str], pods: tuple[str, ...] = ("p",)
    ) -> ClaimRef:
        """A claim allocated on this node, `devices` as (request, device), reserved for `pods`."""
        results = [
            {"request": r, "driver": DRIVER, "pool": NODE, "device": d} for r, d in devices or [("gpu", "gpu-0")]
        ]
        self.claims[(namespace, name)] = {
            "metadata": {"name": name, "namespace": namespace, "uid": uid},
            "status": {
                "allocation": {"devices": {"results": results}},
                "reservedFor": [{"resource": "pods", "name": p, "uid": f"uid-{p}"} for p in pods],
            },
        }
        return ClaimRef(namespace, name, uid)

    def get_claim(self, namespace: str, name: str) -> dict[str, Any]:
        if self.down:
            raise ApiError(f"get claim {namespace}/{name}: connection refused")
        claim = self.claims.get((namespace, name))
        if claim is None:
            raise NotFound(f"get claim {namespace}/{name}: HTTP 404", 404)
        with self._in_flight(claim["metadata"]["uid"]):
            return copy.deepcopy(claim)

    def apply_claim_status(self, namespace: str, name: str, devices: list, field_manager: str, *, uid: str) -> None:
        if devices:
            self.held.set()
            self.hold.wait(10)
        with self._in_flight(uid):
            claim = self.claims.get((namespace, name))
            if claim is not None and claim["metadata"]["uid"] == uid:
                claim["status"]["devices"] = copy.deepcopy(devices)
            self.applies.append((namespace, name, uid, len(devices)))

    def send_claim_status(self, namespace: str, name: str, devices: list, field_manager: str, *, uid: str) -> _Sent:
        return _Sent(lambda: self.apply_claim_status(namespace, name, devices, field_manager, uid=uid))

    def _in_flight(self, uid: str) -> _InFlight:
        return _InFlight(self, uid)


class _Sent:
    """An apply on the wire: the fake server carries it out when its answer is read, so an apply
    held by `FakeAPI.hold` is one the server has not answered yet."""

    def __init__(self, apply: Callable[[], None]) -> None:
        self._apply: Callable[[], None] | None = apply
        self._error: ApiError | None = None

    def wait(self) -> ApiError | None:
        apply, self._apply = self._apply, None
        if apply is not None:
            try:
                apply()
            except ApiError as e:
                self._error = e
        return self._error

    def result(self) -> None:
        if (error := self.wait()) is not None:
            raise error


class _InFlight:
    """Counts the calls about one claim in flight; a second one at once is an overlap."""

    def __init__(self, api: FakeAPI, uid: str) -> None:
        self._api, self._uid = api, uid

    def __enter__(self) -> None:
        with self._api._mutex:
            self._api._busy[self._uid] += 1
            if self._api._busy[self._uid] > 1:
                self._api.overlaps.append(self._uid)
        time.sleep(API_LATENCY)

    def __exit__(self, *exc: object) -> None:
        with self._api._mutex:
            self._api._busy[self._uid] -= 1


def make_preparer(
    data: Path, cdi_root: Path, api: FakeAPI, instance: str, host: Host, sharing: GpuSharing | None = None
) -> Preparer:
    settings = PrepareSettings(DRIVER, NODE, cdi_root, host.dev)
    return Preparer(
        api=api,
        checkpoint=Checkpoint(data, "boot"),
        instance=InstanceLock(data, instance),
        settings=settings,
        lookup_device=host.devices.get,
        driver_files=lambda: host.files,
        files=ClaimFiles(settings, MetadataWriter(data, cdi_root, DRIVER)),
        partitions=MigPartitions(Path("/"), settings.proc_root, MigOwners(data, "boot"), instance),
        sharing=sharing,
    )


def make_reconciler(data: Path, cdi_root: Path, api: FakeAPI, preparer: Preparer, host: Host) -> Reconciler:
    """Start-up reconciliation as a daemon runs it (its own instance lock), preparing through `preparer`."""
    settings = PrepareSettings(DRIVER, NODE, cdi_root, host.dev)
    files = ClaimFiles(settings, MetadataWriter(data, cdi_root, DRIVER))
    checkpoint = Checkpoint(data, "boot")
    instance = InstanceLock(data, f"reconciler-{uuid.uuid4().hex[:8]}")
    partitions = MigPartitions(Path("/"), settings.proc_root, MigOwners(data, "boot"), instance.instance_id)
    return Reconciler(api, checkpoint, instance, settings, files, preparer.prepare, partitions)
