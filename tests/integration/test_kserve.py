"""KServe v1 and the Open Inference Protocol (v2, REST and gRPC) against the real server.

One server for the module, with three models: ``doubler`` (v1 rows, KServe's batcher settings
``maxBatchSize: 8`` / ``maxLatency: 1500`` under the fixed policy, so concurrent requests meet
in one batch), ``tensors`` (v2 rows, adaptive policy: a lone request goes at once, and OIP
metadata in its model-config.yaml) and ``tensors_batched`` (the same handler, batched as
``doubler``).
"""

from __future__ import annotations

import base64
import json
import struct
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import psutil
import pytest
import requests

from model_archiver.packaging import ArchiveOptions, build_archive
from protos import open_inference_pb2 as pb
from protos import open_inference_pb2_grpc as pb_grpc
from tests.conftest import HANDLERS, RunningServer, launch_server

BATCHED = "maxBatchSize: 8\nmaxLatency: 1500\nbatchPolicy: fixed\n"
TENSORS_CONFIG = """
inputs:
  - {name: fp32, datatype: FP32, shape: [-1, 2]}
  - {name: i64, datatype: INT64, shape: [-1]}
outputs:
  - {name: fp32_out, datatype: FP32, shape: [-1, 2]}
  - {name: i8_out, datatype: INT8, shape: [-1]}
  - {name: f64_out, datatype: FP64, shape: [-1]}
"""
HEADER_LENGTH = "Inference-Header-Content-Length"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    root = tmp_path_factory.mktemp("kserve")
    store = root / "model_store"
    store.mkdir()
    for name, handler, config in (("doubler", "doubler", BATCHED),
                                  ("tensors", "tensors", TENSORS_CONFIG),
                                  ("tensors_batched", "tensors", BATCHED)):
        config_file = root / f"{name}.yaml"
        config_file.write_text(config)
        build_archive(ArchiveOptions(model_name=name, handler=str(HANDLERS / f"{handler}.py"),
                                     export_path=store, force=True,
                                     config_file=str(config_file)))
    running = launch_server(store, "doubler.mar", "tensors.mar", "tensors_batched.mar")
    yield running
    running.stop()


def _error(response: requests.Response, status: int) -> str:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}, body
    return str(body["error"])


# ---- KServe v1 --------------------------------------------------------------------------------


def test_v1_lists_models_and_their_readiness(server: RunningServer) -> None:
    listed = requests.get(f"{server.inference}/v1/models", timeout=10)
    assert listed.status_code == 200
    assert set(listed.json()["models"]) == {"doubler", "tensors", "tensors_batched"}

    ready = requests.get(f"{server.inference}/v1/models/doubler", timeout=10)
    assert ready.json() == {"name": "doubler", "ready": True}

    missing = requests.get(f"{server.inference}/v1/models/nope", timeout=10)
    assert "nope" in _error(missing, 404)


def test_v1_instances_of_concurrent_requests_ride_one_batch(server: RunningServer) -> None:
    bodies = [{"instances": [1, [2, 3]]},
              {"instances": [{"x": 4, "y": [5]}, 6.5, 7]},
              {"inputs": [8]}]  # KServe's other spelling

    def predict(body: dict[str, Any]) -> requests.Response:
        return requests.post(f"{server.inference}/v1/models/doubler:predict", json=body,
                             timeout=30)

    def torchserve_predict(_: object) -> requests.Response:
        # A TorchServe request may share the batch: it is one row of its own.
        return requests.post(f"{server.inference}/predictions/doubler", data=b"9",
                             headers={"content-type": "application/json"}, timeout=30)

    with ThreadPoolExecutor(4) as pool:
        plain = pool.submit(torchserve_predict, None)
        answers = list(pool.map(predict, bodies))

    assert [a.status_code for a in answers] == [200, 200, 200], [a.text for a in answers]
    assert [a.json()["predictions"] for a in answers] == [
        [2, [4, 6]], [{"x": 8, "y": [10]}, 13.0, 14], [16]]
    batch_ids = {a.json()["batchId"] for a in answers}
    assert len(batch_ids) == 1 and batch_ids != {""}, batch_ids
    assert plain.result().json() == {"body": 18}


