"""CDI spec versions and the minimum-version rule (Go ``MinimumRequiredVersion``).

A runtime rejects a ``cdiVersion`` it does not know, and older runtimes know few: Debian 12's
podman 4.3.1 stops at 0.5.0. Declaring the lowest version the content needs keeps a spec loadable
everywhere its features are supported, which is why `make_spec` declares the minimum by default.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from cdi.errors import SpecError
from cdi.spec import ContainerEdits, Device, Spec

KNOWN_VERSIONS: tuple[str, ...] = (
    "0.1.0",
    "0.2.0",
    "0.3.0",
    "0.4.0",
    "0.5.0",
    "0.6.0",
    "0.7.0",
    "0.8.0",
    "1.0.0",
    "1.1.0",
)
CURRENT_VERSION = "1.1.0"
FLOOR_VERSION = "0.3.0"


def version_key(version: str) -> tuple[int, ...]:
    """Order versions numerically; the Go validator strips one leading ``v`` before comparing."""
    bare = version.removeprefix("v")
    if bare not in KNOWN_VERSIONS:
        raise SpecError("cdiVersion", f"unknown CDI version {version!r}; known: {', '.join(KNOWN_VERSIONS)}")
    return tuple(int(p) for p in bare.split("."))


def minimum_version(spec: Spec) -> str:
    """The lowest ``cdiVersion`` whose features cover everything the spec uses (docs/reference/cdi.md, 'Minimum version').

    The predicates look at the spec-level edits and at every device's edits; 0.8.0 and 1.0.0 added
    nothing to the format, so they are never the answer.
    """
    edits = [spec.container_edits, *(d.container_edits for d in spec.devices)]
    if _needs_1_1_0(edits):
        return "1.1.0"
    if any(e.intel_rdt is not None or e.additional_gids for e in edits):
        return "0.7.0"
    _, _, class_ = spec.kind.partition("/")
    if spec.annotations or any(d.annotations for d in spec.devices) or "." in class_:
        return "0.6.0"
    if any(d.name[:1].isascii() and d.name[:1].isdigit() for d in spec.devices):
        return "0.5.0"
    if any(n.host_path for e in edits for n in e.device_nodes):
        return "0.5.0"
    if any(m.type for e in edits for m in e.mounts):
        return "0.4.0"
    return FLOOR_VERSION


def _needs_1_1_0(edits: Iterable[ContainerEdits]) -> bool:
    for e in edits:
        if e.net_devices:
            return True
        rdt = e.intel_rdt
        if rdt is not None and (rdt.schemata is not None or rdt.enable_monitoring):
            return True
    return False


def make_spec(
    kind: str,
    devices: Sequence[Device],
    *,
    container_edits: ContainerEdits | None = None,
    annotations: Mapping[str, str] | None = None,
    cdi_version: str | None = None,
    max_version: str | None = None,
) -> Spec:
    """Build a spec declaring the minimum version its content needs, unless `cdi_version` is given.

    `max_version` is the newest version the cluster's runtimes accept (``"0.5.0"`` for podman
    4.3.1): a spec that needs more is refused here, where the caller can still report it, instead
    of being skipped silently by the runtime's cache and failing container creation as
    "unresolvable CDI devices".
    """
    spec = Spec(
        cdi_version="",
        kind=kind,
        devices=tuple(devices),
        container_edits=container_edits or ContainerEdits(),
        annotations=dict(annotations or {}),
    )
    needed = minimum_version(spec)
    version = needed if cdi_version is None else cdi_version
    if version_key(version) < version_key(needed):
        raise SpecError("cdiVersion", f"{version} is older than {needed}, which the content of the spec needs")
    if max_version is not None and version_key(version) > version_key(max_version):
        raise SpecError("cdiVersion", f"the spec needs {version} but the runtimes accept at most {max_version}")
    return Spec(version, spec.kind, spec.devices, spec.container_edits, spec.annotations)
