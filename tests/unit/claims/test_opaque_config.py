"""Opaque claim configuration: strict decoding, precedence, clear per-field errors."""

from __future__ import annotations

import pytest

from driver.claims.opaque_config import (
    ConfigDecodeError,
    GpuConfig,
    NicConfig,
    OpaqueEntry,
    Route,
    opaque_entries,
    resolve,
)

V = "tandem.dev/v1alpha1"


def _e(params, source="FromClaim", requests=(), index=0):
    return OpaqueEntry(source, tuple(requests), params, index)


def test_defaults_without_config():
    cfg = resolve([], "nic")
    assert cfg.nic == NicConfig() and cfg.gpu == GpuConfig()


def test_class_first_then_claim_later_wins_field_by_field():
    entries = [
        _e({"apiVersion": V, "kind": "NicConfig", "mode": "exclusive", "interfaceName": "net1"}, index=1),
        _e({"apiVersion": V, "kind": "NicConfig", "mode": "shared", "mad": True}, source="FromClass", index=0),
        _e({"apiVersion": V, "kind": "NicConfig", "interfaceName": "net9"}, index=2),
    ]
    cfg = resolve(entries, "nic")
    assert cfg.nic == NicConfig(mode="exclusive", interface_name="net9", mad=True)


def test_request_scoping_includes_subrequests():
    entries = [_e({"apiVersion": V, "kind": "NicConfig", "mad": True}, source="FromClass", requests=["nic"])]
    assert resolve(entries, "nic/fast").nic.mad is True
    assert resolve(entries, "other").nic.mad is False


@pytest.mark.parametrize(
    ("params", "match"),
    [
        ({"apiVersion": "v1", "kind": "NicConfig"}, "apiVersion must be"),
        ({"apiVersion": V, "kind": "TpuConfig"}, "kind must be one of"),
        ({"apiVersion": V, "kind": "NicConfig", "mdoe": "exclusive"}, "unknown field NicConfig.mdoe"),
        ({"apiVersion": V, "kind": "NicConfig", "mode": "exclusiv"}, "NicConfig.mode must be one of"),
        ({"apiVersion": V, "kind": "NicConfig", "mad": "yes"}, "NicConfig.mad must be a bool"),
        ({"apiVersion": V, "kind": "GpuConfig", "pairNics": 1}, "GpuConfig.pairNics must be a bool"),
        ({"apiVersion": V, "kind": "NicConfig", "interfaceName": "../../etc"}, "not a valid interface name"),
        ({"apiVersion": V, "kind": "NicConfig", "interfaceName": "a" * 16}, "not a valid interface name"),
        ({"apiVersion": V, "kind": "NicConfig", "interfaceName": "eth0\n"}, "not a valid interface name"),
        ({"apiVersion": V, "kind": "NicConfig", "mode": "exclusive"}, "needs interfaceName"),
        (["not", "an", "object"], "parameters must be an object"),
    ],
)
def test_bad_configs_name_the_field(params, match):
    with pytest.raises(ConfigDecodeError, match=match):
        resolve([_e(params, index=3)], "nic")


@pytest.mark.parametrize("value", [True, False])
@pytest.mark.parametrize("source", ["FromClaim", "", "FromSomewhereNew"])
def test_mad_from_anywhere_but_a_device_class_fails_the_claim(source, value):
    """umad/issm let a pod act as an InfiniBand subnet manager: only cluster admins may grant them."""
    entries = [
        _e({"apiVersion": V, "kind": "NicConfig", "mad": True}, source="FromClass", index=0),
        _e({"apiVersion": V, "kind": "NicConfig", "mad": value}, source=source, requests=["other"], index=1),
    ]
    with pytest.raises(ConfigDecodeError) as e:
        resolve(entries, "nic")  # even for a request the entry does not apply to
    assert str(e.value).startswith(f"config[1] ({source}): NicConfig.mad is accepted only from DeviceClass")
    assert "subnet manager" in str(e.value)