def test_v1_request_with_more_instances_than_max_batch_size_goes_whole(
        server: RunningServer) -> None:
    instances = list(range(11))
    answer = requests.post(f"{server.inference}/v1/models/doubler:predict",
                           json={"instances": instances}, timeout=30)
    assert answer.status_code == 200, answer.text
    assert answer.json()["predictions"] == [2 * i for i in instances]


def test_v1_explain_routes_to_the_handler_with_the_explain_header(server: RunningServer) -> None:
    # Eight instances fill a batch, so it leaves at once.
    answer = requests.post(f"{server.inference}/v1/models/doubler:explain",
                           json={"instances": list(range(8))}, timeout=30)
    assert answer.status_code == 200, answer.text
    assert answer.json()["explanations"] == [{"explained": 2 * i} for i in range(8)]
    assert answer.json()["batchId"]


def test_v1_errors_use_kserves_shape(server: RunningServer) -> None:
    url = f"{server.inference}/v1/models/doubler:predict"
    assert "malformed JSON" in _error(requests.post(url, data=b"{nope", timeout=10), 400)
    assert "instances" in _error(requests.post(url, json={"instances": []}, timeout=10), 400)
    assert "instances" in _error(requests.post(url, json=[1, 2], timeout=10), 400)
    _error(requests.post(f"{server.inference}/v1/models/nope:predict",
                         json={"instances": [1]}, timeout=10), 404)
    _error(requests.get(url, timeout=10), 405)
    _error(requests.post(f"{server.inference}/v1/models/doubler:train", json={}, timeout=10),
           404)


def test_v1_image_classifier_with_base64_instances(model_store: Path, start_server) -> None:
    # A built-in TorchServe handler, unchanged: each instance is one row, {"data": "<b64>"}.
    from tests.integration.vision_fixtures import build_tiny_classifier, jpeg

    build_tiny_classifier(model_store)
    server = start_server("tiny.mar")
    images = [jpeg(1), jpeg(2)]
    expected = [server.predict("tiny", image).json() for image in images]

    answer = requests.post(f"{server.inference}/v1/models/tiny:predict", json={"instances": [
        {"data": base64.b64encode(image).decode()} for image in images]}, timeout=60)
    assert answer.status_code == 200, answer.text
    predictions = answer.json()["predictions"]
    # The same classes, in the same order; a batch of two may differ in the last float bits.
    assert [list(p) for p in predictions] == [list(e) for e in expected]
    for prediction, alone in zip(predictions, expected, strict=True):
        assert prediction == pytest.approx(alone, abs=1e-6)

    corrupt = requests.post(f"{server.inference}/v1/models/tiny:predict", json={"instances": [
        {"data": base64.b64encode(images[0]).decode()}, {"data": "bm90IGFuIGltYWdl"}]},
        timeout=60)
    assert "not an image" in _error(corrupt, 400)


# ---- Open Inference Protocol over REST --------------------------------------------------------


def test_v2_health_and_server_metadata(server: RunningServer) -> None:
    base = f"{server.inference}/v2"
    assert requests.get(f"{base}/health/live", timeout=10).json() == {"live": True}
    ready = requests.get(f"{base}/health/ready", timeout=10)
    assert ready.status_code == 200 and ready.json() == {"ready": True}
    metadata = requests.get(base, timeout=10).json()
    assert metadata["name"] == "batchserve" and metadata["version"]
    assert "binary_tensor_data" in metadata["extensions"]


