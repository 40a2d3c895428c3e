"""The claims of one pod, prepared in one call, give its containers one consistent environment.

The kubelet sends a pod's claims that are not prepared yet, for one driver, in one
NodePrepareResources call. CDI replaces an environment variable by key, so a container that gets
two claims sees only one claim's `NCCL_IB_HCA`: every claim of the call must therefore carry the
same pairing and NIC lists, computed from all of them.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from prepare_fakes import DRIVER, FakeAPI, Host, make_preparer, nic_name, render_host

import cdi
from driver.claims.cdi_spec import PAIRS_ENV, claim_spec_filename
from driver.claims.checkpoint import Checkpoint

NETWORK_ENV = (PAIRS_ENV, "NCCL_IB_HCA", "UCX_NET_DEVICES")


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory) -> Host:
    return render_host(tmp_path_factory.mktemp("host"))


@pytest.fixture
def prepared(tmp_path: Path, host: Host):
    api = FakeAPI()
    p = make_preparer(tmp_path / "data", tmp_path / "cdi", api, "a", host)
    yield api, p, tmp_path / "cdi"
    p.close()


def _network_env(cdi_root: Path, uid: str) -> dict[str, str]:
    spec = cdi.read_spec(cdi_root / claim_spec_filename(DRIVER, uid))
    entries = [*spec.container_edits.env, *(e for d in spec.devices for e in d.container_edits.env)]
    return {k: v for k, _, v in (e.partition("=") for e in entries) if k in NETWORK_ENV}


def test_a_gpu_claim_and_a_nic_claim_of_one_pod_are_paired(prepared, host: Host):
    api, p, cdi_root = prepared
    gpu = api.add("default", "gpu", "uid-gpu", ("gpu", "gpu-0"))
    nic = api.add("default", "nic", "uid-nic", ("nic", nic_name(host, "mlx5_0")))
    results = p.prepare([gpu, nic])
    assert {uid: r.error for uid, r in results.items()} == {gpu.uid: "", nic.uid: ""}
    expected = {PAIRS_ENV: "0:mlx5_0", "NCCL_IB_HCA": "=mlx5_0", "UCX_NET_DEVICES": "mlx5_0:1"}
    assert _network_env(cdi_root, gpu.uid) == expected
    assert _network_env(cdi_root, nic.uid) == expected


def test_two_nic_claims_of_one_pod_each_name_both_nics(prepared, host: Host):
    api, p, cdi_root = prepared
    pair = api.add("default", "pair", "uid-pair", ("gpu", "gpu-2"), ("nic", nic_name(host, "mlx5_1")))
    extra = api.add("default", "extra", "uid-extra", ("nic", nic_name(host, "mlx5_0")))
    assert all(r.error == "" for r in p.prepare([pair, extra]).values())
    # GPU 2 sits on mlx5_1's PCIe root: its NIC comes first; the other NIC follows.
    expected = {PAIRS_ENV: "0:mlx5_1", "NCCL_IB_HCA": "=mlx5_1,mlx5_0", "UCX_NET_DEVICES": "mlx5_1:1,mlx5_0:1"}
    assert _network_env(cdi_root, pair.uid) == expected
    assert _network_env(cdi_root, extra.uid) == expected


def test_a_failing_claim_does_not_hold_back_the_others_and_a_retry_makes_them_consistent(prepared, host: Host):
    """A claim that fails (here: not allocated yet) gets its own error; the kubelet retries the
    whole call, and then every claim, the one already prepared included, carries the same values."""
    api, p, cdi_root = prepared
    gpu = api.add("default", "gpu", "uid-gpu", ("gpu", "gpu-0"))
    nic = api.add("default", "nic", "uid-nic", ("nic", nic_name(host, "mlx5_0")))
    allocation = api.claims[("default", "nic")]["status"].pop("allocation")
    first = p.prepare([gpu, nic])
    assert first[gpu.uid].error == "" and "not allocated" in first[nic.uid].error
    assert _network_env(cdi_root, gpu.uid) == {}
    api.claims[("default", "nic")]["status"]["allocation"] = allocation
    second = p.prepare([gpu, nic])
    assert second[gpu.uid] == first[gpu.uid], "the answer for a prepared claim does not change"
    assert second[nic.uid].error == ""
    assert (
        _network_env(cdi_root, gpu.uid)
        == _network_env(cdi_root, nic.uid)
        == {
            PAIRS_ENV: "0:mlx5_0",
            "NCCL_IB_HCA": "=mlx5_0",
            "UCX_NET_DEVICES": "mlx5_0:1",
        }
    )


def test_the_record_names_the_pods_the_claim_is_reserved_for(prepared, tmp_path: Path):
    """`tandemctl` answers "which pod holds this GPU" from the record: the pods of `reservedFor`
    (not other consumers, not names that are no object names) are kept when the claim is prepared."""
    api, p, _ = prepared
    gpu = api.add("team-a", "gpu", "uid-gpu", ("gpu", "gpu-0"), pods=("train-0", "train-1"))
    reserved = api.claims[("team-a", "gpu")]["status"]["reservedFor"]
    reserved += [{"resource": "jobs", "name": "j", "uid": "u"}, {"resource": "pods", "name": "Bad\n", "uid": "v"}]
    assert p.prepare([gpu])[gpu.uid].error == ""
    assert Checkpoint(tmp_path / "data", "boot").read()[gpu.uid].pods == ("train-0", "train-1")
