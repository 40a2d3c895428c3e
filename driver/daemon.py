"""The composition root: builds every part from the Config and wires them together.

Start order follows the kubelet's expectations: the DRA socket is served before the
registration socket appears, so the kubelet can connect as soon as it reads GetInfo. Shutdown
runs the other way round and removes this instance's own sockets, so a rolling update's other
instance keeps serving.

The kubelet's gRPC server (both sockets, one polling thread) is `kubelet.server.KubeletServer`.
Over 400 lines on purpose: this is the one place that knows every part and how they connect;
split, the wiring would have to be read in two places to be understood.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import threading
import uuid
from typing import Any

from driver.claims.allocation import PrepareSettings
from driver.claims.binding import SOURCE as BINDING_SOURCE
from driver.claims.binding import PreBinder
from driver.claims.binding_conditions import PublishedDevices
from driver.claims.binding_pods import NominatedPods
from driver.claims.checkpoint import Checkpoint, DeviceRecord, InstanceLock
from driver.claims.files import ClaimFiles
from driver.claims.gpu.mig import MigPartitions
from driver.claims.gpu.mig_owners import MigOwners
from driver.claims.gpu.mps import MpsDaemons, MpsError
from driver.claims.gpu.sharing import GpuSharing, mps_gpus, time_slice_gpus
from driver.claims.gpu.time_slices import TimeSliceError, TimeSlices
from driver.claims.metadata import MetadataWriter
from driver.claims.nic.homes import NicHomes
from driver.claims.nic.network_data import NetworkDataRefresh
from driver.claims.prepare import Preparer
from driver.claims.reconcile import Reconciler
from driver.claims.usage import ClaimGpuUsage
from driver.config import Config
from driver.discovery.nic.device import pci_address_of
from driver.events import EventRecorder
from driver.fsutil import boot_id, secure_data_dir
from driver.health.cordon import CordonStore
from driver.health.gpu.monitor import GpuHealthMonitor
from driver.health.gpu.release import GpuReleases
from driver.health.monitors import build_monitors, device_counters, health_counters, xid_counts
from driver.health.nic.monitor import NicHealthMonitor
from driver.inventory.discovery_loops import discovery_loops
from driver.inventory.sources import Coalescer, RefreshLoop
from driver.inventory.store import Inventory
from driver.kube.api import KubeAPI
from driver.kubelet.health import HealthBroadcaster
from driver.kubelet.liveness import PROBE_PERIOD, ProbeFile, probe_path
from driver.kubelet.liveness import check as check_alive
from driver.kubelet.registration import dra_socket_path, registration_socket_path
from driver.kubelet.server import KubeletServer
from driver.logs import CONFIG_FIELD
from driver.metrics import Metrics, MetricsEndpoint, ScrapeSources
from driver.model import MigPlacement
from driver.node.driver_root import find_driver_files
from driver.node.nvml import NVML_ACCESS
from driver.slices.publisher import SlicePublisher
from driver.status.documents import ClaimFacts
from driver.status.paths import status_socket_path
from driver.status.server import StatusServer
from driver.version import describe

log = logging.getLogger(__name__)

SHUTDOWN_GRACE = 10.0  # seconds in-flight prepare/unprepare calls get to finish on SIGTERM
# Seconds a prepare that made (or an unprepare that destroyed) a MIG partition waits for the GPU
# rediscovery that records it; a slower NVML only makes the first XIDs land on the whole GPU.
MIG_REDISCOVERY_WAIT = 5.0


class Daemon:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.data_dir = config.data_dir
        secure_data_dir(self.data_dir)  # before anything is read or written there
        self.dra_socket = dra_socket_path(self.data_dir, config.pod_uid)
        self.reg_socket = registration_socket_path(config.registrar_dir, config.driver_name, config.pod_uid)
        self.inventory = Inventory()
        self.api = KubeAPI(config.kubeconfig)
        self.checkpoint = Checkpoint(self.data_dir, boot_id())
        # Unique per process, not per pod: a container restarted in the same pod must see the
        # prepares its dead predecessor left half done as dead, and roll them back.
        self.instance = InstanceLock(self.data_dir, f"{config.pod_uid or 'local'}-{uuid.uuid4().hex[:8]}")
        self._find_driver_files()
        settings = PrepareSettings(
            driver_name=config.driver_name,
            pool=config.node_name,
            cdi_root=config.cdi_root,
            dev_root=config.dev_root,
            proc_root=config.proc_root,
        )
        metadata = MetadataWriter(self.data_dir, config.cdi_root, config.driver_name)
        files = ClaimFiles(settings, metadata)
        # Dynamic MIG: MIG devices made at prepare, noted as Tandem's apart from the records; a
        # change is rediscovered at once (health attribution, the administrator's instances told
        # apart from Tandem's).
        owners = MigOwners(self.data_dir, boot_id())
        self.partitions = MigPartitions(
            config.nvidia_driver_root,
            config.proc_root,
            owners,
            self.instance.instance_id,
            on_change=self._rediscover_gpus,
        )
        # Kubernetes Events: failed prepares and device health on claims, health and cordons on the Node.
        self.events = EventRecorder(
            self.api, config.driver_name, config.node_name, self.inventory.devices, claims=self.checkpoint.read
        )
        self.inventory.subscribe(self.events.inventory_changed)
        # Exclusive NICs come back from pods under their pod-side name: give them back their own.
        homes = NicHomes(self.data_dir, config.netns or None, warn=self.events.nic_not_home)
        self.nic_homes = homes if config.nic_link_source == "netlink" else None

        # Shared GPUs, as the checkpoint's records say: one MPS control daemon per GPU that MPS
        # claims use; the time-slice interval the records ask for, the default back where none does.
        def recorded() -> list[DeviceRecord]:
            return [d for c in self.checkpoint.read().values() for d in c.devices]

        self.mps = MpsDaemons(
            self.data_dir / "mps",
            config.nvidia_driver_root,
            needed=lambda: mps_gpus(recorded(), self.inventory.get),
            complete=lambda: not self.checkpoint.incomplete,
            sysfs_root=config.sysfs_root,
        )
        self.time_slices = TimeSlices(
            self.data_dir,
            config.nvidia_driver_root,
            needed=lambda: time_slice_gpus(recorded(), self.inventory.get),
            complete=lambda: not self.checkpoint.incomplete,
        )
        self.preparer = Preparer(
            sharing=GpuSharing(self.mps, self.time_slices),
            report_failure=lambda ref, error: self.events.claim_failed(ref.namespace, ref.name, ref.uid, error),
            nic_homes=self.nic_homes,
            api=self.api,
            checkpoint=self.checkpoint,
            instance=self.instance,
            settings=settings,
            lookup_device=self.inventory.get,
            driver_files=lambda: self.driver_files,
            files=files,
            partitions=self.partitions,
        )
        self.reconciler = Reconciler(
            self.api,
            self.checkpoint,
            self.instance,
            settings,
            files,
            prepare=self.preparer.prepare,
            partitions=self.partitions,
        )
        self.monitors = build_monitors(config, self.inventory)
        self.binding, self._nominated = self._build_binding(settings)
        self.publisher = SlicePublisher(
            api=self.api,
            driver_name=config.driver_name,
            node_name=config.node_name,
            get_devices=PublishedDevices(
                self.inventory.devices,
                config.driver_name,
                config.mig_binding_conditions and self.binding is not None,
                config.nic_binding_conditions,
            ),
        )
        self.inventory.subscribe(self.publisher.trigger)
        # A prepared NIC's addresses can change later (DHCP, renumbering): follow them into the
        # claim's metadata and status.
        network_data = NetworkDataRefresh(
            self.api, self.checkpoint, settings, self.inventory.get, metadata, self.preparer.claim_locks
        )
        self.network_refresh = Coalescer("nic-address-refresh", network_data.run)
        self.inventory.subscribe(self.network_refresh.trigger)
        self.health = HealthBroadcaster(self.inventory, config.node_name)
        self.metrics = Metrics(
            self.inventory,
            ScrapeSources(
                lambda: self.publisher.stats,
                lambda: health_counters(self.monitors),
                lambda: xid_counts(self.monitors),
                prepared=lambda: len(self.checkpoint.read()),
                events_dropped=lambda: self.events.dropped,
                claim_gpus=ClaimGpuUsage(self.checkpoint.read, self.inventory.get, config.nvidia_driver_root).read,
                device_counters=lambda: device_counters(self.monitors),
            ),
        )
        self.cordons = CordonStore(self.data_dir, self.inventory, domain=config.driver_name)
        # `tandemctl release`: GPU resets and driver upgrades need Tandem to let go of NVML; a
        # reacquire rediscovers the GPUs at once (an upgrade changes their attributes).
        self.releases = GpuReleases(
            self.data_dir, self.inventory, domain=config.driver_name, on_reacquire=self._rediscover_gpus
        )
        self.status = StatusServer(
            status_socket_path(self.data_dir),
            self.inventory,
            claims=ClaimFacts(self.checkpoint.read, files, self.events.last_failure, self.events.failures),
            cordons=self.cordons,
            releases=self.releases,
            info=self._status_info,
        )
        self._metrics_endpoint: MetricsEndpoint | None = None
        discovery = discovery_loops(
            config,
            self.inventory,
            owned_placements=self._owned_placements,
            mig_generation=self.partitions.generation,
            gpus_found=self._find_driver_files,
            allocated_nics=self._allocated_nics,
            nic_returns=self.nic_homes,
        )
        self.sources: list[RefreshLoop] = discovery.loops
        self._nic_watcher = discovery.nic_watcher
        self.kubelet_server = KubeletServer(config.driver_name, self.dra_socket, self.reg_socket)

    def _build_binding(self, settings: PrepareSettings) -> tuple[PreBinder | None, NominatedPods | None]:
        """Binding conditions (`driver.claims.binding`): only where a device carries them."""
        cfg = self.config
        if not (
            (cfg.mig_binding_conditions and cfg.dynamic_mig != type(cfg.dynamic_mig)()) or cfg.nic_binding_conditions
        ):
            return None, None
        nics = [m for m in self.monitors if isinstance(m, NicHealthMonitor)]
        binder = PreBinder(
            self.api,
            settings,
            self.checkpoint,
            self.partitions,
            self.preparer.claim_locks,
            lookup=self.inventory.get,
            devices=self.inventory.devices,
            taint=lambda name, conds: self.inventory.set_conditions(BINDING_SOURCE, name, conds),
            report=lambda ref, error: self.events.binding_failed(ref.namespace, ref.name, ref.uid, error),
            nic_fault=nics[0].fault_now if nics else lambda _name: None,
            on_ready=lambda seconds: self.metrics.binding_seconds.observe(seconds),
            on_failure=lambda reason: self.metrics.binding_failed(reason),
        )
        return binder, NominatedPods(self.api, cfg.node_name, binder.want)

    def _find_driver_files(self) -> None:
        """The NVIDIA user-space files, found again with every GPU discovery: a driver upgrade changes them."""
        self.driver_files = find_driver_files(self.config.nvidia_driver_root, self.config.nvidia_driver_root_host)

    def _rediscover_gpus(self) -> None:
        """After a MIG partition was made or destroyed: the prepare (unprepare) answers only once
        the inventory has the partition's GPU and compute instance IDs, so that an XID from the
        pod's first instructions is pinned on its partition, not on every tenant of the GPU.
        Before the kubelet can call (start-up reconciliation destroying what a crash left) there
        is nobody to answer, and waiting would stall: the reconciler holds the checkpoint lock
        that a GPU discovery needs (`_owned_placements`). Then a rediscovery is only asked for."""
        for source in (s for s in self.sources if s.name == "gpu"):
            if not self.kubelet_server.serving:
                source.trigger()
            else:
                source.refresh(timeout=MIG_REDISCOVERY_WAIT)

    def _owned_placements(self) -> set[MigPlacement]:
        """The GPU instances Tandem made or is making (dynamic MIG), as the checkpoint records them
        and as the MIG note has them (which a lost checkpoint does not lose)."""
        recorded = {d.mig for c in self.checkpoint.read().values() for d in c.devices if d.mig is not None}
        return recorded | self.partitions.owned()

    def _allocated_nics(self) -> set[str]:
        """PCI addresses of prepared NICs: they stay published while their netdev is inside a pod,
        and a prepared one still on the host is not given back. From the records alone: after a
        restart the inventory has not found a NIC that is inside a pod, and never would."""
        names = (d.device for c in self.checkpoint.read().values() for d in c.devices)
        return {address for name in names if (address := pci_address_of(name)) is not None}

    def _status_info(self) -> dict[str, Any]:
        """What `tandemctl health` shows about the daemon; `problems` mean degraded, `unready` unhealthy."""
        problems = []
        registration = self.kubelet_server.registration
        reg = registration.state if registration else None
        if reg is None or not reg.registered:
            problems.append(
                "the kubelet has not confirmed the registration" + (f": {reg.error}" if reg and reg.error else "")
            )
        for source in self.sources:
            if source.last_error:
                problems.append(f"{source.name} discovery unavailable: {source.last_error}")
        return {
            "node": self.config.node_name,
            "driver": self.config.driver_name,
            "instance": self.instance.instance_id,
            "registered": bool(reg and reg.registered),
            "slices": self.publisher.summary(),
            "problems": problems + self.publisher.progress.problems(),
            "unready": self.publisher.progress.unready(),
            "binding": self.binding.waiting() if self.binding is not None else [],
        }

    def start(self) -> None:
        cfg = self.config
        cfg.registrar_dir.mkdir(parents=True, exist_ok=True)
        cfg.cdi_root.mkdir(parents=True, exist_ok=True)
        # Cordons first: the first published slice already carries them. Releases before
        # anything initialises NVML: a GPU released before a restart stays released.
        self.cordons.load()
        self.releases.load()
        self.status.start()
        if cfg.metrics_address:
            self._metrics_endpoint = MetricsEndpoint(self.metrics, cfg.metrics_address)
            self._metrics_endpoint.start()
        for source in self.sources:
            source.start()
        if self._nic_watcher is not None:
            self._nic_watcher.start()

        # Discovery first: reconciliation must not mistake a kept NIC for a vanished one, and the
        # publisher must not publish a half-discovered pool (on a restart that rewrites the slices
        # twice and hides the undiscovered devices from the scheduler in between).
        for source in self.sources:
            source.wait_first_run(timeout=30)
        # Health before the first publish: a GPU that is already lost is never offered untainted.
        for monitor in self.monitors:
            monitor.start()
            if isinstance(monitor, GpuHealthMonitor) and not NVML_ACCESS.released():
                monitor.trigger_probe(wait=10)
        self.publisher.start()
        self.events.start()
        self.reconciler.run()
        try:  # daemons for the MPS claims that survived a restart; none left for claims that did not
            self.mps.sync()
        except MpsError as e:
            log.warning("MPS: %s (the supervisor retries)", e)
        try:  # the intervals of time-sliced claims again (a reset GPU forgets them), the default elsewhere
            self.time_slices.sync(everything=True)
        except TimeSliceError as e:
            log.warning("time slices: %s (retried at the next prepare or unprepare)", e)
        self.mps.start()
        self.network_refresh.start()
        if self.binding is not None and self._nominated is not None:  # after reconcile's MIG collect
            self.binding.start()
            self._nominated.start()
        self.kubelet_server.start(self.preparer, self.health, self.metrics)
        # What start-up made (modules, discovery, the servers) lives as long as the daemon: moved
        # out of the collector's sight, a full collection scans only what came later (well under
        # a millisecond) instead of every start-up object (25-40 ms, a stalled prepare).
        gc.freeze()

    def rediscover(self) -> None:
        log.info("rediscovering on request")
        for source in self.sources:
            source.trigger()

    def stop(self) -> None:
        """Deregister first (the kubelet stops sending new calls), then drain in-flight calls. The
        metrics port goes first of all: the instance that replaces this one is waiting for it."""
        if self._metrics_endpoint is not None:
            self._metrics_endpoint.stop()
        self.status.stop()
        self.kubelet_server.deregister()
        self.health.close()  # open health streams end now instead of holding the grace period
        self.kubelet_server.stop(SHUTDOWN_GRACE)
        self.network_refresh.stop()
        if self.binding is not None and self._nominated is not None:
            self._nominated.stop()
            self.binding.stop()
        self.preparer.close()
        self.mps.stop()  # the daemons stay, for the claims that use them
        if self._nic_watcher is not None:
            self._nic_watcher.stop()
        for monitor in self.monitors:
            monitor.stop()
        for source in self.sources:
            source.stop()
        self.events.stop()
        self.publisher.stop()  # slices stay: a restart must not cause scheduling churn
        self.instance.release()
        log.info("stopped")


def run_daemon(config: Config) -> int:
    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        log.info("received %s, shutting down", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    log.info("starting %s pid=%d", describe(), os.getpid(), extra={CONFIG_FIELD: config.as_log()})
    try:
        daemon = Daemon(config)
        daemon.start()
    except Exception as e:
        log.error("cannot start: %s", e)
        return 1
    # SIGHUP: rediscover now (after a driver reload, a hot-plug or a MIG reconfiguration).
    signal.signal(signal.SIGHUP, lambda _s, _f: daemon.rediscover())
    # The main loop keeps the kubelet's probes' verdict (driver/kubelet/liveness.py, ProbeFile).
    registration = registration_socket_path(config.registrar_dir, config.driver_name, config.pod_uid)
    probe = ProbeFile(
        probe_path(config.data_dir, config.pod_uid),
        lambda: check_alive(registration, config.driver_name, timeout=PROBE_PERIOD / 2),
        daemon.status.health,
    )
    probe.refresh()
    while not stop.wait(PROBE_PERIOD):
        probe.refresh()
    probe.remove()
    daemon.stop()
    return 0
