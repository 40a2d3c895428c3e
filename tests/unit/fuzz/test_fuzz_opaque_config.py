"""Fuzzing the decoder of opaque claim configuration (driver/claims/opaque_config.py): GpuConfig
and NicConfig, written by any tenant who can write a ResourceClaim.

The property: any parameters, any entries, resolve to a `RequestConfig` or raise
`ConfigDecodeError` (what prepare catches, to fail the claim with its message), never anything
else. Strategies: valid configurations with their fields mutated at any depth (wrong types,
missing, extra, huge numbers, addresses of every shape), and any JSON value at all.
"""

from __future__ import annotations

from fuzzing import fuzz, json_values, mutated
from hypothesis import example
from hypothesis import strategies as st

from driver.claims.opaque_config import (
    API_VERSION,
    FROM_CLASS,
    ConfigDecodeError,
    OpaqueEntry,
    RequestConfig,
    opaque_entries,
    resolve,
)

DRIVER = "tandem.dev"

addresses = (
    st.ip_addresses().map(str)
    | st.builds(lambda ip, n: f"{ip}/{n}", st.ip_addresses(), st.integers(-1, 200))
    | st.sampled_from(["10.0.0.5/24", "fd00::5/64", "10.0.0.0/8", "::/0", "1.2.3.4/33", "fe80::1%eth0/64", "٣.1.1.1/8"])
    | st.text(max_size=70)
)
gpu_configs = st.fixed_dictionaries(
    {"apiVersion": st.just(API_VERSION), "kind": st.just("GpuConfig")},
    optional={
        "pairNics": st.booleans(),
        "sharing": st.sampled_from(["MPS", "TimeSlicing", "mps", ""]),
        "timeSliceInterval": st.sampled_from(["Default", "Short", "Medium", "Long", "long"]),
    },
)
nic_configs = st.fixed_dictionaries(
    {"apiVersion": st.just(API_VERSION), "kind": st.just("NicConfig")},
    optional={
        "mode": st.sampled_from(["shared", "exclusive", "Exclusive"]),
        "interfaceName": st.sampled_from(["net1", "eth0.5", "a" * 16, "", "../x", "net\n1"]) | st.text(max_size=20),
        "mad": st.booleans(),
        "addresses": st.lists(addresses, max_size=18),
        "routes": st.lists(
            st.fixed_dictionaries({"destination": addresses}, optional={"via": st.ip_addresses().map(str)}),
            max_size=18,
        ),
        "mtu": st.integers(0, 70000) | st.integers(),
    },
)


@st.composite
def parameters(draw: st.DrawFn) -> object:
    """A configuration as a tenant might write it: valid, mutated, or any JSON at all."""
    config = draw(gpu_configs | nic_configs)
    return draw(st.sampled_from([config, mutated(config, draw(st.data())), draw(json_values)]))


entries = st.lists(
    st.builds(
        OpaqueEntry,
        source=st.sampled_from([FROM_CLASS, "FromClaim", ""]),
        requests=st.lists(st.sampled_from(["gpu", "nic", "nic/sub"]), max_size=2).map(tuple),
        parameters=parameters(),
        index=st.integers(0, 3),
    ),
    max_size=3,
)


@example(found=[OpaqueEntry("FromClaim", (), {"apiVersion": API_VERSION, "kind": []}, 0)])
@example(found=[OpaqueEntry("FromClaim", (), {"apiVersion": API_VERSION, "kind": {"a": 1}}, 0)])
@fuzz(entries)
def test_any_configuration_resolves_or_is_refused_with_its_own_error(found: list[OpaqueEntry]) -> None:
    for request in ("gpu", "nic/sub"):
        try:
            config = resolve(found, request)
        except ConfigDecodeError as e:
            assert str(e)
            continue
        assert isinstance(config, RequestConfig)
        assert all(isinstance(a, str) for a in config.nic.addresses)


@fuzz(
    st.lists(
        st.fixed_dictionaries(
            {"source": st.sampled_from([FROM_CLASS, "FromClaim"])},
            optional={
                "requests": st.lists(st.text(max_size=5), max_size=2),
                "opaque": st.fixed_dictionaries(
                    {"driver": st.sampled_from([DRIVER, "other"])}, optional={"parameters": parameters()}
                ),
            },
        ),
        max_size=4,
    )
)
def test_the_entries_of_an_allocation_the_server_validated_are_this_drivers(config: list[dict[str, object]]) -> None:
    """The allocation's shape is the API server's (it validates the claim); its parameters are not."""
    found = opaque_entries({"devices": {"config": config}}, DRIVER)  # type: ignore[typeddict-item]
    assert all(e.index >= 0 for e in found) and len(found) <= len(config)