def test_v2_model_metadata_and_readiness(server: RunningServer) -> None:
    base = f"{server.inference}/v2/models"
    metadata = requests.get(f"{base}/tensors", timeout=10).json()
    assert metadata == {
        "name": "tensors", "versions": ["1.0"], "platform": "pytorch",
        "inputs": [{"name": "fp32", "datatype": "FP32", "shape": [-1, 2]},
                   {"name": "i64", "datatype": "INT64", "shape": [-1]}],
        "outputs": [{"name": "fp32_out", "datatype": "FP32", "shape": [-1, 2]},
                    {"name": "i8_out", "datatype": "INT8", "shape": [-1]},
                    {"name": "f64_out", "datatype": "FP64", "shape": [-1]}]}
    assert requests.get(f"{base}/tensors/versions/1.0", timeout=10).json() == metadata
    undeclared = requests.get(f"{base}/doubler", timeout=10).json()
    assert undeclared["inputs"] == [] and undeclared["outputs"] == []
    assert requests.get(f"{base}/tensors/ready", timeout=10).json() == {
        "name": "tensors", "ready": True}
    assert requests.get(f"{base}/tensors/versions/1.0/ready", timeout=10).status_code == 200
    _error(requests.get(f"{base}/tensors/versions/9.9", timeout=10), 404)
    _error(requests.get(f"{base}/nope/ready", timeout=10), 404)


def test_v2_server_ready_waits_for_every_models_minimum_workers(
        build_mar, start_server, tmp_path: Path) -> None:
    """What the Helm chart's readiness probe relies on: one worker up makes a model ready, but
    the server (REST and gRPC) is ready only when every model has its min_workers up."""
    hold = tmp_path / "hold"
    hold_path = tmp_path / "hold_path.txt"
    hold_path.write_text(str(hold))
    build_mar("held", "held_start", extra_files=(str(hold_path),))
    build_mar("echo", "echo")
    server = start_server("held.mar", "echo.mar")
    ready_url = f"{server.inference}/v2/health/ready"
    assert requests.get(ready_url, timeout=10).json() == {"ready": True}

    hold.touch()  # the next worker of "held" stays in initialize until the file goes
    scaled = requests.put(f"{server.management}/models/held",
                          params={"min_worker": 2, "max_worker": 2}, timeout=30)
    assert scaled.status_code == 202, scaled.text
    not_ready = requests.get(ready_url, timeout=10)
    assert (not_ready.status_code, not_ready.json()) == (503, {"ready": False})
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_inference_port}") as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        assert not stub.ServerReady(pb.ServerReadyRequest()).ready
        assert stub.ModelReady(pb.ModelReadyRequest(name="held")).ready
    # The model still serves with the worker it has, and the server is alive.
    assert requests.get(f"{server.inference}/v2/models/held/ready", timeout=10).json() == {
        "name": "held", "ready": True}
    assert server.predict("held", b"x").status_code == 200
    assert requests.get(f"{server.inference}/ping", timeout=10).status_code == 200

    hold.unlink()
    server.wait_for(lambda: requests.get(ready_url, timeout=10).status_code == 200,
                    "the second worker of held to come up")
    workers = server.describe("held")["workers"]
    assert [w["status"] for w in workers] == ["READY", "READY"]  # type: ignore[union-attr,index]


