"""Render a simulated RDMA NIC into sysfs and /dev, laid out the way the kernel lays out mlx5.

Under the PCI function `devices/.../<bdf>/` (made by `sim.fstree.pci_device_dir`):

* `net/<ifname>/{address,mtu,speed,operstate,carrier,type,dev_port}` and `device` -> the function;
  `class/net/<ifname>` is a relative link to it. An empty `ifname` renders no netdev (an
  InfiniBand function without IPoIB). The carrier's history, `carrier_up_count`,
  `carrier_down_count` and `carrier_changes` (their sum, as the kernel counts), starts at one rise
  for a netdev that is up and none for one that is not.
* `net/<ifname>/tandem-sim-addresses`: the NIC's addresses, one CIDR per line. Linux has no such
  file (addresses live in netlink only); discovery reads it only when told the node is simulated.
* `infiniband/<rdma_device>/ports/<p>/{state,link_layer,gid_attrs/ndevs/0}` (GID 0 of every port
  names the netdev) and `device`; `class/infiniband/<rdma_device>` links to it. A RoCE port's
  `gids/0` is the default GID the kernel derives from the netdev's MAC (fe80::EUI-64).
* `infiniband/<rdma_device>/fw_ver`, and per port `rate` ("400 Gb/sec (4X NDR)": the IB width and
  lane speed mlx5 reports for the link's speed), the PMA counters `counters/<name>` (`PORT_COUNTERS`)
  and mlx5's `hw_counters/<name>` (`HW_COUNTERS`, and the `lifespan` setting in ms).
* `infiniband_verbs/uverbs<N>/{ibdev,dev}`, `infiniband_mad/umad<M>/{ibdev,port,dev}` and
  `issm<M>` likewise, with `class/infiniband_verbs/...` and `class/infiniband_mad/...` links.
  Port p uses M = uverbs_index + 32 * (p - 1), so single-port NICs have umad<N> == uverbs<N>.
* SR-IOV: `sriov_totalvfs`/`sriov_numvfs` on a PF, `physfn` on a VF and `virtfn<k>` on its PF
  (render PFs before their VFs: the VF adds itself to the PF's next free `virtfn<k>`).
* `/dev/infiniband/{uverbs<N>,umad<M>,issm<M>,rdma_cm}`: character devices with the kernel's
  numbers (231:192+N, 231:M, 231:64+M; rdma_cm is a dynamic misc minor, 10:58 here) when we may
  `mknod`, empty files otherwise.

`unplug_nic` hot-removes a rendered NIC the way the kernel does (`render_nic` puts it back).
Counters (the carrier's, the ports') are the running node's: rendering again keeps them
(`sim.fstree.write_once`), and `sim.grey` raises them.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from sim.fstree import char_device, pci_device_dir, symlink, write, write_once
from sim.profile import NicSpec

SIM_ADDRESSES_FILE = "tandem-sim-addresses"
IB_MAJOR = 231
UVERBS_BASE_MINOR = 192
ISSM_BASE_MINOR = 64
MISC_MAJOR = 10
RDMA_CM_MINOR = 58
UMAD_PORT_STRIDE = 32
ARPHRD_ETHER = 1
ARPHRD_INFINIBAND = 32

# The PMA counters of a port (`counters/`) and their widths in bits (IBTA PortCounters; the data
# counters from PortCountersExtended): each stops at its largest value.
PORT_COUNTERS = {
    "symbol_error": 16,
    "link_error_recovery": 8,
    "link_downed": 8,
    "port_rcv_errors": 16,
    "local_link_integrity_errors": 4,
    "excessive_buffer_overrun_errors": 4,
    "port_xmit_discards": 16,
    "port_xmit_wait": 32,
    "port_rcv_data": 64,
    "port_xmit_data": 64,
}
# mlx5's `hw_counters/` and their widths: the queue counters' 32 bits and the congestion
# counters' (np_*, rp_*) 64 wrap around.
HW_COUNTERS = {
    "out_of_sequence": 32,
    "packet_seq_err": 32,
    "implied_nak_seq_err": 32,
    "local_ack_timeout_err": 32,
    "req_transport_retries_exceeded": 32,
    "duplicate_request": 32,
    "rnr_nak_retry_err": 32,
    "out_of_buffer": 32,
    "np_ecn_marked_roce_packets": 64,
    "np_cnp_sent": 64,
    "rp_cnp_handled": 64,
    "rp_cnp_ignored": 64,
}
HW_LIFESPAN_MS = 10  # `hw_counters/lifespan`: how long mlx5 keeps a read's values, a setting
# Tenths of a Gb/s per lane of each IB speed, and the width and speed mlx5 reports for an
# Ethernet link of each speed in Mb/s (drivers/infiniband/core/sysfs.c, drivers/infiniband/hw/mlx5).
_LANE_RATES = {"SDR": 25, "DDR": 50, "QDR": 100, "FDR": 140, "EDR": 250, "HDR": 500, "NDR": 1000, "XDR": 2000}
_IB_LINKS = {
    10000: (1, "QDR"),
    25000: (1, "EDR"),
    40000: (4, "QDR"),
    50000: (2, "EDR"),
    100000: (4, "EDR"),
    200000: (4, "HDR"),
    400000: (4, "NDR"),
    800000: (8, "NDR"),
}


def umad_index(nic: NicSpec, port: int) -> int:
    return nic.uverbs_index + UMAD_PORT_STRIDE * (port - 1)


def default_gid(mac: str) -> str:
    """The kernel's default RoCE GID of a netdev (`make_default_gid`): fe80::/64 and the modified
    EUI-64 of its MAC (universal/local bit flipped, ff:fe in the middle), as sysfs spells GIDs."""
    b = bytes.fromhex(mac.replace(":", ""))
    eui = bytes([b[0] ^ 0x02, b[1], b[2], 0xFF, 0xFE, b[3], b[4], b[5]])
    return "fe80:0000:0000:0000:" + ":".join(eui[i : i + 2].hex() for i in range(0, 8, 2))


def rate_string(mbps: int) -> str:
    """A port's `rate` as the kernel prints it for a link of `mbps`; a speed no IB width and lane
    speed make (a link down) as the kernel's default, 1X SDR."""
    width, speed = _IB_LINKS.get(mbps, (1, "SDR"))
    tenths = _LANE_RATES[speed] * width
    return f"{tenths // 10}{'.5' if tenths % 10 else ''} Gb/sec ({width}X {speed})\n"


