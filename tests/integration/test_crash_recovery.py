"""kill -9 during prepare and unprepare, then restart: nothing is lost, nothing is left behind.

The daemon is a real process. To stop it at a chosen step without hooks in the product, the test
makes the simulated API server hold one request (fault injection with a delay) and kills the
daemon while it waits there: during the claim GET (nothing written yet), during the claim-status
apply (checkpoint says PrepareStarted, CDI spec and metadata written), and during the status
clear of an unprepare (files removed, record still there).
"""

from __future__ import annotations

import contextlib
import json
import signal
import threading

import pytest
from waiting import poll

from demo.node import DRIVER
from sim.kubelet import ClaimRef, KubeletSim, KubeletSimError
from sim.scheduler import Request, allocate, attribute, claim_object, published_devices

GPU = Request("gpu", "gpu.tandem.dev", lambda d: attribute(d, "type") == "gpu")
NIC = Request("nic", "nic.tandem.dev", lambda d: attribute(d, "type") == "nic")
HOLD = 30.0  # seconds the API server holds the chosen request; the daemon is killed long before


class Node:
    def __init__(self, apiserver, sim_node, start_daemon):
        self.apiserver = apiserver
        self.node = sim_node()
        self.start_daemon = start_daemon
        self.daemon = None
        self.kubelet = KubeletSim(self.node.registry)

    def start(self):
        self.daemon = self.start_daemon(self.node)
        sock = self.kubelet.wait_for_registration_socket(DRIVER, timeout=60)
        assert poll(lambda: _connectable(self.kubelet, sock), 60), self.daemon.log_text()
        assert poll(lambda: len(published_devices(self.apiserver, DRIVER, self.node.profile.name)) >= 4, 60)

    def kill(self):
        self.daemon.proc.send_signal(signal.SIGKILL)
        self.daemon.proc.wait(timeout=30)

    def claim(self, name: str, *requests: Request) -> ClaimRef:
        claim = self.apiserver.create(claim_object("default", name, list(requests)))
        allocate(self.apiserver, claim, DRIVER, self.node.profile.name, list(requests))
        return ClaimRef("default", name, claim["metadata"]["uid"])

    def checkpoint(self) -> dict:
        path = self.node.plugins / DRIVER / "checkpoint.json"
        return json.loads(path.read_text())["claims"] if path.exists() else {}

    def files_of(self, ref: ClaimRef) -> list[str]:
        cdi = [p.name for p in self.node.cdi.iterdir() if ref.uid in p.name]
        meta = self.node.plugins / DRIVER / "dra-device-metadata" / f"{ref.namespace}_{ref.name}"
        return cdi + ([str(meta)] if meta.exists() else [])

    def prepare_in_background(self, ref: ClaimRef, method: str = "prepare") -> threading.Thread:
        def call():
            # The daemon is killed under this call: the kubelet sees an RPC error, as a real one would.
            with contextlib.suppress(KubeletSimError):
                getattr(self.kubelet, method)([ref])

        t = threading.Thread(target=call, daemon=True)
        t.start()
        return t


def _connectable(kubelet: KubeletSim, sock) -> bool:
    try:
        kubelet.register(sock)
        return True
    except Exception:
        return False


@pytest.fixture
def node(apiserver, sim_node, start_daemon):
    n = Node(apiserver, sim_node, start_daemon)
    yield n
    n.kubelet.close()


def test_kill_during_claim_get_leaves_nothing(node, apiserver):
    node.start()
    ref = node.claim("c1", GPU)
    arrived = apiserver.faults.inject(method="GET", path="/resourceclaims/c1$", status=0, delay=HOLD, count=1)
    node.prepare_in_background(ref)
    assert arrived.wait(30), "the claim GET never reached the API server"
    node.kill()
    assert node.checkpoint() == {} and node.files_of(ref) == []
    apiserver.faults.clear()
    node.start()
    result = node.kubelet.prepare([ref])[ref.uid]
    assert result.error == "" and node.checkpoint()[ref.uid]["state"] == "PrepareCompleted"


def test_kill_during_status_apply_is_rolled_back_at_start(node, apiserver):
    node.start()
    ref = node.claim("c2", GPU, NIC)
    apiserver.faults.inject(method="PATCH", path="/resourceclaims/c2/status", status=0, delay=HOLD, count=1)
    node.prepare_in_background(ref)
    assert poll(lambda: node.checkpoint().get(ref.uid, {}).get("state") == "PrepareStarted")
    assert poll(lambda: len(node.files_of(ref)) >= 2), "CDI spec and metadata are written before the status"
    node.kill()
    apiserver.faults.clear()

    node.start()  # reconciliation: the owner of PrepareStarted is dead -> roll back
    assert ref.uid not in node.checkpoint()
    assert node.files_of(ref) == []
    # The kubelet retries: the claim prepares cleanly, and its devices are free again.
    result = node.kubelet.prepare([ref])[ref.uid]
    assert result.error == "" and len(result.devices) == 2
    assert len(node.files_of(ref)) >= 2
    assert node.kubelet.unprepare([ref]) == {ref.uid: ""}
    assert node.files_of(ref) == [] and ref.uid not in node.checkpoint()


def test_kill_during_unprepare_completes_on_the_next_call(node, apiserver):
    node.start()
    ref = node.claim("c3", NIC)
    assert node.kubelet.prepare([ref])[ref.uid].error == ""
    apiserver.faults.inject(method="PATCH", path="/resourceclaims/c3/status", status=0, delay=HOLD, count=1)
    node.prepare_in_background(ref, method="unprepare")
    assert poll(lambda: node.files_of(ref) == []), "files are removed before the status is cleared"
    node.kill()
    assert node.checkpoint()[ref.uid]["state"] == "PrepareCompleted"  # the record outlives the files
    apiserver.faults.clear()
    node.start()
    assert node.kubelet.unprepare([ref]) == {ref.uid: ""}
    assert ref.uid not in node.checkpoint() and node.files_of(ref) == []


def test_restart_keeps_prepared_claims_and_answers_the_same(node, apiserver):
    node.start()
    ref = node.claim("c4", GPU)
    first = node.kubelet.prepare([ref])[ref.uid]
    assert first.error == ""
    node.kill()
    node.start()
    assert node.kubelet.prepare([ref])[ref.uid] == first
    assert len([p for p in node.node.cdi.iterdir() if ref.uid in p.name and p.name.startswith("k8s.")]) == 1
    assert node.kubelet.unprepare([ref]) == {ref.uid: ""}
