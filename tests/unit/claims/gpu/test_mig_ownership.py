"""Tandem's own GPU instances stay its claims' whatever is lost (issue 22, findings 2 and 7): after a
lost checkpoint and when a GPU leaves `--dynamic-mig` they are never published as free MIG devices,
a claim still in use gets its record back on them, and they are destroyed when their claim is gone;
every MIG change holds a node-wide lock, under which an instance of a rolling update never destroys
a GPU instance the other one adopted and handed out."""

from __future__ import annotations

import os
from ctypes import byref

import pytest
from flocks import locked_elsewhere
from mig_fakes import ONE_G, THREE_G, MigNode, mig_node_fixture  # noqa: F401  (fixture: node)
from prepare_fakes import NODE

from driver.claims.checkpoint import Checkpoint, ClaimRecord, DeviceRecord
from driver.claims.gpu.mig_owners import Made
from driver.claims.unprepare import Unprepared
from driver.claims.vocabulary import PrepareState
from driver.model import MigPlacement

ONE_G_STATIC = "gpu-0-mig-1g-10gb-10-0"  # ONE_G by the name a MIG device of no claim has


def _placement(node: MigNode, name: str) -> MigPlacement:
    info = node.devices[name].gpu
    assert info is not None and info.placement is not None
    return info.placement


def _administrators_3g(node: MigNode) -> None:
    """A 3g.40gb MIG device on memory slices 4-7 that an administrator made (`nvidia-smi mig -cgi 9 -C`)."""
    node.pynvml.nvmlInit()
    gpu = node.pynvml.nvmlDeviceGetHandleByIndex(0)
    gi = node.pynvml.nvmlDeviceCreateGpuInstanceWithPlacement(
        gpu, 9, byref(node.pynvml.c_nvmlGpuInstancePlacement_t(4, 4))
    )
    node.pynvml.nvmlGpuInstanceCreateComputeInstance(gi, 2)
    node.pynvml.nvmlShutdown()


def test_a_lost_checkpoint_loses_no_gpu_instance_and_start_up_gives_its_claim_the_record_back(node: MigNode) -> None:
    a = node.preparer("a")
    one = node.api.add("default", "one", "uid-1", ("mig", ONE_G))
    assert a.prepare([one])[one.uid].error == ""
    assert node.noted() == {_placement(node, ONE_G): Made(one.uid, "a")}  # noted apart from the record
    made = node.instances()
    node.lose_checkpoint()

    devices = node.discover()
    assert ONE_G_STATIC not in devices, "a GPU instance a pod holds is published as a free MIG device"
    assert devices[ONE_G].gpu is not None and devices[ONE_G].gpu.mig_gi == 10  # its claim's partition, made
    b = node.preparer("b")
    node.reconciler(b).run()  # the next start: the claim is still reserved for its pod
    record = node.records()[one.uid]
    assert record.state == PrepareState.COMPLETED and record.devices[0].mig == _placement(node, ONE_G)
    assert node.instances() == made  # adopted, not made again
    assert node.noted() == {_placement(node, ONE_G): Made(one.uid, "b")}
    two = node.api.add("default", "two", "uid-2", ("mig", ONE_G))  # an allocation the scheduler should not make
    assert "already prepared for claim default/one" in b.prepare([two])[two.uid].error
    assert b.unprepare([one]) == {one.uid: Unprepared()} and node.instances() == [] and node.noted() == {}
    a.close()
    b.close()


def test_the_gpu_instance_of_a_claim_gone_while_its_record_was_lost_is_destroyed_at_start_up(node: MigNode) -> None:
    a = node.preparer("a")
    one = node.api.add("default", "one", "uid-1", ("mig", ONE_G))
    assert a.prepare([one])[one.uid].error == ""
    node.lose_checkpoint()
    del node.api.claims[("default", "one")]  # its pod went while nothing recorded the claim
    b = node.preparer("b")
    node.reconciler(b).run()
    assert node.instances() == [("1g.10gb", 10, 0)], "instance a lives: its GPU instance may be a prepare in flight"
    node.die("a")
    node.reconciler(b).run()
    assert node.instances() == [] and node.noted() == {} and node.records() == {}
    a.close()
    b.close()


def test_the_kubelets_unprepare_destroys_the_gpu_instance_of_a_claim_without_a_record(node: MigNode) -> None:
    a = node.preparer("a")
    one = node.api.add("default", "one", "uid-1", ("mig", ONE_G))
    assert a.prepare([one])[one.uid].error == ""
    node.lose_checkpoint()
    assert a.unprepare([one]) == {one.uid: Unprepared()}
    assert node.instances() == [] and node.noted() == {}
    a.close()


def test_a_gpu_that_left_dynamic_mig_keeps_tandems_gpu_instances_its_claims(node: MigNode) -> None:
    a = node.preparer("a")
    one = node.api.add("default", "one", "uid-1", ("mig", ONE_G))
    assert a.prepare([one])[one.uid].error == ""
    _administrators_3g(node)
    static = node.discover(dynamic=False)  # the daemon restarted without GPU 0 in --dynamic-mig
    assert ONE_G_STATIC not in static and ONE_G not in static
    assert "gpu-0-mig-3g-40gb-2-0" in static, "the administrator's MIG device is published as before"
    node.lose_checkpoint()
    assert ONE_G_STATIC not in node.discover(dynamic=False), "the note alone keeps it"
    assert a.unprepare([one]) == {one.uid: Unprepared()}
    assert node.instances() == [("3g.40gb", 2, 0)]  # Tandem's gone, the administrator's kept
    a.close()


