"""Opaque claim configuration: strict decoding, precedence, clear per-field errors."""

from __future__ import annotations

import json

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
from driver.claims.vocabulary import NicMode, Sharing, TimeSliceInterval
from driver.resource_api import MAX_OPAQUE_PARAMETERS

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


def test_words_become_members_and_one_given_as_no_string_is_refused_by_its_json_type():
    gpu = _e({"apiVersion": V, "kind": "GpuConfig", "sharing": "TimeSlicing", "timeSliceInterval": "Long"})
    cfg = resolve([gpu, _e({"apiVersion": V, "kind": "NicConfig", "mode": "exclusive", "interfaceName": "net1"})], "r")
    assert cfg.gpu.sharing is Sharing.TIME_SLICING and cfg.gpu.time_slice_interval is TimeSliceInterval.LONG
    assert cfg.nic.mode is NicMode.EXCLUSIVE and cfg.nic.exclusive
    with pytest.raises(ConfigDecodeError) as e:
        resolve([_e({"apiVersion": V, "kind": "GpuConfig", "sharing": 1})], "r")
    assert str(e.value) == "spec.devices.config[0].opaque.parameters.sharing must be a string, got an integer"
    with pytest.raises(ConfigDecodeError) as e:
        resolve([_e({"apiVersion": V, "kind": "GpuConfig", "sharing": "Time"})], "r")
    assert str(e.value) == (
        "spec.devices.config[0].opaque.parameters.sharing must be one of ['MPS', 'TimeSlicing'], got 'Time'"
    )


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"kind": "GpuConfig", "sharing": "mps"}, ".sharing must be one of ['MPS', 'TimeSlicing'], got 'mps' (did you mean 'MPS'?)"),
        ({"kind": "NicConfig", "mode": "Exclusive"}, ".mode must be one of ['shared', 'exclusive'], got 'Exclusive' (did you mean 'exclusive'?)"),
        ({"kind": "GpuConfig", "pairnics": True}, ": unknown GpuConfig field 'pairnics' (did you mean 'pairNics'?)"),
        ({"kind": "gpuConfig"}, ".kind must be one of ['GpuConfig', 'NicConfig'], got 'gpuConfig' (did you mean 'GpuConfig'?)"),
    ],
)  # fmt: skip
def test_a_case_mistake_is_told_its_spelling(params, message):
    with pytest.raises(ConfigDecodeError) as e:
        resolve([_e({"apiVersion": V, **params}, index=2)], "r")
    assert str(e.value) == f"spec.devices.config[2].opaque.parameters{message}"


def test_request_scoping_includes_subrequests():
    entries = [_e({"apiVersion": V, "kind": "NicConfig", "mad": True}, source="FromClass", requests=["nic"])]
    assert resolve(entries, "nic/fast").nic.mad is True
    assert resolve(entries, "other").nic.mad is False


@pytest.mark.parametrize(
    ("params", "match"),
    [
        ({"apiVersion": "v1", "kind": "NicConfig"}, "apiVersion must be"),
        ({"apiVersion": V, "kind": "TpuConfig"}, "kind must be one of"),
        ({"apiVersion": V, "kind": "NicConfig", "mdoe": "exclusive"}, "unknown NicConfig field 'mdoe'"),
        ({"apiVersion": V, "kind": "NicConfig", "mode": "exclusiv"}, r"parameters\.mode must be one of"),
        ({"apiVersion": V, "kind": "NicConfig", "mad": "yes"}, r"parameters\.mad must be a boolean, got a string"),
        ({"apiVersion": V, "kind": "GpuConfig", "pairNics": 1}, r"parameters\.pairNics must be a boolean"),
        ({"apiVersion": V, "kind": "NicConfig", "interfaceName": "../../etc"}, "not a valid interface name"),
        ({"apiVersion": V, "kind": "NicConfig", "interfaceName": "a" * 16}, "not a valid interface name"),
        ({"apiVersion": V, "kind": "NicConfig", "interfaceName": "eth0\n"}, "not a valid interface name"),
        ({"apiVersion": V, "kind": "NicConfig", "mode": "exclusive"}, "needs interfaceName"),
        (["not", "an", "object"], r"config\[3\]\.opaque\.parameters must be an object, got a list"),
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
    assert str(e.value).startswith(
        "spec.devices.config[1].opaque.parameters.mad is accepted only from DeviceClass configuration, not a claim"
    )
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
    assert opaque_entries(allocation, "tandem.dev") == [_e({}, requests=["nic"], index=0)]


def test_a_claims_entry_is_numbered_as_the_claim_numbers_it():
    """The allocation puts the classes' entries first: the claim's own first entry is its
    config[0] however many come before it, and other drivers' entries still count."""
    tandem = {"driver": "tandem.dev", "parameters": {"apiVersion": V, "kind": "GpuConfig", "sharing": "mps"}}
    allocation = {
        "devices": {
            "config": [
                {"source": "FromClass", "opaque": {"driver": "tandem.dev", "parameters": {}}},
                {"source": "FromClass", "opaque": {"driver": "other.example.com", "parameters": {}}},
                {"source": "FromClaim", "opaque": {"driver": "other.example.com", "parameters": {}}},
                {"source": "FromClaim", "opaque": tandem},
            ]
        }
    }
    class_entry, claim_entry = opaque_entries(allocation, "tandem.dev")
    assert (class_entry.index, claim_entry.index) == (0, 1)
    assert class_entry.where == "DeviceClass config[0].opaque.parameters"
    with pytest.raises(ConfigDecodeError, match=r"^spec\.devices\.config\[1\]\.opaque\.parameters\.sharing "):
        resolve([claim_entry], "r")


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
        (
            {"routes": [{"destination": 0, "via": "10.9.0.1"}]},
            r"routes\[0\]\.destination must be a string, got an integer",
        ),
        (
            {"routes": [{"destination": "10.10.0.0/16", "via": True}]},
            r"routes\[0\]\.via must be a string, got a boolean",
        ),
        ({"routes": [{"destination": "10.10.0.0/16", "via": None}]}, r"routes\[0\]\.via must be a string"),
        (
            {"addresses": ["10.9.0.5/24"], "routes": [{"destination": "10.10.0.0/16", "via": "10.8.0.1"}]},
            "none of the networks",
        ),
        ({"mtu": 67}, "mtu 67 must be 68"),
        ({"addresses": ["fd42::5/64"], "mtu": 1000}, "mtu 1000 must be 1280"),
        ({"mtu": True}, "mtu must be an integer, got a boolean"),
    ],
)
def test_bad_ip_settings_name_the_field(fields, match):
    with pytest.raises(ConfigDecodeError, match=match):
        resolve([_nic(**fields)], "nic")


