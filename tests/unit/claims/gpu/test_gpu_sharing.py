"""Sharing a GPU: published with consumable capacity, allocated many times by the simulated
scheduler as the real allocator would, and prepared per share with the MPS limits CUDA enforces,
or refused where nothing would enforce them."""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prepare_fakes import DRIVER, NODE, FakeAPI, Host, make_preparer, render_host
from scheduler_fakes import allocate_one, published

from driver.claims.allocation import ClaimRef
from driver.claims.gpu.mps import MpsDaemons
from driver.claims.gpu.sharing import GpuSharing, mps_gpus
from driver.discovery.gpu.shared import COMPUTE, MEMORY, shareable
from driver.model import DeviceKind, Taint, TaintEffect
from driver.slices.build import device_to_api
from sim import apivalidate
from sim.scheduler import Request

GIB = 2**30


@pytest.fixture
def host(tmp_path: Path) -> Host:
    """The rendered node, its full GPUs published for sharing."""
    rendered = render_host(tmp_path / "node")
    devices = {n: shareable(d) if d.kind == DeviceKind.GPU else d for n, d in rendered.devices.items()}
    return dataclasses.replace(rendered, devices=devices)


@pytest.fixture
def daemons(tmp_path: Path, host: Host) -> Iterator[MpsDaemons]:
    """MPS control daemons of the stand-in in the node's driver root, needed as the checkpoint says."""
    records: dict[str, Any] = {"checkpoint": None}

    def needed() -> dict[str, str]:
        cp = records["checkpoint"]
        return mps_gpus((d for c in cp.read().values() for d in c.devices), host.devices.get) if cp else {}

    mps = MpsDaemons(tmp_path / "data" / "mps", tmp_path / "node" / "driver", needed)
    mps.records = records  # type: ignore[attr-defined]
    yield mps
    records["checkpoint"] = None
    mps.sync()  # no daemon outlives the test


def _preparer(tmp_path: Path, host: Host, api: FakeAPI, daemons: MpsDaemons) -> Any:
    preparer = make_preparer(tmp_path / "data", tmp_path / "cdi", api, "i", host, GpuSharing(daemons))
    daemons.records["checkpoint"] = preparer._checkpoint  # type: ignore[attr-defined]
    return preparer


def _claim(
    api: FakeAPI, name: str, device: str, consumed: dict[str, str] | None, sharing: str = "", **config: str
) -> ClaimRef:
    """A claim allocated `device` (a share of it with `consumed`), with a GpuConfig of `sharing` and `config`."""
    uid = str(uuid.uuid4())
    result: dict[str, Any] = {"request": "gpu", "driver": DRIVER, "pool": NODE, "device": device}
    if consumed is not None:
        result.update(shareID=str(uuid.uuid4()), consumedCapacity=consumed)
    allocation: dict[str, Any] = {"devices": {"results": [result]}}
    if sharing or config:
        params = {"apiVersion": "tandem.dev/v1alpha1", "kind": "GpuConfig", **config}
        if sharing:
            params["sharing"] = sharing
        allocation["devices"]["config"] = [{"source": "FromClass", "opaque": {"driver": DRIVER, "parameters": params}}]
    api.claims[("default", name)] = {
        "metadata": {"name": name, "namespace": "default", "uid": uid},
        "status": {"allocation": allocation, "reservedFor": [{"resource": "pods", "name": name, "uid": uid}]},
    }
    return ClaimRef("default", name, uid)


def _env(tmp_path: Path, uid: str) -> dict[str, str]:
    spec = json.loads((tmp_path / "cdi" / f"k8s.{DRIVER}-claim_{uid}.json").read_text())
    env = [e for d in spec["devices"] for e in d["containerEdits"].get("env", [])]
    return dict(e.split("=", 1) for e in env)


def _mounts(tmp_path: Path, uid: str) -> dict[str, str]:
    spec = json.loads((tmp_path / "cdi" / f"k8s.{DRIVER}-claim_{uid}.json").read_text())
    return {m["containerPath"]: m["hostPath"] for d in spec["devices"] for m in d["containerEdits"].get("mounts", [])}


def _mount_options(tmp_path: Path, uid: str) -> dict[str, list[str]]:
    spec = json.loads((tmp_path / "cdi" / f"k8s.{DRIVER}-claim_{uid}.json").read_text())
    return {m["containerPath"]: m["options"] for d in spec["devices"] for m in d["containerEdits"].get("mounts", [])}


