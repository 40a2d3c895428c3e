"""Liveness check that exercises the same sockets the kubelet uses, and the probe file.

A process can be running while its gRPC servers are wedged; the only honest probe is the
kubelet's own path: GetInfo on the registration socket, then an empty NodePrepareResources on
the DRA endpoint it names (an empty request must always succeed).

The kubelet's exec probes ask neither these sockets nor the status socket: starting Python for
them cost about 20 millicores. The daemon's main loop writes the verdict into a probe file instead
(`ProbeFile`, one line: `<valid until, Unix seconds> <ready|unready|dead> <why>`), every
`PROBE_PERIOD`, and the probes are shell tests of it (docs/deployment.md, 'Probes and resources').
Its verdicts are those of `tandem-driver liveness [--ready]`: `dead` when that path fails (`check`,
which the daemon runs on itself every `SELF_CHECK_PERIOD`, and at every refresh while it fails),
`unready` when the status socket's /health is not `ready`. A wedged daemon stops refreshing the
file: the verdict expires.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import grpc

from cdi import atomic_write
from driver.errors import EndpointError
from driver.kubelet.api.dra.v1 import api_pb2 as dra_pb2
from driver.kubelet.api.dra.v1 import api_pb2_grpc as dra_grpc
from driver.kubelet.api.pluginregistration.v1 import api_pb2 as reg_pb2
from driver.kubelet.api.pluginregistration.v1 import api_pb2_grpc as reg_grpc
from driver.kubelet.registration import PLUGIN_TYPE

log = logging.getLogger(__name__)

PROBE_PERIOD = 10.0  # seconds between the main loop's refreshes of the probe file
PROBE_VALID = 30  # seconds a verdict holds: two refreshes may be late (a slow self-check) before it expires
# Seconds between the daemon's checks of itself while they pass. A check dials both sockets afresh
# (a kept channel would not notice its socket file replaced), about 9 ms of CPU: at every refresh
# that was 0.09 % of a core, half of an idle instance's whole cost; the liveness probe (every 30 s,
# 3 failures) notices a wedged server at most one period later.
SELF_CHECK_PERIOD = 30.0
MAX_PROBE_REASON = 1000  # characters of why: the kubelet keeps 10 KiB of a probe's output


class NotAlive(EndpointError):
    pass


def check(reg_socket: Path, driver_name: str, timeout: float = 5.0) -> str:
    """Returns the DRA endpoint on success; raises NotAlive saying which step failed."""
    try:
        with grpc.insecure_channel(f"unix://{reg_socket}") as ch:
            info: reg_pb2.PluginInfo = reg_grpc.RegistrationStub(ch).GetInfo(reg_pb2.InfoRequest(), timeout=timeout)
    except grpc.RpcError as e:
        raise NotAlive(f"GetInfo on {reg_socket} failed: {e.code().name} {e.details()}") from e
    if info.type != PLUGIN_TYPE or info.name != driver_name:
        raise NotAlive(f"{reg_socket} answers as {info.type}/{info.name}, not {PLUGIN_TYPE}/{driver_name}")
    try:
        with grpc.insecure_channel(f"unix://{info.endpoint}") as ch:
            dra_grpc.DRAPluginStub(ch).NodePrepareResources(dra_pb2.NodePrepareResourcesRequest(), timeout=timeout)
    except grpc.RpcError as e:
        raise NotAlive(f"empty NodePrepareResources on {info.endpoint} failed: {e.code().name} {e.details()}") from e
    return info.endpoint


def unready(doc: Mapping[str, Any]) -> str | None:
    """Why a /health document is not ready; None when it is. A mapping, not the status socket's
    `HealthDoc`: the status socket is this module's sibling in the layers, and a TypedDict is one."""
    if doc.get("ready") is True:
        return None
    return "; ".join(str(r) for r in doc.get("reasons", [])) or "the daemon says it is not ready"


def probe_path(data_dir: Path, pod_uid: str) -> Path:
    """The probe file of this pod: two pods of a rolling update share the data dir."""
    return data_dir / (f"probe-{pod_uid}" if pod_uid else "probe")


class ProbeFile:
    """The probe file (module docstring), written by the daemon's main loop; nothing else reads
    the facts behind it, so it costs one small write per period and a self-check per
    `SELF_CHECK_PERIOD`."""

    def __init__(
        self,
        path: Path,
        alive: Callable[[], object],
        health: Callable[[], Mapping[str, Any]],
        clock: Callable[[], float] = time.time,
    ) -> None:
        """`alive()` raises an EndpointError saying why the kubelet's path fails; `health()` is /health."""
        self.path = path
        self._alive = alive
        self._health = health
        self._clock = clock
        self._checked_until = float("-inf")  # the last passed self-check holds until then

    def refresh(self) -> str:
        """Writes the verdict now; returns its line."""
        try:
            if self._clock() >= self._checked_until:
                self._alive()
                self._checked_until = self._clock() + SELF_CHECK_PERIOD
            reason = unready(self._health())
        except EndpointError as e:
            verdict, why = "dead", str(e)
        except Exception as e:  # a bug here must not end the main loop; the kubelet restarts us
            log.exception("the daemon's check of itself failed")
            verdict, why = "dead", f"the daemon's check of itself failed: {e}"
        else:
            verdict, why = ("ready", "") if reason is None else ("unready", reason)
        why = " ".join(why.split())[:MAX_PROBE_REASON]  # one line
        line = f"{int(self._clock()) + PROBE_VALID} {verdict} {why}".rstrip() + "\n"
        try:
            atomic_write(self.path, line.encode(), mode=0o644, durable=False)
        except OSError as e:  # the verdict expires and the probes fail: say why here
            log.error("cannot write the probe file %s: %s", self.path, e)
        return line

    def remove(self) -> None:
        """At stop: a probe of this pod finds no verdict, and no file of a gone pod stays behind."""
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
