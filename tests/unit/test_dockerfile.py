"""The container image recipe, checked without building it (no registry is reachable in CI).

What can go wrong silently in a Dockerfile: a COPY of a path that was renamed or that
.dockerignore leaves out (the build fails only on the release machine), a floating base tag (two
builds of one commit differ), a dependency installed from PyPI at build time instead of from the
hash-pinned lock, and a lock that misses a dependency added to pyproject.toml.
"""

from __future__ import annotations

import fnmatch
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from driver.version import COMMIT_ENV, CREATED_ENV

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "Dockerfile"
DOCKERIGNORE = REPO / ".dockerignore"
RUNTIME_LOCK = REPO / "requirements.lock"
BUILD_LOCK = REPO / "requirements-build.lock"
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


@dataclass(frozen=True)
class Instruction:
    keyword: str
    args: str
    line: int


@dataclass
class Stage:
    image: str
    name: str
    instructions: list[Instruction]


def parse_dockerfile(text: str) -> tuple[dict[str, str], list[Stage]]:
    """Instructions (continuations joined, runs of blanks made one, comments dropped); global ARG defaults."""
    instructions: list[Instruction] = []
    pending, start = "", 0
    for number, raw in enumerate(text.splitlines(), 1):
        stripped = raw.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if pending and stripped.startswith("#"):
            continue
        if not pending:
            start = number
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        keyword, _, args = (pending + stripped).partition(" ")
        instructions.append(Instruction(keyword.upper(), " ".join(args.split()), start))
        pending = ""
    assert not pending, "Dockerfile ends inside a continued line"

    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for ins in instructions:
        if ins.keyword == "FROM":
            words = ins.args.split()
            words = [w for w in words if not w.startswith("--platform")]
            image = re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: global_args[m.group(1) or m.group(2)], words[0])
            name = words[2] if len(words) >= 3 and words[1].upper() == "AS" else ""
            stages.append(Stage(image, name, []))
        elif not stages and ins.keyword == "ARG":
            key, _, default = ins.args.partition("=")
            global_args[key] = default.strip('"')
        else:
            assert stages, f"line {ins.line}: {ins.keyword} before the first FROM"
            stages[-1].instructions.append(ins)
    return global_args, stages


GLOBAL_ARGS, STAGES = parse_dockerfile(DOCKERFILE.read_text())
FINAL = STAGES[-1]


def _runs(stage: Stage) -> str:
    return "\n".join(i.args for i in stage.instructions if i.keyword == "RUN")


def test_parser_joins_continuations_and_substitutes_args() -> None:
    args, stages = parse_dockerfile(
        'ARG BASE=img:1.2.3\n# comment\nFROM ${BASE} AS a\nRUN one \\\n  # inner comment\n  two\nFROM $BASE\nCMD ["x"]\n'
    )
    assert args == {"BASE": "img:1.2.3"}
    assert [(s.image, s.name) for s in stages] == [("img:1.2.3", "a"), ("img:1.2.3", "")]
    assert stages[0].instructions[0].args == "one two"


def test_it_has_a_builder_and_a_final_stage() -> None:
    assert len(STAGES) >= 2
    assert all(s.name for s in STAGES[:-1]), "name every intermediate stage, so COPY --from says what it takes"


_DIGEST = re.compile(r"@sha256:[0-9a-f]{64}$")
# An exact release: at least major.minor.patch in the tag (python:3.11.11-slim-bookworm).
_EXACT_TAG = re.compile(r":\d+\.\d+\.\d+[-\w.]*$")


@pytest.mark.parametrize("image", sorted({s.image for s in STAGES}))
def test_base_images_are_pinned(image: str) -> None:
    stage_names = {s.name for s in STAGES}
    if image in stage_names:
        return
    assert _DIGEST.search(image) or _EXACT_TAG.search(image), f"{image} is neither a digest nor an exact version"
    assert not image.endswith(":latest")


@pytest.mark.parametrize("image", ["python:3.11", "python:3.11-slim", "python:latest", "python"])
def test_pin_check_rejects_floating_tags(image: str) -> None:
    assert not (_DIGEST.search(image) or _EXACT_TAG.search(image))


def _copy_sources(ins: Instruction) -> list[str]:
    words = shlex.split(ins.args)
    if any(w.startswith("--from") for w in words):
        return []
    words = [w for w in words if not w.startswith("--")]
    return words[:-1]


def _dockerignore_excludes(path: str) -> bool:
    """Docker's rule: the last matching pattern wins; `!` re-includes."""
    excluded = False
    for raw in DOCKERIGNORE.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pattern = line.lstrip("!").strip("/")
        parts = path.split("/")
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        if any(fnmatch.fnmatchcase(p, pattern) for p in prefixes):
            excluded = not negate
    return excluded