# -- publishing ----------------------------------------------------------------------------------


def test_a_shared_gpu_is_published_once_with_memory_and_compute_the_api_server_accepts(host: Host) -> None:
    api = device_to_api(host.devices["gpu-0"], {}, "")
    assert api["allowMultipleAllocations"] is True
    assert api["capacity"][MEMORY] == {
        "value": "80Gi",
        "requestPolicy": {"default": "80Gi", "validRange": {"min": "1Gi", "max": "80Gi", "step": "1Mi"}},
    }
    assert api["capacity"][COMPUTE] == {
        "value": "100",
        "requestPolicy": {"default": "100", "validRange": {"min": "1", "max": "100", "step": "1"}},
    }
    assert not apivalidate._device_problems("spec.devices[0]", api, False)


def test_a_taint_on_a_shared_gpu_reaches_every_claim_sharing_it(host: Host) -> None:
    """One device, however many shares: its taint is in the one published entry they all hold."""
    tainted = dataclasses.replace(
        host.devices["gpu-0"], taints=(Taint("tandem.dev/xid", TaintEffect.NO_EXECUTE, "79"),)
    )
    api = device_to_api(tainted, {}, "2026-01-01T00:00:00Z")
    assert api["allowMultipleAllocations"] and api["taints"][0]["key"] == "tandem.dev/xid"


# -- the simulated scheduler, as the real allocator ----------------------------------------------


@pytest.fixture
def srv(host: Host) -> Iterator[Any]:
    with published(d for d in host.devices.values() if d.kind == DeviceKind.GPU) as server:
        yield server


def _gpu0(**capacity: str) -> Request:
    return Request("gpu", "gpu.tandem.dev", lambda d: d["name"] == "gpu-0", capacity=capacity)


def test_two_shares_fit_a_gpu_and_a_third_that_asks_for_more_than_is_left_waits(srv: Any) -> None:
    a = allocate_one(srv, "a", _gpu0(memory="40Gi", computePercent="50"))
    b = allocate_one(srv, "b", _gpu0(memory="20G", computePercent="30"))
    assert a["shareID"] != b["shareID"]
    # As the real allocator writes them: rounded to a step, in the step's format (1Mi: binary).
    assert a["consumedCapacity"] == {MEMORY: "40Gi", COMPUTE: "50"}
    assert b["consumedCapacity"] == {MEMORY: "19074Mi", COMPUTE: "30"}  # 20G rounded up to whole MiB
    with pytest.raises(LookupError):
        allocate_one(srv, "c", _gpu0(memory="30Gi", computePercent="10"))
    assert allocate_one(srv, "d", _gpu0(memory="10Gi", computePercent="10"))["device"] == "gpu-0"
    # Below the minimum: the minimum, as the policy writes it.
    assert allocate_one(srv, "tiny", _gpu0(memory="1", computePercent="1"))["consumedCapacity"][MEMORY] == "1Gi"


def test_a_claim_that_names_no_amount_holds_the_whole_gpu(srv: Any) -> None:
    whole = allocate_one(srv, "whole", _gpu0())
    assert whole["consumedCapacity"] == {MEMORY: "80Gi", COMPUTE: "100"}  # the defaults, as written
    with pytest.raises(LookupError):
        allocate_one(srv, "share", _gpu0(memory="1Gi", computePercent="1"))


# -- prepare -------------------------------------------------------------------------------------


