"""The refresh of prepared claims' NIC network data: each claim on its own, transient failures
retried a few times, a claim deleted before its Unprepare no reason to fail."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prepare_fakes import NODE, FakeAPI, Host, make_preparer, nic_name, render_host

from driver.claims.allocation import ClaimRef, PrepareSettings
from driver.claims.checkpoint import Checkpoint
from driver.claims.metadata import MetadataWriter
from driver.claims.nic import network_data as claim_refresh
from driver.claims.nic.network_data import NetworkDataRefresh
from driver.claims.prepare import Preparer
from driver.kube.api import ApiError
from driver.model import Device

NEW_IP = "10.9.9.9/24"


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory) -> Host:
    return render_host(tmp_path_factory.mktemp("host"))


class _FlakyAPI(FakeAPI):
    """Reading a claim named in `failures` fails that many times more, as an overloaded API
    server does (503), asking for `retry_after` seconds of patience."""

    def __init__(self) -> None:
        super().__init__()
        self.failures: dict[str, int] = {}
        self.retry_after = 0.0

    def get_claim(self, namespace: str, name: str) -> dict[str, Any]:
        if self.failures.get(name):
            self.failures[name] -= 1
            message = f"get claim {namespace}/{name}: HTTP 503 Service Unavailable"
            raise ApiError(message, 503, retry_after=self.retry_after)
        return super().get_claim(namespace, name)


class _Claims:
    """Two prepared claims, one on each NIC, whose NICs then got a new address."""

    def __init__(self, tmp_path: Path, host: Host) -> None:
        self.api = _FlakyAPI()
        self.devices: dict[str, Device] = dict(host.devices)
        self.preparer: Preparer = make_preparer(tmp_path / "data", tmp_path / "cdi", self.api, "a", host)
        nics = [nic_name(host, "mlx5_0"), nic_name(host, "mlx5_1")]
        self.refs: list[ClaimRef] = [
            self.api.add("default", name, f"00000000-0000-0000-0000-00000000000{name}", ("nic", nic))
            for name, nic in zip("ab", nics, strict=True)
        ]
        assert all(r.error == "" for r in self.preparer.prepare(self.refs).values())
        for nic in nics:
            old = self.devices[nic]
            assert old.nic is not None
            self.devices[nic] = dataclasses.replace(old, nic=dataclasses.replace(old.nic, ipv4=(NEW_IP,)))
        self.checkpoint = Checkpoint(tmp_path / "data", "boot")
        self.waits: list[float] = []
        self.refresh = NetworkDataRefresh(
            self.api,
            self.checkpoint,
            PrepareSettings("tandem.dev", NODE, tmp_path / "cdi", host.dev),
            self.devices.get,
            MetadataWriter(tmp_path / "data", tmp_path / "cdi", "tandem.dev"),
            self.preparer.claim_locks,
            wait=self.waits.append,
        )

    def ips(self, name: str) -> list[str]:
        return self.api.claims[("default", name)]["status"]["devices"][0]["networkData"]["ips"]

    def in_checkpoint_order(self) -> list[ClaimRef]:
        """The order of the pass: a failure of the first claim once ended it."""
        uids = list(self.checkpoint.read())
        return sorted(self.refs, key=lambda r: uids.index(r.uid))


@pytest.fixture
def claims(tmp_path: Path, host: Host) -> Iterator[_Claims]:
    c = _Claims(tmp_path, host)
    yield c
    c.preparer.close()


def test_a_claim_deleted_before_its_unprepare_does_not_keep_the_others_stale(claims: _Claims) -> None:
    gone, other = claims.in_checkpoint_order()
    del claims.api.claims[("default", gone.name)]  # the pod force-deleted; Unprepare yet to come
    assert claims.refresh.run() == 2  # both claims' metadata, the remaining one's status
    assert claims.ips(other.name)[0] == NEW_IP
    assert claims.waits == []  # a deleted claim is not waited for


def test_a_transient_failure_of_one_claim_is_retried_after_the_others(claims: _Claims) -> None:
    first, second = claims.in_checkpoint_order()
    claims.api.failures[first.name] = 2
    assert claims.refresh.run() == 2
    assert claims.ips(first.name)[0] == NEW_IP and claims.ips(second.name)[0] == NEW_IP
    assert len(claims.waits) == 2  # one backoff before each retry of the first claim
    assert claims.waits[0] < claims.waits[1]


def test_retries_are_bounded_and_the_claims_are_left_for_the_next_pass(claims: _Claims) -> None:
    claims.api.down = True
    assert claims.refresh.run() == 0
    assert len(claims.waits) == claim_refresh.RETRIES
    claims.api.down = False
    assert claims.refresh.run() == 2  # the records were not marked updated: the next pass does it
    assert [claims.ips(r.name)[0] for r in claims.refs] == [NEW_IP, NEW_IP]


def test_a_retry_waits_as_long_as_the_server_asked(claims: _Claims) -> None:
    """Its own backoff would try again after about 0.5 s; the server asked for 1.5."""
    first, _ = claims.in_checkpoint_order()
    claims.api.failures[first.name] = 1
    claims.api.retry_after = 1.5
    assert claims.refresh.run() == 2
    assert claims.waits == [1.5]
    assert claims.ips(first.name)[0] == NEW_IP


def test_a_servers_wait_never_outlasts_the_pass(claims: _Claims) -> None:
    """A Retry-After of 30 s (the most the door lets a server ask) is cut to what the pass may
    still wait: the daemon's stop waits 5 s for a pass to end. Waited out, no further retry."""
    first, second = claims.in_checkpoint_order()
    claims.api.failures[first.name] = 2
    claims.api.retry_after = 30.0
    assert claims.refresh.run() == 1  # the second claim; the first left for the next pass
    assert claims.waits == [claim_refresh.RETRY_WAIT]
    assert claims.ips(second.name)[0] == NEW_IP
