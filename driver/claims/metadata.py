"""Device metadata files (the device "Downward API", KEP-5304), as the Go kubeletplugin library writes them.

Per prepared claim and request (docs/reference/device-metadata.md):

* host file `<dataDir>/dra-device-metadata/<claimUID>/<baseRequest>/metadata.json`
  (directories 0755, file 0644): a JSON stream, one indented `DeviceMetadata` object per
  supported version, newest first (v1beta1, v1alpha1), each followed by a newline
  (`driver.claims.metadata_format`).
  The Go library names the directory `<namespace>_<name>`; Tandem keys it by claim UID instead,
  like every other file it keeps for a claim, so that a claim deleted and recreated under the
  same name (Jobs do this) never shares a file with its predecessor: a late Unprepare of the old
  claim cannot remove what the new claim's containers mount. Containers see the same paths
  either way;
* CDI spec `<cdiDir>/<driver>_metadata_<claimUID>_<baseRequest>.json` (0644, kind
  `<driver>/metadata`, cdiVersion 0.5.0), one device `<claimUID>_<baseRequest>` that bind-mounts
  the host file read-only at
  `/var/run/kubernetes.io/dra-device-attributes/resourceclaims/<claimName>/<baseRequest>/<driver>-metadata.json`,
  or `.../resourceclaimtemplates/<podClaimName>/...` for a claim made from a template;
* its CDI ID `<driver>/metadata=<claimUID>_<baseRequest>` goes to the first response device of
  that request (`assign_metadata_ids`).

New files appear atomically (temporary file, rename), not durably (`driver.fsutil` says why). An
update rewrites the host file in place instead, because containers bind-mount it by inode and
would never see a renamed file.
Every path built from claim data is checked to stay under its base directory.

The files also say which claim a UID belongs to (`claim_names`), which is what rebuilding the
record of prepared claims needs when the checkpoint is lost.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import cdi
from cdi import atomic_write, is_dns_label
from driver.claims.metadata_format import MetadataDevice, MetadataError, decode_stream, document, encode_versions
from driver.config import is_uid
from driver.fsutil import PREPARED_STATE_DURABLE
from driver.untrusted import shown

log = logging.getLogger(__name__)

METADATA_DIR = "dra-device-metadata"
METADATA_FILE = "metadata.json"
CONTAINER_ROOT = "/var/run/kubernetes.io/dra-device-attributes"
CDI_VERSION = "0.5.0"
CDI_CLASS = "metadata"
MOUNT_OPTIONS = ("ro", "bind")
DIR_MODE = 0o755
FILE_MODE = 0o644
MAX_FILE_BYTES = 4 * 1024 * 1024


def base_request(request: str) -> str:
    return request.split("/", 1)[0]


def assign_metadata_ids(request_names: Sequence[Sequence[str]], metadata_ids: Mapping[str, str]) -> list[list[str]]:
    """Which metadata CDI IDs each response device gets, as the Go library decides it.

    `request_names` holds each response device's (already stripped) request names, in response
    order; `metadata_ids` maps base request -> CDI ID (`MetadataWriter.write`). Each ID goes to the
    first device whose names contain its request; an ID whose request no device names is dropped.
    """
    out: list[list[str]] = [[] for _ in request_names]
    for request, cdi_id in metadata_ids.items():
        for i, names in enumerate(request_names):
            if request in names:
                out[i].append(cdi_id)
                break
    return out


def _component(value: str, what: str) -> str:
    """One path component from claim data: never empty, `.`/`..`, or containing `/` or NUL."""
    if not value or value in (".", "..") or "/" in value or "\0" in value:
        raise MetadataError(f"invalid {what} {shown(value)} for a metadata path")
    return value


def _dns_label(value: str, what: str) -> str:
    if not is_dns_label(value):
        raise MetadataError(f"invalid {what} {shown(value)}: expected a DNS label")
    return value


def _under(base: Path, path: Path) -> Path:
    """Defence in depth: `path` must lie strictly inside `base` after normalisation."""
    norm_base = os.path.abspath(base)
    norm = os.path.abspath(path)
    if not norm.startswith(norm_base.rstrip("/") + "/"):
        raise MetadataError(f"metadata path {path} is outside {base}")
    return Path(norm)


class MetadataWriter:
    """Writes, updates and removes the metadata files of prepared claims for one driver."""

    def __init__(self, data_dir: Path, cdi_root: Path, driver_name: str) -> None:
        self.root = Path(data_dir) / METADATA_DIR
        self.cdi_root = Path(cdi_root)
        self.driver = driver_name
        cdi.validate_vendor_name(driver_name)  # the metadata kind is `<driver>/metadata`

    # -- paths ------------------------------------------------------------------------------------

    def claim_dir(self, uid: str) -> Path:
        return _under(self.root, self.root / _component(uid, "claim UID"))

    def host_file(self, uid: str, request: str) -> Path:
        base = self.claim_dir(uid)
        return _under(base, base / _component(base_request(request), "request") / METADATA_FILE)

    def container_path(self, name: str, pod_claim_name: str, request: str) -> str:
        if pod_claim_name:
            middle = f"resourceclaimtemplates/{_dns_label(pod_claim_name, 'pod claim name')}"
        else:
            middle = f"resourceclaims/{_component(name, 'claim name')}"
        path = f"{CONTAINER_ROOT}/{middle}/{_component(base_request(request), 'request')}/{self.driver}-metadata.json"
        if os.path.normpath(path) != path:
            raise MetadataError(f"container path {path!r} is not normalised")
        return path

    def spec_filename(self, uid: str, request: str) -> str:
        return (
            f"{self.driver}_metadata_{_component(uid, 'claim UID')}_{_component(base_request(request), 'request')}.json"
        )

    def cdi_id(self, uid: str, request: str) -> str:
        return cdi.qualified_name(self.driver, CDI_CLASS, f"{uid}_{base_request(request)}")

    # -- prepare ----------------------------------------------------------------------------------

    def write(
        self, namespace: str, name: str, uid: str, pod_claim_name: str, devices: Sequence[MetadataDevice]
    ) -> dict[str, str]:
        """Write every request's files; return base request -> CDI ID. Devices without a request get none.

        Idempotent: a file whose content is already what it would become is not touched (its
        generation kept); a file with other content is rewritten in place with the next generation.
        """
        _dns_label(namespace, "namespace")
        groups: dict[str, list[MetadataDevice]] = {}
        for d in devices:
            if d.request:
                groups.setdefault(d.request, []).append(d)
        by_base: dict[str, str] = {}
        for request in groups:
            base = _dns_label(base_request(request), "request name")
            if base in by_base:
                raise MetadataError(
                    f"requests {shown(by_base[base])} and {shown(request)} share the base request {shown(base)}"
                )
            by_base[base] = request
        paths = {  # every path checked before the first file is written
            request: (
                self.host_file(uid, request),
                self.container_path(name, pod_claim_name, request),
                _under(self.cdi_root, self.cdi_root / self.spec_filename(uid, request)).name,
            )
            for request in by_base.values()
        }
        ids: dict[str, str] = {}
        for base, request in by_base.items():
            host_file, container_path, spec_filename = paths[request]
            self._write_request(host_file, namespace, name, uid, pod_claim_name, request, groups[request])
            self._write_spec(host_file, container_path, spec_filename, f"{uid}_{base}")
            ids[base] = self.cdi_id(uid, request)
        return ids

    def _write_request(
        self,
        path: Path,
        namespace: str,
        name: str,
        uid: str,
        pod_claim_name: str,
        request: str,
        devices: Sequence[MetadataDevice],
    ) -> None:
        try:
            data = self._raw(path)
            existing = _decoded(path, data)
        except MetadataError as e:  # e.g. an in-place update torn by a crash: start over
            log.warning("replacing unreadable device metadata: %s", e)
            data = existing = None
        if existing is not None and existing["metadata"].get("uid") == uid:
            old_generation = existing["metadata"].get("generation")
            old_generation = old_generation if isinstance(old_generation, int) else 0
            same = document(self.driver, namespace, name, uid, old_generation, pod_claim_name, request, devices)
            # Byte for byte: a file of 0.1.0 (v1alpha1 alone), or one whose rewrite stopped after
            # its first object, decodes the same but lacks a version some consumer reads.
            if encode_versions(same) == data:
                return
            # Same claim, new content: containers may already hold the file, so keep its inode.
            doc = document(self.driver, namespace, name, uid, old_generation + 1, pod_claim_name, request, devices)
            _rewrite_in_place(path, encode_versions(doc))
            return
        # A new file (or one left unreadable, or naming another UID): a fresh inode.
        self._mkdirs(path.parent)
        atomic_write(
            path,
            encode_versions(document(self.driver, namespace, name, uid, 1, pod_claim_name, request, devices)),
            FILE_MODE,
            durable=PREPARED_STATE_DURABLE,
        )

    def _write_spec(self, host_file: Path, container_path: str, filename: str, device: str) -> None:
        mount = cdi.Mount(host_path=str(host_file), container_path=container_path, options=MOUNT_OPTIONS)
        spec = cdi.make_spec(
            f"{self.driver}/{CDI_CLASS}",
            [cdi.Device(name=device, container_edits=cdi.ContainerEdits(mounts=(mount,)))],
            cdi_version=CDI_VERSION,
        )
        cdi.update_spec(self.cdi_root, spec, filename, durable=PREPARED_STATE_DURABLE)

    # -- update -----------------------------------------------------------------------------------

    def update(self, namespace: str, name: str, uid: str, request: str, devices: Sequence[MetadataDevice]) -> None:
        """Replace the devices of one prepared request (e.g. once IPs are known), in place.

        Keeps `podClaimName` and the request reference, bumps the generation. A request that was
        never prepared (no file), or a file of another claim with the same name, is an error.
        """
        path = self.host_file(uid, request)
        existing = self._read(path)
        if existing is None:
            raise MetadataError(f"request {shown(request)} not found in prepared claim {namespace}/{name}")
        meta = existing["metadata"]
        if meta.get("uid") != uid:
            raise MetadataError(f"metadata of {namespace}/{name} belongs to claim UID {meta.get('uid')!r}, not {uid!r}")
        generation = meta.get("generation")
        generation = generation if isinstance(generation, int) else 0
        pod_claim_name = existing.get("podClaimName") or ""
        requests = existing.get("requests") or [{}]
        old_ref = requests[0].get("name") if isinstance(requests[0], dict) else None
        ref = request if "/" in request or not isinstance(old_ref, str) else old_ref
        doc = document(self.driver, namespace, name, uid, generation + 1, str(pod_claim_name), ref, devices)
        _rewrite_in_place(path, encode_versions(doc))

    # -- unprepare and reconciliation ----------------------------------------------------------

    def remove(self, uid: str) -> None:
        """Remove the claim's host files and every metadata CDI spec of its UID; missing is fine.

        Everything is found by UID alone: nothing of another claim, whatever its name, is touched.
        """
        self.remove_specs(uid)
        self.remove_claim_dir(uid)

    def remove_claim_dir(self, uid: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            shutil.rmtree(self.claim_dir(uid))

    def remove_specs(self, uid: str) -> None:
        prefix = f"{self.driver}_metadata_{_component(uid, 'claim UID')}_"
        for path in self._spec_files():
            if path.name.startswith(prefix):
                cdi.remove_spec(self.cdi_root, path.name, durable=PREPARED_STATE_DURABLE)

    def owned_claim_dirs(self) -> set[str]:
        """The names of the claim directories: claim UIDs (anything else, such as a directory of
        an older layout, is listed as it is, so that reconciliation removes it as an orphan)."""
        try:
            return {entry.name for entry in self.root.iterdir() if entry.is_dir()}
        except FileNotFoundError:
            return set()

    def claim_names(self, uid: str) -> set[tuple[str, str]]:
        """(namespace, name) that the metadata files of claim `uid` name; unreadable files name none."""
        out = set()
        for path in sorted(self.claim_dir(uid).glob(f"*/{METADATA_FILE}")):
            try:
                doc = self._read(path)
            except MetadataError as e:
                log.warning("%s", e)
                continue
            meta = doc["metadata"] if doc is not None else {}
            namespace, name = meta.get("namespace"), meta.get("name")
            if meta.get("uid") == uid and isinstance(namespace, str) and isinstance(name, str):
                out.add((namespace, name))
        return out

    def remove_temp_files(self) -> list[Path]:
        """Temporary files of atomic writes that a killed process left: beside the host files
        (one directory per claim and request) and beside the metadata CDI specs."""
        removed = cdi.remove_temp_files(self.cdi_root, f"{self.driver}_{CDI_CLASS}_")
        for request_dir in sorted(self.root.glob("*/*")):
            removed += cdi.remove_temp_files(request_dir) if request_dir.is_dir() else []
        return removed

    def owned_spec_uids(self) -> set[str]:
        """Claim UIDs with at least one metadata CDI spec (UIDs and request names hold no `_`).
        The directory is shared with other writers: a name whose UID part is no UID is not ours."""
        prefix = f"{self.driver}_metadata_"
        out = set()
        for path in self._spec_files():
            uid, sep, _ = path.name[len(prefix) :].partition("_")
            if sep and is_uid(uid):
                out.add(uid)
        return out

    def _spec_files(self) -> list[Path]:
        prefix = f"{self.driver}_metadata_"
        try:
            return sorted(p for p in self.cdi_root.iterdir() if p.name.startswith(prefix) and p.name.endswith(".json"))
        except FileNotFoundError:
            return []

    # -- files ----------------------------------------------------------------------------------

    def _mkdirs(self, directory: Path) -> None:
        """Create missing directories with mode 0755 whatever the umask (Go's MkdirAll + chmod)."""
        missing = []
        d = directory
        while not d.exists():
            missing.append(d)
            d = d.parent
        for d in reversed(missing):
            with contextlib.suppress(FileExistsError):
                d.mkdir()
            os.chmod(d, DIR_MODE)

    @classmethod
    def _read(cls, path: Path) -> dict[str, Any] | None:
        """The first known object of the file (its `metadata` is an object); None when missing."""
        return _decoded(path, cls._raw(path))

    @staticmethod
    def _raw(path: Path) -> bytes | None:
        """The file's bytes; None when missing. More than MAX_FILE_BYTES is an error, not read on."""
        try:
            with open(path, "rb") as f:
                data = f.read(MAX_FILE_BYTES + 1)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise MetadataError(f"cannot read {path}: {e}") from None
        if len(data) > MAX_FILE_BYTES:
            raise MetadataError(f"{path} is larger than {MAX_FILE_BYTES} bytes")
        return data


def _decoded(path: Path, data: bytes | None) -> dict[str, Any] | None:
    """The first known object of the bytes `data` read from `path`; None for a missing file."""
    if data is None:
        return None
    try:
        return decode_stream(data)
    except MetadataError as e:
        raise MetadataError(f"{path}: {e}") from None


def _rewrite_in_place(path: Path, data: bytes) -> None:
    """Truncate and write the same inode: running containers bind-mounted it and keep seeing it."""
    fd = os.open(path, os.O_WRONLY | os.O_TRUNC)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)