def _outputs(body: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {output["name"]: output for output in body["outputs"]}


def test_v2_infer_with_json_tensors_of_several_datatypes(server: RunningServer) -> None:
    request = {
        "id": "req-1",
        "inputs": [
            {"name": "fp32", "datatype": "FP32", "shape": [2, 2], "data": [[1.5, 2], [3, 4]]},
            {"name": "i64", "datatype": "INT64", "shape": [2], "data": [10, -(2**40)]},
            {"name": "flag", "datatype": "BOOL", "shape": [2, 1], "data": [True, False]},
            {"name": "text", "datatype": "BYTES", "shape": [2], "data": ["ab", "cd"]},
            {"name": "i8", "datatype": "INT8", "shape": [2], "data": [-3, 60]},
            {"name": "f64", "datatype": "FP64", "shape": [2], "data": [0.25, 1e300]},
            {"name": "u16", "datatype": "UINT16", "shape": [2], "data": [0, 65535]},
        ],
    }
    answer = requests.post(f"{server.inference}/v2/models/tensors/infer", json=request,
                           timeout=30)
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["id"] == "req-1"
    assert (body["model_name"], body["model_version"]) == ("tensors", "1.0")
    outputs = _outputs(body)
    expected = {
        "fp32_out": ("FP32", [2, 2], [3.0, 4.0, 6.0, 8.0]),
        "i64_out": ("INT64", [2], [20, -(2**41)]),
        "flag_out": ("BOOL", [2, 1], [False, True]),
        "text_out": ("BYTES", [2], ["AB", "CD"]),
        "i8_out": ("INT8", [2], [-6, 120]),  # declared in model-config.yaml
        "f64_out": ("FP64", [2], [0.5, 2e300]),  # declared; FP32 could not hold it
        "u16_out": ("INT64", [2], [0, 131070]),  # inferred
        "rows_in_batch": ("INT64", [2], [2, 2]),
    }
    assert {name: (o["datatype"], o["shape"], o["data"]) for name, o in outputs.items()} \
        == expected

    selected = requests.post(f"{server.inference}/v2/models/tensors/infer", json={
        **request, "outputs": [{"name": "text_out"}, {"name": "i64_out"}]}, timeout=30).json()
    assert [o["name"] for o in selected["outputs"]] == ["text_out", "i64_out"]


def _binary_request(header: dict[str, Any], blobs: list[bytes]) -> tuple[bytes, dict[str, str]]:
    encoded = json.dumps(header).encode()
    return encoded + b"".join(blobs), {HEADER_LENGTH: str(len(encoded)),
                                       "content-type": "application/octet-stream"}


def _read_binary_response(response: requests.Response) -> tuple[dict[str, Any], bytes]:
    length = int(response.headers[HEADER_LENGTH])
    return json.loads(response.content[:length]), response.content[length:]


def _bytes_elements(*items: bytes) -> bytes:
    return b"".join(struct.pack("<I", len(item)) + item for item in items)


def test_v2_binary_tensor_extension_both_ways(server: RunningServer) -> None:
    floats = struct.pack("<6f", 1, 2, 3, 4, 5, 6)
    texts = _bytes_elements(b"x\x00y", b"", b"zz")
    body, headers = _binary_request({
        "inputs": [
            {"name": "fp32", "datatype": "FP32", "shape": [3, 2],
             "parameters": {"binary_data_size": len(floats)}},
            {"name": "i64", "datatype": "INT64", "shape": [3], "data": [1, 2, 3]},
            {"name": "raw", "datatype": "BYTES", "shape": [3],
             "parameters": {"binary_data_size": len(texts)}},
        ],
        "outputs": [{"name": "fp32_out", "parameters": {"binary_data": True}},
                    {"name": "i64_out"},
                    {"name": "raw_out", "parameters": {"binary_data": True}}],
    }, [floats, texts])
    answer = requests.post(f"{server.inference}/v2/models/tensors/infer", data=body,
                           headers=headers, timeout=30)
    assert answer.status_code == 200, answer.text
    header, binary = _read_binary_response(answer)
    outputs = _outputs(header)
    assert outputs["i64_out"]["data"] == [2, 4, 6]
    fp32_size = outputs["fp32_out"]["parameters"]["binary_data_size"]
    assert struct.unpack("<6f", binary[:fp32_size]) == (2, 4, 6, 8, 10, 12)
    assert outputs["fp32_out"]["shape"] == [3, 2] and "data" not in outputs["fp32_out"]
    assert binary[fp32_size:] == _bytes_elements(b"X\x00Y", b"", b"ZZ")

    # binary_data_output: every output binary, JSON-only request.
    everything = requests.post(f"{server.inference}/v2/models/tensors/infer", json={
        "inputs": [{"name": "i64", "datatype": "INT64", "shape": [1], "data": [7]}],
        "parameters": {"binary_data_output": True}}, timeout=30)
    header, binary = _read_binary_response(everything)
    assert everything.headers["content-type"] == "application/octet-stream"
    assert [o["name"] for o in header["outputs"]] == ["i64_out", "rows_in_batch"]
    assert struct.unpack("<2q", binary) == (14, 1)


def test_v2_requests_merge_into_one_batch_and_split_back(server: RunningServer) -> None:
    def infer(rows: int, tag: str) -> requests.Response:
        return requests.post(f"{server.inference}/v2/models/tensors_batched/infer", json={
            "id": tag,
            "parameters": {"tag": tag},
            "inputs": [{"name": "i64", "datatype": "INT64", "shape": [rows],
                        "parameters": {"unit": f"unit-{tag}"},
                        "data": list(range(rows))}],
        }, timeout=30)

    with ThreadPoolExecutor(2) as pool:
        first, second = pool.map(infer, (2, 3), ("a", "b"))

    assert first.status_code == second.status_code == 200, (first.text, second.text)
    for answer, rows, tag in ((first.json(), 2, "a"), (second.json(), 3, "b")):
        assert answer["id"] == tag
        outputs = _outputs(answer)
        assert outputs["i64_out"]["shape"] == [rows]
        assert outputs["i64_out"]["data"] == [2 * i for i in range(rows)]
        # One batch of 5 rows; each request gets its own parameters back.
        assert outputs["rows_in_batch"]["data"] == [5] * rows
        assert outputs["rows_in_batch"]["parameters"] == {"tag": tag}
        assert outputs["i64_out"]["parameters"] == {"unit": f"unit-{tag}"}


def test_v2_rest_errors(server: RunningServer) -> None:
    url = f"{server.inference}/v2/models/tensors/infer"
    assert "malformed JSON" in _error(requests.post(url, data=b"{", timeout=10), 400)
    wrong_shape = {"inputs": [{"name": "i64", "datatype": "INT64", "shape": [2, 2],
                               "data": [1, 2, 3]}]}
    assert "shape" in _error(requests.post(url, json=wrong_shape, timeout=30), 400)
    bad_type = {"inputs": [{"name": "i64", "datatype": "INT7", "shape": [1], "data": [1]}]}
    assert "datatype" in _error(requests.post(url, json=bad_type, timeout=30), 400)
    out_of_range = {"inputs": [{"name": "b", "datatype": "UINT8", "shape": [1], "data": [256]}]}
    assert "256" in _error(requests.post(url, json=out_of_range, timeout=30), 400)
    unknown_output = {"inputs": [{"name": "i64", "datatype": "INT64", "shape": [1], "data": [1]}],
                      "outputs": [{"name": "nope"}]}
    assert "nope" in _error(requests.post(url, json=unknown_output, timeout=30), 400)
    body, headers = _binary_request({"inputs": [
        {"name": "f", "datatype": "FP32", "shape": [2],
         "parameters": {"binary_data_size": 8}}]}, [b"\x00" * 4])
    _error(requests.post(url, data=body, headers=headers, timeout=30), 400)
    _error(requests.post(f"{server.inference}/v2/models/nope/infer", json=wrong_shape,
                         timeout=10), 404)
    _error(requests.get(url, timeout=10), 405)


# ---- Open Inference Protocol over gRPC --------------------------------------------------------


@pytest.fixture
def stub(server: RunningServer) -> Iterator[pb_grpc.GRPCInferenceServiceStub]:
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_inference_port}") as channel:
        yield pb_grpc.GRPCInferenceServiceStub(channel)


