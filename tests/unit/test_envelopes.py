"""Service envelopes (backend/codecs/envelopes.py) around real handlers, in process: the bodies they
take and give back are TorchServe's (ts/torch_handler/request_envelope)."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import pytest

from backend.errors import HandlerLoadError
from backend.service.model_service import ModelService, load_service
from protos import open_inference_pb2, worker_pb2
from tests.unit.imports import restore_import_state  # noqa: F401 (a fixture)
from tests.unit.test_backend_service import load_message, model_dir_with

# Module-level handlers are first called with None to initialise (TorchServe's rule).
HANDLERS = {
    # Each row back with the size of the handler call it came in.
    "rows.py": """
        def handle(data, context):
            if data is None:
                return None
            return [{"row": row, "batch": len(data)} for row in data]
    """,
    # The sum of each row's (nested) numbers: an int for ints, a float for floats.
    "sums.py": """
        def _flat(value):
            if isinstance(value, list):
                return [x for item in value for x in _flat(item)]
            return [value]

        def handle(data, context):
            if data is None:
                return None
            return [sum(_flat(row["data"])) for row in data]
    """,
    # Bytes rows back as text, and their type.
    "texts.py": """
        def handle(data, context):
            if data is None:
                return None
            return [[type(row).__name__, row.decode()] for row in data]
    """,
    "fails_on_seven.py": """
        def handle(data, context):
            if data and 7 in data:
                raise ValueError("seven")
            return data
    """,
}
MANIFEST = json.dumps({"model": {"modelName": "mnist", "modelVersion": "1.0",
                                 "handler": "rows.py"}})


pytestmark = pytest.mark.usefixtures("restore_import_state")


def service(tmp_path: Path, handler: str, envelope: str) -> ModelService:
    model_dir = model_dir_with(tmp_path, files=HANDLERS)
    return load_service(load_message(model_dir, handler, envelope=envelope,
                                     manifest_json=MANIFEST))


def json_request(body: Any, request_id: str, **headers: str) -> worker_pb2.Request:
    return worker_pb2.Request(request_id=request_id, inputs={"body": json.dumps(body).encode()},
                              headers={"content-type": "application/json", **headers})


def predict(model: ModelService, *requests: worker_pb2.Request) -> list[worker_pb2.Response]:
    return list(model.predict(worker_pb2.PredictBatch(batch_id=1, requests=requests)).responses)


# ---- kserve (v1) ----------------------------------------------------------------------------


def test_kserve_unwraps_instances_and_answers_predictions_as_torchserve(tmp_path: Path) -> None:
    model = service(tmp_path, "rows.py", "kserve")
    first, second = predict(model, json_request({"instances": [{"data": "a"}, 2]}, "r1"),
                            json_request({"instances": [3]}, "r2"))
    # The rows of both requests met in one handler call; each answer holds its own rows.
    expected = {"predictions": [{"row": {"data": "a"}, "batch": 3}, {"row": 2, "batch": 3}]}
    assert first.body == json.dumps(expected, indent=2).encode()  # TorchServe's bytes
    assert first.content_type == "application/json"
    assert json.loads(second.body) == {"predictions": [{"row": 3, "batch": 3}]}


def test_kserve_explanations_and_raw_bodies(tmp_path: Path) -> None:
    model = service(tmp_path, "rows.py", "kserve")
    raw = worker_pb2.Request(request_id="r", inputs={"body": b'{"instances": ["x"]}'},
                             headers={"explain": "True"})
    (answer,) = predict(model, raw)
    assert json.loads(answer.body) == {"explanations": [{"row": "x", "batch": 1}]}


def test_kserve_refuses_a_body_without_instances_alone(tmp_path: Path) -> None:
    model = service(tmp_path, "rows.py", "kserve")
    bad, good, not_json = predict(
        model, json_request({"inputs": [1]}, "bad"), json_request({"instances": [1]}, "good"),
        worker_pb2.Request(request_id="text", inputs={"body": b"not json"}))
    assert bad.status == 400 and "instances" in bad.error
    assert not_json.status == 400 and "JSON" in not_json.error
    assert json.loads(good.body) == {"predictions": [{"row": 1, "batch": 1}]}


def test_kserve_isolates_a_failing_request(tmp_path: Path) -> None:
    model = service(tmp_path, "fails_on_seven.py", "kserve")
    good, bad = predict(model, json_request({"instances": [1, 2]}, "good"),
                        json_request({"instances": [7]}, "bad"))
    assert json.loads(good.body) == {"predictions": [1, 2]}
    assert bad.status >= 500 and "seven" in bad.error


# ---- kservev2 -------------------------------------------------------------------------------


def test_kservev2_unwraps_inputs_and_answers_outputs_as_torchserve(tmp_path: Path) -> None:
    model = service(tmp_path, "sums.py", "kservev2")
    body = {"id": "req-1", "inputs": [
        {"name": "input-0", "shape": [2, 2], "datatype": "INT64", "data": [1, 2, 3, 4]},
        {"name": "input-1", "shape": [1, 2], "datatype": "FP32", "data": [[0.5, 0.25]]}]}
    (answer,) = predict(model, json_request(body, "r1"))
    expected = {"id": "req-1", "model_name": "mnist", "model_version": "1.0", "outputs": [
        {"name": "input-0", "datatype": "INT64", "data": [10], "shape": [1]},
        {"name": "input-1", "datatype": "FP64", "data": [0.75], "shape": [1]}]}
    assert answer.body == json.dumps(expected, indent=2).encode()


def test_kservev2_rows_are_the_input_objects_and_bytes_their_first_element(
        tmp_path: Path) -> None:
    model = service(tmp_path, "rows.py", "kservev2")
    image = base64.b64encode(b"\x89PNG...").decode()
    body = {"inputs": [{"name": "data", "shape": [1], "datatype": "BYTES",
                        "data": [image, "ignored"]}]}
    first, second = predict(model, json_request(body, "r1"), json_request(body, "r2"))
    document = json.loads(first.body)
    assert document["id"] == "r1"  # no id in the request: the request's own
    (output,) = document["outputs"]
    assert output["name"] == "data" and output["datatype"] == "BYTES"
    # One handler call per request (batch 1), the row the input object with data[0].
    assert output["data"] == [{"row": {"name": "data", "shape": [1], "datatype": "BYTES",
                                       "data": image}, "batch": 1}]
    assert json.loads(second.body)["id"] == "r2"


def test_kservev2_refuses_data_that_does_not_fit_its_shape(tmp_path: Path) -> None:
    model = service(tmp_path, "sums.py", "kservev2")
    body = {"inputs": [{"name": "x", "shape": [3], "datatype": "FP32", "data": [1.0, 2.0]}]}
    (answer,) = predict(model, json_request(body, "r1"))
    assert answer.status == 400 and "does not fit its shape" in answer.error


def test_kservev2_refuses_an_empty_array_of_a_huge_shape(tmp_path: Path) -> None:
    model = service(tmp_path, "sums.py", "kservev2")
    huge = {"inputs": [{"name": "x", "shape": [1, 3_000_000, 0], "datatype": "FP32",
                        "data": [[]]}]}
    deep = {"inputs": [{"name": "x", "shape": [1] * 40, "datatype": "FP32", "data": [1.0]}]}
    small = {"inputs": [{"name": "x", "shape": [2, 0], "datatype": "FP32", "data": [[]]}]}
    refused, too_deep, served = predict(model, json_request(huge, "r1"),
                                        json_request(deep, "r2"), json_request(small, "r3"))
    assert refused.status == 400 and "[1, 3000000, 0]" in refused.error
    assert too_deep.status == 400 and "dimensions" in too_deep.error
    assert served.status == 200, served.error


def test_kservev2_answers_model_infer_as_a_model_infer_response(tmp_path: Path) -> None:
    model = service(tmp_path, "sums.py", "kservev2")
    infer = open_inference_pb2.ModelInferRequest(model_name="mnist", id="g1")
    tensor = infer.inputs.add(name="input-0", datatype="INT32", shape=[1, 3])
    tensor.contents.int_contents.extend([1, 2, 3])
    request = worker_pb2.Request(request_id="r", inputs={"body": infer.SerializeToString()},
                                 tensor_format=worker_pb2.TENSOR_FORMAT_GRPC)
    (answer,) = predict(model, request)
    response = open_inference_pb2.ModelInferResponse.FromString(answer.body)
    assert (response.model_name, response.model_version, response.id) == ("mnist", "1.0", "g1")
    (output,) = response.outputs
    assert (output.name, output.datatype, list(output.shape)) == ("input-0", "INT64", [1])
    assert list(output.contents.int64_contents) == [6]


# ---- json and body, and the names -----------------------------------------------------------


def test_json_envelope_decodes_b64_and_answers_text(tmp_path: Path) -> None:
    model = service(tmp_path, "texts.py", "json")
    body = {"instances": [{"b64": base64.b64encode(b"hi").decode()}]}
    (answer,) = predict(model, json_request(body, "r1"))
    assert answer.content_type.startswith("text/plain")
    assert json.loads(answer.body) == {"predictions": [["bytes", "hi"]]}


def test_body_envelope_hands_the_body_itself(tmp_path: Path) -> None:
    model = service(tmp_path, "rows.py", "body")
    (answer,) = predict(model, worker_pb2.Request(request_id="r", inputs={"body": b"raw"},
                                                  content_types={"body": "text/plain"}))
    assert answer.body == json.dumps({"row": "raw", "batch": 1}, indent=2).encode()


def test_an_unknown_envelope_fails_the_load(tmp_path: Path) -> None:
    with pytest.raises(HandlerLoadError, match="unknown service_envelope 'seldon'"):
        service(tmp_path, "rows.py", "seldon")