def test_ip_settings_need_exclusive_mode():
    shared = _e({"apiVersion": "tandem.dev/v1alpha1", "kind": "NicConfig", "addresses": ["10.9.0.5/24"]})
    with pytest.raises(ConfigDecodeError, match="apply to mode exclusive only"):
        resolve([shared], "nic")


# What a hostile tenant puts in a claim's config: a terminal escape that clears the screen, a
# forged log line, a bidi override, and the whole thing long enough to fill every line it is in.
HOSTILE = "\x1b[2J\x1b[31mpwned\nE0101 forged log line\r\u202eelif\x00" + "k" * 5000


def _assert_safe(message: str) -> None:
    """One printable line (no control, escape, separator or bidi character), bounded."""
    assert message.isprintable(), message[:200]
    assert len(message) < 1000, len(message)


@pytest.mark.parametrize(
    ("params", "shown"),
    [
        ({"apiVersion": V, "kind": "NicConfig", HOSTILE: 1}, "unknown NicConfig field '\\x1b[2J\\x1b[31mpwned\\nE0101"),
        ({"apiVersion": HOSTILE[:500], "kind": "NicConfig"}, "got '\\x1b[2J"),
        ({"apiVersion": V, "kind": HOSTILE[:500]}, "got '\\x1b[2J"),
        ({"apiVersion": V, "kind": "NicConfig", "mode": HOSTILE[:500]}, "parameters.mode must be one of"),
        ({"apiVersion": V, "kind": "GpuConfig", "sharing": HOSTILE[:500]}, "parameters.sharing must be one of"),
        ({"apiVersion": V, "kind": "NicConfig", "interfaceName": HOSTILE[:500]}, "not a valid interface name"),
        ({**_nic(addresses=[HOSTILE[:500]]).parameters}, "is not an address with a prefix length"),
        ({**_nic(routes=[{"destination": HOSTILE[:500]}]).parameters}, "too long for an address or network"),
        ({**_nic(routes=[{"destination": "\x1b[2J/8"}]).parameters}, "does not appear to be"),
    ],
)
def test_a_tenants_strings_reach_the_error_escaped_and_bounded(params, shown):
    """The error becomes the kubelet's answer, a PrepareFailed Event and a log line: a tenant's
    key or value in it is escaped as repr escapes it, cut, and its length told (issue 22, 6)."""
    with pytest.raises(ConfigDecodeError) as e:
        resolve([_e(params)], "nic")
    _assert_safe(str(e.value))
    assert shown in str(e.value)


def test_a_long_key_is_cut_and_its_length_told():
    with pytest.raises(ConfigDecodeError) as e:
        resolve([_e({"apiVersion": V, "kind": "NicConfig", HOSTILE: 1})], "nic")
    assert str(e.value).endswith(f"... ({len(HOSTILE)} characters)")


def test_a_request_name_is_shown_escaped():
    entries = [_e({"apiVersion": V, "kind": "NicConfig", "mode": "exclusive"})]
    with pytest.raises(ConfigDecodeError) as e:
        resolve(entries, "nic\x1b[2J")
    _assert_safe(str(e.value))
    assert "request 'nic\\x1b[2J'" in str(e.value)


def _params_of(size: int) -> dict[str, object]:
    """NicConfig parameters of exactly `size` bytes of compact JSON, an unknown key making up the rest."""
    empty = {"apiVersion": V, "kind": "NicConfig", "": 1}
    key = "k" * (size - len(json.dumps(empty, separators=(",", ":"))))
    return {"apiVersion": V, "kind": "NicConfig", key: 1}


def test_parameters_over_the_api_servers_limit_are_refused_unread():
    """A 1 MiB key (from an API server that does not hold parameters to 10 KiB) is refused by its
    size before any of it is looked at or repeated."""
    with pytest.raises(ConfigDecodeError) as e:
        resolve([_e(_params_of(2**20))], "nic")
    assert str(e.value) == f"spec.devices.config[0].opaque.parameters is {2**20} bytes, at most {MAX_OPAQUE_PARAMETERS}"


def test_the_limit_is_the_api_servers_own():
    """10 KiB of JSON, as the API server counts it: what it lets through is decoded (and here
    fails on its unknown key), one byte more is refused by its size."""
    with pytest.raises(ConfigDecodeError, match="unknown NicConfig field"):
        resolve([_e(_params_of(MAX_OPAQUE_PARAMETERS))], "nic")
    with pytest.raises(ConfigDecodeError, match=f"parameters is {MAX_OPAQUE_PARAMETERS + 1} bytes"):
        resolve([_e(_params_of(MAX_OPAQUE_PARAMETERS + 1))], "nic")