def test_v2_grpc_health_and_metadata(stub: pb_grpc.GRPCInferenceServiceStub) -> None:
    assert stub.ServerLive(pb.ServerLiveRequest()).live
    assert stub.ServerReady(pb.ServerReadyRequest()).ready
    assert stub.ModelReady(pb.ModelReadyRequest(name="tensors", version="1.0")).ready
    server_metadata = stub.ServerMetadata(pb.ServerMetadataRequest())
    assert server_metadata.name == "batchserve"
    assert "binary_tensor_data" in server_metadata.extensions
    metadata = stub.ModelMetadata(pb.ModelMetadataRequest(name="tensors"))
    assert (metadata.name, list(metadata.versions), metadata.platform) == (
        "tensors", ["1.0"], "pytorch")
    assert [(t.name, t.datatype, list(t.shape)) for t in metadata.inputs] == [
        ("fp32", "FP32", [-1, 2]), ("i64", "INT64", [-1])]
    with pytest.raises(grpc.RpcError) as missing:
        stub.ModelMetadata(pb.ModelMetadataRequest(name="nope"))
    assert missing.value.code() is grpc.StatusCode.NOT_FOUND


def test_v2_grpc_infer_with_raw_contents(stub: pb_grpc.GRPCInferenceServiceStub) -> None:
    request = pb.ModelInferRequest(model_name="tensors", id="raw-1")
    request.inputs.add(name="fp32", datatype="FP32", shape=[2, 2])
    request.inputs.add(name="half", datatype="FP16", shape=[2])
    request.inputs.add(name="text", datatype="BYTES", shape=[2])
    request.raw_input_contents.extend([struct.pack("<4f", 1, 2, 3, 4), struct.pack("<2e", 0.5, 1),
                                       _bytes_elements(b"ab", b"c")])
    request.outputs.add(name="fp32_out")
    request.outputs.add(name="text_out")
    request.outputs.add(name="half_out")

    response = stub.ModelInfer(request)

    assert (response.model_name, response.id) == ("tensors", "raw-1")
    assert [(o.name, o.datatype, list(o.shape)) for o in response.outputs] == [
        ("fp32_out", "FP32", [2, 2]), ("text_out", "BYTES", [2]), ("half_out", "FP32", [2])]
    fp32, text, half = response.raw_output_contents
    assert struct.unpack("<4f", fp32) == (2, 4, 6, 8)
    assert text == _bytes_elements(b"AB", b"C")
    assert struct.unpack("<2f", half) == (1, 2)


