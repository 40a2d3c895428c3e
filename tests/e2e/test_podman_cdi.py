"""Proof in a real container runtime: the CDI ids prepare returns work in Debian 12's podman 4.3.1.

The daemon runs as a real process against the simulated cluster and node; the test plays the
kubelet and then does what the container runtime does with the answer: `podman run --device <id>`.
Inside the container it checks the device nodes, the environment and the metadata file, and that
the image's own dynamic loader finds the driver's libraries. Needs root (podman with runc, device
nodes made with mknod, /var/run/cdi).
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import tarfile
import uuid
from pathlib import Path

import pytest

from sim.driver_files import render_driver_files
from sim.kubelet import ClaimRef, KubeletSim
from sim.profile import h100_node
from sim.scheduler import Request, allocate, attribute, claim_object, published_devices

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: podman with runc, mknod, /var/run/cdi")

CDI_ROOT = Path("/var/run/cdi")  # podman 4.3.1 reads only /etc/cdi and /var/run/cdi
IMAGE = "localhost/tandem-busybox:e2e"
GLIBC_IMAGE = "localhost/tandem-glibc:e2e"
LOADER = "/lib64/ld-linux-x86-64.so.2"  # the ELF interpreter path of every x86-64 glibc program
PODMAN = [
    "podman", "--runtime", "/usr/sbin/runc", "--cgroup-manager", "cgroupfs", "run", "--rm", "--network", "none",
    "--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024",
]  # fmt: skip
GPU = Request("gpu", "gpu.tandem.dev", lambda d: attribute(d, "type") == "gpu")
NIC = Request("nic", "nic.tandem.dev", lambda d: attribute(d, "type") == "nic")


def _ensure_runtime() -> None:
    missing = [
        p for p, binary in (("runc", "/usr/sbin/runc"), ("busybox-static", "/bin/busybox")) if not Path(binary).exists()
    ]
    if shutil.which("podman") is None:
        missing.append("podman")
    if missing:
        if shutil.which("apt-get") is None:
            pytest.skip(f"needs {missing} and apt-get is not available to install them")
        subprocess.run(["apt-get", "update", "-qq"], check=True, capture_output=True, timeout=600)
        subprocess.run(["apt-get", "install", "-y", "-qq", *missing], check=True, capture_output=True, timeout=600,
                       env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})  # fmt: skip


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A busybox image made with `podman import`, as docs/reference/cdi.md describes ('Older runtimes'): no registry is needed."""
    _ensure_runtime()
    root = tmp_path_factory.mktemp("rootfs")
    for d in ("bin", "dev", "proc", "sys", "etc", "tmp", "usr/bin", "usr/lib/x86_64-linux-gnu"):
        (root / d).mkdir(parents=True, exist_ok=True)
    busybox = Path("/bin/busybox") if Path("/bin/busybox").exists() else Path(shutil.which("busybox") or "")
    shutil.copy2(busybox, root / "bin/busybox")
    for applet in ("sh", "ls", "cat", "env", "test", "grep", "stat"):
        (root / "bin" / applet).symlink_to("busybox")
    tar = root.parent / "rootfs.tar"
    with tarfile.open(tar, "w") as t:
        t.add(root, arcname=".")
    subprocess.run(["podman", "import", "-q", str(tar), IMAGE], check=True, capture_output=True, timeout=120)
    return IMAGE


