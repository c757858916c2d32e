"""gRPC clients that leave early: the frontend outlives every RPC that ends before its requests.

The server runs in a process of its own: before the fix a client that cancelled a
StreamPredictions2 stream killed the frontend with SIGSEGV, which in-process would have taken
the test run down with it.
"""

from __future__ import annotations

import json

import grpc
import pytest
import requests
from google.protobuf import empty_pb2

from protos import inference_pb2, inference_pb2_grpc, open_inference_pb2, open_inference_pb2_grpc
from tests.conftest import ServerProcess

ROUNDS = 10


def _requests(model: str, body: bytes, count: int) -> list[inference_pb2.PredictionsRequest]:
    return [inference_pb2.PredictionsRequest(model_name=model, input={"body": body})
            for _ in range(count)]


def _assert_serving(server: ServerProcess) -> None:
    assert server.is_alive(), f"the frontend died ({server.process.returncode}):\n" \
                              f"{server.log_text()[-3000:]}"
    assert requests.get(f"{server.inference}/ping", timeout=10).status_code == 200
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_inference_port}") as channel:
        stub = inference_pb2_grpc.InferenceAPIsServiceStub(channel)
        assert json.loads(stub.Ping(empty_pb2.Empty(), timeout=10).health) == {
            "status": "Healthy"}
        answer = stub.Predictions(inference_pb2.PredictionsRequest(
            model_name="echo", input={"body": b"still here"}), timeout=30)
        assert answer.prediction == b"still here"


def test_streams_left_early_never_crash_the_frontend(build_mar, server_process) -> None:
    build_mar("echo", "echo")
    build_mar("streamer", "streamer")
    server = server_process("echo=echo.mar", "streamer=streamer.mar")
    target = f"127.0.0.1:{server.grpc_inference_port}"
    for round_ in range(ROUNDS):
        channel = grpc.insecure_channel(target)
        stub = inference_pb2_grpc.InferenceAPIsServiceStub(channel)
        call = stub.StreamPredictions2(iter(_requests("echo", b"x", 50)))
        assert next(call).prediction == b"x"
        if round_ % 2:
            call.cancel()  # the reproduction of the report
        channel.close()  # or the client simply goes away

        channel = grpc.insecure_channel(target)
        stub = inference_pb2_grpc.InferenceAPIsServiceStub(channel)
        parts = stub.StreamPredictions(inference_pb2.PredictionsRequest(
            model_name="streamer", input={"body": b"s"}))
        assert next(parts).prediction == b"s part 1\n"
        parts.cancel()
        channel.close()
    _assert_serving(server)


def test_requests_of_a_cancelled_stream_leave_the_queue_undispatched(
        build_mar, server_process) -> None:
    build_mar("echo", "echo")
    build_mar("sleepy", "sleep")
    server = server_process("echo=echo.mar", "sleepy=sleepy.mar")
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_inference_port}") as channel:
        stub = inference_pb2_grpc.InferenceAPIsServiceStub(channel)
        call = stub.StreamPredictions2(iter(_requests("sleepy", b"0.3", 20)))
        assert next(call).prediction == b"0.3"
        call.cancel()

    def requests_total() -> int:
        described = requests.get(f"{server.management}/models/sleepy", timeout=10).json()[0]
        return int(described["batching"]["requestsTotal"])

    def queue_empty() -> bool:
        described = requests.get(f"{server.management}/models/sleepy", timeout=10).json()[0]
        return described["jobQueueStatus"]["pendingRequests"] == 0 \
            and described["batching"]["inFlightBatches"] == 0

    server.wait_for(queue_empty, "the cancelled requests to leave the queue")
    # One worker, 0.3 s a request: the cancelled stream's queued requests never ran.
    assert requests_total() < 20
    _assert_serving(server)


@pytest.mark.parametrize("rpc", ["Predictions", "StreamPredictions2", "ModelInfer"])
def test_a_client_deadline_passing_mid_request_leaves_the_frontend_up(
        build_mar, server_process, rpc: str) -> None:
    build_mar("echo", "echo")
    build_mar("sleepy", "sleep")
    server = server_process("echo=echo.mar", "sleepy=sleepy.mar")
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_inference_port}") as channel:
        for _ in range(3):
            if rpc == "StreamPredictions2":
                # The requests share the client's deadline: each is answered 504 in the
                # stream, or the stream ends first, whichever the clock decides.
                call = inference_pb2_grpc.InferenceAPIsServiceStub(channel).StreamPredictions2(
                    iter(_requests("sleepy", b"1", 5)), timeout=0.2)
                try:
                    answers = list(call)
                except grpc.RpcError as error:
                    assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                else:
                    assert [a.status.code for a in answers] == [
                        grpc.StatusCode.DEADLINE_EXCEEDED.value[0]] * 5
                continue
            with pytest.raises(grpc.RpcError) as expired:
                if rpc == "ModelInfer":
                    stub = open_inference_pb2_grpc.GRPCInferenceServiceStub(channel)
                    tensor = open_inference_pb2.ModelInferRequest.InferInputTensor(
                        name="body", datatype="BYTES", shape=[1],
                        contents=open_inference_pb2.InferTensorContents(bytes_contents=[b"1"]))
                    stub.ModelInfer(open_inference_pb2.ModelInferRequest(
                        model_name="sleepy", inputs=[tensor]), timeout=0.2)
                else:
                    inference_pb2_grpc.InferenceAPIsServiceStub(channel).Predictions(
                        _requests("sleepy", b"1", 1)[0], timeout=0.2)
            assert expired.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    _assert_serving(server)