def test_an_mps_share_gets_its_limits_and_the_daemon_of_its_gpu(
    tmp_path: Path, host: Host, daemons: MpsDaemons
) -> None:
    api = FakeAPI()
    preparer = _preparer(tmp_path, host, api, daemons)
    a = _claim(api, "a", "gpu-0", {MEMORY: "20Gi", COMPUTE: "25"}, "MPS")
    b = _claim(api, "b", "gpu-0", {MEMORY: "40Gi", COMPUTE: "50"}, "MPS")
    assert preparer.prepare([a])[a.uid].error == ""
    assert preparer.prepare([b])[b.uid].error == ""
    env = _env(tmp_path, a.uid)
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=20480M"
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == "/tmp/nvidia-mps"
    assert _env(tmp_path, b.uid)["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=40960M"
    assert _mounts(tmp_path, a.uid)["/tmp/nvidia-mps"] == str(daemons.pipe_dir("gpu-0"))
    assert _mounts(tmp_path, a.uid)["/dev/shm"] == str(daemons.shm_dir("gpu-0"))  # the daemon's private one
    # What a tenant can write (docs/security.md): the pipe directory and /dev/shm, as CUDA needs;
    # the daemon's log directory only read; nothing of it with set-uid programs or device nodes.
    options = _mount_options(tmp_path, a.uid)
    assert options["/tmp/nvidia-mps"][0] == options["/dev/shm"][0] == "rw"
    assert options["/var/log/nvidia-mps"][0] == "ro"
    assert all({"nosuid", "nodev"} <= set(o) for o in options.values() if o[0] == "rw")
    pid = daemons.running("gpu-0")
    assert pid is not None  # one daemon for both claims
    assert preparer.unprepare([a])[a.uid].error == ""
    assert daemons.running("gpu-0") == pid  # b still uses it
    assert preparer.unprepare([b])[b.uid].error == ""
    assert daemons.running("gpu-0") is None and not (daemons.root / "gpu-0").exists()
    preparer.close()


@pytest.mark.parametrize(
    ("consumed", "sharing", "error"),
    [
        ({MEMORY: "20Gi", COMPUTE: "25"}, "", "nothing would hold its processes to it: set GpuConfig.sharing MPS"),
        ({MEMORY: "80Gi", COMPUTE: "25"}, "", "holds a share of it (81920Mi of memory and 25% of compute)"),
        ({MEMORY: "20Gi", COMPUTE: "100"}, "TimeSlicing", "TimeSlicing sets the time slice of the whole GPU"),
    ],
)
def test_a_share_nothing_enforces_is_refused(
    tmp_path: Path, host: Host, daemons: MpsDaemons, consumed: dict[str, str], sharing: str, error: str
) -> None:
    api = FakeAPI()
    preparer = _preparer(tmp_path, host, api, daemons)
    ref = _claim(api, "c", "gpu-0", consumed, sharing)
    assert error in preparer.prepare([ref])[ref.uid].error
    assert not (tmp_path / "cdi" / f"k8s.{DRIVER}-claim_{ref.uid}.json").exists()
    assert daemons.running("gpu-0") is None
    preparer.close()


@pytest.mark.parametrize("sharing", ["", "TimeSlicing"])
def test_the_whole_gpu_needs_no_mps(tmp_path: Path, host: Host, daemons: MpsDaemons, sharing: str) -> None:
    api = FakeAPI()
    preparer = _preparer(tmp_path, host, api, daemons)
    ref = _claim(api, "c", "gpu-0", {MEMORY: "80Gi", COMPUTE: "100"}, sharing)
    assert preparer.prepare([ref])[ref.uid].error == ""
    assert not any(k.startswith("CUDA_MPS") for k in _env(tmp_path, ref.uid))
    preparer.close()


def test_mps_on_a_mig_device_is_refused(tmp_path: Path, daemons: MpsDaemons) -> None:
    mig = tmp_path / "mig"
    host = render_host(mig)
    device = next(d for d in host.devices.values() if d.kind == DeviceKind.GPU)
    as_mig = dataclasses.replace(device, name="gpu-0-mig-1g-10gb-0", kind=DeviceKind.MIG)
    host.devices[as_mig.name] = as_mig
    api = FakeAPI()
    preparer = make_preparer(tmp_path / "data", tmp_path / "cdi", api, "i", host, GpuSharing(daemons))
    ref = _claim(api, "c", as_mig.name, None, "MPS")
    assert "applies to full GPUs only" in preparer.prepare([ref])[ref.uid].error
    preparer.close()


def test_an_mps_gpu_with_another_gpu_in_one_claim_is_refused(tmp_path: Path, host: Host, daemons: MpsDaemons) -> None:
    api = FakeAPI()
    preparer = _preparer(tmp_path, host, api, daemons)
    ref = _claim(api, "c", "gpu-0", {MEMORY: "20Gi", COMPUTE: "25"}, "MPS")
    claim = api.claims[("default", "c")]
    claim["status"]["allocation"]["devices"]["results"].append(
        {"request": "gpu", "driver": DRIVER, "pool": NODE, "device": "gpu-1"}
    )
    assert "connects to one MPS daemon" in preparer.prepare([ref])[ref.uid].error
    preparer.close()
