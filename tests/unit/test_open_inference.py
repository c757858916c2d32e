"""The worker's side of KServe v1 and the Open Inference Protocol: tensor codec, rows, and
MLServer's merge and split of parameters (the example of its adaptive batching document)."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from typing import Any

import pytest

from backend.codecs import open_inference
from backend.context import Context
from backend.errors import InvalidInput
from backend.service.loader import EntryPoint
from backend.service.model_service import ModelService
from protos import open_inference_pb2, worker_pb2

SAMPLES: dict[str, list[Any]] = {
    "BOOL": [True, False], "INT8": [-128, 127], "INT16": [-32768, 32767],
    "INT32": [-(2**31), 2**31 - 1], "INT64": [-(2**63), 2**63 - 1], "UINT8": [0, 255],
    "UINT16": [0, 65535], "UINT32": [0, 2**32 - 1], "UINT64": [0, 2**64 - 1],
    "FP16": [0.5, -2.0], "FP32": [1.5, -0.25], "FP64": [1e300, -1e-300],
    "BYTES": [b"", b"a\x00b"],
}


@pytest.mark.parametrize("datatype", sorted(SAMPLES))
def test_binary_data_round_trips_for_every_datatype(datatype: str) -> None:
    data = SAMPLES[datatype]
    packed = open_inference.pack(datatype, data)
    assert open_inference.unpack(datatype, packed, len(data), "x") == data


def test_mlservers_parameter_merge() -> None:
    merged = open_inference.merge_parameters([{"custom-param": "value-1"},
                                              {"custom-param": "value-2"}])
    assert merged == {"custom-param": ["value-1", "value-2"]}


def _service(handle: Callable[[list[Any], Context], list[Any]],
             model_yaml_config: dict[str, Any] | None = None) -> ModelService:
    context = Context("toy", "/nonexistent", {}, 8, None, "0.1.0",
                      model_yaml_config=model_yaml_config)
    return ModelService(EntryPoint(handle, "toy"), context, model_version="1.0")


def _rest(request_id: str, document: dict[str, Any]) -> worker_pb2.Request:
    request = worker_pb2.Request(request_id=request_id,
                                 tensor_format=worker_pb2.TENSOR_FORMAT_REST)
    request.inputs["body"] = json.dumps(document).encode()
    return request


def test_mlservers_batched_output_is_split_back_per_request() -> None:
    """The reference's example: a batched INT32 output of shape [3, 3] with per-item
    parameters comes back to three requests as [1, 3] each, with their own parameters."""
    seen: list[Any] = []

    def handle(data: list[Any], context: Context) -> list[Any]:
        seen.extend(data)
        context.output_parameters["foo"] = {"content_type": "np", "foo": ["foo_1", "foo_2"],
                                            "bar": ["bar_1", "bar_2", "bar_3"]}
        return [{"foo": [1, 2, 3]}, {"foo": [4, 5, 6]}, {"foo": [7, 8, 9]}]

    service = _service(handle, {"outputs": [{"name": "foo", "datatype": "INT32"}]})
    batch = worker_pb2.PredictBatch(batch_id=1, requests=[
        _rest(f"r{i}", {"inputs": [{"name": "parameters-np", "shape": [1], "datatype": "BYTES",
                                    "data": ["x"], "parameters": {"custom-param": f"value-{i}"}}]})
        for i in (1, 2, 3)])
    result = service.predict(batch)

    assert seen == [{"parameters-np": b"x"}] * 3
    outputs = [json.loads(response.body)["outputs"] for response in result.responses]
    assert outputs == [
        [{"name": "foo", "datatype": "INT32", "shape": [1, 3], "data": [1, 2, 3],
          "parameters": {"content_type": "np", "foo": "foo_1", "bar": "bar_1"}}],
        [{"name": "foo", "datatype": "INT32", "shape": [1, 3], "data": [4, 5, 6],
          "parameters": {"content_type": "np", "foo": "foo_2", "bar": "bar_2"}}],
        [{"name": "foo", "datatype": "INT32", "shape": [1, 3], "data": [7, 8, 9],
          "parameters": {"content_type": "np", "bar": "bar_3"}}],
    ]


def test_a_mixed_batch_calls_the_handler_once_and_a_bad_request_fails_alone() -> None:
    calls: list[list[Any]] = []
    merged: list[dict[str, Any]] = []

    def handle(data: list[Any], context: Context) -> list[Any]:
        calls.append(data)
        merged.append(context.input_parameters)
        return [len(row) for row in data]

    bad = _rest("bad", {"inputs": [{"name": "x", "datatype": "INT64", "shape": [2],
                                    "data": [1]}]})
    good = _rest("good", {"inputs": [{"name": "x", "datatype": "INT64", "shape": [2, 1],
                                      "data": [1, 2], "parameters": {"p": 1}},
                                     {"name": "y", "datatype": "BOOL", "shape": [2],
                                      "data": [True, False]}]})
    instances = worker_pb2.Request(request_id="v1", instances=True)
    instances.inputs["body"] = b'[{"a": 1, "b": 2}, 3]'
    plain = worker_pb2.Request(request_id="plain")
    plain.inputs["body"] = b"raw"
    grpc = open_inference_pb2.ModelInferRequest(id="g")
    grpc.inputs.add(name="z", datatype="FP16", shape=[1])
    grpc.raw_input_contents.append(struct.pack("<e", 1.5))
    from_grpc = worker_pb2.Request(request_id="grpc",
                                   tensor_format=worker_pb2.TENSOR_FORMAT_GRPC)
    from_grpc.inputs["body"] = grpc.SerializeToString()

    result = _service(handle).predict(worker_pb2.PredictBatch(
        batch_id=7, requests=[bad, good, instances, plain, from_grpc]))

    assert calls == [[{"x": [1], "y": True}, {"x": [2], "y": False}, {"a": 1, "b": 2},
                      {"data": 3}, {"body": b"raw"}, {"z": 1.5}]]
    assert merged == [{"x": {"p": [1]}, "y": {}, "z": {}}]
    bad_response, good_response, v1_response, plain_response, grpc_response = result.responses
    assert bad_response.status == 400 and "shape" in bad_response.error
    good_outputs = json.loads(good_response.body)["outputs"]
    assert good_outputs == [{"name": "output-0", "datatype": "INT64", "shape": [2],
                             "data": [2, 2]}]
    assert json.loads(v1_response.body) == [2, 1]
    assert plain_response.body == b"1"
    answer = open_inference_pb2.ModelInferResponse.FromString(grpc_response.body)
    assert answer.id == "g"  # raw in, raw out
    assert struct.unpack("<q", answer.raw_output_contents[0]) == (1,)


@pytest.mark.parametrize("document, message", [
    ({"inputs": [{"name": "x", "datatype": "INT64", "shape": [2], "data": [1, 2]},
                 {"name": "y", "datatype": "INT64", "shape": [3], "data": [1, 2, 3]}]},
     r"first \(batch\) dimension"),
    ({"inputs": [{"name": "x", "datatype": "BOOL", "shape": [1], "data": [1]}]}, "true or false"),
    ({"inputs": [{"name": "x", "datatype": "INT64", "shape": [], "data": []}]}, "shape"),
    ({"inputs": [{"name": "x", "datatype": "INT64", "shape": [0], "data": []}]}, "no rows"),
    ({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": ["a"]}]}, "numbers"),
])
def test_invalid_v2_requests_are_invalid_input(document: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidInput, match=message):
        open_inference.decode_rest(json.dumps(document).encode(), None)
