"""The image recipe's cheap parts (the build itself is opt-in: `make image`, docs/container.md):
the Dockerfile runs KServe's line in the foreground as uid 1000, the wheel set's requirements
follow the variant, and the smoke test's model answers every kind of row it is sent."""

from __future__ import annotations

import json
import re
import zipfile
from pathlib import Path

import pytest

from docker import build
from docker.smoke_handler import AffineHandler

DOCKERFILE = build.DOCKERFILE.read_text()


def _instruction(name: str) -> list[str]:
    """The arguments of each ``name`` instruction (continuation lines joined)."""
    text = DOCKERFILE.replace("\\\n", " ")
    return [m.group(1).strip() for m in re.finditer(rf"^{name}\s+(.*)$", text, re.MULTILINE)]


def test_the_command_is_kserves_line_in_the_foreground() -> None:
    (cmd,) = _instruction("CMD")
    expected = list(build.KSERVE_ARGS)
    expected.insert(expected.index("--start") + 1, "--foreground")
    assert json.loads(cmd) == expected
    assert _instruction("ENTRYPOINT") == []  # KServe's args replace CMD; they would append


def test_runs_as_numeric_uid_1000_and_exposes_kserves_ports() -> None:
    assert _instruction("USER") == ["1000"]
    assert set(_instruction("EXPOSE")[0].split()) == {"8080", "8081", "8082", "7070", "7071"}
    assert DOCKERFILE.index("ARG BASE_IMAGE") < DOCKERFILE.index("FROM ")


def _wheel(tmp_path: Path, requires: list[str]) -> Path:
    path = tmp_path / "batchserve-0.1.0-py3-none-any.whl"
    metadata = "Metadata-Version: 2.1\nName: batchserve\nVersion: 0.1.0\n" + "".join(
        f"Requires-Dist: {line}\n" for line in requires)
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("batchserve-0.1.0.dist-info/METADATA", metadata)
    return path


REQUIRES = ["torch>=2.2", "torchvision>=0.17", "grpcio<2,>=1.85.1",
            'uvloop>=0.19; sys_platform != "win32"', 'pytest>=8.0; extra == "dev"']


def test_requirements_pin_the_variants_torch_and_leave_extras_out(tmp_path: Path) -> None:
    variant = build.Variant(torch="torch==2.14.1", torchvision="torchvision==0.29.1")
    assert build.requirements(_wheel(tmp_path, REQUIRES), variant, ["numpy"]) == [
        "torch==2.14.1", "torchvision==0.29.1", "grpcio<2,>=1.85.1",
        'uvloop>=0.19; sys_platform != "win32"', "numpy"]


def test_a_variant_without_torchvision_drops_it(tmp_path: Path) -> None:
    variant = build.Variant(torch="torch==2.13.0+cpu", torchvision=None)
    result = build.requirements(_wheel(tmp_path, REQUIRES), variant, [])
    assert result[0] == "torch==2.13.0+cpu"
    assert not any(line.startswith("torchvision") for line in result)


@pytest.mark.parametrize(("row", "expected"), [
    ({"INPUT0": [1.0, 2.0, 3.0, 4.0]}, {"OUTPUT0": [3.0, 5.0, 7.0, 9.0]}),  # v2 REST, gRPC
    ({"body": b"[0, 0, 0, 0]"}, [1.0, 1.0, 1.0, 1.0]),  # /predictions, raw JSON
    ({"body": [1, 1, 1, 1]}, [3.0, 3.0, 3.0, 3.0]),  # /predictions, decoded JSON
    ({"data": [0.5, 0, 0, 0]}, [2.0, 1.0, 1.0, 1.0]),  # a KServe v1 instance
    ([0, 0.5, 0, 0], [1.0, 2.0, 1.0, 1.0]),  # a v1 instance through TorchServe's kserve envelope
])
def test_the_smoke_model_answers_each_kind_of_row(row: object, expected: object) -> None:
    handler = AffineHandler()
    handler.initialize(None)
    # Batched with a v2 row, as the server may batch them.
    answers = handler.handle([row, {"INPUT0": [0.0, 0.0, 0.0, 0.0]}], None)
    assert answers == [expected, {"OUTPUT0": [1.0, 1.0, 1.0, 1.0]}]
