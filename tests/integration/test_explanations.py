"""Explanations against the real server: TorchServe's /explanations, KServe v1 ``:explain`` and
v2 ``/explain``, for a tiny image classifier (the built-in handler, and TorchServe's
ImageClassifier through the ``ts`` shim), and the 501 of a model that cannot explain."""

from __future__ import annotations

import base64
import json
import struct
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import requests
import torch

from model_archiver.packaging import ArchiveOptions, build_archive
from tests.conftest import ROOT, RunningServer, launch_server
from tests.integration.vision_fixtures import LABELS, build_tiny_classifier, jpeg, tiny_model_files

TS_HANDLERS = ROOT / "tests" / "fixtures" / "ts_handlers"
#: The preprocessed image's shape: what every attribution has.
SHAPE = [3, 224, 224]
LABEL_NAMES = {label for _, label in LABELS.values()}
HEADER_LENGTH = "Inference-Header-Content-Length"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """``tiny`` (the built-in image_classifier), ``nocaptum`` (TorchServe's ImageClassifier
    where Captum cannot be imported) and ``echo`` (a TorchServe handler with no
    get_insights)."""
    store = tmp_path_factory.mktemp("explanations") / "model_store"
    store.mkdir()
    build_tiny_classifier(store)
    model_file, weights, labels = tiny_model_files(store.parent / "nocaptum-src")
    build_archive(ArchiveOptions(
        model_name="nocaptum", version="1.0", model_file=str(model_file),
        serialized_file=str(weights), handler=str(TS_HANDLERS / "no_captum.py"),
        extra_files=(str(labels),), export_path=store, force=True))
    build_archive(ArchiveOptions(model_name="echo", version="1.0",
                                 handler=str(TS_HANDLERS / "no_insights.py"),
                                 export_path=store, force=True))
    running = launch_server(store, "tiny.mar", "nocaptum.mar", "echo.mar")
    yield running
    running.stop()


def explain(server: RunningServer, path: str, body: bytes = b"", **kwargs: Any
            ) -> requests.Response:
    return requests.post(f"{server.inference}/explanations/{path}", data=body, timeout=60,
                         **kwargs)


def attributions(response: requests.Response) -> torch.Tensor:
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/json"
    return torch.tensor(response.json())


def test_explanations_answer_attributions_of_the_input_shape(server: RunningServer) -> None:
    image = jpeg(1)

    default = attributions(explain(server, "tiny", image))
    versioned = attributions(explain(server, "tiny/1.0", image))
    other = attributions(explain(server, "tiny", jpeg(2)))

    assert list(default.shape) == SHAPE
    assert torch.allclose(default, versioned, atol=1e-6)
    assert not torch.allclose(default, other, atol=1e-6)  # they explain their own image
    # A client's own explain header does not make a prediction an explanation.
    predicted = server.predict("tiny", image, headers={"explain": "True"})
    assert predicted.status_code == 200 and set(predicted.json()) == LABEL_NAMES


def test_a_target_picks_the_class_explained(server: RunningServer) -> None:
    image = jpeg(3)
    files = {"data": ("x.jpg", image, "image/jpeg")}

    first = attributions(explain(server, "tiny", image))
    by_form = attributions(requests.post(f"{server.inference}/explanations/tiny", files=files,
                                         data={"target": "1"}, timeout=60))
    by_json = attributions(explain(server, "tiny", json.dumps(
        {"data": base64.b64encode(image).decode(), "target": 1}).encode(),
        headers={"content-type": "application/json"}))
    bad = requests.post(f"{server.inference}/explanations/tiny", files=files,
                        data={"target": "9"}, timeout=60)

    assert torch.allclose(by_form, by_json, atol=1e-6)
    assert not torch.allclose(first, by_form, atol=1e-6)
    assert bad.status_code == 400
    assert "target 9 is not a class of this model" in bad.json()["message"]