def render_netdev(fn: Path, sysfs_root: Path, nic: NicSpec, ifname: str, dev_port: int = 0) -> Path:
    """One netdev of the function `fn`; a multi-port function gets one per port (`dev_port`)."""
    net = fn / "net" / ifname
    ib = nic.link_layer == "InfiniBand"
    write(net / "address", f"{nic.mac}\n")
    write(net / "mtu", f"{nic.mtu}\n")
    write(net / "speed", f"{nic.speed_mbps}\n")
    write(net / "operstate", f"{nic.operstate}\n")
    write(net / "carrier", "1\n" if nic.operstate == "up" else "0\n")
    write(net / "type", f"{ARPHRD_INFINIBAND if ib else ARPHRD_ETHER}\n")
    write(net / "dev_port", f"{dev_port}\n")
    up = 1 if nic.operstate == "up" else 0
    write_once(net / "carrier_up_count", f"{up}\n")
    write_once(net / "carrier_down_count", "0\n")
    write_once(net / "carrier_changes", f"{up}\n")
    write(net / SIM_ADDRESSES_FILE, "".join(f"{a}\n" for a in [*nic.ipv4, *nic.ipv6]))
    symlink(net / "device", fn)
    symlink(sysfs_root / "class" / "net" / ifname, net)
    return net


