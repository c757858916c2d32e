"""``.pt2`` programs (issue 37): what the archiver and the loader read of a file, the batch
dimension's limits and how batches fit them, the loaded program as a module, and
``batchserve-export`` on small models (ExportedPrograms only: AOTInductor's compile is
tests/integration/test_pt2.py's, made once and cached)."""

from __future__ import annotations

import json
import logging
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

from backend.errors import ModelLoadError
from backend.handlers.buckets import fit_buckets
from backend.handlers.graphs import GraphSettings, make_runner
from backend.handlers.tuning import Tuning, captured_elsewhere
from backend.weights import Sharing
from backend.weights.export import compare
from backend.weights.export import main as export_main
from backend.weights.pt2 import BatchLimits, Pt2Program, exported_limits, load_pt2
from model_archiver.cli import main as archiver_main
from model_archiver.pt2 import Pt2Error, Pt2Kind, pt2_kind, pt2_note
from tests.conftest import ROOT

REGRESSOR = ROOT / "tests" / "fixtures" / "models" / "tiny_regressor.py"
CPU = torch.device("cpu")


def _zip(path: Path, *names: str) -> Path:
    with zipfile.ZipFile(path, "w") as archive:
        for name in names:
            archive.writestr(name, b"x" * 16)
    return path


# -- what a .pt2 holds (model_archiver.pt2: no torch) --------------------------------------


def test_the_kind_is_read_from_the_zip_entries(tmp_path: Path) -> None:
    exported = _zip(tmp_path / "a.pt2", "m/models/model.json", "m/data/weights/weight_0")
    aoti = _zip(tmp_path / "b.pt2", "m/data/aotinductor/model/abc.wrapper.so",
                "m/data/aotinductor/model/abc.wrapper.cpp")
    both = _zip(tmp_path / "c.pt2", "m/models/model.json",
                "m/data/aotinductor/model/abc.wrapper.so")
    assert pt2_kind(exported) is Pt2Kind.EXPORTED_PROGRAM
    assert pt2_kind(aoti) is Pt2Kind.AOTINDUCTOR
    assert pt2_kind(both) is Pt2Kind.AOTINDUCTOR  # the compiled form of the same program


def test_a_file_of_neither_kind_says_why(tmp_path: Path) -> None:
    text = tmp_path / "t.pt2"
    text.write_bytes(b"plain text")
    with pytest.raises(Pt2Error, match=r"t.pt2 is not a .pt2 archive \(not a zip file"):
        pt2_kind(text)
    sources = _zip(tmp_path / "s.pt2", "m/data/aotinductor/model/abc.wrapper.cpp")
    with pytest.raises(Pt2Error, match=r"holds neither a torch\.export program"):
        pt2_kind(sources)
    flipped = _zip(tmp_path / "f.pt2", "m/models/model.json")
    data = bytearray(flipped.read_bytes())
    data[data.index(b"x" * 16) + 3] ^= 0xFF  # inside the stored entry
    flipped.write_bytes(data)
    with pytest.raises(Pt2Error, match=r"damaged \.pt2 archive: m/models/model\.json fails"):
        pt2_kind(flipped)


