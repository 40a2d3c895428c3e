"""CDI spec files on disk: naming, atomic writes, removal, listing what a vendor owns.

Runtimes read only regular ``*.json`` / ``*.yaml`` files directly in their spec directories and
refresh their cache whenever the directory changes, so a spec must appear in one step: it is
written under a ``.tmp`` name (ignored by runtimes), then renamed over the final name. A reader
therefore sees the old file or the new one, never a torn one. Whether the write is also made
durable (fsynced) is the caller's choice (`cdi.files`): a static spec in ``/etc/cdi`` must survive
a reboot, a transient one in ``/var/run/cdi`` (a tmpfs) cannot.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path

from cdi.errors import SpecError
from cdi.files import atomic_write, fsync_dir
from cdi.names import validate_class_name, validate_vendor_name
from cdi.spec import Spec
from cdi.validate import validate

log = logging.getLogger(__name__)

SPEC_SUFFIX = ".json"
FILE_MODE = 0o644
MAX_SPEC_BYTES = 4 * 1024 * 1024
_NAME_MAX = 255
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")


def spec_filename(vendor: str, class_: str, unique: str) -> str:
    """``<vendor>-<class>_<unique>.json``, the CDI convention for transient (per-claim) specs.

    Vendor and class must be valid CDI names, which already keeps them free of ``/``. Every
    character of `unique` outside ``[A-Za-z0-9_.-]`` (the ``/`` of the convention included)
    becomes ``_``, so the result is always one plain file name inside the spec directory: with no
    ``/`` left and a vendor prefix that starts with a letter, a ``..`` in `unique` is only text.
    Distinct unique strings may collide after replacement; callers pass claim UIDs, which are
    already safe.
    """
    validate_vendor_name(vendor)
    validate_class_name(class_)
    if not unique:
        raise SpecError("", "the unique part of a spec file name must not be empty")
    name = f"{vendor}-{class_}_{_UNSAFE.sub('_', unique)}{SPEC_SUFFIX}"
    if len(name.encode()) > _NAME_MAX:
        raise SpecError("", f"spec file name {name[:40]!r}... is longer than {_NAME_MAX} bytes")
    return name


def write_spec(directory: Path, spec: Spec, filename: str, *, durable: bool = True, compact: bool = False) -> Path:
    """Validate `spec` (strict rules) and replace ``directory/filename`` with it atomically.

    The directory is created if missing (``/var/run/cdi`` lives on tmpfs and is gone after a
    reboot). With `durable` the data and the rename are both fsynced, so that after a power loss
    too the file is either the old one or the complete new one. `compact`: JSON without
    indentation (`Spec.to_json`).
    """
    _check_filename(filename)
    target = directory / filename
    _write(target, spec, spec.to_json(compact=compact).encode(), durable)
    return target


def update_spec(directory: Path, spec: Spec, filename: str, *, durable: bool = True, compact: bool = False) -> bool:
    """`write_spec`, unless the file already holds exactly this spec; True when it was written.

    An unchanged spec is not rewritten: every rewrite makes the runtimes rescan the directory. A
    file that holds these very bytes passed validation when it was written, so it is not
    validated again either.
    """
    _check_filename(filename)
    target = directory / filename
    data = spec.to_json(compact=compact).encode()
    try:
        if target.read_bytes() == data:
            return False
    except OSError:
        pass
    _write(target, spec, data, durable)
    return True


def _write(target: Path, spec: Spec, data: bytes, durable: bool) -> None:
    validate(spec)
    try:
        atomic_write(target, data, FILE_MODE, durable=durable)
    except FileNotFoundError:  # no directory yet: made on demand, not checked before every write
        target.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        atomic_write(target, data, FILE_MODE, durable=durable)


def remove_spec(directory: Path, filename: str, *, durable: bool = True) -> None:
    """Remove a spec; a file that is already gone is fine (unprepare is retried). `durable`: the
    removal survives a power loss (an fsync of the directory)."""
    _check_filename(filename)
    try:
        os.unlink(directory / filename)
    except FileNotFoundError:
        return
    if durable:
        fsync_dir(directory)


def read_spec(path: Path) -> Spec:
    """Load and validate one spec file with the rules a runtime applies (``strict=False``).

    Only JSON is read: it is what `write_spec` writes. Bad content raises `SpecError` naming the
    file; I/O errors (a missing file) propagate as `OSError`.
    """
    with open(path, "rb") as f:
        data = f.read(MAX_SPEC_BYTES + 1)
    if len(data) > MAX_SPEC_BYTES:
        raise SpecError("", f"larger than {MAX_SPEC_BYTES} bytes", source=str(path))
    try:
        spec = Spec.from_json(data)
        validate(spec, strict=False)
    except SpecError as e:
        raise SpecError(e.field, e.message, source=str(path)) from None
    return spec


def list_specs(directory: Path, vendor: str, class_: str | None = None) -> list[Path]:
    """The spec files of `vendor` (and `class_`, if given) in `directory`, sorted by name.

    A file counts only when both its name has the owner's prefix and the ``kind`` inside is the
    owner's: the prefix alone is ambiguous (vendor ``a.b`` vs ``a.b-c``, both named ``a.b-…``) and
    the kind alone would claim a file someone else wrote by hand. Temporary files, other
    extensions, subdirectories and unreadable files are skipped; a missing directory holds nothing.
    """
    validate_vendor_name(vendor)
    if class_ is not None:
        validate_class_name(class_)
    prefix = f"{vendor}-" if class_ is None else f"{vendor}-{class_}"
    try:
        entries = sorted(directory.iterdir())
    except FileNotFoundError:
        return []
    owned = []
    for path in entries:
        name = path.name
        if not name.startswith(prefix) or not name.endswith(SPEC_SUFFIX) or not path.is_file():
            continue
        if class_ is not None and name[len(prefix)] not in "_.":
            continue  # another class sharing our class as prefix: "gpu" vs "gpux"
        kind = _kind_of(path)
        if kind is None:
            continue
        kind_vendor, _, kind_class = kind.partition("/")
        if kind_vendor == vendor and (class_ is None or kind_class == class_):
            owned.append(path)
    return owned


def _kind_of(path: Path) -> str | None:
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_SPEC_BYTES + 1)
        raw = json.loads(data) if len(data) <= MAX_SPEC_BYTES else None
    except (OSError, ValueError, RecursionError) as e:  # RecursionError: nested too deeply
        log.warning("skipping unreadable CDI spec %s: %s", path, e)
        return None
    kind = raw.get("kind") if isinstance(raw, dict) else None
    if not isinstance(kind, str):
        log.warning("skipping CDI spec %s: no kind", path)
        return None
    return kind


def _check_filename(filename: str) -> None:
    """A spec file name is one path component ending in ``.json``, so it cannot leave the directory."""
    if "/" in filename or "\0" in filename or filename in (".", "..") or not filename.endswith(SPEC_SUFFIX):
        raise SpecError("", f"invalid spec file name {filename!r}: expected a plain name ending in {SPEC_SUFFIX}")
    if len(filename) == len(SPEC_SUFFIX) or filename.startswith("."):
        raise SpecError("", f"invalid spec file name {filename!r}: hidden or empty name")
