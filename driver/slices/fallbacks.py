"""What of a slice the API server stores: the features it may drop are sent until it drops them.

A server with a feature gate off drops list-typed attributes, device taints, shared counters,
consumable capacity or binding conditions without an error (`driver.slices.plan.DROPPABLE`), or,
for list-typed attributes, drops the value and then refuses the empty attribute (422). Every sync
would then rewrite what the server drops, for ever; so each is published until a stored slice
(or that refusal) shows it dropped, and then left out of the devices published, with one log
line that says what that costs. The publisher's own state, apart from the cache of the live
slices, so that the publisher keeps to carrying out writes.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

from driver.kube.api import ApiError
from driver.model import Device
from driver.slices.build import scalar_attributes
from driver.slices.plan import DROPPABLE, list_attributes_dropped

log = logging.getLogger(__name__)


class Fallbacks:
    """The features still sent. Shares the publisher's condition: a fallback is taken under it
    and told by calling `changed` (still under it), which makes the publisher sync again."""

    def __init__(self, cond: threading.Condition, changed: Callable[[], None], scalar_capable: Collection[str]) -> None:
        self._cond = cond
        self._changed = changed
        self._scalar_capable = scalar_capable
        # Guarded by _cond:
        self._list_mode = True
        self._modes = dict.fromkeys(DROPPABLE, True)

    def key(self) -> tuple[bool, ...]:
        """What the devices published depend on here, to compare with a later sync's."""
        with self._cond:
            return (self._list_mode, *self._modes.values())

    def adapt(self, devices: Sequence[Device]) -> list[Device]:
        """`devices` without what the server was seen dropping."""
        with self._cond:
            list_mode, modes = self._list_mode, dict(self._modes)
        out = list(devices)
        if not list_mode:
            out = [scalar_attributes(d, self._scalar_capable) for d in out]
        for feature, on in modes.items():
            if not on:
                out = DROPPABLE[feature].leave_out(out)
        return out

    @property
    def list_attributes(self) -> bool:
        """False once the server was seen dropping list-typed attributes (scalar fallback)."""
        with self._cond:
            return self._list_mode

    def sent(self, feature: str) -> bool:
        """False once the server was seen dropping `feature` (a key of `DROPPABLE`)."""
        with self._cond:
            return self._modes[feature]

    def refused(self, exc: ApiError, devices: Sequence[Device]) -> bool:
        """Fall back to scalar attributes if the server refused our list-typed ones; whether it did.

        A server with DRAListTypeAttributes off drops the list value and then rejects the
        now-empty attribute with "exactly one value must be specified" (docs/reference/resource-api.md, 'Attributes').
        """
        if not (self.list_attributes and exc.status == 422 and "exactly one value must be specified" in str(exc)):
            return False
        if not any(isinstance(v, tuple) for d in devices for v in d.attributes.values()):
            return False
        self._to_scalars()
        return True

    def check(self, sent: Mapping[str, Any], stored: Mapping[str, Any]) -> None:
        """Compare a slice as sent with the server's answer, and stop sending what it dropped."""
        if self.list_attributes and list_attributes_dropped(sent, stored):
            self._to_scalars()
        with self._cond:
            modes = dict(self._modes)
        for feature, on in modes.items():
            if on and DROPPABLE[feature].dropped(sent, stored):
                self._stop_sending(feature)

    def _stop_sending(self, feature: str) -> None:
        with self._cond:
            if not self._modes[feature]:
                return
            log.error("%s; publishing without it to avoid endless rewrites", DROPPABLE[feature].why)
            self._modes[feature] = False
            self._changed()

    def _to_scalars(self) -> None:
        with self._cond:
            if not self._list_mode:
                return
            log.warning(
                "the API server does not store list-typed device attributes (feature gate "
                "DRAListTypeAttributes off?); publishing scalar attributes instead"
            )
            self._list_mode = False
            self._changed()
