"""Shared RoCE NICs: published with consumable capacity, allocated many times by the simulated
scheduler as the real allocator would, prepared per share, and exclusive mode only for the holder
of the whole NIC."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prepare_fakes import DRIVER, NODE, FakeAPI, Host, make_preparer, nic_name, render_host
from scheduler_fakes import allocate_one, published

from driver.claims.allocation import ClaimRef
from driver.discovery.nic.device import RDMA_NETNS_MODE, SHARES, shared_capacity
from sim import apivalidate
from sim.scheduler import Request, attribute

SHARED = 8


@pytest.fixture
def host(tmp_path: Path) -> Host:
    """The rendered node, its NICs shared by `SHARED` claims."""
    rendered = render_host(tmp_path / "node")
    sharing = shared_capacity(SHARED)
    devices = {
        name: dataclasses.replace(
            d,
            capacity=sharing.capacity,
            allow_multiple_allocations=True,
            request_policies=sharing.request_policies,
        )
        if d.nic is not None
        else d
        for name, d in rendered.devices.items()
    }
    return dataclasses.replace(rendered, devices=devices)


def _claim(api: FakeAPI, name: str, device: str, shares: str, config: dict[str, Any] | None = None) -> ClaimRef:
    uid = str(uuid.uuid4())
    result = {
        "request": "nic", "driver": DRIVER, "pool": NODE, "device": device,
        "shareID": str(uuid.uuid4()), "consumedCapacity": {SHARES: shares},
    }  # fmt: skip
    allocation: dict[str, Any] = {"devices": {"results": [result]}}
    if config:
        opaque = {"driver": DRIVER, "parameters": {"apiVersion": "tandem.dev/v1alpha1", "kind": "NicConfig", **config}}
        allocation["devices"]["config"] = [{"source": "FromClaim", "opaque": opaque}]
    api.claims[("default", name)] = {
        "metadata": {"name": name, "namespace": "default", "uid": uid},
        "status": {"allocation": allocation, "reservedFor": [{"resource": "pods", "name": name, "uid": uid}]},
    }
    return ClaimRef("default", name, uid)


def test_claims_sharing_a_nic_each_get_its_rdma_devices_and_its_network_data(tmp_path: Path, host: Host) -> None:
    api = FakeAPI()
    preparer = make_preparer(tmp_path / "data", tmp_path / "cdi", api, "i", host)
    nic = nic_name(host, "mlx5_0")
    refs = [_claim(api, f"share-{i}", nic, "1") for i in range(3)]
    results = {uid: preparer.prepare([ref])[uid] for ref in refs for uid in [ref.uid]}
    assert all(r.error == "" for r in results.values()), results
    ids = {r.devices[0].cdi_device_ids[0] for r in results.values()}
    assert len(ids) == 3  # one CDI device per share
    info = host.devices[nic].nic
    assert info is not None
    for ref in refs:
        (entry,) = api.claims[("default", ref.name)]["status"]["devices"]
        share = api.claims[("default", ref.name)]["status"]["allocation"]["devices"]["results"][0]["shareID"]
        assert entry["shareID"] == share
        assert entry["networkData"]["interfaceName"] == info.ifname  # shared mode: the host's netdev
        assert entry["networkData"]["hardwareAddress"] == info.mac
        assert entry["networkData"]["ips"]
    preparer.close()


def test_exclusive_mode_needs_the_whole_nic(tmp_path: Path, host: Host) -> None:
    api = FakeAPI()
    preparer = make_preparer(tmp_path / "data", tmp_path / "cdi", api, "i", host)
    nic = nic_name(host, "mlx5_0")
    exclusive = {"mode": "exclusive", "interfaceName": "net1"}
    part = _claim(api, "part", nic, "1", exclusive)
    error = preparer.prepare([part])[part.uid].error
    assert "exclusive" in error and f"1 of its {SHARED} shares" in error
    whole = _claim(api, "whole", nic, str(SHARED), exclusive)
    assert preparer.prepare([whole])[whole.uid].error == ""
    (entry,) = api.claims[("default", "whole")]["status"]["devices"]
    assert entry["networkData"]["interfaceName"] == "net1"
    assert "RDMA device is not moved" in entry["conditions"][0]["message"]
    preparer.close()


def test_exclusive_mode_is_refused_where_the_rdma_device_could_not_follow(tmp_path: Path, host: Host) -> None:
    nic = nic_name(host, "mlx5_0")
    device = host.devices[nic]
    host.devices[nic] = dataclasses.replace(device, attributes={**device.attributes, RDMA_NETNS_MODE: "exclusive"})
    api = FakeAPI()
    preparer = make_preparer(tmp_path / "data", tmp_path / "cdi", api, "i", host)
    ref = _claim(api, "c", nic, str(SHARED), {"mode": "exclusive", "interfaceName": "net1"})
    assert "RDMA namespace mode is exclusive" in preparer.prepare([ref])[ref.uid].error
    preparer.close()


# -- the simulated scheduler and API server, as the real ones ------------------------------------


@pytest.fixture
def srv(host: Host) -> Iterator[Any]:
    with published(d for d in host.devices.values() if d.nic is not None) as server:
        yield server


def _nic0(shares: str = "") -> Request:
    return Request(
        "nic",
        "nic.tandem.dev",
        lambda d: attribute(d, "rdmaDevice") == "mlx5_0",
        capacity={SHARES: shares} if shares else {},
    )


def test_eight_claims_share_a_nic_and_a_ninth_waits(srv: Any) -> None:
    results = [allocate_one(srv, f"c{i}", _nic0("1")) for i in range(SHARED)]
    assert len({r["shareID"] for r in results}) == SHARED
    assert {r["consumedCapacity"][SHARES] for r in results} == {"1"}
    with pytest.raises(LookupError):
        allocate_one(srv, "ninth", _nic0("1"))


def test_a_claim_without_a_capacity_request_takes_the_whole_nic(srv: Any) -> None:
    whole = allocate_one(srv, "whole", _nic0())
    assert whole["consumedCapacity"] == {SHARES: str(SHARED)}
    with pytest.raises(LookupError):
        allocate_one(srv, "share", _nic0("1"))


def test_requests_round_up_to_whole_shares_and_above_all_of_them_never_fit(srv: Any) -> None:
    assert allocate_one(srv, "tiny", _nic0("100m"))["consumedCapacity"] == {SHARES: "1"}
    with pytest.raises(LookupError):
        allocate_one(srv, "too-many", _nic0(str(SHARED + 1)))


@pytest.mark.parametrize(
    ("policy", "problem"),
    [
        ({"default": "8", "validRange": {"min": "1", "max": "8", "step": "1"}}, ""),
        ({"default": "9", "validRange": {"min": "1", "max": "8", "step": "1"}}, "validRange.max"),
        ({"default": "1", "validRange": {"min": "1", "step": "8"}}, "one step is larger"),
        ({"validRange": {"min": "1"}}, "default: Required value"),
        ({"default": "2", "validValues": ["1", "2"], "validRange": {"min": "1"}}, "exactly one policy"),
        ({"default": "3", "validValues": ["1", "2"]}, "default value is not valid"),
    ],
)
def test_request_policies_are_validated_as_the_api_server_does(policy: dict[str, Any], problem: str) -> None:
    device = {
        "name": "n",
        "allowMultipleAllocations": True,
        "capacity": {SHARES: {"value": "8", "requestPolicy": policy}},
    }
    problems = apivalidate._device_problems("spec.devices[0]", device, False)
    assert (problem in " ".join(problems)) if problem else not problems, problems
    device.pop("allowMultipleAllocations")
    assert any("Forbidden" in p for p in apivalidate._device_problems("spec.devices[0]", device, False))


def test_one_share_is_an_ordinary_device() -> None:
    sharing = shared_capacity(1)
    assert (sharing.capacity, sharing.allow_multiple_allocations, sharing.request_policies) == ({}, False, {})
