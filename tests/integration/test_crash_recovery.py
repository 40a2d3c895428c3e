"""kill -9 during prepare and unprepare, then restart: nothing is lost, nothing is left behind.

The daemon is a real process. To stop it at a chosen step without hooks in the product, the test
makes the simulated API server hold one request (fault injection with a delay) and kills the
daemon while it waits there: during the claim GET (nothing written yet), during the claim-status
apply (checkpoint says PrepareStarted, CDI spec and metadata written), and during the status
clear of an unprepare (files removed, record still there). To kill it between writing a file and
renaming it into place, a `sitecustomize` module on the daemon's PYTHONPATH holds the rename of a
chosen file. A corrupt checkpoint must cost no claim that a pod still uses.
"""

from __future__ import annotations

import json
import os
import signal
import textwrap
import threading
import uuid
from pathlib import Path

import pytest
from kubelet_calls import call_in_background, registered
from waiting import poll

from demo.node import DRIVER
from sim.kubelet import ClaimRef, KubeletSim
from sim.scheduler import Request, allocate, attribute, claim_object, published_devices, reserve, unreserve

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

    def start(self, env: dict[str, str] | None = None):
        self.daemon = self.start_daemon(self.node, env=env)
        sock = self.kubelet.wait_for_registration_socket(DRIVER, timeout=60)
        assert poll(lambda: registered(self.kubelet, sock), 60), self.daemon.log_text()
        assert poll(lambda: len(published_devices(self.apiserver, DRIVER, self.node.profile.name)) >= 4, 60)

    def kill(self):
        self.daemon.proc.send_signal(signal.SIGKILL)
        self.daemon.proc.wait(timeout=30)

    def claim(self, name: str, *requests: Request, taken: set[str] | None = None) -> ClaimRef:
        """A claim allocated on this node and reserved for a pod, as the scheduler leaves it."""
        claim = self.apiserver.create(claim_object("default", name, list(requests)))
        allocate(self.apiserver, claim, DRIVER, self.node.profile.name, list(requests), taken=taken)
        reserve(self.apiserver, claim, f"pod-{name}", str(uuid.uuid4()))
        return ClaimRef("default", name, claim["metadata"]["uid"])

    @property
    def data_dir(self) -> Path:
        return self.node.plugins / DRIVER

    def temporary_files(self) -> list[str]:
        return sorted(str(p) for d in (self.data_dir, self.node.cdi) for p in d.rglob(".*.tmp"))

    def checkpoint(self) -> dict:
        path = self.node.plugins / DRIVER / "checkpoint.json"
        return json.loads(path.read_text())["claims"] if path.exists() else {}

    def files_of(self, ref: ClaimRef) -> list[str]:
        """The claim's CDI specs and device metadata; all of them are named by its UID. Read while
        the daemon may be removing them: a directory that goes while it is walked holds nothing."""
        cdi = [str(p) for p in self.node.cdi.iterdir() if ref.uid in p.name]
        meta = self.data_dir / "dra-device-metadata" / ref.uid
        return sorted([*cdi, *(os.path.join(d, n) for d, dirs, files in os.walk(meta) for n in (*dirs, *files))])

    def specs_and_mounted_metadata(self, ref: ClaimRef) -> dict[Path, bytes]:
        """The claim's CDI specs and the metadata files they mount, with their content."""
        specs = [p for p in self.node.cdi.iterdir() if ref.uid in p.name]
        mounted = [
            Path(m["hostPath"])
            for p in specs
            for d in json.loads(p.read_text())["devices"]
            for m in d["containerEdits"].get("mounts", ())
            if Path(m["hostPath"]).is_relative_to(self.data_dir)
        ]
        return {p: p.read_bytes() for p in (*specs, *mounted) if p.exists()}

    def prepare_in_background(self, ref: ClaimRef, method: str = "prepare") -> threading.Thread:
        return call_in_background(self.kubelet, method, ref)


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
    assert poll(lambda: len(node.files_of(ref)) >= 2), (
        "CDI spec and metadata are written while the status apply is held"
    )
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


