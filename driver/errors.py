"""The root of Tandem's errors, the branches callers catch, and how a door keeps its library's
exceptions in.

Every error Tandem raises on purpose derives from `TandemError`, so a caller at a boundary (a
gRPC handler, a thread's loop, the CLI) can tell Tandem's own, expected failures from a bug. Each
sits in one branch that says whose problem it is, as the class's `kind` (what metrics count errors
by): the input Tandem was given, one device, the node around the devices, the API server, or one
of Tandem's own sockets. A door turns its library's exceptions into these (`translating`): NVML's
error becomes `NvmlError` (driver/node/nvml.py), pyroute2's `NetlinkError` becomes
`NetlinkFailure` (driver/node/netlink_types.py), and driver/kube/ answers with `ApiError`; nothing past
a door needs to know its library's exceptions.

The whole tree; a name is the class's module under `driver/` and the class (the branches are
here). tests/unit/test_errors.py compares it with the classes defined under driver/, their bases
and kinds, so it cannot go stale:

    TandemError                                     kind "other": no branch fits (none such today)
    ├── InvalidInput                                kind "config": fix the input; a retry fails alike
    │   ├── config.ConfigError                      the daemon's flags
    │   ├── kube.kubeconfig.KubeconfigError         where the API server is and how to log in
    │   ├── claims.allocation.ClaimError            a claim that cannot be prepared (the kubelet's answer)
    │   ├── claims.opaque_config.ConfigDecodeError  a claim's GpuConfig / NicConfig
    │   ├── claims.cdi_spec.ClaimSpecError          a claim's devices in no consistent CDI spec
    │   ├── health.cordon.CordonError               a refused `tandemctl cordon`
    │   │   └── health.cordon.UnknownDevice         ... naming no device
    │   └── health.gpu.release.ReleaseError         a refused `tandemctl release` or `reacquire`
    ├── DeviceError                                 kind "device": one GPU, MIG device or NIC
    │   ├── node.nvml.NvmlError                     an NVML call failed (`value`: NVML's return code)
    │   ├── node.nvml.DeviceSkipped                 NVML cannot identify a device: not published
    │   ├── discovery.nic.sysfs.NicError            sysfs says what cannot be true of a NIC
    │   ├── claims.gpu.mig.MigError                 a MIG device not made or not destroyed
    │   ├── claims.binding.NotReady                 a device not ready for its pod before binding
    │   ├── claims.gpu.mps.MpsError                 a GPU's MPS control daemon not started
    │   └── claims.gpu.time_slices.TimeSliceError   a GPU's time slice not set
    ├── NodeError                                   kind "node": the node around the devices
    │   ├── node.netlink_types.NetlinkFailure       rtnetlink refused (also an OSError, with the errno)
    │   ├── node.nvml.NvmlUnavailable               NVML as a whole: no library, no driver, init failed
    │   │   └── node.nvml.NvmlReleased              ... released by an SRE (`tandemctl release`)
    │   ├── health.gpu.nvml_events.NvmlGone         NVML went away under a session
    │   ├── health.gpu.release.ReleaseTimeout       NVML still held a session when a release gave up
    │   ├── node.driver_root.OutsideRoot            a path that leaves the NVIDIA driver root
    │   ├── discovery.nic.scan.NicDiscoveryError    netlink unreadable, namespace gone
    │   ├── inventory.sources.SourceUnavailable     a whole discovery source, retried with backoff
    │   ├── fsutil.StateFileError                   a state file this release cannot read
    │   │   └── fsutil.NewerFormat                  ... written by a newer release
    │   ├── claims.device_nodes.DeviceNodeError     a device node missing that cannot be made
    │   └── claims.metadata_format.MetadataError    device metadata not written or not readable
    ├── ApiServerError                              kind "api": the API server
    │   └── kube.errors.ApiError                    a failed API call (`status`, `retryable`)
    │       ├── kube.errors.Conflict
    │       └── kube.errors.NotFound
    └── EndpointError                               kind "endpoint": Tandem's own sockets, either end
        ├── status.server.RequestError              a refused status-socket request (its HTTP status)
        ├── status.documents.UnknownClaim           `tandemctl claim`: a claim the daemon knows nothing of
        ├── status.documents.BadClaimKey            `tandemctl claim`: neither a UID nor NAMESPACE/NAME
        ├── kubelet.health.TooManyStreams           more health streams than the limit
        ├── kubelet.liveness.NotAlive               `tandem-driver liveness`: a step failed
        └── ctl.commands.Unreachable                `tandemctl`: no usable answer from the daemon

A builtin second base is kept where callers rely on it: `NetlinkFailure` stays an `OSError`,
because a netlink call fails with OSErrors of its own (a socket, a namespace) and its callers
catch them all as one. The others were `ValueError`s or `RuntimeError`s that every caller catches
by name; `NicError` is in `discovery.nic.sysfs.BROKEN`, with the builtins a broken sysfs entry
raises.

`ClaimError` is the answer a claim's prepare gives the kubelet, so prepare wraps other failures in
it (a MIG device not made, a CDI spec refused); the wrapped error stays its `__cause__`, whose
`kind` says whose problem it was.

`cdi.SpecError` (cdi/errors.py) is outside the tree: `cdi` is a standalone library and imports
nothing of the driver. The driver meets it where it builds a claim's CDI spec:
`driver.claims.prepare` turns it into a `ClaimError`, as it does a `ClaimSpecError`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import ClassVar, Literal, ParamSpec, TypeVar

Kind = Literal["other", "config", "device", "node", "api", "endpoint"]

P = ParamSpec("P")
R = TypeVar("R")
E = TypeVar("E", bound=BaseException)


class TandemError(Exception):
    """An expected failure, with a message fit for a log line, an Event or a claim's status."""

    kind: ClassVar[Kind] = "other"