@pytest.mark.parametrize(
    "ins", [i for s in STAGES for i in s.instructions if i.keyword in ("COPY", "ADD")], ids=lambda i: f"line{i.line}"
)
def test_copy_sources_exist_and_are_in_the_build_context(ins: Instruction) -> None:
    for src in _copy_sources(ins):
        assert (REPO / src).exists(), f"line {ins.line}: {src} does not exist"
        assert not _dockerignore_excludes(src), f"line {ins.line}: .dockerignore leaves {src} out of the context"


def test_bind_mounted_context_files_exist_and_are_in_the_context() -> None:
    for stage in STAGES:
        for ins in stage.instructions:
            for m in re.finditer(r"--mount=(\S+)", ins.args):
                opts = dict(kv.split("=", 1) for kv in m.group(1).split(","))
                if opts.get("type") == "bind" and "from" not in opts:
                    assert (REPO / opts["source"]).exists(), opts["source"]
                    assert not _dockerignore_excludes(opts["source"]), opts["source"]


def test_dockerignore_keeps_local_state_out_of_the_context() -> None:
    for path in (".venv", ".git", "tests", "tandem_dra.egg-info", "driver/__pycache__", ".notes"):
        assert _dockerignore_excludes(path), path
    for path in ("driver/cli.py", "cdi/spec.py", "pyproject.toml"):
        assert not _dockerignore_excludes(path), path


# Packaged in the wheel (`tandem-driver demo` after `pip install '.[sim]'` in a checkout), but not in the
# image: the privileged driver pod carries only the driver (issue 11, item 18).
SIMULATION_PACKAGES = {"sim", "demo"}
PACKAGES = {p.rstrip("*") for p in PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]}
COPIED = {src for s in STAGES for i in s.instructions if i.keyword == "COPY" for src in _copy_sources(i)}


def test_everything_the_package_build_needs_is_copied() -> None:
    """setuptools needs pyproject.toml, the readme it names, and every package of the driver."""
    assert SIMULATION_PACKAGES < PACKAGES, "pyproject.toml no longer packages the simulation: update this test"
    assert {"pyproject.toml", PYPROJECT["project"]["readme"]} | (PACKAGES - SIMULATION_PACKAGES) <= COPIED


def test_the_image_leaves_the_simulation_out() -> None:
    """Neither copied nor in the build context: nothing of sim/ or demo/ can reach a layer."""
    for package in sorted(SIMULATION_PACKAGES):
        assert not any(src == package or src.startswith(f"{package}/") for src in COPIED), package
        assert _dockerignore_excludes(package), f".dockerignore lets {package}/ into the build context"


def _stage_builder_context(dest: Path) -> None:
    """What the builder stage's WORKDIR holds after its COPY instructions (context files only)."""
    (builder,) = [s for s in STAGES if s.name == "builder"]
    ignore = shutil.ignore_patterns("__pycache__", "*.py[co]")
    for ins in builder.instructions:
        sources = _copy_sources(ins) if ins.keyword == "COPY" else []
        if not sources:
            continue
        target = dest / shlex.split(ins.args)[-1]
        for src in sources:
            assert not _dockerignore_excludes(src), src
            into = target / Path(src).name if ins.args.endswith("/") or len(sources) > 1 else target
            if (REPO / src).is_dir():
                shutil.copytree(REPO / src, into, ignore=ignore)
            else:
                into.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(REPO / src, into)