def test_the_archiver_names_the_kind_and_warns_of_a_bad_one(tmp_path: Path) -> None:
    good = _zip(tmp_path / "model.pt2", "m/data/aotinductor/model/abc.wrapper.so")
    bad = tmp_path / "bad.pt2"
    bad.write_bytes(b"nope")
    assert pt2_note(tmp_path / "weights.pt") is None and pt2_note(None) is None
    note = pt2_note(good)
    assert note is not None and note.startswith("model.pt2 holds an AOTInductor package")
    warning = pt2_note(bad)
    assert warning is not None and warning.startswith("warning: bad.pt2 is not a .pt2")
    assert "the server will refuse to load it" in warning

    result = CliRunner().invoke(archiver_main, [
        "--model-name", "m", "--version", "1", "--serialized-file", str(good), "--handler",
        "image_classifier", "--export-path", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "model-archiver: model.pt2 holds an AOTInductor package" in result.stderr
    assert result.stdout.strip() == str(tmp_path / "m.mar")  # stdout: the archive only


# -- the batch dimension and the buckets ----------------------------------------------------


def test_batch_limits_parse_say_and_constrain() -> None:
    assert BatchLimits.parse("1:64") == BatchLimits(1, 64, dynamic=True)
    assert BatchLimits.parse("2:") == BatchLimits(2, None, dynamic=True)
    assert BatchLimits.parse("3:3") == BatchLimits(3, 3, dynamic=False)
    for text in ("0:4", "4:2", "a:b", ""):
        with pytest.raises(ValueError, match=r"batchserve\.batch_dim must be low:high"):
            BatchLimits.parse(text)
    assert BatchLimits(1, 64).text() == "batch dimension 1..64"
    assert BatchLimits(2, None).text() == "batch dimension 2..any"
    assert BatchLimits(1, 1, dynamic=False).text().endswith("chunks of 1 (one request at a time)")
    assert BatchLimits(1, 64).metadata() == "1:64" and BatchLimits(2).metadata() == "2:"
    assert not BatchLimits(1, 8).constrains(8) and BatchLimits(1, 4).constrains(8)
    assert BatchLimits(2, None).constrains(1) and not BatchLimits(1, None).constrains(512)


def test_buckets_fit_within_the_batch_dimension() -> None:
    assert fit_buckets((1, 2, 4, 8), 1, 4) == (1, 2, 4)
    assert fit_buckets((1, 2, 4, 8), 2, 4) == (2, 4)
    assert fit_buckets((1, 2, 4, 8), 1, 1) == (1,)
    assert fit_buckets((1, 2, 4, 8), 3, None) == (3, 4, 8)
    assert fit_buckets((16,), 1, 64) == (16,)


def _settings(limits: BatchLimits | None, *, device: str = "cpu", batch_size: int = 8,
              buckets: tuple[int, ...] | None = None, **extra: Any) -> GraphSettings:
    return GraphSettings(device=torch.device(device), batch_size=batch_size,
                         batch_buckets=buckets, graphs_by_default=True, limits=limits, **extra)


def _buckets(settings: GraphSettings) -> tuple[int, ...] | None:
    runner, _ = make_runner(lambda x: x, settings)
    return runner.buckets if runner is not None else None


def test_a_program_runs_in_buckets_only_where_it_cannot_take_a_batch_as_it_comes() -> None:
    assert _buckets(_settings(None)) is None
    assert _buckets(_settings(BatchLimits(1, 64))) is None  # any batch of up to 8 fits
    assert _buckets(_settings(BatchLimits(1, 4))) == (1, 2, 4)
    assert _buckets(_settings(BatchLimits(1, 1, dynamic=False))) == (1,)
    assert _buckets(_settings(BatchLimits(2, None))) == (2, 4, 8)
    assert _buckets(_settings(BatchLimits(1, 1, dynamic=False), buckets=())) == (1,)
    assert _buckets(_settings(BatchLimits(1, 64), buckets=(1, 128))) == (1, 64)
    assert _buckets(_settings(BatchLimits(unknown="no metadata"), buckets=(1, 2))) == (1, 2)
    assert _buckets(_settings(BatchLimits(1, 4), device="cuda")) == (1, 2, 4)
    assert _buckets(_settings(BatchLimits(1, 4), unfit="tokens")) is None


def test_a_batch_above_the_batch_dimension_runs_in_chunks_it_takes() -> None:
    seen: list[int] = []

    def forward(x: torch.Tensor) -> torch.Tensor:
        assert 1 <= x.shape[0] <= 4
        seen.append(x.shape[0])
        return x * 2

    runner, _ = make_runner(forward, _settings(BatchLimits(1, 4)))
    assert runner is not None
    rows = torch.arange(10.0).unsqueeze(1)
    assert torch.equal(runner(rows), rows * 2)
    assert seen == [4, 4, 2]


def test_an_aoti_package_is_not_captured_on_cuda() -> None:
    aoti = Pt2Program(lambda x: x, Pt2Kind.AOTINDUCTOR, BatchLimits(1, 8), "m.pt2")
    exported = Pt2Program(lambda x: x, Pt2Kind.EXPORTED_PROGRAM, BatchLimits(1, 8), "m.pt2")
    assert "AOTInductor package" in captured_elsewhere(Tuning(), aoti)
    assert captured_elsewhere(Tuning(), exported) == ""
    runner, _ = make_runner(lambda x: x, _settings(
        BatchLimits(1, 8), device="cuda", captured_elsewhere=captured_elsewhere(Tuning(), aoti)))
    assert runner is not None and runner.execution().mode == "padded"
    assert "AOTInductor package" in runner.execution().fallback_reason


# -- the loaded program --------------------------------------------------------------------


def test_a_program_module_tolerates_eval_and_feeds_aoti_contiguous_inputs() -> None:
    seen: list[bool] = []
    program = Pt2Program(lambda x: seen.append(x.is_contiguous()) or x, Pt2Kind.AOTINDUCTOR,
                         BatchLimits(1, 4), "m.pt2", contiguous=True)
    program.eval()
    assert list(program.parameters()) == []  # the callable is not a submodule
    image = torch.zeros(2, 3, 4, 4).to(memory_format=torch.channels_last)
    program(image)
    assert seen == [True]
    assert program.describe() == ("m.pt2: an AOTInductor package "
                                  "(torch._inductor.aoti_compile_and_package), "
                                  "batch dimension 1..4")


def test_a_list_input_runs_in_chunks_of_the_length_it_was_exported_for() -> None:
    calls: list[int] = []

    def detector(images: list[torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        assert len(images) == 2 and all(image.is_contiguous() for image in images)
        calls.append(len(images))
        return [{"scores": image.sum().reshape(1)} for image in images]

    program = Pt2Program(detector, Pt2Kind.AOTINDUCTOR, BatchLimits(2, 2, dynamic=False),
                         "d.pt2", contiguous=True)
    images = [torch.full((3, 2, 2), float(i)).transpose(1, 2) for i in range(5)]
    outputs = program(images)
    assert [float(output["scores"]) for output in outputs] == [0.0, 12.0, 24.0, 36.0, 48.0]
    assert calls == [2, 2, 2]


class _Pair(torch.nn.Module):
    def forward(self, images: list[torch.Tensor]) -> torch.Tensor:
        return torch.stack([image.sum() for image in images])


def _exported(model: torch.nn.Module, example: Any, dynamic: Any = None
              ) -> torch.export.ExportedProgram:
    return torch.export.export(model, example, dynamic_shapes=dynamic, strict=False)


_ROWS = (torch.zeros(3, 2),)


@pytest.mark.parametrize(("model", "example", "dynamic", "limits"), [
    (torch.nn.Linear(2, 1), _ROWS, ({0: torch.export.Dim("batch", min=1, max=16)},),
     BatchLimits(1, 16)),
    (torch.nn.Linear(2, 1), _ROWS, ({0: torch.export.Dim("batch", min=2)},),
     BatchLimits(2, None)),
    (torch.nn.Linear(2, 1), _ROWS, None, BatchLimits(3, 3, dynamic=False)),
    (_Pair(), ([torch.zeros(3, 4, 4), torch.zeros(3, 4, 4)],), None,
     BatchLimits(2, 2, dynamic=False)),  # a list's length is fixed
], ids=["dynamic", "unbounded", "static", "list"])
def test_the_batch_dimension_is_read_from_an_exported_program(
        model: torch.nn.Module, example: Any, dynamic: Any, limits: BatchLimits) -> None:
    assert exported_limits(_exported(model, example, dynamic)) == limits


def test_an_exported_program_loads_with_its_weights_mapped_from_the_archive(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    torch.manual_seed(0)
    linear = torch.nn.Linear(2, 1)
    batch = torch.export.Dim("batch", min=1, max=8)
    path = tmp_path / "m.pt2"
    torch.export.save(_exported(linear, (torch.zeros(2, 2),), ({0: batch},)), str(path))

    with caplog.at_level(logging.INFO, logger="backend.weights.pt2"):
        program = load_pt2(path, CPU)
    assert "m.pt2: 2 of 2 storages mapped from the archive" in caplog.text
    assert "m.pt2: a torch.export ExportedProgram (torch.export.save), batch dimension 1..8" \
        in caplog.text
    rows = torch.randn(5, 2)
    assert torch.allclose(program(rows), linear(rows))
    copied = load_pt2(path, CPU, Sharing.COPY)
    assert torch.allclose(copied(rows), linear(rows))


# -- batchserve-export ---------------------------------------------------------------------


def test_compare_reports_the_largest_difference_and_the_top5() -> None:
    torch.manual_seed(0)
    source = torch.nn.Linear(4, 6)
    shifted = torch.nn.Linear(4, 6)
    shifted.load_state_dict(source.state_dict())
    with torch.no_grad():
        shifted.bias += 0.5
    rows = torch.randn(3, 4)
    same = compare(source, source, rows)
    assert same.largest_difference == 0 and same.same_top5 == 3 and same.rows == 3
    moved = compare(shifted, source, rows)
    assert moved.largest_difference == pytest.approx(0.5, abs=1e-6) and moved.same_top5 == 3


@pytest.mark.parametrize("source", ["eager", "torchscript"])
def test_the_export_command_writes_a_checked_program(tmp_path: Path, source: str) -> None:
    import warnings

    namespace: dict[str, Any] = {}
    exec(compile(REGRESSOR.read_text(), str(REGRESSOR), "exec"), namespace)
    torch.manual_seed(0)
    model = namespace["TinyRegressor"]()
    weights = tmp_path / "w.pt"
    torch.save(model.state_dict(), weights)
    if source == "eager":
        inputs = ["--model-file", str(REGRESSOR), "--serialized-file", str(weights)]
    else:
        script = tmp_path / "ts.pt"
        with warnings.catch_warnings():  # torch deprecates TorchScript: this is its way out
            warnings.simplefilter("ignore", FutureWarning)
            torch.jit.save(torch.jit.script(model), str(script))
        inputs = ["--serialized-file", str(script)]
    report = tmp_path / "report.json"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.jit.load's, in the converter
        result = CliRunner().invoke(export_main, [
            *inputs, "--model-name", "reg", "--export-path", str(tmp_path / "out"),
            "--input-shape", "2", "--max-batch", "16", "--kinds", "exported_program",
            "--check-batches", "1,5,40", "--report", str(report)])

    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].startswith(f"exported_program: {tmp_path / 'out' / 'reg.export.pt2'} in ")
    assert lines[0].endswith("batch dimension 1..16)")
    assert [line.split(":")[0].strip() for line in lines[1:]] == ["batch 1", "batch 5",
                                                                   "batch 16"]
    assert all("(ok, tolerance 0.001)" in line for line in lines[1:])
    made = json.loads(report.read_text())
    assert [record["kind"] for record in made] == ["exported_program"]
    assert [check["batch"] for check in made[0]["checks"]] == [1, 5, 16]
    program = load_pt2(tmp_path / "out" / "reg.export.pt2", CPU)
    rows = torch.randn(7, 2)
    assert torch.allclose(program(rows), model(rows), atol=1e-6)


def test_the_export_command_says_why_a_model_cannot_have_a_batch_dimension(
        tmp_path: Path) -> None:
    model_file = tmp_path / "model.py"
    model_file.write_text("import torch\n\n\nclass Fixed(torch.nn.Module):\n"
                          "    def forward(self, x):\n"
                          "        return x.reshape(2, -1)\n")
    result = CliRunner().invoke(export_main, [
        "--model-file", str(model_file), "--model-name", "fixed", "--export-path",
        str(tmp_path), "--input-shape", "3", "--kinds", "exported_program"])
    assert result.exit_code == 1
    assert result.output.startswith("exported_program: FAILED: torch.export failed: ")
    fixed = CliRunner().invoke(export_main, [
        "--model-file", str(model_file), "--model-name", "fixed", "--export-path",
        str(tmp_path), "--input-shape", "3", "--kinds", "exported_program",
        "--static-batch", "2"])
    assert fixed.exit_code == 0, fixed.output
    assert "no dynamic batch dimension: batches run in chunks of 2" in fixed.output


def test_an_aoti_package_for_another_device_is_refused_before_torch_loads_it(
        tmp_path: Path) -> None:
    package = tmp_path / "m.pt2"
    with zipfile.ZipFile(package, "w") as archive:
        archive.writestr("m/data/aotinductor/model/abc.wrapper.so", b"not a library")
        archive.writestr("m/data/aotinductor/model/abc.wrapper_metadata.json",
                         json.dumps({"AOTI_DEVICE_KEY": "cuda"}))
    with pytest.raises(ModelLoadError, match=r"m\.pt2 was compiled by AOTInductor for cuda "
                                             r"and this worker runs on cpu: compile it for cpu"):
        load_pt2(package, CPU)