class InvalidInput(TandemError):
    """What Tandem was given cannot be used as given (a claim, a flag, a kubeconfig, an SRE's
    request): fixing the input fixes it; retrying the same input fails the same way."""

    kind: ClassVar[Kind] = "config"


class DeviceError(TandemError):
    """One device (a GPU, a MIG device, a NIC), or the NVIDIA software acting for it, failed or
    refused; the node's other devices are not concerned."""

    kind: ClassVar[Kind] = "device"


class NodeError(TandemError):
    """The node around the devices failed: the kernel's interfaces (netlink, device nodes), NVML
    or the NVIDIA driver as a whole, files Tandem keeps. Often passes (a driver that loads later)."""

    kind: ClassVar[Kind] = "node"


class ApiServerError(TandemError):
    """The API server could not be reached, or refused a request."""

    kind: ClassVar[Kind] = "api"


class EndpointError(TandemError):
    """One of Tandem's own sockets (the status socket, the kubelet's sockets), at either end: a
    request refused there, or no usable answer from it."""

    kind: ClassVar[Kind] = "endpoint"


def error_kind(e: BaseException) -> Kind:
    """Whose problem `e` was, for counting errors: the kind of its `__cause__` where that is one of
    Tandem's (prepare wraps a MIG or NVML failure in a `ClaimError`, which alone would count a
    broken GPU as the tenant's typo), else its own; "other" for what is not Tandem's (a bug)."""
    for candidate in (e.__cause__, e):
        if isinstance(candidate, TandemError):
            return candidate.kind
    return "other"


def translating(call: Callable[P, R], library_error: type[E], translate: Callable[[E], TandemError]) -> Callable[P, R]:
    """`call`, raising `translate(e)` (chained to `e`) for a `library_error` e: how a door keeps
    its library's exceptions from its callers, for one Python frame more per call."""

    @functools.wraps(call)
    def translated(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return call(*args, **kwargs)
        except library_error as e:
            raise translate(e) from e

    return translated
