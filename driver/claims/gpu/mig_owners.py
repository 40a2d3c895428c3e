"""Which GPU instances Tandem made on this node, and the one lock of every MIG change:
`<data dir>/mig-owned.json` under `<data dir>/mig.lock`.

Why a note beside the checkpoint's records: what tells a GPU instance Tandem made for a claim from
one an administrator made must outlive what the records do not. The checkpoint can be lost (set
aside unreadable, then rebuilt only for the claims pods still use), and a GPU can leave
`--dynamic-mig`; either way, without the note, a GPU instance a running pod holds would be
published as a free MIG device and prepared for a second claim. An entry names the GPU instance
by device identity, never by a device name: its GPU's UUID and its placement (profile ID, first
memory slice, size; NVML lets one GPU instance hold a memory slice), with the claim (UID) it was
made for and the driver instance that made it or last adopted it (`Made`).

`driver.claims.gpu.mig` notes a GPU instance before it makes it and drops the entry after it has
destroyed it, all under the lock, so a kill -9 at any line leaves every instance Tandem made
noted; at worst an entry of one that no longer exists, which matches nothing NVML lists and goes
with the next change at its placement or at start-up (`MigPartitions.collect`). A reboot takes
every GPU instance with it, so an entry names its boot and one of an earlier boot is dropped as
the file is read. Written atomically but not durably, like the checkpoint (`driver.fsutil`).

The lock is node-wide, not per GPU: the two instances of a rolling update both make and destroy
MIG devices, one file needs one lock, and a destroy must see under it who holds the GPU instance
now (`Made.owner`). MIG changes are rare, and each takes a fraction of a second.

The file (`FORMAT_VERSION` 1): `{"version": 1, "instances": [{"bootID", "parentUUID",
"profileID", "start", "size", "claim", "owner"}]}`; one this release cannot read is set aside
(`driver.fsutil`), and an entry it cannot read is dropped, logged.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from cdi import atomic_write
from driver.fsutil import PREPARED_STATE_DURABLE, locked, read_json_state
from driver.model import MigPlacement

log = logging.getLogger(__name__)

FILE = "mig-owned.json"
LOCK = "mig.lock"
FORMAT_VERSION = 1


@dataclass(frozen=True)
class Made:
    """Who a GPU instance Tandem made belongs to."""

    claim: str  # the UID of the claim it was made for
    owner: str  # the driver instance that made or last adopted it: the only one that may roll it back


class MigOwners:
    """The note of what Tandem made (module docstring), read and written only under its lock."""

    def __init__(self, data_dir: Path, boot_id: str) -> None:
        self.path = data_dir / FILE
        self._lock_path = data_dir / LOCK
        self._boot = boot_id
        self._mutex = threading.Lock()

    @contextlib.contextmanager
    def changing(self) -> Iterator[dict[MigPlacement, Made]]:
        """The note, held: no other thread or process changes MIG or the note until the block ends.
        A change to the yielded entries is written only by `save`, which the block calls before
        the NVML call the change announces."""
        with locked(self._mutex, self._lock_path):
            yield self._read()

    def save(self, entries: dict[MigPlacement, Made]) -> None:
        """Write `entries` (only inside `changing`)."""
        rows = [
            {
                "bootID": self._boot,
                "parentUUID": p.parent_uuid,
                "profileID": p.profile_id,
                "start": p.start,
                "size": p.size,
                "claim": m.claim,
                "owner": m.owner,
            }
            for p, m in sorted(entries.items(), key=lambda e: (e[0].parent_uuid, e[0].start, e[0].profile_id))
        ]
        doc = {"version": FORMAT_VERSION, "instances": rows}
        atomic_write(self.path, json.dumps(doc, indent=1).encode(), 0o600, durable=PREPARED_STATE_DURABLE)

    def _read(self) -> dict[MigPlacement, Made]:
        rows = read_json_state(self.path, "MIG ownership", "instances", list, version=FORMAT_VERSION)
        out: dict[MigPlacement, Made] = {}
        for row in rows:
            try:
                if row["bootID"] != self._boot:
                    continue  # its GPU instance went with that boot
                placement = MigPlacement(
                    str(row["parentUUID"]), int(row["profileID"]), int(row["start"]), int(row["size"])
                )
                out[placement] = Made(str(row["claim"]), str(row["owner"]))
            except (TypeError, KeyError, ValueError, OverflowError) as e:  # OverflowError: int() of an infinity
                log.error("%s: an entry that is no GPU instance is dropped (%s: %s)", self.path, type(e).__name__, e)
        return out
