"""The image recipes' cheap parts (the build itself is opt-in: `make image`, docs/container.md):
the Dockerfile runs KServe's line in the foreground as uid 1000, the SageMaker one runs the
toolkit's `serve` through its entry point (which is run here with a stand-in toolkit), the
wheel set's requirements follow the variant, and the smoke tests' models answer what they are
sent."""

from __future__ import annotations

import json
import os
import subprocess
import zipfile
from pathlib import Path

import pytest

from docker import build
from docker.contract import instructions
from docker.smoke_handler import AffineHandler

DOCKERFILE = build.DOCKERFILE.read_text()


def _instruction(name: str) -> list[str]:
    return instructions(build.DOCKERFILE, name)


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


# ---- the SageMaker variant (docker/Dockerfile.sagemaker) --------------------------------

def _sagemaker_instruction(name: str) -> list[str]:
    return instructions(build.SAGEMAKER_DOCKERFILE, name)


def test_sagemaker_image_runs_serve_through_its_entry_point() -> None:
    # SageMaker runs `docker run IMAGE serve`: the argument reaches the entry point.
    (entrypoint,) = _sagemaker_instruction("ENTRYPOINT")
    assert json.loads(entrypoint) == ["/usr/local/bin/sagemaker-entrypoint.sh"]
    assert [json.loads(cmd) for cmd in _sagemaker_instruction("CMD")] == [["serve"]]
    assert _sagemaker_instruction("EXPOSE") == ["8080"]
    assert _sagemaker_instruction("USER") == ["1000"]
    labels = " ".join(_sagemaker_instruction("LABEL"))
    assert "com.amazonaws.sagemaker.capabilities.accept-bind-to-port=true" in labels
    assert "com.amazonaws.sagemaker.capabilities.multi-models=true" in labels


def test_sagemaker_image_leaves_the_server_in_the_background_and_its_config_writable() -> None:
    # The toolkit needs `torchserve --start` to return, and writes its config file as uid 1000.
    env = " ".join(_sagemaker_instruction("ENV"))
    assert "BATCHSERVE_FOREGROUND" not in env
    run = " ".join(_sagemaker_instruction("RUN"))
    assert "chown model-server:model-server /etc/sagemaker-ts.properties" in run
    assert any("--chown=1000:1000" in copy and "/opt/batchserve" in copy
               for copy in _sagemaker_instruction("COPY"))


def test_the_sagemaker_variant_adds_the_toolkit(tmp_path: Path) -> None:
    variant = build.VARIANTS["sagemaker"]
    result = build.requirements(_wheel(tmp_path, REQUIRES), variant, ["numpy"])
    assert result[0] == variant.torch
    assert result[-3:] == [*build.SAGEMAKER_REQUIREMENTS, "numpy"]
    assert build.SAGEMAKER_REQUIREMENTS[0].startswith("sagemaker-pytorch-inference")
    assert variant.dockerfile == build.SAGEMAKER_DOCKERFILE
    assert build.SAGEMAKER_ENTRYPOINT in variant.files


def _run_entrypoint(tmp_path: Path, args: list[str], env: dict[str, str]) -> list[str]:
    """The entry point with a stand-in `serve` first on PATH that prints what it was given."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / "serve"
    fake.write_text('#!/bin/sh\necho "serve $# ${SAGEMAKER_MODEL_SERVER_WORKERS:-unset}"\n')
    fake.chmod(0o755)
    done = subprocess.run([str(build.SAGEMAKER_ENTRYPOINT), *args], capture_output=True,
                          text=True, timeout=30,
                          env={"PATH": f"{bin_dir}:/usr/bin:/bin", **env})
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def test_the_entry_point_runs_the_toolkit_with_the_cpu_count_as_workers(tmp_path: Path
                                                                        ) -> None:
    cpus = str(len(os.sched_getaffinity(0)))
    assert _run_entrypoint(tmp_path, ["serve"], {}) == ["serve", "0", cpus]
    assert _run_entrypoint(tmp_path, [], {}) == ["serve", "0", cpus]
    # A value the user set is kept (AWS's entry point overwrote it).
    assert _run_entrypoint(tmp_path, ["serve"], {"SAGEMAKER_MODEL_SERVER_WORKERS": "3"}) == [
        "serve", "0", "3"]


def test_the_entry_point_runs_any_other_command_in_its_place(tmp_path: Path) -> None:
    assert _run_entrypoint(tmp_path, ["echo", "hello", "there"], {}) == ["hello", "there"]


def test_the_sagemaker_smoke_model_answers_through_the_user_functions(tmp_path: Path) -> None:
    # What the smoke test writes as a model directory, read back by its inference.py as the
    # toolkit calls it: the weights decide the answer, JSON (text) and NPY (bytes) alike.
    from docker import sagemaker_contract, smoke_inference

    weights = sagemaker_contract.MULTI["beta"]
    weights.write(tmp_path / "model")
    assert (tmp_path / "model" / "code" / "inference.py").read_text() == \
        sagemaker_contract.USER_SCRIPT.read_text()
    model = smoke_inference.model_fn(str(tmp_path / "model"))
    for body, headers in (sagemaker_contract.json_body(sagemaker_contract.INPUTS),
                          sagemaker_contract.npy_body(sagemaker_contract.INPUTS)):
        content_type = headers["Content-Type"]
        data = smoke_inference.input_fn(
            body.decode() if content_type == "application/json" else body, content_type)
        answer, answer_type = smoke_inference.output_fn(
            smoke_inference.predict_fn(data, model), "application/json")
        assert json.loads(answer) == weights.expected() == [[2.0, 5.0, 8.0, 11.0],
                                                            [-1.0, -1.0, -1.0, -1.0]]
        assert answer_type == "application/json"
    with pytest.raises(ValueError, match="unsupported content type"):
        smoke_inference.input_fn("1,2,3,4", "text/csv")