def render_nic(nic: NicSpec, sysfs_root: Path, dev_root: Path) -> None:
    sysfs_root, dev_root = Path(sysfs_root), Path(dev_root)
    fn = pci_device_dir(
        sysfs_root,
        nic.pci_address,
        nic.pcie_root,
        nic.numa_node,
        nic.vendor_id,
        nic.device_id,
        nic.driver or None,
        bridges=nic.pcie_bridges,
    )
    if nic.ifname:
        render_netdev(fn, sysfs_root, nic, nic.ifname)

    rdma = fn / "infiniband" / nic.rdma_device
    write(rdma / "fw_ver", f"{nic.fw_ver}\n")
    for port in range(1, nic.ports + 1):
        port_dir = rdma / "ports" / str(port)
        write(port_dir / "state", f"{nic.port_state}\n")
        write(port_dir / "link_layer", f"{nic.link_layer}\n")
        write(port_dir / "rate", rate_string(nic.speed_mbps))
        for name in PORT_COUNTERS:
            write_once(port_dir / "counters" / name, "0\n")
        for name in HW_COUNTERS:
            write_once(port_dir / "hw_counters" / name, "0\n")
        write_once(port_dir / "hw_counters" / "lifespan", f"{HW_LIFESPAN_MS}\n")
        write(port_dir / "gid_attrs" / "ndevs" / "0", f"{nic.ifname}\n")
        if nic.link_layer == "Ethernet" and nic.mac:
            write(port_dir / "gids" / "0", f"{default_gid(nic.mac)}\n")
    symlink(rdma / "device", fn)
    symlink(sysfs_root / "class" / "infiniband" / nic.rdma_device, rdma)

    use_mknod = os.geteuid() == 0
    uverbs = f"uverbs{nic.uverbs_index}"
    _class_entry(fn, sysfs_root, "infiniband_verbs", uverbs, nic.rdma_device, None, UVERBS_BASE_MINOR)
    use_mknod = char_device(dev_root / "infiniband" / uverbs, IB_MAJOR, UVERBS_BASE_MINOR + nic.uverbs_index, use_mknod)
    for port in range(1, nic.ports + 1):
        m = umad_index(nic, port)
        for name, minor in ((f"umad{m}", m), (f"issm{m}", ISSM_BASE_MINOR + m)):
            _class_entry(fn, sysfs_root, "infiniband_mad", name, nic.rdma_device, port, minor)
            char_device(dev_root / "infiniband" / name, IB_MAJOR, minor, use_mknod)
    char_device(dev_root / "infiniband" / "rdma_cm", MISC_MAJOR, RDMA_CM_MINOR, use_mknod)

    if nic.is_vf and nic.physfn:
        _link_vf(fn, sysfs_root, nic.physfn)
    elif nic.sriov_totalvfs > 0:
        write(fn / "sriov_totalvfs", f"{nic.sriov_totalvfs}\n")
        write(fn / "sriov_numvfs", f"{nic.sriov_numvfs}\n")


def unplug_nic(nic: NicSpec, sysfs_root: Path, dev_root: Path) -> None:
    """What a hot-remove (or, for a VF, lowering its PF's `sriov_numvfs`) leaves: the PCI
    function's directory goes with everything under it (netdevs, RDMA device, char device
    entries), and so do the links to it (`bus/pci/devices`, its driver's, `class/*`, the PF's
    `virtfn<k>`) and the char device nodes of its RDMA device."""
    sysfs_root, dev_root = Path(sysfs_root), Path(dev_root)
    listed = sysfs_root / "bus" / "pci" / "devices" / nic.pci_address
    fn = listed.resolve()
    links = [*(sysfs_root / "class").glob("*/*"), *(sysfs_root / "bus" / "pci" / "drivers").glob("*/*")]
    if (fn / "physfn").is_symlink():
        links += (fn / "physfn").resolve().glob("virtfn*")
    for link in links:
        if link.is_symlink() and link.resolve().is_relative_to(fn):
            link.unlink()
    listed.unlink()
    shutil.rmtree(fn)
    nodes = [f"uverbs{nic.uverbs_index}"]
    for port in range(1, nic.ports + 1):
        nodes += [f"umad{umad_index(nic, port)}", f"issm{umad_index(nic, port)}"]
    for name in nodes:
        (dev_root / "infiniband" / name).unlink(missing_ok=True)


def _class_entry(fn: Path, sysfs_root: Path, cls: str, name: str, ibdev: str, port: int | None, minor: int) -> None:
    entry = fn / cls / name
    write(entry / "ibdev", f"{ibdev}\n")
    write(entry / "dev", f"{IB_MAJOR}:{minor}\n")
    if port is not None:
        write(entry / "port", f"{port}\n")
    symlink(entry / "device", fn)
    symlink(sysfs_root / "class" / cls / name, entry)


def _link_vf(vf: Path, sysfs_root: Path, physfn: str) -> None:
    pf_link = sysfs_root / "bus" / "pci" / "devices" / physfn
    pf = pf_link.resolve() if pf_link.exists() else pf_link
    symlink(vf / "physfn", pf)
    if not pf.is_dir():
        return
    taken = {p.resolve() for p in pf.glob("virtfn*")}
    if vf.resolve() in taken:
        return
    k = 0
    while (pf / f"virtfn{k}").is_symlink():
        k += 1
    symlink(pf / f"virtfn{k}", vf)
