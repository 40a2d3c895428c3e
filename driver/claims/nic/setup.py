"""An exclusive NIC's settings in the pod (NicConfig addresses, routes, MTU), applied on arrival.

The OCI runtime moves the netdev into the pod's network namespace (CDI `netDevices`, OCI
`linux.netDevices`), keeping its permanent global addresses and its MTU, and sets it up
(runtime-spec 1.3, 'Network Devices'). It configures nothing else, by design. So the claim's
settings go into the CDI device as a `createRuntime` hook: the runtime runs it after it moved the
netdev (runc: `setupNetworkDevices`, then the createRuntime hooks) and before the container
starts, in the runtime's namespaces, with the container's state (its `pid`) on stdin. The hook
enters the pod's network namespace with the host's `nsenter` and configures the interface with the
host's `ip`: the claim's addresses replace the ones it brought from the host, then the MTU, then the
routes. A failure fails the container's creation, with the hook's message in the pod's events.

The host must have `sh`, `nsenter` (util-linux) and `ip` (iproute2), as every general-purpose
distribution does; `docs/deployment.md` says so. Nothing is written on the host: the script is the
hook's argument.
"""

from __future__ import annotations

import shlex

import cdi
from driver.claims.opaque_config import NicConfig

HOOK = "createRuntime"
SHELL = "/bin/sh"
PATH = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
TIMEOUT = 10  # seconds the runtime gives the hook
# The container's state arrives on stdin as JSON; its "pid" names the pod's namespaces.
_PID = r"""pid=$(tr -d '\n' | sed -n 's/.*"pid": *\([0-9][0-9]*\).*/\1/p')"""


def needs_setup(config: NicConfig) -> bool:
    return bool(config.addresses or config.routes or config.mtu)


def setup_hook(config: NicConfig) -> cdi.Hook:
    """The createRuntime hook that gives the interface `config.interface_name` its settings."""
    dev = shlex.quote(config.interface_name)
    steps = []
    if config.addresses:
        steps.append(f"ip address flush dev {dev} scope global")
        steps += [
            f"ip address add {shlex.quote(a)} dev {dev}" + (" nodad" if ":" in a else "") for a in config.addresses
        ]
    if config.mtu:
        steps.append(f"ip link set dev {dev} mtu {config.mtu}")
    steps.append(f"ip link set dev {dev} up")
    for route in config.routes:
        via = f" via {shlex.quote(route.via)}" if route.via else ""
        steps.append(f"ip route replace {shlex.quote(route.destination)}{via} dev {dev}")
    script = "; ".join(
        [
            "set -e",
            _PID,
            '[ -n "$pid" ] || { echo "tandem: no pid in the container state" >&2; exit 1; }',
            *(f'nsenter -t "$pid" -n {step}' for step in steps),
        ]
    )
    return cdi.Hook(hook_name=HOOK, path=SHELL, args=("sh", "-c", script), env=(PATH,), timeout=TIMEOUT)
