#!/usr/bin/env python3
"""Pack a root directory into a one-layer OCI image archive that `ctr images import` accepts.

The local cluster reaches no image registry, so the images its pods need (the pod sandbox's
pause image and a busybox test image) are built here from files this machine already has. The
layer is reproducible: entries sorted, owned by root, timestamps zero, so the same files give the
same digest and a second `hack/cluster.sh up` imports nothing new.

    image.py --name registry.k8s.io/pause:3.10 --rootfs DIR --entrypoint /pause --out pause.tar
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import json
import tarfile
from pathlib import Path

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
OCI_LAYER = "application/vnd.oci.image.layer.v1.tar+gzip"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"


def layer_tar(rootfs: Path) -> bytes:
    """The uncompressed layer: every entry below rootfs, sorted, root-owned, mtime 0."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in sorted(rootfs.rglob("*")):
            info = tar.gettarinfo(str(path), arcname=str(path.relative_to(rootfs)))
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            info.mtime = 0
            if info.isreg():
                with path.open("rb") as f:
                    tar.addfile(info, f)
            else:
                tar.addfile(info)
    return buf.getvalue()


def _blob(tar: tarfile.TarFile, data: bytes) -> str:
    digest = hashlib.sha256(data).hexdigest()
    info = tarfile.TarInfo(f"blobs/sha256/{digest}")
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))
    return f"sha256:{digest}"


def _json(obj: object) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def write_archive(name: str, rootfs: Path, entrypoint: list[str], cmd: list[str], out: Path) -> str:
    """Writes the OCI archive; returns the manifest digest."""
    raw = layer_tar(rootfs)
    compressed = gzip.compress(raw, mtime=0)
    config = {
        "architecture": "amd64",
        "os": "linux",
        "config": {"Entrypoint": entrypoint, "Cmd": cmd, "Env": ["PATH=/bin:/usr/bin:/sbin:/usr/sbin"]},
        "rootfs": {"type": "layers", "diff_ids": [f"sha256:{hashlib.sha256(raw).hexdigest()}"]},
    }
    with tarfile.open(out, "w") as tar:
        config_bytes = _json(config)
        config_digest = _blob(tar, config_bytes)
        layer_digest = _blob(tar, compressed)
        manifest = _json(
            {
                "schemaVersion": 2,
                "mediaType": OCI_MANIFEST,
                "config": {"mediaType": OCI_CONFIG, "digest": config_digest, "size": len(config_bytes)},
                "layers": [{"mediaType": OCI_LAYER, "digest": layer_digest, "size": len(compressed)}],
            }
        )
        manifest_digest = _blob(tar, manifest)
        index = {
            "schemaVersion": 2,
            "mediaType": OCI_INDEX,
            "manifests": [
                {
                    "mediaType": OCI_MANIFEST,
                    "digest": manifest_digest,
                    "size": len(manifest),
                    "platform": {"architecture": "amd64", "os": "linux"},
                    # containerd names the imported image after this annotation.
                    "annotations": {"io.containerd.image.name": name, "org.opencontainers.image.ref.name": name},
                }
            ],
        }
        for member, data in (("oci-layout", _json({"imageLayoutVersion": "1.0.0"})), ("index.json", _json(index))):
            info = tarfile.TarInfo(member)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return manifest_digest


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--name", required=True, help="full image reference, e.g. registry.k8s.io/pause:3.10")
    p.add_argument("--rootfs", required=True, type=Path)
    p.add_argument("--entrypoint", nargs="*", default=[])
    p.add_argument("--cmd", nargs="*", default=[])
    p.add_argument("--out", required=True, type=Path)
    a = p.parse_args()
    print(write_archive(a.name, a.rootfs, a.entrypoint, a.cmd, a.out))


if __name__ == "__main__":
    main()
