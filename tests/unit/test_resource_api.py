"""resource.Quantity values, compared as the API server's canonical rewrite makes them equal."""

from __future__ import annotations

from decimal import Decimal

import pytest

from driver.resource_api import parse_quantity


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("80Gi", Decimal(80 * 2**30)),
        ("85899345920", Decimal(80 * 2**30)),
        ("500m", Decimal("0.5")),
        ("0.5", Decimal("0.5")),
        ("1e3", Decimal(1000)),
        ("1E-3", Decimal("0.001")),
        ("1k", Decimal(1000)),
        ("2M", Decimal(2_000_000)),
        (".5Ki", Decimal(512)),
        ("+3", Decimal(3)),
        ("-1.5G", Decimal(-1_500_000_000)),
        ("7n", Decimal("7e-9")),
        ("1E", Decimal(10**18)),
    ],
)
def test_spellings_of_one_value_compare_equal(text: str, value: Decimal) -> None:
    assert parse_quantity(text) == value


@pytest.mark.parametrize("text", ["", "Gi", "1Ki2", "1 Gi", "1ki", "1K", "abc", "1e", "0x10"])
def test_what_is_no_quantity_is_a_value_error(text: str) -> None:
    with pytest.raises(ValueError, match="is not a quantity"):
        parse_quantity(text)
