"""CDI validation names the offending field; the minimum version follows the Go rule feature by feature."""

from __future__ import annotations

import pytest

from cdi import (
    ContainerEdits,
    Device,
    DeviceNode,
    Hook,
    IntelRdt,
    Mount,
    NetDevice,
    Spec,
    SpecError,
    make_spec,
    minimum_version,
    problems,
    validate,
)

ENV = ContainerEdits(env=["A=1"])


def _spec(*edits: ContainerEdits, version: str = "1.1.0", kind: str = "vendor.example.com/gpu", **kw: object) -> Spec:
    devices = [Device(name=f"d{i}", container_edits=e) for i, e in enumerate(edits or (ENV,))]
    return Spec(cdi_version=version, kind=kind, devices=devices, **kw)  # type: ignore[arg-type]


def _fails(spec: Spec, field: str, words: str, *, strict: bool = True) -> None:
    with pytest.raises(SpecError) as e:
        validate(spec, strict=strict)
    assert e.value.field == field, str(e.value)
    assert words in str(e.value)


def test_a_good_spec_passes_both_modes():
    spec = _spec(
        ContainerEdits(
            env=["A=", "B=x=y"],
            device_nodes=[DeviceNode(path="/dev/x", type="c", permissions="rwm"), DeviceNode(path="/dev/y")],
            mounts=[Mount(host_path="/a", container_path="/b", options=["ro"])],
            hooks=[Hook(hook_name=n, path="/bin/h", timeout=1) for n in ("prestart", "createRuntime", "poststop")],
            net_devices=[NetDevice("eth1", "net1"), NetDevice("eth2", "net2")],
            intel_rdt=IntelRdt(clos_id="/"),
        ),
        ContainerEdits(additional_gids=[0]),  # only gid 0 still counts as an edit, as in Go
    )
    validate(spec)
    validate(spec, strict=False)
    assert list(problems(spec)) == []


@pytest.mark.parametrize(
    ("edits", "field", "words"),
    [
        (ContainerEdits(env=["A=1", "NOVALUE"]), "env[1]", "expected NAME=value"),
        (ContainerEdits(env=["=x"]), "env[0]", "expected NAME=value"),
        (ContainerEdits(device_nodes=[DeviceNode(path="")]), "deviceNodes[0].path", "must not be empty"),
        (ContainerEdits(device_nodes=[DeviceNode(path="/dev/x", type="x")]), "deviceNodes[0].type", "invalid device type"),
        (ContainerEdits(device_nodes=[DeviceNode(path="/dev/x", permissions="rwx")]), "deviceNodes[0].permissions", "only r, w and m"),
        (ContainerEdits(mounts=[Mount(host_path="", container_path="/b")]), "mounts[0].hostPath", "must not be empty"),
        (ContainerEdits(mounts=[Mount(host_path="/a", container_path="")]), "mounts[0].containerPath", "must not be empty"),
        (ContainerEdits(hooks=[Hook(hook_name="preStart", path="/x")]), "hooks[0].hookName", "unknown hook 'preStart'"),
        (ContainerEdits(hooks=[Hook(hook_name="poststart", path="")]), "hooks[0].path", "must not be empty"),
        (ContainerEdits(hooks=[Hook(hook_name="poststart", path="/x", env=["X"])]), "hooks[0].env[0]", "expected NAME=value"),
        (ContainerEdits(intel_rdt=IntelRdt(clos_id="..")), "intelRdt.closID", "invalid closID"),
        (ContainerEdits(intel_rdt=IntelRdt(clos_id="a/b")), "intelRdt.closID", "invalid closID"),
        (ContainerEdits(intel_rdt=IntelRdt(clos_id="a\nb")), "intelRdt.closID", "invalid closID"),
        (ContainerEdits(intel_rdt=IntelRdt(clos_id="x" * 4096)), "intelRdt.closID", "invalid closID"),
        (ContainerEdits(net_devices=[NetDevice("", "net1")]), "netDevices[0].hostInterfaceName", "must not be empty"),
        (ContainerEdits(net_devices=[NetDevice("eth1", "")]), "netDevices[0].name", "must not be empty"),
        (ContainerEdits(net_devices=[NetDevice("eth1", "a"), NetDevice("eth1", "b")]), "netDevices[1].hostInterfaceName", "duplicate"),
        (ContainerEdits(net_devices=[NetDevice("eth1", "a"), NetDevice("eth2", "a")]), "netDevices[1].name", "duplicate"),
    ],
)  # fmt: skip
def test_runtime_rules_name_the_field(edits: ContainerEdits, field: str, words: str):
    """Third device, so the path shows the index; the spec-level edits get the same rules."""
    _fails(_spec(ENV, ENV, edits), f"devices[2].containerEdits.{field}", words, strict=False)
    _fails(_spec(ENV, container_edits=edits), f"containerEdits.{field}", words, strict=False)