def test_a_record_never_destroys_a_gpu_instance_made_for_another_claim(node: MigNode) -> None:
    """A record names its placement before its prepare finds out whether the placement is free
    (here taken by another claim's partition, the record left by a prepare that died then): rolling
    that record back at start-up destroys nothing of the other claim's."""
    a = node.preparer("a")
    one = node.api.add("default", "one", "uid-1", ("mig", ONE_G))
    assert a.prepare([one])[one.uid].error == ""
    with Checkpoint(node.root / "data", "boot").transaction() as claims:
        device = DeviceRecord(("mig",), NODE, ONE_G, mig=_placement(node, ONE_G))
        claims["uid-x"] = ClaimRecord("default", "x", "uid-x", PrepareState.STARTED, (device,), owner="gone-1234")
    node.reconciler(a).run()
    assert "uid-x" not in node.records()
    assert node.instances() == [("1g.10gb", 10, 0)], "claim one's GPU instance was destroyed for claim x"
    a.close()


def test_every_mig_change_holds_the_node_wide_lock(node: MigNode, monkeypatch: pytest.MonkeyPatch) -> None:
    held: list[tuple[str, bool]] = []
    for name in (
        "nvmlDeviceCreateGpuInstanceWithPlacement",
        "nvmlGpuInstanceCreateComputeInstance",
        "nvmlComputeInstanceDestroy",
        "nvmlGpuInstanceDestroy",
    ):

        def spy(*args: object, _real: object = getattr(node.pynvml, name), _name: str = name) -> object:
            held.append((_name, locked_elsewhere(node.root / "data" / "mig.lock")))
            return _real(*args)  # type: ignore[operator]

        monkeypatch.setattr(node.pynvml, name, spy)
    a = node.preparer("a")
    one = node.api.add("default", "one", "uid-1", ("mig", ONE_G))
    assert a.prepare([one])[one.uid].error == ""
    assert a.unprepare([one]) == {one.uid: Unprepared()}
    assert len(held) == 4 and all(locked for _, locked in held), held
    a.close()


def test_a_rollback_spares_what_the_other_instance_of_a_rolling_update_adopted(node: MigNode) -> None:
    """Instance A makes the claim's first MIG device; the kubelet gives up on A and asks B, which
    adopts it, makes the second and answers; A's second then fails, and A rolls back what it made:
    not the device B handed to the container."""
    claim = node.api.add("default", "c", "uid-c", ("small", ONE_G), ("big", THREE_G))
    b = node.preparer("b")
    answers = []

    def kubelet_turns_to_b() -> None:  # after each MIG change of A's, outside its lock
        if not answers:
            answers.append(b.prepare([claim])[claim.uid])
            node.inject("nvmlGpuInstanceGetComputeInstanceProfileInfo", node.pynvml.NVML_ERROR_UNKNOWN)

    a = node.preparer("a", on_change=kubelet_turns_to_b)
    error = a.prepare([claim])[claim.uid].error
    assert answers[0].error == "" and error, (answers, error)
    assert node.instances() == [("1g.10gb", 10, 0), ("3g.40gb", 2, 0)], "A destroyed a device B handed out"
    assert node.records()[claim.uid].state == PrepareState.COMPLETED
    node.inject("", 0)
    assert b.unprepare([claim]) == {claim.uid: Unprepared()} and node.instances() == [] and node.noted() == {}
    a.close()
    b.close()


def test_a_mig_device_made_after_the_other_instance_unprepared_the_claim_is_destroyed(node: MigNode) -> None:
    """The kubelet gave up on A and unprepared the claim through B while A was between its two MIG
    devices: B destroyed the first, A then made the second; A's end must not leave it behind."""
    claim = node.api.add("default", "c", "uid-c", ("small", ONE_G), ("big", THREE_G))
    b = node.preparer("b")
    unprepared = []

    def kubelet_unprepares_through_b() -> None:
        if not unprepared:
            unprepared.append(b.unprepare([claim])[claim.uid].error)

    a = node.preparer("a", on_change=kubelet_unprepares_through_b)
    assert "unprepared while its MIG devices were made" in a.prepare([claim])[claim.uid].error
    assert unprepared == [""]
    assert node.instances() == [] and node.noted() == {} and node.records() == {}
    assert not list(node.root.glob(f"cdi/*{claim.uid}*"))
    a.close()
    b.close()


def test_the_note_is_read_only_by_root_and_entries_of_an_earlier_boot_are_dropped(node: MigNode) -> None:
    a = node.preparer("a")
    one = node.api.add("default", "one", "uid-1", ("mig", ONE_G))
    assert a.prepare([one])[one.uid].error == ""
    path = node.owners().path
    assert os.stat(path).st_mode & 0o777 == 0o600
    path.write_text(path.read_text().replace('"boot"', '"an-earlier-boot"'))
    assert node.noted() == {}
    a.close()
