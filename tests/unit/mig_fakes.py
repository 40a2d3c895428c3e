"""A simulated node with an H100 in MIG mode and the fake NVML initialised in this process, shared
by the dynamic-MIG tests: as NVML sees it (`h100_in_mig_mode`), and with the claim flow around it,
any number of driver instances preparing on one data dir (`MigNode`, `mig_node`, and the fixture
`node`: a test module imports `mig_node_fixture  # noqa: F401`), and the names of GPU 0's MIG
devices that the dynamic-MIG tests allocate (`ONE_G`, `THREE_G`)."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import pytest
from prepare_fakes import DRIVER, NODE, FakeAPI

from driver.claims.allocation import PrepareSettings
from driver.claims.checkpoint import Checkpoint, ClaimRecord, InstanceLock
from driver.claims.files import ClaimFiles
from driver.claims.gpu.mig import MigPartitions
from driver.claims.gpu.mig_owners import Made, MigOwners
from driver.claims.metadata import MetadataWriter
from driver.claims.prepare import Preparer
from driver.claims.reconcile import Reconciler
from driver.daemon import Daemon
from driver.discovery.gpu.discover import GpuDiscovery
from driver.model import Device, MigPlacement
from driver.node.driver_root import find_driver_files
from sim import nvml as sim_nvml
from sim.driver_files import render_driver_files
from sim.profile import MigProfileSpec, NodeProfile, h100_node
from sim.sysfs import render_node

ONE_G = "gpu-0-mig-1g-10gb-p3"  # 1g.10gb on memory slice 3: GPU instance 10
THREE_G = "gpu-0-mig-3g-40gb-p4"  # 3g.40gb on memory slices 4-7: GPU instance 2


@contextlib.contextmanager
def h100_in_mig_mode(
    root: Path, mig_profiles: list[MigProfileSpec] | None = None
) -> Iterator[tuple[ModuleType, Path, NodeProfile]]:
    """Two MIG-capable H100s, the first in MIG mode, rendered under `root` (with /proc, where the fake
    makes MIG capabilities); yields the fake `pynvml` (initialised), its state file and the node.
    `mig_profiles`: the first GPU's profile table instead of the H100's (e.g. a Blackwell's)."""
    profile = h100_node(gpus=2, nics=0, mig_capable=True)
    profile.gpus[0].mig_mode = True
    if mig_profiles is not None:
        profile.gpus[0].mig_profiles = list(mig_profiles)
    state = root / "nvml.json"
    render_node(profile, root / "sys", root / "dev", root / "proc")
    sim_nvml.write_state(profile, state, proc_root=root / "proc")
    with sim_nvml.fake_pynvml_in_process(state) as pynvml:
        pynvml.nvmlInit()
        try:
            yield pynvml, state, profile
        finally:
            pynvml.nvmlShutdown()


@dataclass
class MigNode:
    """Two H100s, GPU 0 in MIG mode and served dynamically, with a fake API server; each driver
    instance (`preparer`) has its own MIG partitions and instance lock, as each process has."""

    root: Path
    state: Path
    pynvml: ModuleType
    devices: dict[str, Device]
    api: FakeAPI
    locks: dict[str, InstanceLock] = field(default_factory=dict)

    @property
    def settings(self) -> PrepareSettings:
        return PrepareSettings(DRIVER, NODE, self.root / "cdi", self.root / "dev", self.root / "proc")

    def files(self) -> ClaimFiles:
        return ClaimFiles(self.settings, MetadataWriter(self.root / "data", self.root / "cdi", DRIVER))

    def owners(self) -> MigOwners:
        return MigOwners(self.root / "data", "boot")

    def partitions(self, instance: str, on_change: Callable[[], None] = lambda: None) -> MigPartitions:
        """The MIG devices as the driver instance `instance` makes them."""
        return MigPartitions(Path("/"), self.root / "proc", self.owners(), instance, on_change)

    def preparer(self, instance: str = "a", on_change: Callable[[], None] = lambda: None) -> Preparer:
        self.locks[instance] = InstanceLock(self.root / "data", instance)
        return Preparer(
            api=self.api,
            checkpoint=Checkpoint(self.root / "data", "boot"),
            instance=self.locks[instance],
            settings=self.settings,
            lookup_device=self.devices.get,
            driver_files=lambda: find_driver_files(self.root / "driver"),
            files=self.files(),
            partitions=self.partitions(instance, on_change),
        )

    def die(self, instance: str) -> None:
        """The driver instance is gone (kill -9): its instance lock goes with its process."""
        self.locks.pop(instance).release()

    def reconciler(self, preparer: Preparer) -> Reconciler:
        """Start-up reconciliation of a new driver instance that prepares through `preparer`."""
        instance = InstanceLock(self.root / "data", f"start-{uuid.uuid4().hex[:8]}")
        checkpoint = Checkpoint(self.root / "data", "boot")
        return Reconciler(self.api, checkpoint, instance, self.settings, self.files(), preparer.prepare,
                          partitions=self.partitions(instance.instance_id))  # fmt: skip

    def discover(self, dynamic: bool = True) -> dict[str, Device]:
        """GPU discovery as the daemon wires it (`Daemon._owned_placements`); `dynamic`: GPU 0 is
        served dynamically (else it left `--dynamic-mig`)."""
        daemon = Daemon.__new__(Daemon)  # only what _owned_placements reads
        daemon.checkpoint = Checkpoint(self.root / "data", "boot")
        daemon.partitions = self.partitions("discovery")
        found = GpuDiscovery(self.root / "sys", proc_root=self.root / "proc",
                             dynamic_mig=lambda minor, _: dynamic and minor == 0,
                             owned_placements=daemon._owned_placements).discover()  # fmt: skip
        return {d.name: d for d in found}

    def instances(self) -> list[tuple[str, int, int | None]]:
        """What NVML holds on GPU 0: (profile, GPU instance, compute instance)."""
        migs = sim_nvml.read_state(self.state).gpus[0].mig_devices
        return sorted((m.profile, m.gi_id, m.ci_id) for m in migs)

    def inject(self, function: str, code: int) -> None:
        profile = sim_nvml.read_state(self.state)
        profile.gpus[0].nvml_errors = {function: code} if function else {}
        sim_nvml.write_state(profile, self.state)

    def records(self) -> dict[str, ClaimRecord]:
        return Checkpoint(self.root / "data", "boot").read()

    def noted(self) -> dict[MigPlacement, Made]:
        """The MIG note: the GPU instances Tandem made, and for whom."""
        with self.owners().changing() as notes:
            return notes

    def lose_checkpoint(self) -> None:
        """The checkpoint is gone (set aside unreadable, or deleted): nothing says what is prepared."""
        (self.root / "data" / "checkpoint.json").unlink()


@contextlib.contextmanager
def mig_node(root: Path) -> Iterator[MigNode]:
    profile = h100_node(NODE, gpus=2, nics=0, mig_capable=True)
    profile.gpus[0].mig_mode = True
    render_node(profile, root / "sys", root / "dev", root / "proc", lazy_nodes=True)
    render_driver_files(root / "driver")
    state = root / "nvml.json"
    sim_nvml.write_state(profile, state, proc_root=root / "proc")
    with sim_nvml.fake_pynvml_in_process(state) as pynvml:
        devices = GpuDiscovery(
            root / "sys", proc_root=root / "proc", dynamic_mig=lambda minor, _: minor == 0
        ).discover()
        yield MigNode(root, state, pynvml, {d.name: d for d in devices}, FakeAPI())


@pytest.fixture(name="node")
def mig_node_fixture(tmp_path: Path) -> Iterator[MigNode]:
    """`mig_node` under the test's tmp_path."""
    with mig_node(tmp_path) as n:
        yield n
