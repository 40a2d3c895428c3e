"""The NVIDIA user-space driver files found under a driver root: libraries, binaries, firmware."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from driver.node.driver_root import DriverFiles, find_driver_files
from sim.driver_files import render_driver_files

VERSION = "580.95.05"
LIBS = "usr/lib/x86_64-linux-gnu"


@pytest.fixture
def root(tmp_path: Path) -> Path:
    r = tmp_path / "driver"
    render_driver_files(r, VERSION)
    return r


def mounts(files: DriverFiles) -> dict[str, str]:
    """container path -> host path"""
    return {c: h for h, c in files.mounts}


def test_host_paths_are_rerooted_where_the_runtime_finds_the_driver(root: Path) -> None:
    """The daemon sees the host's driver at /driver-root; the runtime resolves CDI host paths on the host."""
    files = find_driver_files(root, host_root=Path("/"))
    lib = next(h for h, c in files.libraries if c.endswith(f"libcuda.so.{VERSION}"))
    assert lib == f"/{LIBS}/libcuda.so.{VERSION}"
    assert [c for _, c in files.mounts] == [c for _, c in find_driver_files(root).mounts]


def test_simulated_tree_yields_libraries_binaries_and_firmware(root: Path) -> None:
    files = find_driver_files(root)
    m = mounts(files)
    real = f"{root}/{LIBS}/libcuda.so.{VERSION}"
    assert files.version == VERSION
    # the real file at its own path, and the soname and development links at theirs, all the real file
    for name in (f"libcuda.so.{VERSION}", "libcuda.so.1", "libcuda.so"):
        assert m[f"/{LIBS}/{name}"] == real
    assert m[f"/{LIBS}/libnvidia-ml.so.1"] == f"{root}/{LIBS}/libnvidia-ml.so.{VERSION}"
    assert m[f"/{LIBS}/libnvidia-nvvm.so.4"] == f"{root}/{LIBS}/libnvidia-nvvm.so.{VERSION}"
    assert f"/{LIBS}/libnvidia-gpucomp.so.{VERSION}" in m
    assert {c for _, c in files.binaries} == {
        "/usr/bin/nvidia-smi",
        "/usr/bin/nvidia-debugdump",
        "/usr/bin/nvidia-persistenced",
        "/usr/bin/nvidia-cuda-mps-control",
        "/usr/bin/nvidia-cuda-mps-server",
    }
    assert files.firmware == ((f"{root}/lib/firmware/nvidia/{VERSION}", f"/lib/firmware/nvidia/{VERSION}"),)
    assert len(set(m)) == len(files.mounts)  # no container path twice


# The loader's own search path, without ld.so.cache: Debian/Ubuntu, RHEL/UBI/Fedora/SUSE, Arch.
LOADER_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib")


@pytest.mark.parametrize("host_dir", ["usr/lib/x86_64-linux-gnu", "usr/lib64", "lib64"])
def test_libraries_are_mounted_where_every_distributions_loader_looks(tmp_path: Path, host_dir: str) -> None:
    """An Ubuntu host's libraries in a UBI image, a RHEL host's in an Ubuntu image: each image's
    loader finds them in its default directories, with no cache entry, hook or environment."""
    render_driver_files(tmp_path, VERSION, lib_dir=host_dir)
    files = find_driver_files(tmp_path, machine="x86_64")
    m = mounts(files)
    real = str(tmp_path / host_dir / f"libcuda.so.{VERSION}")
    for d in LOADER_DIRS:
        for name in (f"libcuda.so.{VERSION}", "libcuda.so.1", "libcuda.so"):
            assert m[f"{d}/{name}"] == real, f"{d}/{name}"
        assert m[f"{d}/libnvidia-ml.so.1"] == str(tmp_path / host_dir / f"libnvidia-ml.so.{VERSION}")
    assert {c.rsplit("/", 1)[0] for _, c in files.libraries} == set(LOADER_DIRS)
    assert len(set(m)) == len(files.mounts)  # no container path twice


def test_a_library_in_two_host_directories_is_taken_from_the_first(tmp_path: Path) -> None:
    render_driver_files(tmp_path, VERSION, lib_dir="usr/lib/x86_64-linux-gnu")
    render_driver_files(tmp_path, "1.0.0", lib_dir="usr/lib64")  # a stale copy elsewhere
    m = mounts(find_driver_files(tmp_path, machine="x86_64"))
    assert m["/usr/lib64/libcuda.so.1"] == str(tmp_path / f"usr/lib/x86_64-linux-gnu/libcuda.so.{VERSION}")
    assert len(set(m)) == len(find_driver_files(tmp_path, machine="x86_64").mounts)


def test_aarch64_nodes_use_their_own_multiarch_directory(root: Path) -> None:
    dirs = {c.rsplit("/", 1)[0] for _, c in find_driver_files(root, machine="aarch64").libraries}
    assert dirs == {"/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib"}


def test_simulated_libraries_are_shared_objects_the_loader_accepts(root: Path) -> None:
    """Real ELF files with their soname, so that a container's ld.so and ldconfig treat them as the driver's."""
    lib = root / LIBS / "libcuda.so.1"
    assert lib.read_bytes()[:4] == b"\x7fELF"
    if shutil.which("ldconfig") or Path("/sbin/ldconfig").exists():
        ldconfig = shutil.which("ldconfig") or "/sbin/ldconfig"
        out = subprocess.run([ldconfig, "-n", "-N", "-v", str(root / LIBS)], capture_output=True, text=True, timeout=30)
        assert f"libcuda.so.1 -> libcuda.so.{VERSION}" in out.stdout, out.stderr


