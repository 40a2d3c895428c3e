"""Claim -> this driver's devices on this node, validated before anything touches a file."""

from __future__ import annotations

import pytest
from prepare_fakes import FakeAPI, make_preparer, render_host

from driver.claims.allocation import ClaimError, ClaimRef, allocated_devices, validate_ref

REF = ClaimRef("default", "c", "uid-1")


def _claim(results, uid="uid-1"):
    return {"metadata": {"uid": uid}, "status": {"allocation": {"devices": {"results": results}}}}


def test_keeps_only_this_driver_and_strips_subrequests():
    claim = _claim([
        {"request": "gpu/large", "driver": "tandem.dev", "pool": "n1", "device": "gpu-0"},
        {"request": "other", "driver": "other.example.com", "pool": "n1", "device": "x"},
        {"request": "nic", "driver": "tandem.dev", "pool": "n1", "device": "pci-0000-8a-00-0", "shareID": "s"},
        {"request": "mon", "driver": "tandem.dev", "pool": "n1", "device": "gpu-0", "adminAccess": True},
    ])  # fmt: skip
    got = allocated_devices(claim, REF, "tandem.dev", "n1")
    assert [(d.request_names, d.device, d.share_id) for d in got] == [
        (("gpu", "mon"), "gpu-0", None),
        (("nic",), "pci-0000-8a-00-0", "s"),
    ]
    # One ordinary request makes the device ordinary: it stays under the in-use check.
    assert got[0].admin_access is False
    only_admin = _claim(
        [{"request": "mon", "driver": "tandem.dev", "pool": "n1", "device": "gpu-1", "adminAccess": True}]
    )
    assert allocated_devices(only_admin, REF, "tandem.dev", "n1")[0].admin_access is True


@pytest.mark.parametrize(
    ("claim", "match"),
    [
        ({"metadata": {"uid": "other"}, "status": {}}, "was replaced"),
        ({"metadata": {"uid": "uid-1"}, "status": {}}, "not allocated"),
        (_claim([{"request": "g", "driver": "tandem.dev", "pool": "n2", "device": "gpu-0"}]), "not this node"),
    ],
)
def test_rejections(claim, match):
    with pytest.raises(ClaimError, match=match):
        allocated_devices(claim, REF, "tandem.dev", "n1")


@pytest.mark.parametrize(
    "ref",
    [
        ClaimRef("../etc", "c", "u"),
        ClaimRef("ns", "a/b", "u"),
        ClaimRef("ns", "c", "../../x"),
        ClaimRef("ns", "c", ""),
        ClaimRef("NS", "c", "u"),
        ClaimRef("ns", "c" * 300, "u"),
        ClaimRef("ns\n", "c", "u"),
        ClaimRef("ns", "c\n", "u"),
        ClaimRef("ns", "c", "u\n"),
    ],
)
def test_untrusted_references_are_rejected(ref):
    with pytest.raises(ClaimError, match="invalid claim"):
        validate_ref(ref)


@pytest.mark.parametrize("field", ["namespace", "name", "uid"])
def test_a_rejected_reference_is_shown_escaped_with_its_length(field):
    """The error is the kubelet's answer and a log line: escaped (driver.untrusted), cut, and how
    long the value was told, not silently cut at 80 characters."""
    value = "\x1b[2J" + "x" * 5000
    with pytest.raises(ClaimError) as e:
        validate_ref(ClaimRef(**{**{"namespace": "ns", "name": "c", "uid": "u"}, field: value}))
    assert str(e.value).endswith("... (5004 characters)") and "'\\x1b[2J" in str(e.value)
    assert str(e.value).isprintable()


def test_a_failed_prepare_says_whose_problem_it_was(tmp_path):
    """What `tandem_claim_errors_total{error_type}` counts: a claim naming a device this node
    lacks, or an invalid reference, is the claim's (config); an API server that is down is "api"."""
    host = render_host(tmp_path / "host")
    api = FakeAPI()
    p = make_preparer(tmp_path / "data", tmp_path / "cdi", api, "a", host)
    try:
        absent = api.add("default", "absent", "uid-absent", ("gpu", "gpu-99"))
        bad = ClaimRef("NS", "c", "uid-bad")
        results = p.prepare([absent, bad])
        assert {uid: r.error_kind for uid, r in results.items()} == {absent.uid: "config", bad.uid: "config"}
        api.down = True
        fine = api.add("default", "fine", "uid-fine", ("gpu", "gpu-0"))
        assert p.prepare([fine])[fine.uid].error_kind == "api"
    finally:
        p.close()
