"""Grey-failure verdicts kept across a restart of the daemon.

A grey verdict rests on history: a count taints on one rise that will not come again, a state
only after it has held for minutes. A daemon that forgot its verdicts when it restarted (an
upgrade, a crash) would offer a sick device to the scheduler until the history was made again,
or forever for a count. So what is reported is kept in `<data dir>/grey-verdicts.json`, rewritten
(atomically) whenever it changes, and reported again at start-up; from there it clears as any
verdict does, once the signal has read well for the recovery time.

Entries are by device identity (a GPU's UUID, a NIC's PCI address) and of this boot only: a
reboot retrains every link and restarts every counter, and whatever is still wrong is found again
(hence no fsync either: a power loss is a reboot). A device not in the inventory when it starts
keeps its entry until it is, or until the next boot. Only the grey monitor's thread uses this.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from cdi import atomic_write
from driver.fsutil import read_json_state
from driver.health.grey import Kept

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
FILE_NAME = "grey-verdicts.json"
_TEXT_LIMIT = 1024  # a reason is a sentence the rules wrote


def _text(raw: dict[str, Any], key: str) -> str:
    value = raw.get(key)
    if not isinstance(value, str) or not 0 < len(value) <= _TEXT_LIMIT:
        raise TypeError(f"{key} is a non-empty string of at most {_TEXT_LIMIT} characters")
    return value


def _entry(raw: Any) -> tuple[str, Kept]:
    if not isinstance(raw, dict):
        raise TypeError("an entry is an object")
    state, since = raw.get("state"), raw.get("since")
    if type(state) is not bool:
        raise TypeError("state is a boolean")
    if not isinstance(since, int | float) or isinstance(since, bool) or not 0 <= since < 2**40:
        raise TypeError("since is a time")
    kept = Kept(
        _text(raw, "condition"), _text(raw, "signal"), state, _text(raw, "value"), _text(raw, "reason"), float(since)
    )
    return _text(raw, "device"), kept


class KeptVerdicts:
    """The file of reported grey verdicts."""

    def __init__(self, data_dir: Path, boot: str) -> None:
        self.path = data_dir / FILE_NAME
        self._boot = boot
        self._saved: dict[str, list[Kept]] = {}

    def load(self) -> dict[str, list[Kept]]:
        """Each device's verdicts to report again, from the file of this boot."""
        doc = read_json_state(self.path, "grey-failure verdicts", "verdicts", dict, version=FORMAT_VERSION)
        out: dict[str, list[Kept]] = {}
        for raw in doc.get("entries", []) if isinstance(doc.get("entries"), list) else []:
            try:
                identity, kept = _entry(raw)
            except TypeError as e:
                log.error("%s: ignoring the entry %r: %s", self.path, raw, e)
                continue
            out.setdefault(identity, []).append(kept)
        if out and doc.get("boot") != self._boot:
            log.info("%d grey-failure verdict(s) of an earlier boot dropped: a reboot retrains links", len(out))
            return {}
        for identity, verdicts in out.items():
            log.warning(
                "%s: %s still reported from before this start", identity, ", ".join(k.condition for k in verdicts)
            )
        self._saved = out
        return out

    def save(self, verdicts: Mapping[str, list[Kept]]) -> None:
        """Writes the verdicts when they changed."""
        current = {identity: sorted(kept) for identity, kept in verdicts.items() if kept}
        if current == self._saved:
            return
        entries = [
            {"device": identity, **dataclasses.asdict(k)} for identity, kept in sorted(current.items()) for k in kept
        ]
        doc = {"version": FORMAT_VERSION, "verdicts": {"boot": self._boot, "entries": entries}}
        try:
            atomic_write(self.path, json.dumps(doc, indent=1).encode(), mode=0o600, durable=False)
        except OSError as e:  # the verdicts stand in memory; the next change writes again
            log.error("cannot write %s: %s; a restart now would forget the grey-failure verdicts", self.path, e)
            return
        self._saved = current
