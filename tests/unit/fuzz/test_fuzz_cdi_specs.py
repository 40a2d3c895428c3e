"""Fuzzing the reader of CDI spec files (cdi/spec.py through cdi/decode.py, and cdi/store.py's
`read_spec` and `list_specs`): a spec file in the CDI directory may be any other program's.

The property: any file gives a `Spec` or raises `SpecError` (`read_spec`), and `list_specs` skips
what it cannot read: never anything else. Strategies: a spec as Tandem writes one with its fields
mutated at any depth, and hostile JSON and bytes.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from fuzzing import deep_json, fuzz, hostile_json, mutated
from hypothesis import example
from hypothesis import strategies as st

from cdi.errors import SpecError
from cdi.spec import Spec
from cdi.store import list_specs, read_spec

SPEC = {
    "cdiVersion": "0.6.0",
    "kind": "tandem.dev/claim",
    "annotations": {"a": "b"},
    "devices": [
        {
            "name": "gpu-0",
            "containerEdits": {
                "env": ["A=1"],
                "deviceNodes": [{"path": "/dev/nvidia0", "major": 195, "minor": 0, "permissions": "rw", "uid": 0}],
                "mounts": [{"hostPath": "/usr/lib/x", "containerPath": "/usr/lib/x", "options": ["ro", "nosuid"]}],
                "hooks": [{"hookName": "createContainer", "path": "/bin/true", "args": ["true"], "timeout": 5}],
            },
        }
    ],
    "containerEdits": {"env": ["B=2"]},
}


@st.composite
def specs(draw: st.DrawFn) -> bytes:
    return json.dumps(mutated(SPEC, draw(st.data()))).encode()


@pytest.fixture(scope="module")
def directory() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="fuzz-cdi-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@example(data=b"[" * 3000)
@fuzz(specs() | deep_json | hostile_json | st.binary(max_size=64))
def test_any_spec_file_reads_as_a_spec_or_a_spec_error(directory: Path, data: bytes) -> None:
    path = directory / "tandem.dev-claim_x.json"
    path.write_bytes(data)
    try:
        assert isinstance(read_spec(path), Spec)
    except SpecError as e:
        assert str(e)
    assert list_specs(directory, "tandem.dev") in ([], [path])