def test_a_corrupt_checkpoint_keeps_the_claims_pods_still_use(node, apiserver):
    """The checkpoint is lost while claims are prepared: the claims still reserved for a pod keep
    their files (their containers may restart at any time) and are known again; the claim whose
    pod is gone and the claim that was deleted lose theirs."""
    node.start()
    live = node.claim("live", GPU, NIC)
    first = node.kubelet.prepare([live])[live.uid]
    done = node.claim("done", GPU, taken={d.device_name for d in first.devices})
    gone = node.claim("gone", NIC, taken={d.device_name for d in first.devices})
    results = node.kubelet.prepare([done, gone])
    assert first.error == "" and all(r.error == "" for r in results.values())
    live_files = node.specs_and_mounted_metadata(live)
    assert len(live_files) == 5, "a CDI spec, and per request a metadata spec and the file it mounts"
    node.kill()

    unreserve(apiserver, apiserver.get("resourceclaims", "done", "default"))
    unreserve(apiserver, apiserver.get("resourceclaims", "gone", "default"))
    apiserver.delete("resourceclaims", "gone", "default")
    (node.data_dir / "checkpoint.json").write_text('{"version": 1, "claims": {"trunc')
    node.start()

    assert node.specs_and_mounted_metadata(live) == live_files, "the files of a claim in use are kept as they were"
    assert node.checkpoint()[live.uid]["state"] == "PrepareCompleted"
    assert node.files_of(done) == [] and node.files_of(gone) == []
    assert set(node.checkpoint()) == {live.uid}
    assert node.kubelet.prepare([live])[live.uid] == first, "the kubelet gets the same answer as before"
    assert node.kubelet.unprepare([live]) == {live.uid: ""}
    assert node.files_of(live) == [] and node.checkpoint() == {}


def _hold_renames(root: Path) -> Path:
    """A `sitecustomize` that, once the file $TANDEM_TEST_HOLD exists, stops the thread renaming a
    temporary file onto a name starting with its content, after creating $TANDEM_TEST_HOLD.held:
    the process is then killed there. Both ways a write ends are held: a rename (`os.replace`) and
    the swap of names that replaces an existing file (`cdi.files._exchange`)."""
    (root / "sitecustomize.py").write_text(
        textwrap.dedent("""
        import os, threading
        _hold, _replace = os.environ.get("TANDEM_TEST_HOLD"), os.replace

        def _wait_if_held(src, dst):
            name = os.path.basename(os.fspath(dst))
            target = open(_hold).read() if _hold and os.path.exists(_hold) else ""
            if target and name.startswith(target) and os.fspath(src).endswith(".tmp"):
                open(_hold + ".held", "w").close()
                threading.Event().wait()

        def _holding_replace(src, dst, *args, **kwargs):
            _wait_if_held(src, dst)
            return _replace(src, dst, *args, **kwargs)

        os.replace = _holding_replace
        import cdi.files
        _exchange = cdi.files._exchange

        def _holding_exchange(tmp, path):
            _wait_if_held(tmp, path)
            return _exchange(tmp, path)

        cdi.files._exchange = _holding_exchange
    """)
    )
    return root


@pytest.mark.parametrize("target", ["checkpoint.json", f"k8s.{DRIVER}-claim_", f"{DRIVER}_metadata_", "metadata.json"])
def test_kill_between_write_and_rename_leaves_no_temporary_file(node, monkeypatch, target):
    hooks = _hold_renames(node.node.root)
    monkeypatch.setenv("PYTHONPATH", str(hooks))
    hold = node.node.root / "hold"
    node.start(env={"TANDEM_TEST_HOLD": str(hold)})
    ref = node.claim("c5", GPU, NIC)
    hold.write_text(target)  # from now on, not while the daemon starts
    held = node.node.root / "hold.held"
    node.prepare_in_background(ref)
    assert poll(held.exists, 30), f"no write of {target} reached its rename"
    node.kill()
    leftovers = set(node.temporary_files())
    assert leftovers, "killed between write and rename: the temporary file is there"
    foreign = node.node.cdi / ".nvidia.com-gpu.json.ab12cd34.tmp"  # another CDI writer's, mid-write
    foreign.write_text("{}")

    node.start()
    # The new daemon's own writes (the probe file every 10 s) may be in flight: their temporaries
    # are not leftovers, so what is checked is that none of the killed process's remain.
    remaining = set(node.temporary_files())
    assert str(foreign) in remaining, "another writer's temporary file is left alone"
    assert not leftovers & remaining, "the killed process's temporary files are removed"
    result = node.kubelet.prepare([ref])[ref.uid]
    assert result.error == "" and len(result.devices) == 2
    assert node.kubelet.unprepare([ref]) == {ref.uid: ""}
    assert node.files_of(ref) == [] and node.checkpoint() == {}
