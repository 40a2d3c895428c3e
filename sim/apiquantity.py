"""Canonical form of Kubernetes quantities, as the API server writes them back.

A real API server parses every `resource.Quantity` and serialises it in canonical form, so what a
client reads back can differ textually from what it wrote (`1024Mi` -> `1Gi`, `0.5` -> `500m`). A
driver that compares desired and live objects textually would update forever; the simulator
reproduces the rewrite so that such a bug shows up in tests. Rules follow apimachinery's
`Quantity.CanonicalizeBytes`:

* the format is taken from the suffix: `Ki`..`Ei` binary, `e<n>` decimal-exponent, anything else
  (including a bare number) decimal-SI;
* values are rounded up to nano units;
* binary values that are not whole numbers or lie strictly between -1024 and 1024 are written as
  decimal-SI;
* decimal forms use the largest exponent that is a multiple of 3 and keeps the mantissa an integer.
"""

from __future__ import annotations

import re
from decimal import ROUND_CEILING, ROUND_FLOOR, Decimal, localcontext

from kubernetes.utils import parse_quantity

_GRAMMAR = re.compile(
    r"^(?P<number>[+-]?(?:\d+(?:\.\d*)?|\.\d+))"
    r"(?:[eE](?P<exponent>[+-]?\d+)|(?P<suffix>|[numkMGTPE]|[KMGTPE]i))$"
)
_BINARY_SUFFIXES = {0: "", 1: "Ki", 2: "Mi", 3: "Gi", 4: "Ti", 5: "Pi", 6: "Ei"}
_DECIMAL_SUFFIXES = {-9: "n", -6: "u", -3: "m", 0: "", 3: "k", 6: "M", 9: "G", 12: "T", 15: "P", 18: "E"}
_NANO = Decimal("1e-9")


def parse(text: str) -> tuple[Decimal, str]:
    """Parse a quantity string into its exact value and format ("BinarySI", "DecimalSI", "DecimalExponent").

    Raises ValueError with a message fit for an API error when the string is not a quantity.
    """
    if not isinstance(text, str):
        raise ValueError(f"quantities must be strings, got {type(text).__name__}")
    match = _GRAMMAR.match(text)
    if not match:
        raise ValueError(f"{text!r}: quantities must match the regular expression {_GRAMMAR.pattern!r}")
    with localcontext() as ctx:
        ctx.prec = 100
        if match.group("exponent") is not None:
            value = Decimal(match.group("number")).scaleb(int(match.group("exponent")))
            fmt = "DecimalExponent"
        else:
            value = parse_quantity(text)
            fmt = "BinarySI" if match.group("suffix").endswith("i") else "DecimalSI"
        if value != 0:
            # Round away from zero to nano units, as apimachinery does ("you asked for some").
            rounding = ROUND_CEILING if value > 0 else ROUND_FLOOR
            value = value.quantize(_NANO, rounding=rounding)
    return value, fmt


def canonical(text: str) -> str:
    """The string a Kubernetes API server stores for the quantity `text`."""
    return formatted(*parse(text))


def formatted(value: Decimal, fmt: str) -> str:
    """The canonical string of `value` in the format `fmt` ("BinarySI", "DecimalSI",
    "DecimalExponent"), as apimachinery writes a Quantity made with that format (`NewQuantity`)."""
    if value == 0:
        return "0"
    if fmt == "BinarySI" and (abs(value) < 1024 or value != value.to_integral_value()):
        fmt = "DecimalSI"
    sign = "-" if value < 0 else ""
    magnitude = abs(value)
    if fmt == "BinarySI":
        mantissa, exponent = int(magnitude), 0
        while exponent < 6 and mantissa % 1024 == 0:
            mantissa //= 1024
            exponent += 1
        return f"{sign}{mantissa}{_BINARY_SUFFIXES[exponent]}"
    mantissa, exponent = _decimal_mantissa(magnitude)
    if fmt == "DecimalExponent":
        return f"{sign}{mantissa}" + (f"e{exponent}" if exponent else "")
    suffix = _DECIMAL_SUFFIXES.get(exponent)
    if suffix is None:
        return f"{sign}{mantissa}e{exponent}"
    return f"{sign}{mantissa}{suffix}"


def _decimal_mantissa(magnitude: Decimal) -> tuple[int, int]:
    """Integer mantissa and the largest exponent (a multiple of 3) with magnitude == mantissa * 10**exponent."""
    sign_digits_exp = magnitude.normalize().as_tuple()
    mantissa = int("".join(str(d) for d in sign_digits_exp.digits))
    exponent = int(sign_digits_exp.exponent)
    shift = exponent % 3  # Python's % floors, so the exponent moves down to a multiple of 3
    return mantissa * 10**shift, exponent - shift
