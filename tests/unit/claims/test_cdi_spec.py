"""A claim's devices as a CDI spec: nodes, driver mounts, NIC modes, GPU-NIC pairing, names and IDs."""

from __future__ import annotations

import dataclasses
import logging
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

import cdi
from cdi.version import version_key
from driver.claims.cdi_spec import (
    ClaimSpecError,
    PlannedDevice,
    claim_spec,
    claim_spec_filename,
    pair_gpus_with_nics,
)
from driver.claims.device_nodes import DeviceNodes
from driver.claims.opaque_config import GpuConfig, NicConfig, RequestConfig
from driver.discovery.gpu.discover import GpuDiscovery
from driver.discovery.nic.discover import NicDiscovery
from driver.discovery.pcie import PCIE_SWITCH
from driver.model import NUMA_NODE, PCIE_ROOT, Device, DeviceKind, GpuInfo, NicInfo
from driver.node.driver_root import DriverFiles, find_driver_files
from sim import nvml as sim_nvml
from sim.driver_files import render_driver_files
from sim.nics import render_nic
from sim.profile import NicSpec, a100_mig_node, h100_node
from sim.sysfs import NVIDIA_CAPS_MAJOR, NVIDIA_UVM_MAJOR, render_node

DRIVER = "tandem.example.org"
UID = "7f1c9e2a-51d3-4c3e-9b61-0c2f3a5d8e11"
KIND = f"k8s.{DRIVER}/claim"
SHARE_A = "0a5b2c3d-1111-4222-8333-444455556666"
SHARE_B = "0a5b2c3d-1111-4222-8333-777788889999"


@dataclass
class Node:
    dev: Path
    proc: Path
    devices: dict[str, Device]
    files: DriverFiles

    @property
    def nodes(self) -> DeviceNodes:
        return DeviceNodes(self.dev, self.proc)


def _discover(root: Path, profile, with_nics: bool, lazy_nodes: bool = False) -> Node:  # type: ignore[no-untyped-def]
    state = root / "nvml.json"
    render_node(profile, root / "sys", root / "dev", root / "proc", lazy_nodes=lazy_nodes)
    render_driver_files(root / "driver")
    with sim_nvml.fake_pynvml_in_process(state):
        sim_nvml.write_state(profile, state)
        devices = GpuDiscovery(root / "sys", proc_root=root / "proc").discover()
    if with_nics:
        devices += NicDiscovery(root / "sys", netlink=False).discover()
    return Node(root / "dev", root / "proc", {d.name: d for d in devices}, find_driver_files(root / "driver"))


