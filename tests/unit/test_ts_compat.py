"""Unmodified TorchServe handlers (``import ts``) run on batchserve's ``ts`` shim.

Driven as the worker drives them (load_service + ModelService.predict), with the shim
installed the way the worker installs it and removed again after each test.
"""

from __future__ import annotations

import importlib
import importlib.util
import io
import json
import shutil
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image

from backend.compat import SHIM_DIR, install_torchserve_shim
from backend.errors import InvalidInput
from backend.handlers.vision import IMAGENET_TRANSFORM
from backend.service.model_service import ModelService, load_service
from protos import worker_pb2
from tests.integration.vision_fixtures import LABELS, jpeg, tiny_model_files
from tests.unit.imports import forget_modules

TS_HANDLERS = Path(__file__).resolve().parents[1] / "fixtures" / "ts_handlers"

LINEAR_MODEL = """
    from torch import nn


    class TinyLinear(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(2, 1)

        def forward(self, x):
            return self.fc(x)
"""


@pytest.fixture(autouse=True)
def ts_shim(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Install the shim as the worker does; afterwards restore sys.path and forget ``ts``
    and every module imported from the test's model directories."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    # A vision handler may lift Pillow's process-wide limit (limit_max_image_pixels=false).
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", Image.MAX_IMAGE_PIXELS)
    if not install_torchserve_shim():
        pytest.skip("a real TorchServe `ts` package is installed; the shim stays unused")
    yield
    forget_modules(tmp_path, "ts")


# --- building model directories and batches ---------------------------------------------------


def model_dir_with(tmp_path: Path, *handler_files: str) -> Path:
    """A model directory (an extracted archive) holding copies of fixture handlers."""
    model_dir = tmp_path / "model"
    model_dir.mkdir(exist_ok=True)
    for name in handler_files:
        shutil.copy(TS_HANDLERS / name, model_dir / name)
    return model_dir


def load(model_dir: Path, handler: str, model: dict[str, str] | None = None) -> ModelService:
    entries = {"modelName": "m", "handler": handler, **(model or {})}
    manifest = {"runtime": "python", "model": entries}
    return load_service(worker_pb2.LoadModel(
        model_name="m", model_version="1.0", model_dir=str(model_dir), handler=handler,
        batch_size=4, gpu_id=-1, manifest_json=json.dumps(manifest),
        limit_max_image_pixels=True, decode_input_request=True, server_version="0.1.0"))


def batch(*bodies: bytes, content_type: str | None = None) -> worker_pb2.PredictBatch:
    """One request per body, with ids r0, r1, ..."""
    headers = {"Content-Type": content_type} if content_type else {}
    return worker_pb2.PredictBatch(batch_id=1, requests=[
        worker_pb2.Request(request_id=f"r{index}", inputs={"body": body}, headers=headers)
        for index, body in enumerate(bodies)])


def ts_module(name: str) -> Any:
    """A module of the shim (``ts`` is importable only once the fixture installed it)."""
    return importlib.import_module(name)


def handler_of(service: ModelService) -> Any:
    return service.entry_point.handle.__self__  # type: ignore[attr-defined]


# --- installing the shim ----------------------------------------------------------------------


def test_the_shim_is_appended_to_sys_path_and_answers_import_ts() -> None:
    assert sys.path[-1] == str(SHIM_DIR)
    spec = importlib.util.find_spec("ts")
    assert spec is not None and spec.origin is not None
    assert Path(spec.origin).is_relative_to(SHIM_DIR)
    assert install_torchserve_shim()  # idempotent
    assert sys.path.count(str(SHIM_DIR)) == 1


def test_a_real_ts_package_wins_over_the_shim(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p != str(SHIM_DIR)])
    forget_modules(tmp_path, "ts")  # a fresh worker: nothing named ts imported yet
    real = tmp_path / "site" / "ts"
    real.mkdir(parents=True)
    (real / "__init__.py").write_text("")
    sys.path.insert(0, str(real.parent))
    assert not install_torchserve_shim()
    assert str(SHIM_DIR) not in sys.path
    assert Path(sys.modules["ts"].__file__ or "").parent == real