def test_wheel_built_from_the_image_context_holds_only_the_driver(tmp_path: Path) -> None:
    """The builder's own wheel command, run on what the builder copies: the wheel the image
    installs has the driver, its console scripts and no simulation."""
    stage, wheels = tmp_path / "src", tmp_path / "wheels"
    _stage_builder_context(stage)
    pip_wheel = ["pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q", "--wheel-dir", str(wheels)]
    subprocess.run(
        [sys.executable, "-m", *pip_wheel, str(stage)],
        check=True,
        capture_output=True,
        timeout=300,
        env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"},
    )
    (wheel,) = wheels.glob("tandem_dra-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
        scripts = zf.read(entry_points).decode()
    top = {n.split("/", 1)[0] for n in names if not n.split("/", 1)[0].endswith(".dist-info")}
    assert top == PACKAGES - SIMULATION_PACKAGES
    assert "driver/daemon.py" in names and "cdi/spec.py" in names
    for script in PYPROJECT["project"]["scripts"]:
        assert f"{script} = " in scripts, script


def test_builder_installs_only_hash_pinned_binaries() -> None:
    builder = "\n".join(_runs(s) for s in STAGES[:-1])
    assert re.search(r"pip install --require-hashes --only-binary=:all: -r requirements-build.lock", builder)
    assert re.search(r"pip wheel --require-hashes --only-binary=:all: --wheel-dir \S+ -r requirements.lock", builder)
    assert re.search(r"pip wheel --no-deps --no-build-isolation .* \.( &&|$)", builder, re.MULTILINE)


def test_final_stage_installs_the_package_from_wheels_only() -> None:
    final = _runs(FINAL)
    assert re.search(r"pip install --no-index --find-links \S+ --require-hashes -r \S*requirements.lock", final)
    assert re.search(r"pip install --no-index --no-deps \S*tandem_dra-\*\.whl", final)


def test_final_install_layer_is_keyed_by_what_the_builder_made() -> None:
    """buildah (`podman build`, which hack/cluster uses) keys its layer cache for a RUN by the
    instruction and the layer below, not by what a bind mount from another stage holds: with the
    wheels only bind-mounted, a rebuild after a code change reused the old install layer, and the
    image kept the old driver. A COPY from the builder is keyed by content, so copying the wheels'
    checksums in just before the install makes every new wheel a new layer; the install then
    checks the wheels against them."""
    final = FINAL.instructions
    install = next(i for i, ins in enumerate(final) if ins.keyword == "RUN" and "from=builder" in ins.args)
    sums = [shlex.split(ins.args) for ins in final[:install] if ins.keyword == "COPY" and "--from=builder" in ins.args]
    assert sums, "no COPY --from=builder before the install: buildah's cache cannot see a new wheel"
    source, target = sums[-1][-2:]
    assert re.search(rf"sha256sum [^\n]*> *{re.escape(source)}", "\n".join(_runs(s) for s in STAGES[:-1]))
    assert re.search(rf"sha256sum [^\n]*-c [^\n]*{re.escape(target)}", final[install].args)


def test_final_stage_has_no_build_tools_or_source_tree() -> None:
    final = _runs(FINAL)
    assert not re.search(r"apt-get|apk add|gcc|build-essential|pip install [^\n]*setuptools", final)
    sources = [src for i in FINAL.instructions if i.keyword in ("COPY", "ADD") for src in _copy_sources(i)]
    assert sources == [], f"the final stage copies {sources} from the context; it should take only wheels"


def test_entrypoint_is_the_installed_console_script() -> None:
    (entry,) = [i for i in FINAL.instructions if i.keyword == "ENTRYPOINT"]
    assert entry.args == '["tandem-driver"]'
    assert "tandem-driver" in PYPROJECT["project"]["scripts"]


def test_final_image_defaults_to_a_non_root_user() -> None:
    users = [i.args for i in FINAL.instructions if i.keyword == "USER"]
    assert users, "no USER: the image would run as root by default"
    uid = users[-1].split(":")[0]
    assert uid not in ("0", "root")


# -- what the image was built from ---------------------------------------------------------------

OCI = "org.opencontainers.image."
# The labels whose value is the build's: each from the build arg of the final stage named here.
LABELS_FROM_ARGS = {"version": "TANDEM_VERSION", "revision": COMMIT_ENV, "created": CREATED_ENV}


def _settings(keyword: str) -> dict[str, str]:
    """The final stage's `key=value` pairs of its LABEL, ENV or ARG instructions, unquoted as the
    builder unquotes them (an ARG without a default: an empty value)."""
    words = [w for i in FINAL.instructions if i.keyword == keyword for w in shlex.split(i.args)]
    return {key: value for key, _, value in (w.partition("=") for w in words)}


def test_the_image_carries_the_oci_labels() -> None:
    labels = _settings("LABEL")
    wanted = {OCI + n for n in ("title", "description", "version", "revision", "source", "licenses", "created")}
    assert wanted <= set(labels), f"missing: {sorted(wanted - set(labels))}"
    assert labels[OCI + "licenses"] == PYPROJECT["project"]["license"]["text"]
    for label, arg in LABELS_FROM_ARGS.items():
        assert labels[OCI + label] == f"${{{arg}}}", f"{label} must come from the build arg {arg}"


def test_the_build_args_come_after_every_install_step() -> None:
    """A RUN after an ARG is keyed by the arg's value in the layer cache: declared before the
    install, a new commit or build time would reinstall everything. After the last RUN they cost
    only the metadata."""
    final = FINAL.instructions
    last_run = max(n for n, ins in enumerate(final) if ins.keyword == "RUN")
    declared = {ins.args.partition("=")[0]: n for n, ins in enumerate(final) if ins.keyword == "ARG"}
    for arg in LABELS_FROM_ARGS.values():
        assert arg in declared, f"the final stage does not declare ARG {arg}"
        assert declared[arg] > last_run, f"ARG {arg} comes before a RUN"


def test_the_version_label_defaults_to_the_package_version() -> None:
    """A plain `podman build .` labels the image with the version of the wheel inside it."""
    assert _settings("ARG")["TANDEM_VERSION"] == PYPROJECT["project"]["version"]


def test_the_commit_and_build_time_are_in_the_environment_the_driver_reads() -> None:
    """The image has no .git: `tandem-driver --version` finds its commit and build time in these
    variables (driver/version.py)."""
    env = _settings("ENV")
    assert env.get(COMMIT_ENV) == f"${{{COMMIT_ENV}}}"
    assert env.get(CREATED_ENV) == f"${{{CREATED_ENV}}}"


def test_the_cluster_image_build_passes_the_commit_and_build_time() -> None:
    """hack/cluster.sh image (hack/cluster/build.sh) is the image build in hack/: it names the
    commit git says and the build time."""
    script = (REPO / "hack" / "cluster" / "build.sh").read_text()
    build = re.search(r'"\$\{PODMAN\[@\]\}" build (?:[^\n]*\\\n)*[^\n]*', script)
    assert build, "no podman build in hack/cluster/build.sh"
    assert re.search(r"local git=\(git [^)]*\)", script), "git is run as one command, checkout marked safe"
    assert re.search(r'commit="\$\("\$\{git\[@\]\}" rev-parse HEAD', script)
    assert f'--build-arg {COMMIT_ENV}="$commit"' in build.group()
    assert re.search(rf'--build-arg {CREATED_ENV}="\$\(date -u \+%Y-%m-%dT%H:%M:%SZ\)"', build.group())


# -- lock files -----------------------------------------------------------------------------


def parse_lock(text: str) -> dict[str, tuple[Version, int]]:
    """name -> (pinned version, number of hashes) of a pip-compile --generate-hashes file."""
    pins: dict[str, tuple[Version, int]] = {}
    current = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        m = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s\\;]+)", line)
        if m:
            current = canonicalize_name(m.group(1))
            pins[current] = (Version(m.group(2)), 0)
        elif line.startswith("--hash=sha256:") and current:
            version, count = pins[current]
            pins[current] = (version, count + 1)
        elif not line.startswith("--hash"):
            raise AssertionError(f"unexpected lock line: {line!r}")
    return pins


