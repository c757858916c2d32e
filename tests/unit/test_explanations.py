"""Explanations in the worker, driven as the worker drives handlers (load_service + predict):
TorchServe's ``explain`` header, the image classifiers' IntegratedGradients (built-in and
``ts.torch_handler``), targets, batches that mix explanations and predictions, and the 501 of
a handler that cannot explain or of a worker without Captum."""

from __future__ import annotations

import base64
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from captum.attr import IntegratedGradients

from backend.compat import install_torchserve_shim
from backend.service.model_service import ModelService
from protos import worker_pb2
from tests.unit import test_ts_compat as ts_compat
from tests.unit.imports import forget_modules
from tests.unit.test_handlers import (
    TINY_TEXT_CLASSIFIER,
    batch,
    eager_model_dir,
    handler_of,
    image,
    load,
    request,
)

SHAPE = [3, 224, 224]


@pytest.fixture(autouse=True)
def import_state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The ``ts`` shim as the worker installs it; afterwards sys.path as it was, and ``ts`` and
    the modules of the test's model directories forgotten."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    if not install_torchserve_shim():
        pytest.skip("a real TorchServe `ts` package is installed; the shim stays unused")
    yield
    forget_modules(tmp_path, "ts")


def explain(req: worker_pb2.Request) -> worker_pb2.Request:
    """The request as /explanations sends it to the worker."""
    req.headers["explain"] = "True"
    return req


def shape_of(value: Any) -> list[int]:
    return [len(value), *shape_of(value[0])] if isinstance(value, list) else []


def expected_attributions(service: ModelService, body: bytes, target: int) -> torch.Tensor:
    """Captum's own IntegratedGradients (TorchServe's 15 steps) over the handler's input."""
    handler = handler_of(service)
    inputs = handler.preprocess(handler.load_images([{"body": body}]))
    attributions: torch.Tensor = IntegratedGradients(handler.model).attribute(
        inputs, target=target, n_steps=15)
    return attributions[0]


def compat_classifier(tmp_path: Path, source: str) -> ModelService:
    """A ts.torch_handler handler file over the tiny classifier."""
    model_dir = tmp_path / "model"
    model_file, weights, _ = ts_compat.tiny_model_files(model_dir)
    (model_dir / "handler.py").write_text(source)
    return ts_compat.load(model_dir, "handler.py",
                          {"modelFile": model_file.name, "serializedFile": weights.name})


# --- the built-in image classifier ------------------------------------------------------------


def test_classifier_explains_with_integrated_gradients(tmp_path: Path) -> None:
    service = load(eager_model_dir(tmp_path))

    result = service.predict(batch(explain(request(image(1))), explain(request(image(2)))))

    assert [r.status for r in result.responses] == [200, 200]
    assert {r.content_type for r in result.responses} == {"application/json"}
    for response, seed in zip(result.responses, (1, 2), strict=True):
        attributions = json.loads(response.body)
        assert shape_of(attributions) == SHAPE  # the preprocessed image's
        assert torch.allclose(torch.tensor(attributions),
                              expected_attributions(service, image(seed), 0), atol=1e-5)


def test_each_request_names_its_own_target(tmp_path: Path) -> None:
    service = load(eager_model_dir(tmp_path))
    picture = image(3)
    as_json = json.dumps({"data": base64.b64encode(picture).decode(),
                          "target": 2}).encode()

    result = service.predict(batch(
        explain(request(picture)),
        explain(request(as_json, content_type="application/json")),
        explain(worker_pb2.Request(inputs={"data": picture, "target": b"1"})),
        explain(worker_pb2.Request(inputs={"data": picture, "target": b"cat"})),
        explain(worker_pb2.Request(inputs={"data": picture, "target": b"7"})),
    ))

    statuses = [r.status for r in result.responses]
    assert statuses == [200, 200, 200, 400, 400]
    for response, target in zip(result.responses[:3], (0, 2, 1), strict=True):
        assert torch.allclose(torch.tensor(json.loads(response.body)),
                              expected_attributions(service, picture, target), atol=1e-5)
    assert "target must be a class index, got 'cat'" in result.responses[3].error
    assert "target 7 is not a class of this model (it has 3" in result.responses[4].error


def test_a_bad_image_fails_only_its_own_explanation(tmp_path: Path) -> None:
    service = load(eager_model_dir(tmp_path))

    result = service.predict(batch(explain(request(b"not an image")),
                                   explain(request(image(4)))))

    assert [r.status for r in result.responses] == [400, 200]
    assert "not an image" in result.responses[0].error