def test_a_ts_folder_in_a_model_directory_does_not_stand_in_for_ts(tmp_path: Path) -> None:
    decoy = tmp_path / "model" / "ts" / "torch_handler"
    decoy.mkdir(parents=True)
    for folder in (decoy.parent, decoy):
        (folder / "__init__.py").write_text("raise ImportError('the decoy was imported')\n")
    (decoy / "base_handler.py").write_text("raise ImportError('the decoy was imported')\n")
    sys.path.insert(0, str(tmp_path / "model"))  # as the worker does once it loads a model
    importlib.invalidate_caches()
    base_handler = importlib.import_module("ts.torch_handler.base_handler")
    assert Path(base_handler.__file__ or "").is_relative_to(SHIM_DIR)


# --- PredictionException ------------------------------------------------------------------------


def test_prediction_exception_fails_the_batch_with_its_own_status(tmp_path: Path) -> None:
    service = load(model_dir_with(tmp_path, "teapot.py"), "teapot.py")

    result = service.predict(batch(b"coffee", b"teapot"))

    assert [r.status for r in result.responses] == [418, 418]
    assert {r.error for r in result.responses} == {"I'm a teapot, not a coffee machine"}
    assert {r.error_type for r in result.responses} == {"PredictionException"}
    served = service.predict(batch(b"coffee"))
    assert [(r.status, r.body) for r in served.responses] == [(200, b"coffee")]


def test_prediction_exception_is_torchserve_shaped() -> None:
    PredictionException = ts_module("ts.utils.util").PredictionException

    exc = PredictionException("nope", 429)
    assert (exc.message, exc.error_code, str(exc)) == ("nope", 429, "nope : 429")
    assert PredictionException("boom").error_code == 500


# --- BaseHandler subclass with an eager model -------------------------------------------------


def test_base_handler_subclass_with_an_eager_model(tmp_path: Path) -> None:
    model_dir = model_dir_with(tmp_path, "my_handler.py")
    (model_dir / "model.py").write_text(textwrap.dedent(LINEAR_MODEL))
    torch.save({"fc.weight": torch.tensor([[1.0, 2.0]]), "fc.bias": torch.tensor([0.5])},
               model_dir / "model.pt")
    service = load(model_dir, "my_handler.py",
                   {"modelFile": "model.py", "serializedFile": "model.pt"})

    rows = [{"x": [1.0, 1.0]}, {"x": [3.0, -1.0]}]
    result = service.predict(
        batch(*(json.dumps(row).encode() for row in rows), content_type="application/json"))

    assert [r.status for r in result.responses] == [200, 200]
    assert [json.loads(r.body) for r in result.responses] == [{"y": 3.5}, {"y": 1.5}]
    handler = handler_of(service)
    assert handler.initialized and handler.scale == 1.0
    assert handler.device == torch.device("cpu") and handler.map_location == "cpu"
    assert handler.manifest["model"]["modelFile"] == "model.py"
    assert handler.model_pt_path == str(model_dir / "model.pt")
    assert handler.mapping is None  # no index_to_name.json in this archive
    assert not handler.model.training
    metrics = {metric.name: metric for metric in result.metrics}  # they travel with the batch
    assert "HandlerTime" in metrics
    assert metrics["RowsScored"].value == 2
    # The handler's dimension, then those TorchServe adds.
    assert dict(zip(metrics["RowsScored"].dimension_names,
                    metrics["RowsScored"].dimension_values, strict=True)) == {
        "model": "m", "ModelName": "m", "Level": "Model"}


# --- ImageClassifier subclass -------------------------------------------------------------------