RUNTIME_PINS = parse_lock(RUNTIME_LOCK.read_text())
BUILD_PINS = parse_lock(BUILD_LOCK.read_text())


def test_lock_parser_counts_hashes() -> None:
    pins = parse_lock("# c\nfoo-bar==1.2 \\\n    --hash=sha256:aa \\\n    --hash=sha256:bb\n    # via x\nbaz==3\n")
    assert pins == {"foo-bar": (Version("1.2"), 2), "baz": (Version("3"), 0)}


@pytest.mark.parametrize("requirement", PYPROJECT["project"]["dependencies"])
def test_runtime_lock_pins_every_dependency_within_its_range(requirement: str) -> None:
    req = Requirement(requirement)
    name = canonicalize_name(req.name)
    assert name in RUNTIME_PINS, f"{req.name} is a dependency but requirements.lock lacks it: run hack/lock-deps.sh"
    version, _ = RUNTIME_PINS[name]
    assert req.specifier.contains(version, prereleases=True), f"{name}=={version} is outside {req.specifier}"


@pytest.mark.parametrize("requirement", PYPROJECT["build-system"]["requires"])
def test_build_lock_pins_the_build_backend(requirement: str) -> None:
    req = Requirement(requirement)
    name = canonicalize_name(req.name)
    assert name in BUILD_PINS, f"{req.name} is a build requirement but requirements-build.lock lacks it"
    assert req.specifier.contains(BUILD_PINS[name][0], prereleases=True)


def test_every_pin_carries_hashes() -> None:
    for lock, pins in ((RUNTIME_LOCK, RUNTIME_PINS), (BUILD_LOCK, BUILD_PINS)):
        unhashed = [name for name, (_, hashes) in pins.items() if hashes == 0]
        assert not unhashed, f"{lock.name}: {unhashed} without --hash (pip --require-hashes refuses them)"


def test_runtime_lock_holds_no_test_tools() -> None:
    test_only = {canonicalize_name(Requirement(r).name) for r in PYPROJECT["project"]["optional-dependencies"]["test"]}
    runtime = {canonicalize_name(Requirement(r).name) for r in PYPROJECT["project"]["dependencies"]}
    assert not (test_only - runtime) & set(RUNTIME_PINS)


def test_lock_files_say_how_they_were_made() -> None:
    for lock in (RUNTIME_LOCK, BUILD_LOCK):
        assert "hack/lock-deps.sh" in lock.read_text().split("\n\n", 1)[0], lock.name
    script = REPO / "hack" / "lock-deps.sh"
    assert os.access(script, os.X_OK)