@pytest.fixture(scope="module")
def glibc_image(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Busybox plus a glibc loader, libc and one dynamic program (this machine's Debian ones), with
    an ld.so.cache made by ldconfig for that tree: it lists the image's own libraries and nothing
    under /usr/lib64, a directory this loader does not search on its own."""
    _ensure_runtime()
    if platform.machine() != "x86_64" or not Path(LOADER).exists() or shutil.which("ldconfig") is None:
        pytest.skip("needs an x86-64 glibc host with ldconfig to build the image from")
    root = tmp_path_factory.mktemp("glibc-rootfs")
    for d in ("bin", "dev", "proc", "sys", "etc", "tmp", "lib64", "usr/bin", "lib/x86_64-linux-gnu"):
        (root / d).mkdir(parents=True, exist_ok=True)
    shutil.copy2(Path("/bin/busybox").resolve(), root / "bin/busybox")
    for applet in ("sh", "cat", "grep", "echo"):
        (root / "bin" / applet).symlink_to("busybox")
    shutil.copy2(Path(LOADER).resolve(), root / LOADER.lstrip("/"))
    libc = Path(subprocess.run(["ldd", "/usr/bin/true"], capture_output=True, text=True, check=True).stdout.split(
        "libc.so.6 => ", 1)[1].split()[0])  # fmt: skip
    shutil.copy2(libc.resolve(), root / "lib/x86_64-linux-gnu/libc.so.6")
    shutil.copy2("/usr/bin/true", root / "usr/bin/true")
    (root / "etc/ld.so.conf").write_text("")
    subprocess.run(["ldconfig", "-r", str(root)], check=True, capture_output=True, timeout=60)
    cache = subprocess.run(["ldconfig", "-p", "-C", str(root / "etc/ld.so.cache")], capture_output=True, text=True,
                           check=True).stdout  # fmt: skip
    assert "libc.so.6" in cache and "/usr/lib64" not in cache and "libcuda" not in cache, cache
    tar = root.parent / "glibc-rootfs.tar"
    with tarfile.open(tar, "w") as t:
        t.add(root, arcname=".")
    subprocess.run(["podman", "import", "-q", str(tar), GLIBC_IMAGE], check=True, capture_output=True, timeout=120)
    return GLIBC_IMAGE


def _run(image: str, cdi_ids: list[str], script: str) -> str:
    args = [*PODMAN]
    for i in cdi_ids:
        args += ["--device", i]
    proc = subprocess.run([*args, image, "sh", "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"podman failed ({proc.returncode}): {proc.stderr}\n{proc.stdout}"
    return proc.stdout


@pytest.fixture
def e2e_with(apiserver, sim_node, start_daemon):
    """Starts a daemon (extra flags, a function of the node) with a unique driver name, so its CDI
    specs in /var/run/cdi cannot clash with anything."""
    started = []

    def start(flags=lambda node: ()):  # type: ignore[no-untyped-def]
        driver = f"e2e-{uuid.uuid4().hex[:8]}.tandem.dev"
        node = sim_node(h100_node("node-e2e", gpus=2, nics=2))
        daemon = start_daemon(node, "--driver-name", driver, "--cdi-root", str(CDI_ROOT), *flags(node))
        kubelet = KubeletSim(node.registry)
        started.append((driver, daemon, kubelet))
        kubelet.register(kubelet.wait_for_registration_socket(driver, timeout=60))
        assert apiserver.wait_for(lambda: len(published_devices(apiserver, driver, node.profile.name)) >= 4, 60)
        return driver, node, daemon, kubelet

    yield start
    for driver, daemon, kubelet in started:
        kubelet.close()
        daemon.stop()
        for spec in CDI_ROOT.glob(f"*{driver}*"):
            spec.unlink()


@pytest.fixture
def e2e(e2e_with):
    return e2e_with()


def _prepare(apiserver, driver, node, kubelet, name, *requests, match=""):
    claim = apiserver.create(claim_object("default", name, list(requests), match))
    allocate(apiserver, claim, driver, node.profile.name, list(requests), match)
    ref = ClaimRef("default", name, claim["metadata"]["uid"])
    result = kubelet.prepare([ref])[ref.uid]
    assert result.error == ""
    return ref, result


def _ids(result) -> list[str]:
    return [i for d in result.devices for i in d.cdi_device_ids]


def test_gpu_claim_in_a_real_container(apiserver, e2e, image):
    driver, node, _, kubelet = e2e
    # As on a node where no CUDA process ran yet: nvidia-modprobe has not made these.
    assert not (node.dev / "nvidia-uvm").exists() and not (node.dev / "nvidia-uvm-tools").exists()
    ref, result = _prepare(apiserver, driver, node, kubelet, "gpu-claim", GPU)
    minor = int(result.devices[0].device_name.split("-")[1])
    out = _run(image, _ids(result), f"""
        test -c /dev/nvidia{minor} && echo node-ok
        test -c /dev/nvidiactl && echo ctl-ok
        test -c /dev/nvidia-uvm && test -c /dev/nvidia-uvm-tools && echo uvm-ok
        test -e /dev/nvidia{1 - minor} || echo other-gpu-hidden
        /usr/bin/nvidia-smi
        test -r /usr/lib/x86_64-linux-gnu/libcuda.so.1 && echo libcuda-ok
        echo ---metadata---
        cat /var/run/kubernetes.io/dra-device-attributes/resourceclaims/gpu-claim/gpu/{driver}-metadata.json
    """)  # fmt: skip
    assert "node-ok" in out and "ctl-ok" in out and "uvm-ok" in out
    assert "other-gpu-hidden" in out and "libcuda-ok" in out
    assert f"GPU 0: Simulated NVIDIA GPU (device: /dev/nvidia{minor})" in out
    meta = json.JSONDecoder().raw_decode(out.split("---metadata---", 1)[1].strip())[0]
    assert meta["kind"] == "DeviceMetadata" and meta["metadata"]["uid"] == ref.uid
    assert meta["requests"][0]["devices"][0]["name"] == result.devices[0].device_name
    assert kubelet.unprepare([ref]) == {ref.uid: ""}
    assert not list(CDI_ROOT.glob(f"*{ref.uid}*"))


def test_nic_claim_in_a_real_container(apiserver, e2e, image):
    driver, node, _, kubelet = e2e
    ref, result = _prepare(apiserver, driver, node, kubelet, "nic-claim", NIC)
    dev = next(d for d in published_devices(apiserver, driver, node.profile.name)
               if d["name"] == result.devices[0].device_name)  # fmt: skip
    rdma = attribute(dev, "rdmaDevice")
    out = _run(image, _ids(result), "ls /dev/infiniband; env")
    assert "rdma_cm" in out and "uverbs" in out
    assert "NCCL_IB_HCA==" in out.replace(f"={rdma}", "=" + rdma) or rdma in out
    status = apiserver.get("resourceclaims", "nic-claim", "default")["status"]["devices"]
    assert status[0]["networkData"]["interfaceName"] == attribute(dev, "ifName")
    assert status[0]["conditions"][0]["type"] == "Ready"
    assert kubelet.unprepare([ref]) == {ref.uid: ""}


def test_gpu_and_nic_pair_in_a_real_container(apiserver, e2e, image):
    driver, node, _, kubelet = e2e
    ref, result = _prepare(apiserver, driver, node, kubelet, "pair", GPU, NIC, match="resource.kubernetes.io/pcieRoot")
    out = _run(image, _ids(result), "env; ls /dev /dev/infiniband")
    nic = next(d for d in result.devices if d.device_name.startswith("pci-"))
    dev = next(d for d in published_devices(apiserver, driver, node.profile.name) if d["name"] == nic.device_name)
    assert f"TANDEM_GPU_NIC_PAIRS=0:{attribute(dev, 'rdmaDevice')}" in out.splitlines()
    assert "rdma_cm" in out and "nvidia" in out
    assert kubelet.unprepare([ref]) == {ref.uid: ""}


def test_an_rpm_hosts_libraries_load_in_an_image_whose_cache_does_not_list_them(apiserver, e2e_with, glibc_image):
    """The driver of a RHEL-style host lives in /usr/lib64, which a Debian-built image's loader never
    searches and whose ld.so.cache does not list: the image's own loader must still find it."""

    def rpm_driver_root(node):  # type: ignore[no-untyped-def]
        root = node.root / "nvidia-rpm"
        render_driver_files(root, lib_dir="usr/lib64")
        return ("--nvidia-driver-root", str(root))

    driver, node, _, kubelet = e2e_with(rpm_driver_root)
    ref, result = _prepare(apiserver, driver, node, kubelet, "loader-claim", GPU)
    out = _run(glibc_image, _ids(result), f"""
        {LOADER} --preload "libcuda.so.1 libnvidia-ml.so.1" --list /usr/bin/true 2>&1
        LD_PRELOAD="libcuda.so.1 libnvidia-ml.so.1" /usr/bin/true 2>&1 && echo ran-ok
    """)  # fmt: skip
    assert "cannot be preloaded" not in out, out
    for lib in ("libcuda.so.1", "libnvidia-ml.so.1"):
        assert f"{lib} => /usr/lib/x86_64-linux-gnu/{lib} " in out, out
    assert "ran-ok" in out
    assert kubelet.unprepare([ref]) == {ref.uid: ""}
