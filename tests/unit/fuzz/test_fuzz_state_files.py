"""Fuzzing the readers of Tandem's state files in its data directory: the checkpoint
(driver/claims/checkpoint.py), `nic-homes.json`, `mig-owned.json`, `time-slices.json`,
`cordons.json`, `released.json` and `held-resets.json`, all through `driver.fsutil`'s versioned
reading.

Tandem wrote these, but a crash of the disk, a hand edit, or a newer (or older) release can leave
anything there. The property: any bytes give the reader's documented value, never an exception
(a daemon that raised here would crash-loop), and lose nothing: a file the reader cannot use is
either left where it was or moved aside whole (`<name>.corrupt-*`, or `<name>.newer-*` for a
newer format version, which a newer release reads again). Strategies: each file as its writer
writes it, with fields mutated at any depth, of a newer format version, or replaced by hostile
JSON (deep nesting, huge numbers) and by any bytes.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fuzzing import deep_json, fuzz, hostile_json, mutated
from hypothesis import example
from hypothesis import strategies as st

from driver.claims.checkpoint import Checkpoint, ClaimRecord, DeviceRecord
from driver.claims.gpu.mig_owners import Made, MigOwners
from driver.claims.gpu.time_slices import TimeSlices
from driver.claims.nic.homes import NicHomes
from driver.fsutil import StateFileError, parse_state
from driver.health.cordon import Cordon, CordonStore
from driver.health.gpu.held import HeldResets
from driver.health.gpu.policy import GpuHealthPolicy
from driver.health.gpu.release import GpuReleases, Release
from driver.inventory.store import Inventory
from driver.model import MigPlacement

BOOT = "boot-1"
UID = "0c2a4bd5-3c38-4b5e-9f2e-0123456789ab"
GPU = "GPU-0b8e4c8a-1111-2222-3333-444455556666"

# Each file as its writer writes it, at the current format version.
DOCUMENTS: dict[str, dict[str, Any]] = {
    "checkpoint.json": {
        "version": 1,
        "bootID": BOOT,
        "claims": {
            UID: {
                "namespace": "ns",
                "name": "claim",
                "state": "PrepareCompleted",
                "devices": [
                    {
                        "requestNames": ["gpu"],
                        "pool": "node-a",
                        "device": "gpu-0",
                        "cdiDeviceIDs": ["tandem.dev/gpu=x"],
                        "migPlacement": {"parentUUID": GPU, "profileID": 19, "start": 0, "size": 1},
                        "consumedCapacity": {"memory": "10Gi"},
                        "sharing": "MPS",
                        "timeSliceInterval": "Short",
                        "networkData": {"interfaceName": "net1", "ips": ["10.0.0.1/24"]},
                    }
                ],
                "owner": "pod-1234abcd",
                "pods": ["p"],
            }
        },
    },
    "nic-homes.json": {
        "version": 1,
        "nics": {
            "0000:17:00.0": {"ifname": "eth2", "mtu": 9000, "mac": "aa:bb:cc:dd:ee:ff", "addresses": ["10.0.0.1/24"]}
        },
    },
    "mig-owned.json": {
        "version": 1,
        "instances": [
            {"bootID": BOOT, "parentUUID": GPU, "profileID": 19, "start": 0, "size": 1, "claim": UID, "owner": "o"}
        ],
    },
    "time-slices.json": {"version": 1, "gpus": {"gpu-0": {"uuid": GPU, "interval": "Short", "pending": False}}},
    "cordons.json": {"version": 1, "cordons": {"gpu-0": {"reason": "bad fan", "by": "alice", "since": "x"}}},
    "released.json": {
        "version": 1,
        "releases": [{"gpu": GPU, "device": "gpu-0", "reason": "r", "by": "", "since": ""}],
    },
    "held-resets.json": {
        "version": 1,
        "held": {"boot": BOOT, "entries": [{"gpu": GPU, "pci": "", "subject": GPU, "xid": 79}]},
    },
}


def _contents(name: str) -> st.SearchStrategy[bytes]:
    """What the file may hold: its writer's document mutated, of a newer version, JSON nested
    deeper than a parser recurses, or anything."""
    document = DOCUMENTS[name]

    @st.composite
    def documents(draw: st.DrawFn) -> bytes:
        doc = mutated(document, draw(st.data()))
        if isinstance(doc, dict) and draw(st.booleans()):
            doc["version"] = draw(st.sampled_from([0, 2, 99, -1, 2**70, 1.0, "1", True, None]))
        return json.dumps(doc).encode()

    return documents() | deep_json | hostile_json | st.binary(max_size=64)


@pytest.fixture(scope="module")
def data_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="fuzz-state-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _read_keeping(data_dir: Path, name: str, data: bytes, read: Callable[[Path], object]) -> object:
    """`read(dir)` of a fresh data dir whose `name` holds `data`; checks the file was lost nowhere."""
    directory = data_dir / "d"
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir()
    (directory / name).write_bytes(data)
    value = read(directory)
    kept = [p.read_bytes() for p in directory.iterdir() if p.name == name or p.name.startswith(f"{name}.")]
    assert kept == [data], f"{name} lost or duplicated: {[p.name for p in directory.iterdir()]}"
    if (directory / name).exists() is False:
        aside = next(p.name for p in directory.iterdir() if p.name.startswith(f"{name}."))
        newer = isinstance(json.loads(data).get("version"), int) if data.startswith(b"{") and _json(data) else False
        assert aside.startswith(f"{name}.newer-") or aside.startswith(f"{name}.corrupt-") or not newer
    return value


def _json(data: bytes) -> bool:
    try:
        return isinstance(json.loads(data), dict)
    except (ValueError, RecursionError):
        return False


@fuzz(_contents("checkpoint.json"))
def test_the_checkpoint_reads_as_records_or_is_set_aside(data_dir: Path, data: bytes) -> None:
    checkpoint: dict[str, ClaimRecord] = {}

    def read(directory: Path) -> object:
        store = Checkpoint(directory, BOOT)
        checkpoint.update(store.read())
        return store

    _read_keeping(data_dir, "checkpoint.json", data, read)
    for uid, record in checkpoint.items():
        assert record.uid == uid and isinstance(record.namespace, str) and isinstance(record.name, str)
        assert all(isinstance(d, DeviceRecord) and isinstance(d.device, str) for d in record.devices)
        json.dumps(record.to_json())  # what the next write of the file does with it


@fuzz(_contents("nic-homes.json"))
def test_nic_homes_read_as_home_names(data_dir: Path, data: bytes) -> None:
    names = _read_keeping(data_dir, "nic-homes.json", data, lambda d: NicHomes(d).home_names())
    assert isinstance(names, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in names.items())


@example(
    data=b'{"version":1,"instances":[{"bootID":"boot-1","parentUUID":"g","profileID":1e999,"start":0,"size":1,"claim":"c","owner":"o"}]}'
)
@fuzz(_contents("mig-owned.json"))
def test_the_mig_ownership_note_reads_as_placements(data_dir: Path, data: bytes) -> None:
    def read(directory: Path) -> dict[MigPlacement, Made]:
        with MigOwners(directory, BOOT).changing() as entries:
            return entries

    owned = _read_keeping(data_dir, "mig-owned.json", data, read)
    assert isinstance(owned, dict)
    assert all(isinstance(p, MigPlacement) and isinstance(m, Made) for p, m in owned.items())


@fuzz(_contents("time-slices.json"))
def test_the_time_slice_note_reads_as_intervals(data_dir: Path, data: bytes) -> None:
    def read(directory: Path) -> dict[str, tuple[str, str]]:
        return TimeSlices(directory, directory, lambda: {}).applied()

    applied = _read_keeping(data_dir, "time-slices.json", data, read)
    assert isinstance(applied, dict)
    assert all(isinstance(uuid, str) and isinstance(interval, str) for uuid, interval in applied.values())


@fuzz(_contents("cordons.json"))
def test_cordons_read_as_cordons(data_dir: Path, data: bytes) -> None:
    cordons = _read_keeping(data_dir, "cordons.json", data, lambda d: CordonStore(d, Inventory())._read())
    assert isinstance(cordons, dict) and all(isinstance(c, Cordon) for c in cordons.values())


@fuzz(_contents("released.json"))
def test_releases_read_as_releases(data_dir: Path, data: bytes) -> None:
    releases = _read_keeping(data_dir, "released.json", data, lambda d: GpuReleases(d, Inventory())._read())
    assert isinstance(releases, dict) and all(isinstance(r, Release) for r in releases.values())


@fuzz(_contents("held-resets.json"))
def test_held_reset_xids_read_as_conditions(data_dir: Path, data: bytes) -> None:
    held = _read_keeping(data_dir, "held-resets.json", data, lambda d: HeldResets(d, BOOT).load(GpuHealthPolicy()))
    assert isinstance(held, list) and all(isinstance(subject, str) for subject, _ in held)


@fuzz(_contents("cordons.json"), st.integers(0, 3))
def test_parse_state_gives_an_object_or_its_own_error(data: bytes, version: int) -> None:
    """The rule every reader above follows (driver/fsutil.py): ValueError for bytes that are no
    JSON, StateFileError for a document it cannot read; nothing else."""
    try:
        doc = parse_state(data, version, {n: dict for n in range(version)})
    except (ValueError, StateFileError):
        return
    assert isinstance(doc, dict)


def test_json_nested_too_deeply_is_a_state_file_error() -> None:
    """json.loads' RecursionError escaped parse_state, and with it every read_json_state reader:
    a StateFileError sets the file aside instead."""
    with pytest.raises(StateFileError):
        parse_state(b"[" * 3000, 1, {})