@pytest.mark.parametrize(
    ("edits", "field", "words"),
    [
        (ContainerEdits(device_nodes=[DeviceNode(path="dev/x")]), "deviceNodes[0].path", "absolute"),
        (ContainerEdits(device_nodes=[DeviceNode(path="/dev/x", host_path="x")]), "deviceNodes[0].hostPath", "absolute"),
        (ContainerEdits(device_nodes=[DeviceNode(path="/dev/x", permissions="none")]), "deviceNodes[0].permissions", "only r, w and m"),
        (ContainerEdits(mounts=[Mount(host_path="tmpfs", container_path="b")]), "mounts[0].containerPath", "absolute"),
        (ContainerEdits(hooks=[Hook(hook_name="poststart", path="hook")]), "hooks[0].path", "absolute"),
        (ContainerEdits(hooks=[Hook(hook_name="poststart", path="/hook", timeout=0)]), "hooks[0].timeout", "greater than zero"),
        (ContainerEdits(net_devices=[NetDevice("eth1", "a" * 16)]), "netDevices[0].name", "invalid interface name"),
        (ContainerEdits(net_devices=[NetDevice("eth:1", "a")]), "netDevices[0].hostInterfaceName", "invalid interface name"),
        (ContainerEdits(net_devices=[NetDevice("eth1", "a b")]), "netDevices[0].name", "invalid interface name"),
        (ContainerEdits(net_devices=[NetDevice("eth1", "..")]), "netDevices[0].name", "invalid interface name"),
    ],
)  # fmt: skip
def test_strict_rules_apply_only_in_strict_mode(edits: ContainerEdits, field: str, words: str):
    spec = _spec(edits)
    _fails(spec, f"devices[0].containerEdits.{field}", words)
    validate(spec, strict=False)


@pytest.mark.parametrize(
    ("spec", "field", "words"),
    [
        (_spec(version="9.9.9"), "cdiVersion", "unknown CDI version"),
        (_spec(version=""), "cdiVersion", "unknown CDI version"),
        (_spec(ContainerEdits(net_devices=[NetDevice("e", "n")]), version="1.0.0"), "cdiVersion", "uses features of 1.1.0"),
        (_spec(kind="vendor"), "kind", "expected vendor/class"),
        (_spec(kind="/gpu"), "kind", "expected vendor/class"),
        (_spec(kind="nvidia.com/gpu/x"), "kind", "invalid class 'gpu/x'"),
        (_spec(kind="1nvidia.com/gpu"), "kind", "invalid vendor"),
        (Spec(cdi_version="0.3.0", kind="v/c", devices=[]), "devices", "at least one device"),
        (_spec(ContainerEdits()), "devices[0].containerEdits", "at least one edit"),
        (_spec(ENV, ContainerEdits(mounts=[])), "devices[1].containerEdits", "at least one edit"),
        (Spec("1.1.0", "v/c", [Device("a", ENV), Device("b", ENV), Device("a", ENV)]), "devices[2].name", "duplicate device name 'a'"),
        (Spec("1.1.0", "v/c", [Device("-a", ENV)]), "devices[0].name", "invalid device name"),
        (_spec(annotations={"bad key": "x"}), 'annotations["bad key"]', "invalid annotation key"),
        (_spec(annotations={"a/b/c": "x"}), 'annotations["a/b/c"]', "at most one '/'"),
        (_spec(annotations={"/b": "x"}), 'annotations["/b"]', "prefix before '/' must be non-empty"),
        (_spec(annotations={"Bad_Prefix/b": "x"}), 'annotations["Bad_Prefix/b"]', "DNS subdomain"),
        (_spec(annotations={"x" * 64: "v"}), f'annotations["{"x" * 64}"]', "at most 63"),
        (_spec(annotations={"k": "v" * 256 * 1024}), "annotations", "more than the limit"),
        (Spec("1.1.0", "v/c", [Device("a", ENV, annotations={"a.b/-x": ""})]), 'devices[0].annotations["a.b/-x"]', "name part"),
    ],
)  # fmt: skip
def test_spec_rules_name_the_field(spec: Spec, field: str, words: str):
    _fails(spec, field, words, strict=False)


def test_annotation_keys_are_checked_case_insensitively_like_go():
    validate(_spec(annotations={"Example.COM/Some-Key": "x"}))


def test_a_v_prefix_passes_a_runtime_but_not_our_writer():
    spec = _spec(version="v1.1.0")
    validate(spec, strict=False)
    _fails(spec, "cdiVersion", "bare version")


def test_a_bad_type_is_reported_not_crashed_on():
    spec = _spec(ContainerEdits(env=[42]))  # type: ignore[list-item]
    _fails(spec, "devices[0].containerEdits.env[0]", "expected a string")


def test_spec_level_edits_are_checked_every_time_though_remembered():
    """The spec-level edits' problems are remembered by value (a driver's specs share them): every
    spec that carries the same bad edits still fails, in load order, and a good spec still passes."""
    bad = ContainerEdits(env=["X"], mounts=[Mount(host_path="/a", container_path="relative")])
    for _ in range(3):
        spec = Spec(cdi_version="0.5.0", kind="vendor.example.com/gpu", devices=[Device("d", ENV)], container_edits=bad)
        assert [p.field for p in problems(spec)] == ["containerEdits.env[0]", "containerEdits.mounts[0].containerPath"]
        assert [p.field for p in problems(spec, strict=False)] == ["containerEdits.env[0]"]
    good = Spec(cdi_version="0.5.0", kind="vendor.example.com/gpu", devices=[Device("d", ENV)], container_edits=ENV)
    validate(good)
    validate(good)