def test_explanations_and_predictions_in_one_batch_each_get_their_own(tmp_path: Path) -> None:
    service = load(eager_model_dir(tmp_path))
    alone = json.loads(service.predict(batch(request(image(5)))).responses[0].body)
    # A client's own explain header on a prediction is overridden by the frontend; "False"
    # reaches the worker then.
    predicted = request(image(5))
    predicted.headers["explain"] = "False"
    mixed = [explain(request(image(6))), predicted, explain(request(image(7))), request(image(5))]

    assert service.prepare(batch(*mixed)) is None  # explanations are not decoded ahead
    result = service.predict(batch(*mixed))

    assert [r.status for r in result.responses] == [200] * 4
    assert [r.request_id for r in result.responses] == ["r0", "r1", "r2", "r3"]
    bodies = [json.loads(r.body) for r in result.responses]
    assert shape_of(bodies[0]) == shape_of(bodies[2]) == SHAPE
    for prediction in (bodies[1], bodies[3]):
        assert list(prediction) == list(alone)
        assert prediction == pytest.approx(alone, abs=1e-6)


def test_without_captum_an_explanation_is_501_and_predictions_go_on(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    service = load(eager_model_dir(tmp_path))
    monkeypatch.setitem(sys.modules, "captum", None)  # what `import captum` sees without it
    monkeypatch.setitem(sys.modules, "captum.attr", None)

    result = service.predict(batch(explain(request(image(1))), request(image(1))))

    explained, predicted = result.responses
    assert explained.status == 501
    assert "explanations need Captum, which is not installed" in explained.error
    assert "pip install captum" in explained.error
    assert predicted.status == 200 and json.loads(predicted.body)


def test_a_builtin_handler_without_explanations_answers_501(tmp_path: Path) -> None:
    model_dir = eager_model_dir(tmp_path, TINY_TEXT_CLASSIFIER,
                                labels={"0": "Negative", "1": "Positive"})
    torch.save(["<unk>", "good"], model_dir / "source_vocab.pt")
    service = load(model_dir, "text_classifier")

    result = service.predict(batch(explain(request(b"good")), explain(request(b"bad"))))

    assert [r.status for r in result.responses] == [501, 501]
    assert result.responses[0].error == (
        "TextClassifier does not explain its predictions (it defines no explain_requests); "
        "ask /predictions for them instead")
    assert service.predict(batch(request(b"good"))).responses[0].status == 200


# --- ts.torch_handler (TorchServe's handlers, unmodified) ---------------------------------------


def test_ts_image_classifier_explains_as_torchserve_does(tmp_path: Path) -> None:
    service = compat_classifier(tmp_path, (
        "from ts.torch_handler.image_classifier import ImageClassifier\n\n\n"
        "class Plain(ImageClassifier):\n    pass\n"))
    handler = handler_of(service)
    picture = ts_compat.jpeg(1)

    result = service.predict(ts_compat.batch(picture))
    forms = worker_pb2.PredictBatch(batch_id=2, requests=[explain(worker_pb2.Request(
        request_id="r0", inputs={"data": picture, "target": b"2"}))])
    targeted = service.predict(forms)
    explained = service.predict(worker_pb2.PredictBatch(batch_id=3, requests=[
        explain(req) for req in ts_compat.batch(picture).requests]))

    assert result.responses[0].status == 200 and set(json.loads(result.responses[0].body)) == {
        label for _, label in ts_compat.LABELS.values()}  # a prediction
    inputs = handler.preprocess([{"body": picture}])
    for response, target in ((explained.responses[0], 0), (targeted.responses[0], 2)):
        assert response.status == 200, response.error
        attributions = torch.tensor(json.loads(response.body))
        assert list(attributions.shape) == SHAPE
        expected = IntegratedGradients(handler.model).attribute(inputs, target=target,
                                                                n_steps=15)[0]
        assert torch.allclose(attributions, expected, atol=1e-5)
    assert handler.explain  # TorchServe's flag, set by _is_explain


def test_ts_handler_without_get_insights_answers_501(tmp_path: Path) -> None:
    service = compat_classifier(tmp_path, (
        "from ts.torch_handler.base_handler import BaseHandler\n\n\n"
        "class Scores(BaseHandler):\n    def preprocess(self, data):\n        return data\n"))

    result = service.predict(worker_pb2.PredictBatch(batch_id=1, requests=[
        explain(worker_pb2.Request(request_id="r0", inputs={"body": b"[1]"}))]))

    assert result.responses[0].status == 501
    assert result.responses[0].error == (
        "Scores cannot explain its predictions: it defines no get_insights (TorchServe's "
        "explanation hook)")