@pytest.fixture(scope="module")
def h100(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    """4 GPUs (0, 1 on NUMA 0; 2, 3 on NUMA 1) and 2 NICs: mlx5_0 on GPU 0's root, mlx5_1 on GPU 2's."""
    yield _discover(tmp_path_factory.mktemp("h100"), h100_node("h", gpus=4, nics=2), with_nics=True)


@pytest.fixture
def fresh(tmp_path: Path) -> Node:
    """The h100 node rendered for one test, which may break its /dev and /proc."""
    return _discover(tmp_path, h100_node("h", gpus=4, nics=2), with_nics=True)


@pytest.fixture(scope="module")
def a100(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    yield _discover(tmp_path_factory.mktemp("a100"), a100_mig_node("m", gpus=1, per_gpu=2), with_nics=False)


def plan(
    device: Device, request: str = "req", config: RequestConfig | None = None, share: str | None = None
) -> PlannedDevice:
    return PlannedDevice(device, (request,), config or RequestConfig(), share)


def build(
    node: Node, planned: list[PlannedDevice], dev_root: Path | None = None
) -> tuple[cdi.Spec, dict[str, list[str]]]:
    spec, ids = claim_spec(DRIVER, UID, planned, DeviceNodes(dev_root or node.dev, node.proc), node.files)
    assert spec is not None
    cdi.validate(spec)
    return spec, ids


def device(spec: cdi.Spec, name: str) -> cdi.Device:
    return next(d for d in spec.devices if d.name == f"{UID}-{name}")


def node_paths(edits: cdi.ContainerEdits) -> list[str]:
    return [n.path for n in edits.device_nodes]


def all_node_paths(spec: cdi.Spec) -> list[str]:
    return node_paths(spec.container_edits) + [p for d in spec.devices for p in node_paths(d.container_edits)]


def all_env(spec: cdi.Spec) -> dict[str, str]:
    entries = list(spec.container_edits.env) + [e for d in spec.devices for e in d.container_edits.env]
    keys = [e.split("=", 1)[0] for e in entries]
    assert len(keys) == len(set(keys)), f"duplicate env keys: {keys}"
    return dict(e.split("=", 1) for e in entries)  # type: ignore[misc]


def exclusive(name: str) -> RequestConfig:
    return RequestConfig(nic=NicConfig(mode="exclusive", interface_name=name))


# -- GPUs ---------------------------------------------------------------------------------------


def test_gpu_claim_gets_its_nodes_control_nodes_and_driver_files(h100: Node) -> None:
    spec, ids = build(h100, [plan(h100.devices["gpu-1"]), plan(h100.devices["gpu-3"])])
    assert spec.kind == KIND
    assert node_paths(device(spec, "gpu-1").container_edits) == ["/dev/nvidia1"]
    assert node_paths(device(spec, "gpu-3").container_edits) == ["/dev/nvidia3"]
    assert node_paths(spec.container_edits) == [
        "/dev/nvidiactl",
        "/dev/nvidia-uvm",
        "/dev/nvidia-uvm-tools",
        "/dev/nvidia-modeset",
    ]
    assert "/dev/nvidia0" not in all_node_paths(spec) and "/dev/nvidia2" not in all_node_paths(spec)
    mounts = {m.container_path: m for m in spec.container_edits.mounts}
    assert set(mounts) == {c for _, c in h100.files.mounts}
    lib = mounts["/usr/lib/x86_64-linux-gnu/libcuda.so.1"]
    assert lib.host_path.endswith("libcuda.so.580.95.05")
    assert lib.options == ("ro", "nosuid", "nodev", "bind") and lib.type == ""
    env = all_env(spec)
    assert env["TANDEM_DEVICE_GPU_1"] == h100.devices["gpu-1"].gpu.uuid  # type: ignore[union-attr]
    assert "NVIDIA_VISIBLE_DEVICES" not in env and "CUDA_VISIBLE_DEVICES" not in env
    assert ids == {"gpu-1": [f"{KIND}={UID}-gpu-1"], "gpu-3": [f"{KIND}={UID}-gpu-3"]}
    assert spec.cdi_version == "0.5.0"  # the device names start with the UID's digit


def test_device_nodes_carry_the_host_numbers(h100: Node) -> None:
    spec, _ = build(h100, [plan(h100.devices["gpu-2"])])
    st = os.stat(h100.dev / "nvidia2")
    (node,) = device(spec, "gpu-2").container_edits.device_nodes
    if not stat.S_ISCHR(st.st_mode):
        pytest.skip("the simulated /dev holds plain files here (no mknod permission)")
    assert (node.type, node.major, node.minor, node.permissions) == ("c", 195, 2, "rw")
    assert node.file_mode == st.st_mode & 0o777


def test_host_path_only_when_dev_root_is_not_dev(h100: Node) -> None:
    spec, _ = build(h100, [plan(h100.devices["gpu-0"])])
    (node,) = device(spec, "gpu-0").container_edits.device_nodes
    assert (node.path, node.host_path) == ("/dev/nvidia0", str(h100.dev / "nvidia0"))
    real = DeviceNodes(Path("/dev"), Path("/proc")).node("null")
    assert real is not None and real.path == "/dev/null" and real.host_path == ""
    assert (real.type, real.major, real.minor) == ("c", 1, 3)


def test_plain_file_node_leaves_type_and_numbers_to_the_runtime(tmp_path: Path) -> None:
    (tmp_path / "nvidia0").touch()
    node = DeviceNodes(tmp_path, tmp_path / "proc").node("nvidia0")
    assert node == cdi.DeviceNode(path="/dev/nvidia0", host_path=str(tmp_path / "nvidia0"), permissions="rw")


def test_optional_nodes_are_left_out_with_a_warning(fresh: Node, caplog: pytest.LogCaptureFixture) -> None:
    """nvidia-modeset is display, rdma_cm librdmacm's: CUDA, NCCL and UCX work without them."""
    dev = fresh.dev
    (dev / "nvidia-modeset").unlink()
    (dev / "infiniband/rdma_cm").unlink()
    with caplog.at_level(logging.WARNING, logger="driver.claims.device_nodes"):
        spec, _ = build(fresh, [plan(fresh.devices["gpu-1"]), plan(fresh.devices["pci-0000-1a-00-0"])])
    assert all_node_paths(spec) == [
        "/dev/nvidiactl",
        "/dev/nvidia-uvm",
        "/dev/nvidia-uvm-tools",
        "/dev/nvidia1",
        "/dev/infiniband/uverbs0",
    ]
    assert str(dev / "nvidia-modeset") in caplog.text and str(dev / "infiniband/rdma_cm") in caplog.text


# -- device nodes made on first use, as nvidia-modprobe makes them --------------------------------

needs_mknod = pytest.mark.skipif(os.geteuid() != 0, reason="making character devices needs root (CAP_MKNOD)")


@needs_mknod
def test_lazily_made_gpu_nodes_are_created_from_proc(tmp_path: Path) -> None:
    """A fresh node has no nvidia-uvm until some CUDA process ran nvidia-modprobe: prepare makes it."""
    node = _discover(tmp_path, h100_node("h", gpus=2, nics=0), with_nics=False, lazy_nodes=True)
    assert not (node.dev / "nvidia-uvm").exists() and not (node.dev / "nvidia-uvm-tools").exists()
    (node.dev / "nvidia1").unlink()  # the GPU's own node too (major 195 is fixed)
    spec, _ = build(node, [plan(node.devices["gpu-1"])])
    made = {
        n.path: n for n in [*spec.container_edits.device_nodes, *device(spec, "gpu-1").container_edits.device_nodes]
    }
    for name, major, minor in (("nvidia-uvm", NVIDIA_UVM_MAJOR, 0), ("nvidia-uvm-tools", NVIDIA_UVM_MAJOR, 1),
                               ("nvidia1", 195, 1)):  # fmt: skip
        st = os.stat(node.dev / name)
        assert stat.S_ISCHR(st.st_mode) and (os.major(st.st_rdev), os.minor(st.st_rdev)) == (major, minor), name
        assert stat.S_IMODE(st.st_mode) == 0o666 and (st.st_uid, st.st_gid) == (0, 0), name
        n = made[f"/dev/{name}"]
        assert (n.type, n.major, n.minor, n.file_mode) == ("c", major, minor, 0o666)


@needs_mknod
def test_a_node_half_made_by_a_killed_daemon_is_made_again_whole(tmp_path: Path) -> None:
    """Killed between mknod and chmod, a daemon leaves only its temporary node, never a node with
    the umask's narrower mode: the next prepare removes the temporary one and makes the node."""
    node = _discover(tmp_path, h100_node("h", gpus=1, nics=0), with_nics=False, lazy_nodes=True)
    left = node.dev / ".nvidia-uvm.tandem-new"
    os.mknod(left, stat.S_IFCHR | 0o600, os.makedev(NVIDIA_UVM_MAJOR, 0))
    build(node, [plan(node.devices["gpu-0"])])
    assert stat.S_IMODE(os.stat(node.dev / "nvidia-uvm").st_mode) == 0o666
    assert sorted(p.name for p in node.dev.iterdir() if p.name.startswith(".")) == []


@needs_mknod
def test_lazily_made_mig_capability_nodes_take_the_access_files_mode(tmp_path: Path) -> None:
    node = _discover(tmp_path, a100_mig_node("m", gpus=1, per_gpu=2), with_nics=False, lazy_nodes=True)
    mig = node.devices["gpu-0-mig-1g-5gb-7-0"]
    assert mig.gpu is not None and not (node.dev / "nvidia-caps").exists()
    spec, _ = build(node, [plan(mig)])
    assert stat.S_IMODE(os.stat(node.dev / "nvidia-caps").st_mode) == 0o755
    for minor in mig.gpu.mig_caps:
        st = os.stat(node.dev / f"nvidia-caps/nvidia-cap{minor}")
        assert (os.major(st.st_rdev), os.minor(st.st_rdev)) == (NVIDIA_CAPS_MAJOR, minor)
        assert stat.S_IMODE(st.st_mode) == 0o444  # DeviceFileMode: 292 in its access file
    assert [n.file_mode for n in device(spec, mig.name).container_edits.device_nodes][1:] == [0o444, 0o444]


def test_missing_uvm_node_without_the_module_fails_the_claim_naming_it(fresh: Node) -> None:
    (fresh.dev / "nvidia-uvm").unlink()
    devices = (fresh.proc / "devices").read_text()
    (fresh.proc / "devices").write_text("".join(line for line in devices.splitlines(True) if "nvidia-uvm" not in line))
    with pytest.raises(ClaimSpecError, match=rf"{fresh.dev}/nvidia-uvm is missing .* no nvidia-uvm .*module loaded"):
        claim_spec(DRIVER, UID, [plan(fresh.devices["gpu-0"])], fresh.nodes, fresh.files)
    assert not (fresh.dev / "nvidia-uvm").exists()


def test_missing_gpu_node_the_driver_forbids_making_fails_the_claim(fresh: Node) -> None:
    """ModifyDeviceFiles: 0 means whoever set it manages the nodes: never make one then."""
    (fresh.dev / "nvidia2").unlink()
    params = fresh.proc / "driver/nvidia/params"
    params.write_text(params.read_text().replace("ModifyDeviceFiles: 1", "ModifyDeviceFiles: 0"))
    with pytest.raises(ClaimSpecError, match=rf"{fresh.dev}/nvidia2 is missing and the NVIDIA driver forbids"):
        claim_spec(DRIVER, UID, [plan(fresh.devices["gpu-2"])], fresh.nodes, fresh.files)
    assert not (fresh.dev / "nvidia2").exists()


@pytest.mark.parametrize(("name", "module"), [("uverbs1", "ib_uverbs"), ("umad1", "ib_umad"), ("issm1", "ib_umad")])
def test_missing_rdma_node_fails_the_claim_naming_node_and_module(fresh: Node, name: str, module: str) -> None:
    """udev makes RDMA nodes when the module registers the device: nothing Tandem may make up."""
    (fresh.dev / "infiniband" / name).unlink()
    mad = RequestConfig(nic=NicConfig(mad=True))
    with pytest.raises(ClaimSpecError, match=rf"{fresh.dev}/infiniband/{name} is missing: .*{module} kernel module"):
        claim_spec(DRIVER, UID, [plan(fresh.devices["pci-0000-22-00-0"], config=mad)], fresh.nodes, fresh.files)
    assert not (fresh.dev / "infiniband" / name).exists()


def test_rdma_node_missing_when_discovered_fails_the_claim_naming_it(tmp_path: Path) -> None:
    """Discovery names the NIC's char devices from sysfs; whether their nodes exist is prepare's to check."""
    root = tmp_path / "n"
    render_node(h100_node("h", gpus=0, nics=1), root / "sys", root / "dev")
    (root / "dev/infiniband/uverbs0").unlink()
    (nic,) = NicDiscovery(root / "sys", netlink=False).discover()
    assert nic.nic is not None and nic.nic.uverbs == "uverbs0"
    with pytest.raises(ClaimSpecError, match=rf"{root}/dev/infiniband/uverbs0 is missing: .*ib_uverbs"):
        claim_spec(DRIVER, UID, [plan(nic)], DeviceNodes(root / "dev", root / "proc"), DriverFiles())


def test_nic_without_a_uverbs_device_fails_the_claim(h100: Node) -> None:
    nic = h100.devices["pci-0000-1a-00-0"]
    assert nic.nic is not None
    unloaded = dataclasses.replace(nic, nic=dataclasses.replace(nic.nic, uverbs="", umad="", issm=""))
    with pytest.raises(ClaimSpecError, match="no uverbs device in sysfs: the ib_uverbs kernel module"):
        claim_spec(DRIVER, UID, [plan(unloaded)], h100.nodes, h100.files)
    with pytest.raises(ClaimSpecError, match=r"NicConfig\.mad needs the ib_umad kernel module"):
        bare = dataclasses.replace(nic, nic=dataclasses.replace(nic.nic, umad="", issm=""))
        claim_spec(DRIVER, UID, [plan(bare, config=RequestConfig(nic=NicConfig(mad=True)))], h100.nodes, h100.files)


def test_mig_device_without_capability_minors_fails_the_claim(a100: Node) -> None:
    mig = a100.devices["gpu-0-mig-1g-5gb-7-0"]
    assert mig.gpu is not None
    blind = dataclasses.replace(mig, gpu=dataclasses.replace(mig.gpu, mig_caps=()))
    with pytest.raises(ClaimSpecError, match="no nvidia-caps access minors"):
        claim_spec(DRIVER, UID, [plan(blind)], a100.nodes, a100.files)


def test_mig_device_gets_parent_node_and_its_two_caps(a100: Node) -> None:
    mig = a100.devices["gpu-0-mig-1g-5gb-7-0"]
    assert mig.gpu is not None
    gi, ci = mig.gpu.mig_caps
    spec, _ = build(a100, [plan(mig)])
    assert node_paths(device(spec, mig.name).container_edits) == [
        "/dev/nvidia0",
        f"/dev/nvidia-caps/nvidia-cap{gi}",
        f"/dev/nvidia-caps/nvidia-cap{ci}",
    ]
    assert all_env(spec)[f"TANDEM_DEVICE_{mig.name.upper().replace('-', '_')}"] == mig.gpu.uuid


def test_two_mig_siblings_share_the_parent_node_once(a100: Node) -> None:
    a, b = a100.devices["gpu-0-mig-1g-5gb-7-0"], a100.devices["gpu-0-mig-1g-5gb-8-0"]
    spec, _ = build(a100, [plan(a), plan(b)])
    paths = all_node_paths(spec)
    assert paths.count("/dev/nvidia0") == 1 and "/dev/nvidia0" in node_paths(spec.container_edits)
    assert node_paths(device(spec, a.name).container_edits) == [
        f"/dev/nvidia-caps/nvidia-cap{c}" for c in a.gpu.mig_caps
    ]  # type: ignore[union-attr]
    assert node_paths(device(spec, b.name).container_edits) == [
        f"/dev/nvidia-caps/nvidia-cap{c}" for c in b.gpu.mig_caps
    ]  # type: ignore[union-attr]


def test_share_ids_make_distinct_devices_and_ids(h100: Node) -> None:
    gpu = h100.devices["gpu-0"]
    spec, ids = build(h100, [plan(gpu, "a", share=SHARE_A), plan(gpu, "b", share=SHARE_B)])
    assert ids == {"gpu-0": [f"{KIND}={UID}-gpu-0-{SHARE_A}", f"{KIND}={UID}-gpu-0-{SHARE_B}"]}
    assert [d.name for d in spec.devices] == [f"{UID}-gpu-0-{SHARE_A}", f"{UID}-gpu-0-{SHARE_B}"]
    assert all_node_paths(spec).count("/dev/nvidia0") == 1  # both shares need it: spec level
    assert all(d.container_edits.env for d in spec.devices)  # still valid, non-empty devices


# -- NICs ---------------------------------------------------------------------------------------


def test_shared_nic_gets_verbs_and_rdma_cm_and_library_env(h100: Node) -> None:
    nic = h100.devices["pci-0000-1a-00-0"]
    spec, ids = build(h100, [plan(nic)])
    assert node_paths(device(spec, nic.name).container_edits) == ["/dev/infiniband/uverbs0", "/dev/infiniband/rdma_cm"]
    env = all_env(spec)
    assert env["NCCL_IB_HCA"] == "=mlx5_0"
    assert env["UCX_NET_DEVICES"] == "mlx5_0:1"
    assert "TANDEM_GPU_NIC_PAIRS" not in env and "NCCL_SOCKET_IFNAME" not in env
    assert spec.container_edits.mounts == () and "/dev/nvidiactl" not in all_node_paths(spec)
    assert version_key(spec.cdi_version) <= version_key("0.5.0")  # loads in podman 4.3.1
    assert ids == {nic.name: [f"{KIND}={UID}-{nic.name}"]}


def test_mad_adds_umad_and_issm(h100: Node) -> None:
    nic = h100.devices["pci-0000-22-00-0"]
    spec, _ = build(h100, [plan(nic, config=RequestConfig(nic=NicConfig(mad=True)))])
    assert node_paths(device(spec, nic.name).container_edits) == [
        "/dev/infiniband/uverbs1",
        "/dev/infiniband/rdma_cm",
        "/dev/infiniband/umad1",
        "/dev/infiniband/issm1",
    ]


def test_two_nics_share_rdma_cm_once_and_list_both(h100: Node) -> None:
    a, b = h100.devices["pci-0000-1a-00-0"], h100.devices["pci-0000-22-00-0"]
    spec, _ = build(h100, [plan(b), plan(a)])
    assert all_node_paths(spec).count("/dev/infiniband/rdma_cm") == 1
    env = all_env(spec)
    assert env["NCCL_IB_HCA"] == "=mlx5_0,mlx5_1"  # by PCI address without GPUs
    assert env["UCX_NET_DEVICES"] == "mlx5_0:1,mlx5_1:1"


def test_ucx_names_the_port_the_netdev_is_on(tmp_path: Path, h100: Node) -> None:
    """A two-port function whose netdev sits on port 2: UCX must be told `<rdma>:2`, not `:1`."""
    spec2 = NicSpec("0000:5b:00.0", "pci0000:5a", 0, "ens5f0np0", "b8:3f:d2:00:00:55", "mlx5_5", 5, ports=2)
    render_nic(spec2, tmp_path / "sys", tmp_path / "dev")
    fn = (tmp_path / "sys/bus/pci/devices/0000:5b:00.0").resolve()
    (fn / "infiniband/mlx5_5/ports/1/gid_attrs/ndevs/0").write_text("other\n")
    (nic,) = NicDiscovery(tmp_path / "sys", netlink=False).discover()
    assert nic.nic is not None and nic.nic.port == 2
    env = all_env(claim_spec(DRIVER, UID, [plan(nic)], DeviceNodes(tmp_path / "dev", tmp_path), h100.files)[0])  # type: ignore[arg-type]
    assert env["UCX_NET_DEVICES"] == "mlx5_5:2"


def test_exclusive_nic_moves_the_netdev_and_needs_1_1_0(h100: Node) -> None:
    nic = h100.devices["pci-0000-1a-00-0"]
    spec, _ = build(h100, [plan(nic, config=exclusive("net1"))])
    assert device(spec, nic.name).container_edits.net_devices == (cdi.NetDevice("ens1f0np0", "net1"),)
    assert spec.cdi_version == "1.1.0"
    assert "/dev/infiniband/uverbs0" in all_node_paths(spec)
    assert device(spec, nic.name).container_edits.hooks == ()  # nothing to set up in the pod


def test_exclusive_nic_settings_come_as_a_create_runtime_hook(h100: Node) -> None:
    nic = h100.devices["pci-0000-1a-00-0"]
    config = RequestConfig(nic=NicConfig(mode="exclusive", interface_name="net1", addresses=("10.9.0.5/24",), mtu=4200))
    spec, _ = build(h100, [plan(nic, config=config)])
    (hook,) = device(spec, nic.name).container_edits.hooks
    assert (hook.hook_name, hook.path) == ("createRuntime", "/bin/sh")
    assert "ip address add 10.9.0.5/24 dev net1" in hook.args[-1] and "mtu 4200" in hook.args[-1]
    cdi.validate(spec)  # what runtimes check on load


def test_exclusive_nics_with_the_same_pod_name_are_refused(h100: Node) -> None:
    a, b = h100.devices["pci-0000-1a-00-0"], h100.devices["pci-0000-22-00-0"]
    with pytest.raises(ClaimSpecError, match="net1"):
        claim_spec(
            DRIVER, UID, [plan(a, config=exclusive("net1")), plan(b, config=exclusive("net1"))], h100.nodes, h100.files
        )


def test_exclusive_nic_without_a_host_netdev_is_refused(h100: Node) -> None:
    nic = h100.devices["pci-0000-1a-00-0"]
    assert nic.nic is not None
    gone = dataclasses.replace(nic, nic=dataclasses.replace(nic.nic, present=False))
    with pytest.raises(ClaimSpecError, match="no network interface"):
        claim_spec(DRIVER, UID, [plan(gone, config=exclusive("net1"))], h100.nodes, h100.files)


# -- GPU + NIC ----------------------------------------------------------------------------------


def test_gpu_nic_pairing_follows_the_pcie_switch_in_gpu_order(h100: Node) -> None:
    d = h100.devices
    planned = [plan(d[n], "nic") for n in ("pci-0000-22-00-0", "pci-0000-1a-00-0")]
    planned += [plan(d[n], "gpu") for n in ("gpu-3", "gpu-0", "gpu-2", "gpu-1")]  # order given does not matter
    spec, _ = build(h100, planned)
    env = all_env(spec)
    # all on one root complex: gpu-0 and gpu-1 sit behind mlx5_0's switch, gpu-2 and gpu-3 behind mlx5_1's
    assert env["TANDEM_GPU_NIC_PAIRS"] == "0:mlx5_0,1:mlx5_0,2:mlx5_1,3:mlx5_1"
    assert env["NCCL_IB_HCA"] == "=mlx5_0,mlx5_1"
    assert version_key(spec.cdi_version) <= version_key("0.5.0")


def test_nccl_order_follows_the_first_gpu_that_uses_each_nic(h100: Node) -> None:
    d = h100.devices
    planned = [plan(d["gpu-2"]), plan(d["pci-0000-1a-00-0"]), plan(d["pci-0000-22-00-0"])]
    env = all_env(build(h100, planned)[0])
    assert env["TANDEM_GPU_NIC_PAIRS"] == "0:mlx5_1"
    assert env["NCCL_IB_HCA"] == "=mlx5_1,mlx5_0"
    assert env["UCX_NET_DEVICES"] == "mlx5_1:1,mlx5_0:1"


def test_pair_nics_false_gives_no_pairing_env(h100: Node) -> None:
    d = h100.devices
    off = RequestConfig(gpu=GpuConfig(pair_nics=False))
    env = all_env(build(h100, [plan(d["gpu-2"], config=off), plan(d["pci-0000-1a-00-0"])])[0])
    assert "TANDEM_GPU_NIC_PAIRS" not in env
    assert env["NCCL_IB_HCA"] == "=mlx5_0"


def test_pairing_skips_unpaired_gpus_but_keeps_their_ordinals(h100: Node) -> None:
    d = h100.devices
    off = RequestConfig(gpu=GpuConfig(pair_nics=False))
    planned = [plan(d["gpu-0"], "a", off), plan(d["gpu-2"], "b"), plan(d["pci-0000-22-00-0"], "n")]
    assert all_env(build(h100, planned)[0])["TANDEM_GPU_NIC_PAIRS"] == "1:mlx5_1"


def _gpu(name: str, bus: str, root: str, numa: int | tuple[int, ...]) -> Device:
    return Device(
        name,
        DeviceKind.GPU,
        {PCIE_ROOT: root, NUMA_NODE: numa},
        gpu=GpuInfo(minor=int(name.rsplit("-", 1)[1]), uuid=f"GPU-{name}", pci_bus_id=bus),
    )


def _nic(name: str, bus: str, root: str, numa: int) -> Device:
    return Device(name, DeviceKind.NIC, {PCIE_ROOT: root, NUMA_NODE: numa}, nic=NicInfo(bus, f"if-{name}", name))


def test_nearest_rule_balances_within_a_tier_and_falls_back_to_any() -> None:
    nics = [_nic("mlx5_1", "0000:90:00.0", "pci0000:90", 1), _nic("mlx5_0", "0000:10:00.0", "pci0000:10", 0)]
    gpus = [
        _gpu("gpu-0", "0000:11:00.0", "pci0000:11", 2),  # no NIC on NUMA 2, loads tie: lowest PCI address
        _gpu("gpu-1", "0000:12:00.0", "pci0000:12", (0, 1)),  # list form, own node first: NUMA beats load
        _gpu("gpu-2", "0000:13:00.0", "pci0000:13", 2),  # any NIC: the least used one
        _gpu("gpu-3", "0000:90:01.0", "pci0000:90", 0),  # same root beats NUMA
    ]
    pairs = pair_gpus_with_nics(gpus, nics)
    assert [(p.ordinal, p.nic.name) for p in pairs] == [(0, "mlx5_0"), (1, "mlx5_0"), (2, "mlx5_1"), (3, "mlx5_1")]
    assert [p.rule for p in pairs] == ["none", "numaNode", "none", "pcieRoot"]


def _at(device: Device, *path: str, switch: str = "") -> Device:
    attrs = {**device.attributes, PCIE_ROOT: path[0], **({PCIE_SWITCH: switch} if switch else {})}
    return dataclasses.replace(device, attributes=attrs, pcie_path=path)


def test_smallest_pcie_distance_wins_over_load_and_names_its_rule() -> None:
    """Two levels of switches below one root port: the GPU's own switch first, then the NIC behind
    the parent switch (a bridge below the root complex), then one that shares only the root."""
    root, rp, top = "pci0000:40", "0000:40:01.0", "0000:41:00.0"
    own = _at(_nic("mlx5_0", "0000:45:00.0", root, 0), root, rp, top, "0000:42:00.0", "0000:43:00.0", "0000:44:02.0",
              switch="0000:43:00.0")  # fmt: skip
    parent = _at(_nic("mlx5_1", "0000:46:00.0", root, 0), root, rp, top, "0000:42:01.0", switch="0000:41:00.0")
    far = _at(_nic("mlx5_2", "0000:50:00.0", root, 0), root, "0000:40:02.0", "0000:4f:00.0", "0000:4f:01.0",
              switch="0000:4f:00.0")  # fmt: skip
    below = (root, rp, top, "0000:42:00.0", "0000:43:00.0")
    gpus = [
        _at(_gpu(f"gpu-{i}", f"0000:45:0{i}.0", root, 0), *below, f"0000:44:0{i}.0", switch="0000:43:00.0")
        for i in range(2)
    ]
    pairs = pair_gpus_with_nics(gpus, [far, parent, own])
    assert [(p.nic.name, p.rule) for p in pairs] == [("mlx5_0", PCIE_SWITCH), ("mlx5_0", PCIE_SWITCH)]
    pairs = pair_gpus_with_nics(gpus, [far, parent])
    assert [(p.nic.name, p.rule) for p in pairs] == [("mlx5_1", "pcieBridge"), ("mlx5_1", "pcieBridge")]
    assert [(p.nic.name, p.rule) for p in pair_gpus_with_nics(gpus[:1], [far])] == [("mlx5_2", "pcieRoot")]


def test_whole_claim_has_unique_nodes_and_env_keys(h100: Node, a100: Node) -> None:
    d = h100.devices
    planned = [
        plan(d["gpu-0"], "a", share=SHARE_A),
        plan(d["gpu-0"], "b", share=SHARE_B),
        plan(d["gpu-1"], "c"),
        plan(d["pci-0000-1a-00-0"], "n", RequestConfig(nic=NicConfig(mad=True))),
        plan(d["pci-0000-22-00-0"], "n"),
    ]
    spec, ids = build(h100, planned)
    paths = all_node_paths(spec)
    assert len(paths) == len(set(paths)), paths
    all_env(spec)  # asserts unique keys
    assert set(ids) == {"gpu-0", "gpu-1", "pci-0000-1a-00-0", "pci-0000-22-00-0"}


def test_spec_round_trips_through_the_cdi_writer(h100: Node, tmp_path: Path) -> None:
    d = h100.devices
    spec, _ = build(h100, [plan(d["gpu-0"]), plan(d["pci-0000-1a-00-0"])])
    name = claim_spec_filename(DRIVER, UID)
    assert name == f"k8s.{DRIVER}-claim_{UID}.json"
    path = cdi.write_spec(tmp_path, spec, name)
    assert cdi.read_spec(path) == spec
    assert cdi.list_specs(tmp_path, f"k8s.{DRIVER}", "claim") == [path]


def test_no_devices_no_spec(h100: Node) -> None:
    assert claim_spec(DRIVER, UID, [], h100.nodes, h100.files) == (None, {})


def test_device_without_hardware_info_is_refused(h100: Node) -> None:
    bare = Device("gpu-9", DeviceKind.GPU)
    with pytest.raises(ClaimSpecError, match="gpu-9"):
        claim_spec(DRIVER, UID, [plan(bare)], h100.nodes, h100.files)