def test_image_classifier_subclass_overrides_postprocess(tmp_path: Path) -> None:
    model_dir = model_dir_with(tmp_path, "custom_classifier.py")
    model_file, weights, _ = tiny_model_files(model_dir)
    service = load(model_dir, "custom_classifier.py",
                   {"modelFile": model_file.name, "serializedFile": weights.name})
    handler = handler_of(service)
    assert handler.get_max_result_classes() == 5
    assert handler.mapping == {key: label for key, (_, label) in LABELS.items()}

    images = [jpeg(1), jpeg(2)]
    result = service.predict(batch(*images))

    assert [r.status for r in result.responses] == [200, 200]
    answers = [json.loads(r.body) for r in result.responses]
    with torch.inference_mode():
        pixels = torch.stack([IMAGENET_TRANSFORM(Image.open(io.BytesIO(i))) for i in images])
        best = torch.softmax(handler.model(pixels), dim=1).max(dim=1)
    expected = [{LABELS[str(c)][1]: pytest.approx(p, abs=1e-5)}
                for c, p in zip(best.indices.tolist(), best.values.tolist(), strict=True)]
    assert answers == expected


def test_image_classifier_returns_topk_labels_and_rejects_a_bad_image(tmp_path: Path) -> None:
    model_dir = tmp_path / "model"
    model_file, weights, _ = tiny_model_files(model_dir)
    (model_dir / "handler.py").write_text(
        "from ts.torch_handler.image_classifier import ImageClassifier\n\n\n"
        "class Plain(ImageClassifier):\n    pass\n")
    service = load(model_dir, "handler.py",
                   {"modelFile": model_file.name, "serializedFile": weights.name})
    image_classifier = ts_module("ts.torch_handler.image_classifier")
    assert isinstance(handler_of(service), image_classifier.ImageClassifier)

    answer = json.loads(service.predict(batch(jpeg(3))).responses[0].body)
    assert set(answer) == {label for _, label in LABELS.values()}  # 3 classes < topk 5
    assert sum(answer.values()) == pytest.approx(1.0)
    with pytest.raises(InvalidInput, match="not an image"):
        service.predict(batch(b"not an image"))
    # TorchServe fails a whole batch for one bad image; here only that request fails.
    mixed = service.predict(batch(jpeg(4), b"not an image", jpeg(5)))
    assert [r.status for r in mixed.responses] == [200, 400, 200]
    assert "not an image" in mixed.responses[1].error
    assert set(json.loads(mixed.responses[2].body)) <= {label for _, label in LABELS.values()}


# --- intermediate responses ---------------------------------------------------------------------


def test_send_intermediate_predict_response_streams_through_the_partial_sink(
    tmp_path: Path,
) -> None:
    service = load(model_dir_with(tmp_path, "streamer.py"), "streamer.py")
    parts: list[tuple[str, Any, int]] = []
    service.context.partial_sink = lambda request_id, item, status: parts.append(
        (request_id, item, status))

    result = service.predict(batch(b"a", b"b", content_type="text/plain"))

    assert parts == [("r0", "part 0 of a", 200), ("r1", "part 0 of b", 200),
                     ("r0", "part 1 of a", 200), ("r1", "part 1 of b", 200)]
    assert [r.body for r in result.responses] == [b"done with a", b"done with b"]


# --- helpers of ts.utils.util -------------------------------------------------------------------


def test_map_class_to_label_and_list_classes_from_module() -> None:
    util = ts_module("ts.utils.util")
    assert util.map_class_to_label([[0.25, 0.75]], {"0": "cat"}) == [{"cat": 0.25, "1": 0.75}]
    assert util.map_class_to_label([[0.9]], None, [[2]]) == [{"2": 0.9}]
    with pytest.raises(TypeError):
        util.map_class_to_label(torch.tensor([[1.0]]))
    assert util.list_classes_from_module(util) == [util.PT2Backend, util.PredictionException]
    assert util.list_classes_from_module(util, ValueError) == []
