"""CDI spec files: atomic replacement, safe names, listing only what a vendor/class owns."""

from __future__ import annotations

import fcntl
import json
import os
import stat
import string
import tempfile
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cdi import (
    ContainerEdits,
    Device,
    DeviceNode,
    SpecError,
    list_specs,
    make_spec,
    read_spec,
    remove_spec,
    remove_temp_files,
    spec_filename,
    update_spec,
    write_spec,
)
from cdi import files as cdi_files

VENDOR = "k8s.tandem.example.org"


def _spec(name: str = "uid1-gpu-0", kind: str = f"{VENDOR}/claim", env: str = "A=1"):
    return make_spec(kind, [Device(name, ContainerEdits(env=[env], device_nodes=[DeviceNode("/dev/nvidia0")]))])


def test_write_then_read(tmp_path: Path):
    spec = _spec()
    path = write_spec(tmp_path / "cdi", spec, "x.json")
    assert path == tmp_path / "cdi" / "x.json"
    assert read_spec(path) == spec
    assert json.loads(path.read_text()) == spec.to_dict()
    assert os.listdir(tmp_path / "cdi") == ["x.json"], "temporary file left behind"


def test_written_file_is_world_readable_whatever_the_umask(tmp_path: Path):
    old = os.umask(0o077)
    try:
        path = write_spec(tmp_path, _spec(), "x.json")
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644


def test_an_invalid_spec_is_not_written(tmp_path: Path):
    bad = make_spec(f"{VENDOR}/claim", [Device("d", ContainerEdits(env=["A=1"]))])
    bad = type(bad)(bad.cdi_version, bad.kind, [Device("d", ContainerEdits(env=["NOEQUALS"]))])
    with pytest.raises(SpecError, match=r"devices\[0\]\.containerEdits\.env\[0\]"):
        write_spec(tmp_path, bad, "x.json")
    assert os.listdir(tmp_path) == []


def test_a_crash_before_the_rename_leaves_the_old_file_and_no_temp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    path = write_spec(tmp_path, _spec(env="A=old"), "x.json")
    before = path.read_bytes()

    def crash(src: str, dst: str) -> None:
        assert Path(src).parent == tmp_path and not Path(src).name.endswith((".json", ".yaml")), (
            "runtime would read the temp"
        )
        assert json.loads(Path(src).read_bytes()) == _spec(env="A=new").to_dict(), (
            "temp must be complete before the rename"
        )
        raise OSError("simulated crash")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="simulated crash"):
        write_spec(tmp_path, _spec(env="A=new"), "x.json")
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["x.json"]


