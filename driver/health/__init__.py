"""Health sources: each turns what it observes (NVML events, link state, manual cordons) into
device conditions in the inventory, under its own source name, so one source never clears
another's verdict.
"""

from __future__ import annotations

from collections.abc import Iterable

from driver.health.gpu.policy import NAMES as GPU_CONDITIONS
from driver.health.grey import NAMES as GREY_CONDITIONS
from driver.health.nic.signals import LINK_DOWN, NIC_LOST, RDMA_PORT_DOWN
from driver.model import TaintEffect


def condition_keys(domain: str) -> dict[str, str]:
    """Every condition key a health source can raise -> the source that owns it ("gpu", "nic" or
    "grey")."""
    keys = {f"{domain}/{n}": "gpu" for n in GPU_CONDITIONS}
    keys.update({f"{domain}/{n}": "nic" for n in (LINK_DOWN, RDMA_PORT_DOWN, NIC_LOST)})
    keys.update({f"{domain}/{n}": "grey" for n in GREY_CONDITIONS})
    return keys


def parse_taint_effects(specs: Iterable[str], domain: str = "tandem.dev") -> dict[str, TaintEffect]:
    """`["tandem.dev/xid=NoExecute", ...]` (the `--taint-effect` flag) -> {key: effect}.

    Unknown keys are refused rather than ignored: a typo would silently keep the default.
    """
    known = condition_keys(domain)
    effects: dict[str, TaintEffect] = {}
    for spec in specs:
        key, sep, value = spec.partition("=")
        if not sep:
            raise ValueError(f"taint effect {spec!r} is not KEY=EFFECT")
        if key not in known:
            raise ValueError(f"taint effect {spec!r}: unknown key {key!r}; known keys: {', '.join(sorted(known))}")
        try:
            effects[key] = TaintEffect(value)
        except ValueError:
            allowed = ", ".join(e.value for e in TaintEffect)
            raise ValueError(f"taint effect {spec!r}: {value!r} is not one of {allowed}") from None
    return effects


def effects_for(effects: dict[str, TaintEffect], source: str, domain: str) -> dict[str, TaintEffect]:
    owners = condition_keys(domain)
    return {k: v for k, v in effects.items() if owners.get(k) == source}