def test_every_host_path_is_a_regular_file_or_the_firmware_directory(root: Path) -> None:
    files = find_driver_files(root)
    for host, _ in files.libraries + files.binaries:
        assert Path(host).is_file() and not Path(host).is_symlink()
    assert all(Path(h).is_dir() for h, _ in files.firmware)


def test_simulated_nvidia_smi_is_a_posix_shell_script_listing_device_nodes(root: Path) -> None:
    smi = root / "usr/bin/nvidia-smi"
    assert smi.read_text().startswith("#!/bin/sh\n")
    assert os.access(smi, os.X_OK)
    out = subprocess.run([str(smi)], capture_output=True, text=True, check=True, timeout=10).stdout
    assert out.splitlines()[0] == f"NVIDIA-SMI simulated, driver version {VERSION}"


def test_rendering_twice_is_idempotent(root: Path) -> None:
    before = find_driver_files(root)
    render_driver_files(root, VERSION)
    assert find_driver_files(root) == before


def test_relative_link_out_of_the_root_is_ignored(root: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "libnvidia-cfg.so.1").write_text("planted")
    link = root / LIBS / "libnvidia-cfg.so.1"
    link.symlink_to(os.path.relpath(outside / "libnvidia-cfg.so.1", link.parent))
    m = mounts(find_driver_files(root))
    assert f"/{LIBS}/libnvidia-cfg.so.1" not in m
    assert all(str(outside) not in h for h in m.values())
    assert f"/{LIBS}/libcuda.so.1" in m  # the rest is still found


def test_absolute_link_is_resolved_inside_the_root(root: Path, tmp_path: Path) -> None:
    # A driver container's tree has absolute links that mean its own files, never the host's.
    (root / LIBS / "libnvidia-ml.so.1").unlink()
    (root / LIBS / "libnvidia-ml.so.1").symlink_to(f"/{LIBS}/libnvidia-ml.so.{VERSION}")
    host_file = tmp_path / "hostetc" / "libnvidia-tls.so.1"
    host_file.parent.mkdir()
    host_file.write_text("host file")
    (root / LIBS / "libnvidia-tls.so.1").symlink_to(str(host_file))  # absolute: root/<that path>, missing
    m = mounts(find_driver_files(root))
    assert m[f"/{LIBS}/libnvidia-ml.so.1"] == f"{root}/{LIBS}/libnvidia-ml.so.{VERSION}"
    assert f"/{LIBS}/libnvidia-tls.so.1" not in m


def test_directory_link_out_of_the_root_is_ignored(tmp_path: Path) -> None:
    outside = tmp_path / "outside" / "lib64"
    outside.mkdir(parents=True)
    (outside / "libcuda.so.1").write_text("planted")
    root = tmp_path / "driver"
    root.mkdir()
    (root / "lib64").symlink_to("../outside/lib64")
    assert find_driver_files(root) == DriverFiles()


def test_aliased_library_directory_is_scanned_once(tmp_path: Path) -> None:
    root = tmp_path / "driver"
    (root / "usr/lib64").mkdir(parents=True)
    (root / f"usr/lib64/libcuda.so.{VERSION}").write_text("lib")
    (root / "usr/lib64/libcuda.so.1").symlink_to(f"libcuda.so.{VERSION}")
    (root / "lib64").symlink_to("usr/lib64")  # merged /usr
    files = find_driver_files(root, machine="x86_64")
    names = ["libcuda.so.1", f"libcuda.so.{VERSION}"]
    assert sorted(c for _, c in files.libraries) == sorted(f"{d}/{n}" for d in LOADER_DIRS for n in names)


def test_link_loop_and_dangling_link_are_skipped(root: Path) -> None:
    (root / LIBS / "libnvidia-allocator.so.1").symlink_to("libnvidia-allocator.so.1")
    (root / LIBS / "libnvidia-opencl.so.1").symlink_to("libnvidia-opencl.so.999")
    m = mounts(find_driver_files(root))
    assert f"/{LIBS}/libnvidia-allocator.so.1" not in m
    assert f"/{LIBS}/libnvidia-opencl.so.1" not in m
    assert f"/{LIBS}/libcuda.so.1" in m


def test_unrelated_files_are_not_mounted(root: Path) -> None:
    (root / LIBS / "libc.so.6").write_text("libc")
    (root / LIBS / "libcudart.so.12").write_text("CUDA runtime belongs to the image")
    m = mounts(find_driver_files(root))
    assert f"/{LIBS}/libc.so.6" not in m
    assert f"/{LIBS}/libcudart.so.12" not in m


def test_root_without_a_driver_yields_nothing(tmp_path: Path) -> None:
    assert find_driver_files(tmp_path) == DriverFiles()
    assert find_driver_files(tmp_path / "missing") == DriverFiles()


def test_firmware_of_another_version_is_not_mounted(root: Path) -> None:
    shutil.move(root / "lib/firmware/nvidia" / VERSION, root / "lib/firmware/nvidia/570.0.0")
    assert find_driver_files(root).firmware == ()
