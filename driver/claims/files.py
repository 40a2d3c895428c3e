"""A prepared claim's files on the node, every one of them named by the claim's UID.

The claim's CDI spec (`<cdi root>/k8s.<driver>-claim_<uid>.json`, `driver.claims.cdi_spec`), its device
metadata specs and files (`driver.claims.metadata`). Found by UID alone, never by name: a claim deleted
and recreated under the same name (Jobs do this) is another claim, and nothing done for one may
touch the other's files. Shared by the prepare transactions and start-up reconciliation.

Written atomically, not durably: `driver.fsutil` says why.
"""

from __future__ import annotations

from pathlib import Path

import cdi
from driver.claims.allocation import PrepareSettings
from driver.claims.cdi_spec import CLAIM_CLASS, claim_spec_filename, claim_vendor
from driver.claims.metadata import MetadataWriter
from driver.config import is_uid
from driver.fsutil import PREPARED_STATE_DURABLE


class ClaimFiles:
    def __init__(self, settings: PrepareSettings, metadata: MetadataWriter) -> None:
        self._s = settings
        self.metadata = metadata

    def write_spec(self, uid: str, spec: cdi.Spec | None) -> bool:
        """Write the claim's CDI spec unless the file already holds it; True when it was written.
        Compact JSON, as the Go CDI library writes a spec (and the cheapest to encode)."""
        if spec is None:
            return False
        filename = claim_spec_filename(self._s.driver_name, uid)
        return cdi.update_spec(self._s.cdi_root, spec, filename, durable=PREPARED_STATE_DURABLE, compact=True)

    def has_spec(self, uid: str) -> bool:
        return (self._s.cdi_root / claim_spec_filename(self._s.driver_name, uid)).exists()

    def present(self, uid: str) -> dict[str, bool]:
        """Which of the claim's files are on the node, for `tandemctl claim`: a prepared claim
        has its CDI spec and, where it asked for metadata, its metadata specs and directory."""
        return {
            "cdiSpec": self.has_spec(uid),
            "metadataSpecs": uid in self.metadata.owned_spec_uids(),
            "metadataDir": self.metadata.claim_dir(uid).is_dir(),
        }

    def remove(self, uid: str) -> None:
        """The claim's CDI spec, metadata specs and metadata directory; what is missing is fine.
        A name that is no UID is a metadata directory of another layout (`uids`): only it goes."""
        if not is_uid(uid):
            self.metadata.remove_claim_dir(uid)
            return
        cdi.remove_spec(self._s.cdi_root, claim_spec_filename(self._s.driver_name, uid), durable=PREPARED_STATE_DURABLE)
        self.metadata.remove(uid)

    def spec_uids(self) -> set[str]:
        """The claims with a CDI spec: the claims prepared on this node since it booted
        (`/var/run/cdi` is a tmpfs), whatever the checkpoint says."""
        specs = cdi.list_specs(self._s.cdi_root, claim_vendor(self._s.driver_name), CLAIM_CLASS)
        uids = {path.name.rsplit("_", 1)[-1].removesuffix(".json") for path in specs}
        return {uid for uid in uids if is_uid(uid)}  # the directory is shared: other names are not ours

    def uids(self) -> set[str]:
        """Every claim with any file (a metadata directory of another layout is listed by its name)."""
        return self.spec_uids() | self.metadata.owned_spec_uids() | self.metadata.owned_claim_dirs()

    def remove_temp_files(self, data_dir: Path) -> list[Path]:
        """The temporary files of atomic writes a killed process left: in the data dir (all of it
        is the driver's: checkpoint, cordons), beside the claim and metadata specs in the shared
        CDI directory (only names of this driver's specs), and beside the metadata files."""
        claim_specs = f"{claim_vendor(self._s.driver_name)}-{CLAIM_CLASS}_"
        return [
            *cdi.remove_temp_files(data_dir),
            *cdi.remove_temp_files(self._s.cdi_root, claim_specs),
            *self.metadata.remove_temp_files(),
        ]
