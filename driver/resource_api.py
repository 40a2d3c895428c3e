"""What resource.k8s.io/v1 demands of the objects the driver writes, in one place.

The API server rejects a whole ResourceSlice (every device in it, not just the one that breaks a
rule) and a whole claim status write when a limit is exceeded, so discovery trims each device to
fit before it is published and the slice planner cuts the pool into slices that fit. The numbers
are the `resource/v1` validation constants (docs/reference/resource-api.md, 'Limits').
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping
from decimal import Decimal

API_VERSION = "resource.k8s.io/v1"

# Per ResourceSlice (ResourceSliceMaxDevices), and when any device in it has taints,
# consumesCounters or list-typed attributes (ResourceSliceMaxDevicesWithAdvancedFeatures).
MAX_DEVICES_PER_SLICE = 128
MAX_DEVICES_ADVANCED = 64
# Counter sets in one slice (ResourceSliceMaxCounterSets); counters in a set or consumed by one
# device from one set (...MaxCountersPerCounterSet, ...MaxCountersPerDeviceCounterConsumption).
# A device may consume from at most 2 sets; a dynamic-MIG device uses one.
MAX_COUNTER_SETS = 8
MAX_COUNTERS = 32

# Per device: attribute and capacity entries together, attribute values (a list attribute counts
# each element), characters of a string or version value, taints.
MAX_ATTRIBUTES_AND_CAPACITIES = 32
MAX_ATTRIBUTE_VALUES = 48
MAX_VALUE_LENGTH = 64
MAX_TAINTS = 16

# Per device entry of a claim's status.devices: addresses in networkData.ips.
MAX_NETWORK_IPS = 16

# Bytes of one opaque configuration's `parameters`, as JSON (OpaqueParametersMaxLength).
MAX_OPAQUE_PARAMETERS = 10 * 1024


def value_count(attributes: Mapping[str, object]) -> int:
    """Attribute values as MAX_ATTRIBUTE_VALUES counts them: a list counts each of its elements."""
    return sum(len(v) if isinstance(v, tuple) else 1 for v in attributes.values())


def rfc3339(wall: float | None = None) -> str:
    """A time as the API writes metav1.Time: RFC 3339 in UTC, whole seconds, `Z` ("2025-01-02T03:04:05Z").

    `wall` is Unix time; None is now.
    """
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() if wall is None else wall))


# resource.Quantity's grammar (apimachinery): a decimal number, then a binary-SI suffix, a
# decimal-SI suffix or a decimal exponent.
_QUANTITY = re.compile(r"([+-]?(?:\d+(?:\.\d*)?|\.\d+))(?:([KMGTPE]i|[numkMGTPE]?)|[eE]([+-]?\d+))")
_SCALE = {
    **{s: Decimal(1024) ** (i + 1) for i, s in enumerate(("Ki", "Mi", "Gi", "Ti", "Pi", "Ei"))},
    **{
        s: Decimal(10) ** e
        for s, e in {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}.items()
    },
}


def parse_quantity(text: str) -> Decimal:
    """The exact value of a quantity string (`80Gi`, `500m`, `1e3`), so that two spellings of one
    value compare equal, as the API server's canonical rewrite makes them; ValueError if not one."""
    m = _QUANTITY.fullmatch(text)
    if m is None:
        raise ValueError(f"{text!r} is not a quantity")
    number, suffix, exponent = m.groups()
    return Decimal(number) * (Decimal(10) ** int(exponent) if exponent is not None else _SCALE[suffix])
