"""One request cannot hold the event loop for everyone: inputs, parts, instances and rows are
bounded (a clear 4xx), and max_response_size holds on every protocol."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator

import grpc
import pytest
import requests

from protos import inference_pb2, inference_pb2_grpc
from protos import open_inference_pb2 as oip
from protos import open_inference_pb2_grpc as oip_grpc
from tests.conftest import RunningServer

MAX_RESPONSE = 4096
#: What a ping may take while a hostile request is handled (it took 2 s before the bounds).
PING_WITHIN_S = 1.0


@pytest.fixture
def server(build_mar, start_server) -> RunningServer:
    build_mar("echo", "echo")
    build_mar("streamer", "streamer")
    build_mar("tensors", "tensors")
    return start_server("echo.mar", "streamer.mar", "tensors.mar",
                        max_response_size_bytes=MAX_RESPONSE)


class PingWatch:
    """Pings the server in a thread while a test runs; the slowest answer is kept."""

    def __init__(self, server: RunningServer) -> None:
        self.url = f"{server.inference}/ping"
        self.slowest_s = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with requests.Session() as session:
            while not self._stop.is_set():
                started = time.monotonic()
                session.get(self.url, timeout=30)
                self.slowest_s = max(self.slowest_s, time.monotonic() - started)
                self._stop.wait(0.02)

    def __enter__(self) -> PingWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=60)


@pytest.fixture
def channel(server: RunningServer) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_inference_port}") as opened:
        yield opened


def test_a_grpc_request_with_400k_inputs_is_refused_without_stalling_others(
        server: RunningServer, channel: grpc.Channel) -> None:
    stub = inference_pb2_grpc.InferenceAPIsServiceStub(channel)
    hostile = inference_pb2.PredictionsRequest(
        model_name="echo", input={f"k{i}": b"v" for i in range(400_000)})
    with PingWatch(server) as watch:
        for _ in range(3):
            with pytest.raises(grpc.RpcError) as refused:
                stub.Predictions(hostile, timeout=60)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "at most 1000 inputs" in refused.value.details()
    assert watch.slowest_s < PING_WITHIN_S
    # In a stream only that request is refused; the others are answered.
    good = inference_pb2.PredictionsRequest(model_name="echo", input={"body": b"ok"},
                                            sequence_id="s")
    answers = list(stub.StreamPredictions2(iter([good, hostile, good]), timeout=60))
    assert [a.prediction for a in answers] == [b"ok", b"", b"ok"]
    assert answers[1].status.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert [a.sequence_id for a in answers] == ["s", "", "s"]


def test_a_v2_grpc_request_is_bounded_and_never_decoded_in_the_frontend(
        server: RunningServer, channel: grpc.Channel) -> None:
    stub = oip_grpc.GRPCInferenceServiceStub(channel)
    tensor = oip.ModelInferRequest.InferInputTensor(
        name="i64", datatype="INT64", shape=[1], contents=oip.InferTensorContents(
            int64_contents=[1]))
    with pytest.raises(grpc.RpcError) as too_many:
        stub.ModelInfer(oip.ModelInferRequest(model_name="tensors", inputs=[tensor] * 1001),
                        timeout=30)
    assert too_many.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "at most 1000 inputs" in too_many.value.details()
    rows = oip.ModelInferRequest.InferInputTensor(name="i64", datatype="INT64",
                                                 shape=[20_000])
    with pytest.raises(grpc.RpcError) as too_long:
        stub.ModelInfer(oip.ModelInferRequest(model_name="tensors", inputs=[rows]), timeout=30)
    assert too_long.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "at most 10000 rows" in too_long.value.details()
    raw_infer = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer",
                                    response_deserializer=oip.ModelInferResponse.FromString)
    with pytest.raises(grpc.RpcError) as garbage:
        raw_infer(b"\xff\xff\xff", timeout=30)
    assert garbage.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # 300k tiny elements in one tensor: decoded by the worker, not by the frontend's loop.
    many = oip.ModelInferRequest(model_name="tensors", inputs=[
        oip.ModelInferRequest.InferInputTensor(
            name="strings", datatype="BYTES", shape=[1, 300_000],
            contents=oip.InferTensorContents(bytes_contents=[b"x"] * 300_000))])
    with PingWatch(server) as watch:
        try:
            stub.ModelInfer(many, timeout=60)
        except grpc.RpcError as error:  # the handler may refuse it; the frontend must not stall
            assert error.code() != grpc.StatusCode.UNAVAILABLE
    assert watch.slowest_s < PING_WITHIN_S


def _multipart(parts: int) -> bytes:
    part = b'--B\r\nContent-Disposition: form-data; name="a"\r\n\r\nx\r\n'
    return part * parts + b"--B--\r\n"


def test_forms_with_too_many_fields_are_400_without_stalling_others(
        server: RunningServer) -> None:
    with PingWatch(server) as watch:
        refused = server.predict("echo", _multipart(111_000),
                                 headers={"Content-Type": "multipart/form-data; boundary=B"})
        assert refused.status_code == 400
        assert "at most 1000 form fields" in refused.json()["message"]
        urlencoded = server.predict("echo", b"&".join([b"a=1"] * 200_000), headers={
            "Content-Type": "application/x-www-form-urlencoded"})
        assert urlencoded.status_code == 400
    assert watch.slowest_s < PING_WITHIN_S
    fine = server.predict("echo", _multipart(3),
                          headers={"Content-Type": "multipart/form-data; boundary=B"})
    assert fine.status_code == 200


def test_kserve_requests_are_bounded_and_json_nesting_is_a_400(server: RunningServer) -> None:
    v1 = f"{server.inference}/v1/models/echo:predict"
    with PingWatch(server) as watch:
        huge = requests.post(v1, data=json.dumps({"instances": [1] * 1_000_000}), timeout=60)
    assert huge.status_code == 400
    assert "at most 10000 instances" in huge.json()["error"]
    assert watch.slowest_s < PING_WITHIN_S
    deep = b"[" * 100_000 + b"]" * 100_000
    nested = requests.post(v1, data=b'{"instances": ' + deep + b"}", timeout=60)
    assert nested.status_code == 400 and "nested deeper than 100 levels" in nested.json()["error"]
    v2 = requests.post(f"{server.inference}/v2/models/tensors/infer",
                       data=b'{"inputs": ' + deep + b"}", timeout=60)
    assert v2.status_code == 400 and "nested deeper than 100 levels" in v2.json()["error"]
    rows = requests.post(f"{server.inference}/v2/models/tensors/infer", json={"inputs": [
        {"name": "i64", "datatype": "INT64", "shape": [20_000], "data": [0] * 20_000}]},
        timeout=60)
    assert rows.status_code == 400 and "at most 10000 rows" in rows.json()["error"]
    # JSON the worker decodes for a handler is bounded as the frontend's (issue 31): past
    # 100 levels it is refused before it is parsed, whether or not Python's parser could
    # read it (500 levels it could, and what recursed over it next failed: 500).
    for depth in (500, 2000):
        deep_enough = b"[" * depth + b"]" * depth
        torchserve = server.predict("echo", deep_enough,
                                    headers={"Content-Type": "application/json"})
        assert torchserve.status_code == 400, torchserve.text
        assert "nested deeper than 100 levels" in torchserve.json()["message"]
    within = b"[" * 30 + b"]" * 30  # decoded (echo answers it pretty-printed)
    answer = server.predict("echo", within, headers={"Content-Type": "application/json"})
    assert answer.status_code == 200, answer.text
    assert answer.json() == json.loads(within)


def test_max_response_size_holds_on_every_protocol(server: RunningServer,
                                                   channel: grpc.Channel) -> None:
    big = b"x" * (MAX_RESPONSE + 1)
    message = f"exceeds max_response_size ({MAX_RESPONSE} bytes)"
    http = server.predict("echo", big)
    assert http.status_code == 500 and message in http.json()["message"]
    assert server.predict("echo", b"small").content == b"small"

    v1 = requests.post(f"{server.inference}/v1/models/echo:predict",
                       json={"instances": ["y" * (MAX_RESPONSE // 2)] * 2}, timeout=30)
    assert v1.status_code == 500 and "max_response_size" in v1.json()["error"]
    v2 = requests.post(f"{server.inference}/v2/models/tensors/infer", json={"inputs": [
        {"name": "i64", "datatype": "INT64", "shape": [2000], "data": list(range(2000))}]},
        timeout=30)
    assert v2.status_code == 500 and message in v2.json()["error"]

    stub = inference_pb2_grpc.InferenceAPIsServiceStub(channel)
    with pytest.raises(grpc.RpcError) as unary:
        stub.Predictions(inference_pb2.PredictionsRequest(model_name="echo",
                                                          input={"body": big}), timeout=30)
    assert unary.value.code() == grpc.StatusCode.INTERNAL and message in unary.value.details()
    with pytest.raises(grpc.RpcError) as streamed:
        list(stub.StreamPredictions(inference_pb2.PredictionsRequest(
            model_name="streamer", input={"body": big}), timeout=30))
    assert streamed.value.code() == grpc.StatusCode.INTERNAL
    assert message in streamed.value.details()
    tensor = oip.ModelInferRequest.InferInputTensor(
        name="i64", datatype="INT64", shape=[2000],
        contents=oip.InferTensorContents(int64_contents=list(range(2000))))
    with pytest.raises(grpc.RpcError) as infer:
        oip_grpc.GRPCInferenceServiceStub(channel).ModelInfer(
            oip.ModelInferRequest(model_name="tensors", inputs=[tensor]), timeout=30)
    assert infer.value.code() == grpc.StatusCode.INTERNAL and message in infer.value.details()