def test_data_is_durable_before_the_rename_and_the_rename_after(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    events: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        events.append("fsync-dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "fsync-file")
        real_fsync(fd)

    def replace(src: str, dst: str) -> None:
        events.append("rename")
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    write_spec(tmp_path, _spec(), "x.json")
    assert events == ["fsync-file", "rename", "fsync-dir"]


def _leave_temp_file(target: Path) -> Path:
    """What a writer killed between write and rename leaves (the same name `atomic_write` uses)."""
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    os.close(fd)
    return Path(tmp)


def test_leftover_temporary_files_are_removed_by_their_target_prefix_only(tmp_path: Path):
    ours = _leave_temp_file(tmp_path / f"{VENDOR}-claim_uid1.json")
    other_vendor = _leave_temp_file(tmp_path / "nvidia.com-gpu.json")
    not_a_temp = tmp_path / f".{VENDOR}-claim_uid2.json.tmp"  # no random part: not atomic_write's
    not_a_temp.write_text("x")
    (tmp_path / "x.json").write_text("{}")
    assert remove_temp_files(tmp_path, f"{VENDOR}-claim_") == [ours]
    assert sorted(os.listdir(tmp_path)) == sorted([other_vendor.name, not_a_temp.name, "x.json"])
    assert remove_temp_files(tmp_path / "missing") == []


def test_a_temporary_file_being_written_is_left_to_its_writer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The other daemon of a rolling update may be between write and rename right now: its
    temporary file is still locked, and sweeping the directory must not make its rename fail."""
    swept: list[Path] = []
    real_replace = os.replace

    def sweep_then_replace(src: str, dst: str) -> None:
        swept.extend(remove_temp_files(tmp_path))
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", sweep_then_replace)
    path = write_spec(tmp_path, _spec(), "x.json")
    assert swept == [] and read_spec(path) == _spec()


def test_a_temporary_file_swept_before_its_writer_locked_it_is_replaced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    real_flock = fcntl.flock
    created: list[str] = []

    def sweep_then_flock(fd: int, op: int) -> None:
        if op == fcntl.LOCK_EX:  # the writer locking its new temporary file (the sweep never blocks)
            created.append(os.readlink(f"/proc/self/fd/{fd}"))
            if len(created) == 1:
                assert remove_temp_files(tmp_path) == [Path(created[0])]
        real_flock(fd, op)

    monkeypatch.setattr(fcntl, "flock", sweep_then_flock)
    path = write_spec(tmp_path, _spec(), "x.json")
    assert len(created) == 2 and read_spec(path) == _spec()
    assert os.listdir(tmp_path) == ["x.json"]


def test_durable_writes_and_removals_fsync_the_file_and_the_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    synced: list[str] = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), real_fsync(fd)))
    write_spec(tmp_path, _spec(), "x.json")  # durable: the library's default (a static spec)
    assert len(synced) == 2 and synced[0].startswith(f"{tmp_path}/.x.json.") and synced[1] == str(tmp_path)
    remove_spec(tmp_path, "x.json")
    assert synced[2:] == [str(tmp_path)]
    synced.clear()
    assert update_spec(tmp_path, _spec(), "y.json", durable=False) is True  # atomic only (a transient spec)
    assert update_spec(tmp_path, _spec(), "y.json", durable=False) is False  # unchanged: not rewritten
    remove_spec(tmp_path, "y.json", durable=False)
    assert synced == []


def test_a_write_that_need_not_be_durable_exchanges_the_names_instead_of_renaming_over(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ext4 flushes a file renamed over another to the disk inside the rename (`cdi.files` says
    why that is a stall); an exchange of the names is as atomic and gets no such flush."""
    write_spec(tmp_path, _spec(env="A=old"), "x.json")
    held = os.open(tmp_path / "x.json", os.O_RDONLY)  # a reader that opened the old file keeps it whole
    monkeypatch.setattr(os, "replace", lambda *_: pytest.fail("a plain rename over the spec"))
    try:
        assert update_spec(tmp_path, _spec(env="A=new"), "x.json", durable=False) is True
        assert read_spec(tmp_path / "x.json") == _spec(env="A=new")
        assert json.loads(os.pread(held, 1 << 16, 0)) == _spec(env="A=old").to_dict()
    finally:
        os.close(held)
    assert os.listdir(tmp_path) == ["x.json"]


def test_a_writer_killed_after_the_exchange_leaves_the_old_content_to_the_sweep(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_spec(tmp_path, _spec(env="A=old"), "x.json")
    real_unlink = os.unlink

    def killed(path: str, *args: object, **kwargs: object) -> None:
        if Path(path).name.startswith(".x.json."):
            raise SystemExit("killed")
        real_unlink(path)

    monkeypatch.setattr(os, "unlink", killed)
    with pytest.raises(SystemExit):
        update_spec(tmp_path, _spec(env="A=new"), "x.json", durable=False)
    monkeypatch.setattr(os, "unlink", real_unlink)
    assert read_spec(tmp_path / "x.json") == _spec(env="A=new")
    (left,) = (p for p in tmp_path.iterdir() if p.name != "x.json")
    assert remove_temp_files(tmp_path) == [left]
    assert os.listdir(tmp_path) == ["x.json"]


def test_what_is_no_regular_file_is_never_exchanged_away(tmp_path: Path) -> None:
    (tmp_path / "x.json").mkdir()
    with pytest.raises(IsADirectoryError):
        cdi_files.atomic_write(tmp_path / "x.json", b"{}", durable=False)
    assert (tmp_path / "x.json").is_dir() and os.listdir(tmp_path) == ["x.json"]


def test_without_an_exchange_a_plain_rename_replaces_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cdi_files, "_renameat2", None)  # not Linux, or a C library without it
    write_spec(tmp_path, _spec(env="A=1"), "x.json", durable=False)
    write_spec(tmp_path, _spec(env="A=2"), "x.json", durable=False)
    assert read_spec(tmp_path / "x.json").devices[0].container_edits.env == ("A=2",)
    assert os.listdir(tmp_path) == ["x.json"]


def test_overwrite_replaces_the_content(tmp_path: Path):
    write_spec(tmp_path, _spec(env="A=1"), "x.json")
    write_spec(tmp_path, _spec(env="A=2"), "x.json")
    assert read_spec(tmp_path / "x.json").devices[0].container_edits.env == ("A=2",)


def test_remove_is_idempotent(tmp_path: Path):
    write_spec(tmp_path, _spec(), "x.json")
    remove_spec(tmp_path, "x.json")
    remove_spec(tmp_path, "x.json")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("name", ["../x.json", "a/x.json", "x.yaml", "x", ".json", ".x.json", "..", "x.json\0"])
def test_file_names_cannot_leave_the_directory(tmp_path: Path, name: str):
    with pytest.raises(SpecError, match="invalid spec file name"):
        write_spec(tmp_path / "d", _spec(), name)
    with pytest.raises(SpecError, match="invalid spec file name"):
        remove_spec(tmp_path / "d", name)
    assert not (tmp_path / "d").exists()


def test_spec_filename_follows_the_transient_convention():
    assert spec_filename(VENDOR, "claim", "5a3c-e1") == f"{VENDOR}-claim_5a3c-e1.json"
    assert spec_filename("v", "c", "ns/name") == "v-c_ns_name.json"
    assert spec_filename("v", "c", "../../etc/passwd") == "v-c_.._.._etc_passwd.json"


@pytest.mark.parametrize(
    ("vendor", "class_", "unique"), [("v/x", "c", "u"), ("v", "c/x", "u"), ("v", "c", ""), ("v", "c", "x" * 250)]
)
def test_spec_filename_rejects(vendor: str, class_: str, unique: str):
    with pytest.raises(SpecError):
        spec_filename(vendor, class_, unique)


@given(st.text(min_size=1, max_size=200))
def test_no_unique_string_escapes_the_directory(unique: str):
    root = Path("/var/run/cdi")
    name = spec_filename(VENDOR, "claim", unique)
    assert os.path.normpath(root / name) == str(root / name)
    assert (root / name).parent == root
    assert set(name) <= set(string.ascii_letters + string.digits + "_.-")
    assert name.startswith(f"{VENDOR}-claim_") and name.endswith(".json")
    assert len(name.encode()) <= 255


@given(st.text(alphabet=string.ascii_letters + string.digits + "/._-\0 \n", min_size=1, max_size=40))
def test_generated_names_are_writable_and_listed(unique: str):
    with tempfile.TemporaryDirectory() as d:
        root = Path(d) / "cdi"
        path = write_spec(root, _spec(), spec_filename(VENDOR, "claim", unique))
        assert path.parent == root
        assert list_specs(root, VENDOR, "claim") == [path]


def _write_raw(directory: Path, name: str, kind: str) -> Path:
    path = directory / name
    path.write_text(json.dumps(_spec(kind=kind).to_dict() | {"kind": kind}))
    return path


def test_list_specs_finds_only_what_the_vendor_and_class_own(tmp_path: Path):
    mine = write_spec(tmp_path, _spec(), spec_filename(VENDOR, "claim", "u1"))
    static = write_spec(tmp_path, _spec(), f"{VENDOR}-claim.json")
    other_class = write_spec(tmp_path, _spec(kind=f"{VENDOR}/gpu"), spec_filename(VENDOR, "gpu", "u2"))
    claimx = _write_raw(tmp_path, spec_filename(VENDOR, "claimx", "u3"), f"{VENDOR}/claimx")  # class sharing our prefix
    _write_raw(tmp_path, spec_filename(f"{VENDOR}-x", "claim", "u4"), f"{VENDOR}-x/claim")  # vendor sharing our prefix
    _write_raw(tmp_path, f"{VENDOR}-claim_forged.json", "nvidia.com/gpu")  # our name, someone else's kind
    _write_raw(tmp_path, "nvidia.com-gpu.json", "nvidia.com/gpu")
    (tmp_path / f".{VENDOR}-claim_u5.json.abc.tmp").write_text("{")  # a write in progress
    (tmp_path / f"{VENDOR}-claim_u6.json.tmp").write_text("{")
    (tmp_path / f"{VENDOR}-claim_u7.yaml").write_text("kind: x")
    (tmp_path / f"{VENDOR}-claim_torn.json").write_text('{"kind": "k8s')
    (tmp_path / f"{VENDOR}-claim_list.json").write_text("[]")
    (tmp_path / f"{VENDOR}-claim_dir.json").mkdir()

    assert list_specs(tmp_path, VENDOR, "claim") == sorted([mine, static])
    assert list_specs(tmp_path, VENDOR) == sorted([mine, static, other_class, claimx])
    assert list_specs(tmp_path / "missing", VENDOR) == []


def test_read_spec_reports_the_file_and_field(tmp_path: Path):
    path = tmp_path / "x.json"
    path.write_text(
        json.dumps({"cdiVersion": "0.3.0", "kind": "v/c", "devices": [{"name": "d", "containerEdits": {"env": ["X"]}}]})
    )
    with pytest.raises(SpecError) as e:
        read_spec(path)
    assert e.value.field == "devices[0].containerEdits.env[0]"
    assert str(e.value).startswith(f"{path}: devices[0].containerEdits.env[0]: invalid environment variable")
    path.write_text("{")
    with pytest.raises(SpecError, match="not valid JSON"):
        read_spec(path)


def test_read_spec_loads_what_a_runtime_loads(tmp_path: Path):
    """Runtime rules, not the writer's: a relative container path is the OCI runtime's business."""
    path = tmp_path / "x.json"
    path.write_text(
        json.dumps(
            {
                "cdiVersion": "v0.3.0",
                "kind": "v/c",
                "devices": [{"name": "d", "containerEdits": {"deviceNodes": [{"path": "dev/x"}]}}],
            }
        )
    )
    assert read_spec(path).devices[0].container_edits.device_nodes[0].path == "dev/x"