def test_v2_grpc_infer_with_typed_contents(stub: pb_grpc.GRPCInferenceServiceStub) -> None:
    request = pb.ModelInferRequest(model_name="tensors", model_version="1.0")
    i32 = request.inputs.add(name="i32", datatype="INT32", shape=[3])
    i32.contents.int_contents.extend([1, -2, 3])
    flag = request.inputs.add(name="flag", datatype="BOOL", shape=[3])
    flag.contents.bool_contents.extend([True, False, True])
    request.parameters["tag"].string_param = "typed"

    response = stub.ModelInfer(request)

    assert not response.raw_output_contents
    outputs = {o.name: o for o in response.outputs}
    assert list(outputs["i32_out"].contents.int64_contents) == [2, -4, 6]
    assert list(outputs["flag_out"].contents.bool_contents) == [False, True, False]
    assert outputs["rows_in_batch"].parameters["tag"].string_param == "typed"


def test_v2_grpc_errors(stub: pb_grpc.GRPCInferenceServiceStub) -> None:
    unknown = pb.ModelInferRequest(model_name="nope")
    unknown.inputs.add(name="x", datatype="INT64", shape=[1]).contents.int64_contents.append(1)
    with pytest.raises(grpc.RpcError) as missing:
        stub.ModelInfer(unknown)
    assert missing.value.code() is grpc.StatusCode.NOT_FOUND

    wrong_shape = pb.ModelInferRequest(model_name="tensors")
    wrong_shape.inputs.add(name="x", datatype="INT64", shape=[2, 2]).contents \
        .int64_contents.extend([1, 2, 3])
    with pytest.raises(grpc.RpcError) as invalid:
        stub.ModelInfer(wrong_shape)
    assert invalid.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "shape" in (invalid.value.details() or "")

    with pytest.raises(grpc.RpcError) as no_inputs:
        stub.ModelInfer(pb.ModelInferRequest(model_name="tensors"))
    assert no_inputs.value.code() is grpc.StatusCode.INVALID_ARGUMENT