def test_mad_from_a_device_class_is_accepted():
    entries = [_e({"apiVersion": V, "kind": "NicConfig", "mad": True}, source="FromClass")]
    assert resolve(entries, "nic").nic.mad is True


def test_only_this_drivers_entries_are_taken():
    allocation = {
        "devices": {
            "config": [
                {"source": "FromClass", "opaque": {"driver": "other.example.com", "parameters": {"x": 1}}},
                {"source": "FromClaim", "requests": ["nic"], "opaque": {"driver": "tandem.dev", "parameters": {}}},
            ]
        }
    }
    assert opaque_entries(allocation, "tandem.dev") == [_e({}, requests=["nic"], index=1)]


def _nic(**fields):
    return _e({"apiVersion": "tandem.dev/v1alpha1", "kind": "NicConfig", "mode": "exclusive",
               "interfaceName": "net1", **fields})  # fmt: skip


def test_exclusive_ip_settings_are_decoded_canonically():
    routes = [{"destination": "10.10.0.0/16", "via": "10.9.0.1"}, {"destination": "0.0.0.0/0"}]
    cfg = resolve([_nic(addresses=["10.9.0.5/24", "fd42:0::5/64"], routes=routes, mtu=9000)], "nic").nic
    assert cfg.addresses == ("10.9.0.5/24", "fd42::5/64")
    assert cfg.routes == (Route("10.10.0.0/16", "10.9.0.1"), Route("0.0.0.0/0"))
    assert cfg.mtu == 9000


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"addresses": ["10.9.0.5"]}, r"addresses\[0\] .*prefix length"),
        ({"addresses": ["10.9.0.300/24"]}, r"addresses\[0\]"),
        ({"addresses": ["127.0.0.2/8"]}, "loopback"),
        ({"addresses": ["fe80::1/64"]}, "link-local"),
        ({"addresses": ["10.9.0.5/24", "10.9.0.5/24"]}, "twice"),
        ({"addresses": [f"10.9.0.{i}/24" for i in range(1, 18)]}, "at most 16"),
        ({"addresses": "10.9.0.5/24"}, "addresses must be a list"),
        ({"routes": [{"destination": "10.10.0.1/16"}]}, r"routes\[0\].*host bits"),
        ({"routes": [{"destination": "10.10.0.0/16", "via": "fd42::1"}]}, "different IP versions"),
        ({"routes": [{"to": "10.10.0.0/16"}]}, "destination"),
        # ipaddress would take numbers: 0.0.0.0/32 via 0.0.0.1
        ({"routes": [{"destination": 0, "via": "10.9.0.1"}]}, r"routes\[0\]\.destination must be a string, got int"),
        ({"routes": [{"destination": "10.10.0.0/16", "via": True}]}, r"routes\[0\]\.via must be a string, got bool"),
        ({"routes": [{"destination": "10.10.0.0/16", "via": None}]}, r"routes\[0\]\.via must be a string"),
        (
            {"addresses": ["10.9.0.5/24"], "routes": [{"destination": "10.10.0.0/16", "via": "10.8.0.1"}]},
            "none of the networks",
        ),
        ({"mtu": 67}, "mtu 67 must be 68"),
        ({"addresses": ["fd42::5/64"], "mtu": 1000}, "mtu 1000 must be 1280"),
        ({"mtu": True}, "mtu must be a int"),
    ],
)
def test_bad_ip_settings_name_the_field(fields, match):
    with pytest.raises(ConfigDecodeError, match=match):
        resolve([_nic(**fields)], "nic")


def test_ip_settings_need_exclusive_mode():
    shared = _e({"apiVersion": "tandem.dev/v1alpha1", "kind": "NicConfig", "addresses": ["10.9.0.5/24"]})
    with pytest.raises(ConfigDecodeError, match="apply to mode exclusive only"):
        resolve([shared], "nic")
