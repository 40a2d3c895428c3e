"""Dynamic MIG publishing: every placement of every profile, counters that make the scheduler's
answer NVML's answer, the administrator's MIG devices kept, and slices within the API's rules."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from ctypes import byref
from pathlib import Path
from types import ModuleType

import pytest
from mig_fakes import h100_in_mig_mode

from cdi import is_dns_label
from driver.discovery.gpu.discover import GpuDiscovery
from driver.discovery.gpu.dynamic_mig import parse_placement_name, placement_device_name
from driver.discovery.gpu.mig import mig_device_name, profile_label
from driver.health.gpu.policy import NO_INSTANCE, event_targets, index_gpus
from driver.model import Device, DeviceKind, MigPlacement
from driver.slices.build import build_slices, device_to_api
from sim import nvml as sim_nvml
from sim.apivalidate import slice_problems
from sim.profile import (
    A100_40GB_MIG,
    A100_80GB_MIG,
    H100_80GB_MIG,
    H200_MIG,
    RTX_PRO_6000_MIG,
    MigProfileSpec,
    NodeProfile,
    h100_node,
)
from sim.sysfs import render_node

Discover = Callable[..., list[Device]]
H100_DEVICES = 7 + 7 + 4 + 3 + 2 + 1  # placements of the H100 profiles but 7g.80gb (the whole GPU)
BLACKWELL_DEVICES = 4 * 5 + 2 * 4 + 1  # 1g, +me, +gfx, -me, +me.all; 2g, +gfx, -me, +me.all; 4g+gfx


@pytest.fixture
def node(tmp_path: Path) -> Iterator[tuple[ModuleType, Path, NodeProfile]]:
    with h100_in_mig_mode(tmp_path) as (pynvml, _, profile):
        yield pynvml, tmp_path, profile


def discover(root: Path, owned: frozenset[MigPlacement] = frozenset(), dynamic: bool = True) -> dict[str, Device]:
    found = GpuDiscovery(
        root / "sys",
        proc_root=root / "proc",
        dynamic_mig=lambda minor, uuid: dynamic,
        owned_placements=lambda: owned,
    ).discover()
    return {d.name: d for d in found}


CI_SPANNING = {19: 0, 20: 0, 15: 0, 14: 1, 9: 2, 5: 3, 0: 4}  # GPU instance profile -> its whole compute instance


def make_gi(pynvml: ModuleType, profile_id: int, start: int, size: int) -> None:
    """A GPU instance and its compute instance made on GPU 0, as `nvidia-smi mig -cgi ... -C` would."""
    gpu = pynvml.nvmlDeviceGetHandleByIndex(0)
    gi = pynvml.nvmlDeviceCreateGpuInstanceWithPlacement(
        gpu, profile_id, byref(pynvml.c_nvmlGpuInstancePlacement_t(start, size))
    )
    pynvml.nvmlGpuInstanceCreateComputeInstance(gi, CI_SPANNING[profile_id])


def uses(device: Device) -> dict[str, int]:
    (use,) = device.consumes_counters
    return {k: int(v) for k, v in use.counters}


def test_every_placement_and_the_whole_gpu_are_published(node: tuple[ModuleType, Path, NodeProfile]) -> None:
    _, root, profile = node
    devices = discover(root)
    gpu0 = {n: d for n, d in devices.items() if n.startswith("gpu-0")}
    assert len(gpu0) == H100_DEVICES + 1 and "gpu-1" in devices  # GPU 1 is not in MIG mode: as before
    assert sorted(n for n in gpu0 if n.startswith("gpu-0-mig-1g-20gb")) == [
        f"gpu-0-mig-1g-20gb-p{s}" for s in (0, 2, 4, 6)
    ]
    p = gpu0["gpu-0-mig-3g-40gb-p4"]
    assert p.kind is DeviceKind.MIG and p.gpu is not None
    assert p.attributes["profile"] == "3g.40gb" and p.attributes["parentUUID"] == profile.gpus[0].uuid
    assert (p.attributes["placementStart"], p.attributes["placementSize"]) == (4, 4)
    assert "uuid" not in p.attributes  # it has none until it is made; the published form never changes
    assert p.capacity["multiprocessors"] == "60"
    assert p.gpu.placement == MigPlacement(profile.gpus[0].uuid, 9, 4, 4)
    assert uses(p) == {"memory-slice-4": 1, "memory-slice-5": 1, "memory-slice-6": 1, "memory-slice-7": 1,
                       "compute-slices": 3}  # fmt: skip
    assert uses(gpu0["gpu-0-mig-1g-10gb-me-p2"]) == {"memory-slice-2": 1, "compute-slices": 1, "ofa-engines": 1}
    whole = gpu0["gpu-0"]
    assert whole.kind is DeviceKind.GPU and whole.attributes["uuid"] == profile.gpus[0].uuid
    assert whole.gpu is not None and whole.gpu.placement == MigPlacement(profile.gpus[0].uuid, 0, 0, 8)
    (use,) = whole.consumes_counters
    assert use.counters == use.counter_set.counters  # the whole GPU takes everything
    assert use.counter_set.name == "gpu-0-counters" and len(use.counter_set.counters) == 10


def _fits(a: Device, b: Device) -> bool:
    (ua,), (ub,) = a.consumes_counters, b.consumes_counters
    total = dict(ua.counter_set.counters)
    return all(int(dict(ua.counters).get(k, 0)) + int(dict(ub.counters).get(k, 0)) <= int(v) for k, v in total.items())


def test_counters_allow_exactly_the_pairs_nvml_allows(node: tuple[ModuleType, Path, NodeProfile]) -> None:
    """For every two published partitions: the scheduler may give both out iff NVML can make both."""
    pynvml, root, _ = node
    _assert_counters_allow_exactly_the_pairs_nvml_allows(pynvml, root)


def _assert_counters_allow_exactly_the_pairs_nvml_allows(pynvml: ModuleType, root: Path) -> None:
    partitions = [d for n, d in discover(root).items() if n.startswith("gpu-0") and d.gpu and d.gpu.placement]
    gpu = pynvml.nvmlDeviceGetHandleByIndex(0)
    for a, b in itertools.combinations(partitions, 2):
        made = []
        try:
            for d in (a, b):
                assert d.gpu is not None and d.gpu.placement is not None
                pl = d.gpu.placement
                where = pynvml.c_nvmlGpuInstancePlacement_t(pl.start, pl.size)
                made.append(pynvml.nvmlDeviceCreateGpuInstanceWithPlacement(gpu, pl.profile_id, byref(where)))
            nvml_allows = True
        except pynvml.NVMLError_InsufficientResources:
            nvml_allows = False
        finally:
            for gi in made:
                pynvml.nvmlGpuInstanceDestroy(gi)
        assert _fits(a, b) == nvml_allows, (a.name, b.name)


def test_administrators_mig_devices_are_kept_and_fenced_off(node: tuple[ModuleType, Path, NodeProfile]) -> None:
    pynvml, root, _ = node
    make_gi(pynvml, 9, 4, 4)  # an administrator's 3g.40gb on memory slices 4-7 (GPU instance 2)
    devices = discover(root)
    gpu0 = sorted(n for n in devices if n.startswith("gpu-0"))
    assert "gpu-0-mig-3g-40gb-2-0" in gpu0  # published as any MIG device is
    assert "gpu-0" not in gpu0  # no whole GPU while someone else's instance is on it
    assert not any((parse_placement_name(n) or (0, "", 0))[2] >= 4 for n in gpu0)  # nothing overlaps it
    assert "gpu-0-mig-4g-40gb-p0" in gpu0 and "gpu-0-mig-1g-10gb-p3" in gpu0  # 4g + 3g is a layout
    make_gi(pynvml, 20, 3, 1)  # and the one media-extension instance
    fenced = discover(root)
    assert not any("-me-p" in n for n in fenced) and "gpu-0-mig-4g-40gb-p0" not in fenced
    assert "gpu-0-mig-1g-10gb-p2" in fenced
    (use,) = fenced["gpu-0-mig-1g-10gb-p0"].consumes_counters
    left = dict(use.counter_set.counters)
    assert (left["compute-slices"], left["ofa-engines"], left["memory-slice-4"], left["memory-slice-0"]) == (
        "3", "0", "0", "1",
    )  # fmt: skip


def test_tandems_own_instance_is_its_placement_device(node: tuple[ModuleType, Path, NodeProfile]) -> None:
    pynvml, root, profile = node
    mine = MigPlacement(profile.gpus[0].uuid, 15, 2, 2)  # 1g.20gb on memory slices 2-3 (GPU instance 4)
    before = discover(root, frozenset({mine}))
    make_gi(pynvml, 15, 2, 2)
    after = discover(root, frozenset({mine}))
    assert sorted(after) == sorted(before)  # no MIG device of its own, the whole GPU stays
    name = "gpu-0-mig-1g-20gb-p2"
    assert device_to_api(after[name], {}, "") == device_to_api(before[name], {}, "")  # no slice write
    info = after[name].gpu
    assert info is not None and (info.mig_gi, info.mig_ci) == (4, 0) and info.uuid.startswith("MIG-")
    assert len(info.mig_caps) == 2


def test_not_selected_gpus_publish_their_mig_devices_as_before(node: tuple[ModuleType, Path, NodeProfile]) -> None:
    pynvml, root, _ = node
    make_gi(pynvml, 19, 0, 1)
    assert sorted(n for n in discover(root, dynamic=False) if n.startswith("gpu-0")) == ["gpu-0-mig-1g-10gb-7-0"]


def test_a_pass_overlapping_a_mig_change_is_redone(node: tuple[ModuleType, Path, NodeProfile]) -> None:
    _, root, _ = node
    ticks = iter([0, 1, 1, 1])  # the first pass saw a change made while it ran
    owned_reads = []
    GpuDiscovery(
        root / "sys",
        proc_root=root / "proc",
        dynamic_mig=lambda minor, uuid: True,
        owned_placements=lambda: owned_reads.append(1) or frozenset(),
        mig_generation=lambda: next(ticks),
    ).discover()
    assert len(owned_reads) == 2


@pytest.mark.parametrize(
    ("profiles", "per_gpu"), [(H100_80GB_MIG, H100_DEVICES + 1), (RTX_PRO_6000_MIG, BLACKWELL_DEVICES + 1)]
)
def test_slices_of_eight_dynamic_gpus_pass_the_api_rules(
    tmp_path: Path, profiles: list[MigProfileSpec], per_gpu: int
) -> None:
    profile = h100_node(gpus=8, nics=0, mig_capable=True)
    for gpu in profile.gpus:
        gpu.mig_mode = True
        gpu.mig_profiles = list(profiles)
    render_node(profile, tmp_path / "sys", tmp_path / "dev", tmp_path / "proc")
    sim_nvml.write_state(profile, tmp_path / "nvml.json")
    with sim_nvml.fake_pynvml_in_process(tmp_path / "nvml.json"):
        devices = list(discover(tmp_path).values())
    slices = build_slices(devices, "tandem.dev", "n1", "uid-1", 0)
    counters = [s for s in slices if "sharedCounters" in s["spec"]]
    assert len(devices) == 8 * per_gpu
    assert len(counters) == 1 and len(counters[0]["spec"]["sharedCounters"]) == 8
    assert all(len(s["spec"].get("devices", [])) <= 64 for s in slices) and len(slices) == 5
    for s in slices:
        assert slice_problems(s["spec"]) == [], s["metadata"]["generateName"]
        assert not ("devices" in s["spec"] and "sharedCounters" in s["spec"])


def test_placement_names_are_dns_labels_and_round_trip() -> None:
    name = placement_device_name(7, "1g.18gb+me", 6)
    assert name == "gpu-7-mig-1g-18gb-me-p6"
    assert parse_placement_name(name) == (7, "1g-18gb-me", 6)
    assert parse_placement_name("gpu-7-mig-1g-18gb-13-0") is None  # a MIG device's name is not a placement's


def _slice(**spec: object) -> dict[str, object]:
    return {"driver": "tandem.dev", "nodeName": "n1", "pool": {"name": "n1", "generation": 0, "resourceSliceCount": 2},
            **spec}  # fmt: skip


def _device(name: str, *uses: tuple[str, dict[str, str]]) -> dict[str, object]:
    consumes = [{"counterSet": s, "counters": {k: {"value": v} for k, v in c.items()}} for s, c in uses]
    return {"name": name, "consumesCounters": consumes}


def test_the_simulated_api_server_keeps_kubernetes_counter_rules() -> None:
    """resource/v1 validation (k8s.io/kubernetes pkg/apis/resource/validation, 1.37.2)."""
    one = {"memory-slice-0": "1"}
    both = _slice(devices=[_device("a", ("s", one))], sharedCounters=[{"name": "s", "counters": {"c": {"value": "1"}}}])
    assert any("only one of `sharedCounters` or `devices`" in p for p in slice_problems(both))
    nine = _slice(sharedCounters=[{"name": f"s{i}", "counters": {"c": {"value": "1"}}} for i in range(9)])
    assert any("sharedCounters: Too many: 9" in p for p in slice_problems(nine))
    wide = _slice(sharedCounters=[{"name": "s", "counters": {f"c{i}": {"value": "1"} for i in range(33)}}])
    assert any("Too many: 33" in p for p in slice_problems(wide))
    three = _slice(devices=[_device("a", ("s1", one), ("s2", one), ("s3", one))])
    assert any("consumesCounters: Too many: 3" in p for p in slice_problems(three))
    twice = _slice(devices=[_device("a", ("s1", one), ("s1", one))])
    assert any("Duplicate value: 's1'" in p for p in slice_problems(twice))
    bad = _slice(sharedCounters=[{"name": "Bad_Name", "counters": {"memory_slice": {"value": "1"}}}])
    assert len([p for p in slice_problems(bad) if "RFC 1123 label" in p]) == 2
    crowded = _slice(devices=[_device(f"d{i}", ("s", one)) for i in range(65)])
    assert any("Too many: 65: must have at most 64" in p for p in slice_problems(crowded))


def test_health_reaches_partitions(node: tuple[ModuleType, Path, NodeProfile]) -> None:
    """An XID NVML attributes to a made partition's instances names that partition; one it does not
    attribute names every device of the GPU: each partition, made or not, and the whole GPU."""
    pynvml, root, profile = node
    uuid = profile.gpus[0].uuid
    mine = {MigPlacement(uuid, 15, 2, 2), MigPlacement(uuid, 0, 0, 8)}
    make_gi(pynvml, 15, 2, 2)
    devices = discover(root, frozenset(mine))
    gpu = index_gpus(devices.values())[uuid]
    assert event_targets(gpu, 4, 0) == ("gpu-0-mig-1g-20gb-p2",)
    everything = event_targets(gpu, NO_INSTANCE, NO_INSTANCE)
    assert set(everything) == {n for n in devices if n.startswith("gpu-0")} and len(everything) == H100_DEVICES + 1


@pytest.mark.parametrize(
    "profiles", [A100_40GB_MIG, A100_80GB_MIG, H100_80GB_MIG, H200_MIG, RTX_PRO_6000_MIG], ids=lambda t: t[-1].name
)
def test_every_simulated_profile_has_a_name_of_its_own(profiles: list[MigProfileSpec]) -> None:
    """One device name per profile and placement: two profiles with one name publish one of them."""
    labels = {p.name: profile_label(p.name) for p in profiles}
    assert None not in labels.values() and len(set(labels.values())) == len(profiles), labels
    for p in profiles:
        for name in (placement_device_name(99, p.name, max(p.starts)), mig_device_name(99, p.name, 14, 7)):
            assert name is not None and is_dns_label(name), name


def test_blackwell_profile_suffixes_keep_their_meaning_in_names() -> None:
    assert profile_label("1g.24gb+me") == "1g-24gb-me"
    assert profile_label("1g.24gb-me") == "1g-24gb-nome"  # no media engine: not "-me"
    assert profile_label("1g.24gb+me.all") == "1g-24gb-me-all"
    assert profile_label("2g.48gb+gfx") == "2g-48gb-gfx"
    assert profile_label("1g.24gb+nome") is None, "would read as 1g.24gb-me"
    assert profile_label("1g.24gb me") is None and profile_label("MIG") is None  # outside NVML's grammar


def test_a_blackwell_gpu_publishes_every_profile_with_counters_for_its_media_engines(tmp_path: Path) -> None:
    """RTX PRO 6000 Blackwell: "-me" placements are published beside "+me" ones, and "+me.all"
    (every decoder, encoder, JPEG and OFA engine on one slice) consumes them all."""
    with h100_in_mig_mode(tmp_path, RTX_PRO_6000_MIG) as (pynvml, _, _):
        gpu0 = {n: d for n, d in discover(tmp_path).items() if n.startswith("gpu-0")}
        assert len(gpu0) == BLACKWELL_DEVICES + 1
        assert {f"gpu-0-mig-1g-24gb-{s}-p3" for s in ("me", "nome", "me-all", "gfx")} <= set(gpu0)
        assert gpu0["gpu-0-mig-1g-24gb-nome-p3"].attributes["profile"] == "1g.24gb-me"
        assert uses(gpu0["gpu-0-mig-1g-24gb-me-all-p3"]) == {
            "memory-slice-3": 1, "compute-slices": 1, "decoders": 4, "encoders": 4, "jpeg-engines": 4, "ofa-engines": 1,
        }  # fmt: skip
        assert uses(gpu0["gpu-0-mig-1g-24gb-nome-p3"]) == {"memory-slice-3": 1, "compute-slices": 1}
        (use,) = gpu0["gpu-0"].consumes_counters
        assert use.counters == use.counter_set.counters and len(use.counter_set.counters) == 4 + 5
        _assert_counters_allow_exactly_the_pairs_nvml_allows(pynvml, tmp_path)