def test_explanations_of_unknown_models_and_wrong_methods(server: RunningServer) -> None:
    missing = explain(server, "nope", jpeg(1))
    assert missing.status_code == 404
    assert missing.json()["type"] == "ModelNotFoundException"
    no_version = explain(server, "tiny/9.9", jpeg(1))
    assert no_version.status_code == 404
    assert no_version.json()["type"] == "ModelVersionNotFoundException"
    assert requests.get(f"{server.inference}/explanations/tiny", timeout=30).status_code == 405
    assert explain(server, "").status_code == 404


def test_kserve_v1_explain(server: RunningServer) -> None:
    image = jpeg(4)
    alone = attributions(explain(server, "tiny", image))

    answer = requests.post(f"{server.inference}/v1/models/tiny:explain", json={
        "instances": [{"data": base64.b64encode(image).decode()}]}, timeout=60)

    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert set(body) == {"explanations", "batchId"}
    (explanation,) = body["explanations"]
    assert torch.allclose(torch.tensor(explanation), alone, atol=1e-6)


def test_kserve_v2_explain(server: RunningServer) -> None:
    image = jpeg(5)
    alone = attributions(explain(server, "tiny", image))
    blob = struct.pack("<I", len(image)) + image
    header = json.dumps({"inputs": [{"name": "data", "datatype": "BYTES", "shape": [1],
                                     "parameters": {"binary_data_size": len(blob)}}]}).encode()

    for path in ("tiny/explain", "tiny/versions/1.0/explain"):
        answer = requests.post(f"{server.inference}/v2/models/{path}", data=header + blob,
                               headers={HEADER_LENGTH: str(len(header)),
                                        "content-type": "application/octet-stream"}, timeout=60)

        assert answer.status_code == 200, answer.text
        (output,) = answer.json()["outputs"]
        assert (output["datatype"], output["shape"]) == ("FP32", [1, *SHAPE])
        explained = torch.tensor(output["data"]).reshape(SHAPE)
        assert torch.allclose(explained, alone, atol=1e-5)


def test_explanations_and_predictions_sharing_a_batch_each_get_theirs(
        server: RunningServer) -> None:
    requests.post(f"{server.management}/models", params={
        "url": "tiny.mar", "model_name": "tinybatched", "batch_size": 4,
        "max_batch_delay": 5000, "batch_policy": "fixed", "initial_workers": 1,
        "synchronous": "true"}, timeout=120).raise_for_status()
    images = [jpeg(6), jpeg(7)]
    alone = [attributions(explain(server, "tiny", image)) for image in images]

    with ThreadPoolExecutor(4) as pool:
        explained = [pool.submit(explain, server, "tinybatched", image) for image in images]
        predicted = [pool.submit(server.predict, "tinybatched", image) for image in images]
        answers = [future.result() for future in (*explained, *predicted)]

    assert server.describe("tinybatched")["batching"]["recentBatchSizes"] == [4]  # type: ignore[index]
    for answer, expected in zip(answers[:2], alone, strict=True):
        assert torch.allclose(attributions(answer), expected, atol=1e-5)
    for answer in answers[2:]:
        assert answer.status_code == 200 and set(answer.json()) == LABEL_NAMES


def test_without_captum_explanations_are_501_and_predictions_go_on(
        server: RunningServer) -> None:
    image = jpeg(8)

    refused = explain(server, "nocaptum", image)
    v1 = requests.post(f"{server.inference}/v1/models/nocaptum:explain", json={
        "instances": [{"data": base64.b64encode(image).decode()}]}, timeout=60)

    assert refused.status_code == 501
    body = refused.json()
    assert (body["code"], body["type"]) == (501, "NotImplementedException")
    assert "explanations need Captum, which is not installed" in body["message"]
    assert v1.status_code == 501 and "Captum" in v1.json()["error"]
    predicted = server.predict("nocaptum", image)
    assert predicted.status_code == 200 and set(predicted.json()) == LABEL_NAMES


def test_a_handler_without_an_explanation_path_answers_501(server: RunningServer) -> None:
    refused = explain(server, "echo", b"hello")

    assert refused.status_code == 501
    assert refused.json() == {
        "code": 501, "type": "NotImplementedException",
        "message": "Echo cannot explain its predictions: it defines no get_insights "
                   "(TorchServe's explanation hook)"}
    assert server.predict("echo", b"hello").content == b"hello"