def test_spec_level_edits_of_the_wrong_type_are_reported_unhashable_or_not():
    for edits in (ContainerEdits(env=[42]), ContainerEdits(env=[["A=1"]])):  # type: ignore[list-item]
        spec = Spec(
            cdi_version="0.5.0", kind="vendor.example.com/gpu", devices=[Device("d", ENV)], container_edits=edits
        )
        _fails(spec, "containerEdits.env[0]", "expected a string")


def test_problems_lists_them_all():
    spec = _spec(ContainerEdits(env=["X"], device_nodes=[DeviceNode(path="")]), kind="bad")
    assert [p.field for p in problems(spec)] == [
        "kind",
        "devices[0].containerEdits.env[0]",
        "devices[0].containerEdits.deviceNodes[0].path",
    ]


# --- minimum version ---------------------------------------------------------------------------

GPU_NODE = DeviceNode(path="/dev/nvidia0", type="c", permissions="rw")


@pytest.mark.parametrize(
    ("spec", "version"),
    [
        (_spec(ENV), "0.3.0"),
        (_spec(ContainerEdits(device_nodes=[GPU_NODE], mounts=[Mount("/a", "/b", ["bind"])])), "0.3.0"),
        (_spec(ContainerEdits(mounts=[Mount("/a", "/b", type="bind")])), "0.4.0"),
        (_spec(ENV, container_edits=ContainerEdits(mounts=[Mount("/a", "/b", type="bind")])), "0.4.0"),
        (_spec(ContainerEdits(device_nodes=[DeviceNode("/dev/x", host_path="/dev/y")])), "0.5.0"),
        (Spec("", "v/c", [Device("7f1c-gpu-0", ENV)]), "0.5.0"),
        (_spec(annotations={"a": "b"}), "0.6.0"),
        (Spec("", "v/c", [Device("a", ENV, annotations={"a": "b"})]), "0.6.0"),
        (_spec(kind="vendor.example.com/gpu.x"), "0.6.0"),
        (_spec(ContainerEdits(additional_gids=[44])), "0.7.0"),
        (_spec(ContainerEdits(intel_rdt=IntelRdt())), "0.7.0"),
        (_spec(ContainerEdits(intel_rdt=IntelRdt(clos_id="c", l3_cache_schema="L3:0=f"))), "0.7.0"),
        (_spec(ContainerEdits(intel_rdt=IntelRdt(schemata=[]))), "1.1.0"),
        (_spec(ContainerEdits(intel_rdt=IntelRdt(enable_monitoring=True))), "1.1.0"),
        (_spec(ContainerEdits(net_devices=[NetDevice("e", "n")])), "1.1.0"),
        (_spec(ENV, container_edits=ContainerEdits(net_devices=[NetDevice("e", "n")])), "1.1.0"),
    ],
)  # fmt: skip
def test_minimum_version_per_feature(spec: Spec, version: str):
    assert minimum_version(spec) == version


def test_the_highest_feature_wins():
    spec = _spec(ContainerEdits(mounts=[Mount("/a", "/b", type="bind")], additional_gids=[1]))
    assert minimum_version(spec) == "0.7.0"


def test_a_dot_in_the_vendor_does_not_raise_the_version():
    assert minimum_version(_spec(kind="k8s.tandem.example.org/claim")) == "0.3.0"


def test_make_spec_declares_the_minimum():
    spec = make_spec(
        "k8s.tandem.example.org/claim", [Device("7f1c-pci-0000-8a-00-0", ContainerEdits(device_nodes=[GPU_NODE]))]
    )
    assert spec.cdi_version == "0.5.0"
    validate(spec)


def test_make_spec_accepts_a_newer_version_but_not_an_older_one():
    devices = [Device("gpu0", ENV)]
    assert make_spec("v/c", devices, cdi_version="1.1.0").cdi_version == "1.1.0"
    with pytest.raises(SpecError, match=r"older than 0\.7\.0"):
        make_spec("v/c", devices, container_edits=ContainerEdits(additional_gids=[1]), cdi_version="0.5.0")


def test_make_spec_refuses_what_the_runtimes_cannot_load():
    """podman 4.3.1 (Debian 12) knows up to 0.5.0: netDevices must fail here, not in the runtime cache."""
    nic = [Device("nic0", ContainerEdits(net_devices=[NetDevice("ens5f0v2", "net1")]))]
    with pytest.raises(SpecError, match=r"accept at most 0\.5\.0"):
        make_spec("v/c", nic, max_version="0.5.0")
    assert make_spec("v/c", [Device("0gpu", ENV)], max_version="0.5.0").cdi_version == "0.5.0"
