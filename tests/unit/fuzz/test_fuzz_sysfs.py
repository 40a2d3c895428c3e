"""Fuzzing the readers of sysfs values: NIC attributes (driver/discovery/nic/sysfs.py), link and
RDMA port state (driver/health/nic/link_sysfs.py), NUMA and CPU topology
(driver/discovery/topology.py) and PCIe config space and device links (driver/discovery/pcie.py).

sysfs is the kernel's, but a kernel bug, a half-removed device or a test tree can put anything in
a file, and a netdev's name is a tenant's choice once its NIC is in a pod. The property: any
content of a file, any name of an entry, gives the reader's documented value or the error its
callers catch (`nic.sysfs.BROKEN`; `ValueError` of `pci_bus_id`); the soft readers (topology,
link state) raise nothing at all.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from fuzzing import fuzz, raises_only
from hypothesis import example
from hypothesis import strategies as st

from driver.discovery import pcie, topology
from driver.discovery.nic import sysfs as nic_sysfs
from driver.health.nic.link_sysfs import LinkSysfs
from driver.node.rtnl import LinkState

BDF = "0000:17:00.0"

# What a sysfs file may hold: numbers in every spelling, text that is not UTF-8, and junk.
contents = (
    st.sampled_from(
        [b"", b"0\n", b"-1\n", b"0x15b3\n", b"4: ACTIVE\n", b"0-3,8\n", b"10 21\n", b"\xff\xfe", b"1" * 5000]
    )
    | st.from_regex(rb"\A[ \t\n]*-?(0x)?[0-9a-fA-F,:\- ]{0,40}[ \t\n]*\Z")
    | st.text(max_size=40).map(str.encode)
    | st.binary(max_size=64)
)
# Names of entries sysfs lists (a port, a NUMA node): digits as `str.isdigit` takes them too.
entry_names = st.from_regex(r"\A[0-9]{1,6}\Z") | st.text(
    alphabet="0123456789\u00b2\u00b3\u0663\u07c0", min_size=1, max_size=6
)


@pytest.fixture(scope="module")
def root() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="fuzz-sysfs-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _tree(root: Path, files: dict[str, bytes]) -> Path:
    """A fresh sysfs tree under `root` holding `files` (relative paths)."""
    tree = root / "sys"
    shutil.rmtree(tree, ignore_errors=True)
    for rel, data in files.items():
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        (tree / rel).write_bytes(data)
    return tree


@fuzz(contents)
def test_nic_attribute_readers_give_a_value_or_a_broken_entry(root: Path, data: bytes) -> None:
    path = _tree(root, {"value": data}) / "value"
    for read in (nic_sysfs.read, nic_sysfs.read_or_empty, nic_sysfs.hex_id):
        assert isinstance(raises_only(nic_sysfs.BROKEN, lambda read=read: read(path)) or "", str)
    number = raises_only(nic_sysfs.BROKEN, lambda: nic_sysfs.read_int(path))
    assert number is None or isinstance(number, int)


@fuzz(contents, contents, contents, contents)
def test_a_netdevs_link_state_is_read_or_not_judged(
    root: Path, operstate: bytes, flags: bytes, ifindex: bytes, carrier: bytes
) -> None:
    net = "class/net/eth0"
    files = {f"{net}/operstate": operstate, f"{net}/flags": flags, f"{net}/ifindex": ifindex, f"{net}/carrier": carrier}
    errors: list[None] = []
    state = LinkSysfs(_tree(root, files), lambda: errors.append(None)).link("eth0")
    assert state is None or (isinstance(state, LinkState) and isinstance(state.index, int))


@example(names=["\u00b2"], states=[b"4: ACTIVE"])
@fuzz(st.lists(entry_names, max_size=3, unique=True), st.lists(contents, min_size=3, max_size=3))
def test_rdma_ports_are_read_or_left_out(root: Path, names: list[str], states: list[bytes]) -> None:
    files = {}
    for name, state in zip(names, states, strict=False):
        files[f"class/infiniband/mlx5_0/ports/{name}/state"] = state
        files[f"class/infiniband/mlx5_0/ports/{name}/phys_state"] = states[-1]
    ports = LinkSysfs(_tree(root, files), lambda: None).ports("mlx5_0")
    assert all(isinstance(port, int) for port in ports)


@example(nodes=["0", "\u00b2"], numa=b"0", distance=b"10 21", cpulist=b"0-3", package=b"0")
@fuzz(st.lists(entry_names, max_size=3, unique=True), contents, contents, contents, contents)
def test_the_numa_topology_of_a_function_is_read_or_left_out(
    root: Path, nodes: list[str], numa: bytes, distance: bytes, cpulist: bytes, package: bytes
) -> None:
    files = {f"bus/pci/devices/{BDF}/numa_node": numa}
    for name in ["0", *nodes]:
        files[f"devices/system/node/node{name}/distance"] = distance
        files[f"devices/system/node/node{name}/cpulist"] = cpulist
    files["devices/system/cpu/cpu0/topology/physical_package_id"] = package
    tree = _tree(root, files)
    node = topology.numa_node(tree, BDF)
    assert node is None or (isinstance(node, int) and 0 <= node <= topology.MAX_NUMA_NODE)
    assert all(isinstance(n, int) for n in topology.numa_node_list(tree, node or 0))


@fuzz(st.text(max_size=40) | st.binary(max_size=40))
def test_a_pci_bus_id_is_canonical_or_refused(raw: str | bytes) -> None:
    bdf = raises_only((ValueError,), lambda: topology.pci_bus_id(raw))
    assert bdf is None or topology.is_pci_bus_id(bdf)


@fuzz(st.binary(max_size=300), st.integers(0, 0xFF), st.integers(0, 0xFF))
def test_the_port_type_of_any_config_space_is_a_nibble_or_none(config: bytes, pointer: int, status: int) -> None:
    """Config spaces with a capability list (status bit and pointer set), so that the walk is
    fuzzed, not only refused at its first check."""
    if len(config) > 0x40:
        config = config[:6] + bytes([status | 0x10]) + config[7:0x34] + bytes([pointer]) + config[0x35:]
    found = pcie.port_type(config)
    assert found is None or 0 <= found <= 0xF


@fuzz(st.lists(st.sampled_from(["..", ".", "devices", "pci0000:15", "0000:16:00.0", BDF, "", "/", "x"]), max_size=8))
def test_a_device_link_gives_a_path_below_devices_or_none(root: Path, parts: list[str]) -> None:
    tree = _tree(root, {})
    (tree / "bus/pci/devices").mkdir(parents=True)
    os.symlink("/".join(parts) or ".", tree / "bus/pci/devices" / BDF)
    path = pcie.pcie_path(tree, BDF)
    assert path is None or (path.root.startswith("pci") and ".." not in path.nodes)
    assert isinstance(topology.topology(tree, BDF, list_form=True), topology.Topology)