def _worker_rss(server: RunningServer, model: str) -> int:
    (worker,) = server.describe(model)["workers"]  # type: ignore[misc]
    return int(psutil.Process(worker["pid"]).memory_info().rss)


def test_a_shape_that_promises_more_than_its_bytes_is_refused_at_once(
        server: RunningServer, stub: pb_grpc.GRPCInferenceServiceStub) -> None:
    """An 85-byte empty tensor of shape [1, 3000000, 0] once cost the worker seconds and
    ~200 MiB (three million empty lists); the work a request causes is bounded by its bytes."""
    url = f"{server.inference}/v2/models/tensors/infer"
    before = _worker_rss(server, "tensors")
    huge = b'{"inputs":[{"name":"x","datatype":"FP32","shape":[1,3000000,0],"data":[]}]}'
    for body in (huge, huge.replace(b"[1,3000000,0]", b"[5000,1000,0]"),
                 huge.replace(b"[1,3000000,0]", b"[1,1000,1000,1000,0]")):
        assert "nested lists" in _error(requests.post(url, data=body, timeout=30), 400)
    deep = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1] * 33, "data": [1.0]}]}
    assert "dimensions" in _error(requests.post(url, json=deep, timeout=30), 400)
    nested = b'{"inputs":[{"name":"x","datatype":"FP32","shape":[1],"data":' + b"[" * 5000 \
        + b"1" + b"]" * 5000 + b"}]}"
    assert "nested deeper than 100 levels" in _error(requests.post(url, data=nested,
                                                                    timeout=30), 400)
    request = pb.ModelInferRequest(model_name="tensors", raw_input_contents=[b""])
    request.inputs.add(name="x", datatype="FP32", shape=[1, 3_000_000, 0])
    with pytest.raises(grpc.RpcError) as refused:
        stub.ModelInfer(request)
    assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "nested lists" in (refused.value.details() or "")
    # A small empty tensor is still served, and so is the next request.
    small = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [2, 0], "data": []}]}
    assert requests.post(url, json=small, timeout=30).status_code == 200
    ok = {"inputs": [{"name": "i64", "datatype": "INT64", "shape": [1], "data": [1]}]}
    assert requests.post(url, json=ok, timeout=30).status_code == 200
    assert _worker_rss(server, "tensors") - before < 50 * 1024 * 1024


def test_every_documented_kserve_route_is_served(server: RunningServer) -> None:
    """The inference port's OpenAPI document lists KServe's routes; each one answers with a
    status the document gives it (never the 404 of an unknown route)."""
    document = requests.get(f"{server.inference}/api-description", timeout=10).json()
    kserve_paths = {path: item for path, item in document["paths"].items()
                    if path.startswith(("/v1", "/v2"))}
    assert len(kserve_paths) >= 13
    for template, item in kserve_paths.items():
        path = template.replace("{model_name}", "doubler").replace("{model_version}", "1.0")
        for method, operation in item.items():
            if method == "parameters":
                continue
            body = {"instances": [[1.0]]} if ":" in path else {
                "inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [1.0]}]}
            answer = requests.request(method.upper(), f"{server.inference}{path}",
                                      json=body if method == "post" else None, timeout=60)
            assert str(answer.status_code) in operation["responses"], \
                (method, path, answer.status_code, answer.text)
            if answer.status_code == 404:
                assert "doubler" in answer.text, (method, path, answer.text)
