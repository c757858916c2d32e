"""TorchServe's gRPC APIs against the real server, with a real grpc client.

The stubs are generated in the test from our .proto files (as a TorchServe user generates
them from TorchServe's), not imported from the server's package.
"""

from __future__ import annotations

import importlib
import json
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType

import grpc
import pytest
import requests
from google.protobuf import empty_pb2

from tests.conftest import ROOT, RunningServer


@pytest.fixture(scope="module")
def stubs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, ModuleType]]:
    """Client stubs generated now from protos/*.proto into a private package."""
    from grpc_tools import protoc

    out = tmp_path_factory.mktemp("stubs")
    include = Path(protoc.__file__).parent / "_proto"
    import google.rpc

    rpc_include = Path(google.rpc.__path__[0]).parent.parent
    for proto in ("inference.proto", "management.proto"):
        assert protoc.main(["protoc", f"-I{ROOT / 'protos'}", f"-I{include}", f"-I{rpc_include}",
                            f"--python_out={out}", f"--grpc_python_out={out}",
                            str(ROOT / "protos" / proto)]) == 0
    sys.path.insert(0, str(out))
    saved = {name: sys.modules.pop(name) for name in list(sys.modules)
             if name.split(".")[0] in ("inference_pb2", "inference_pb2_grpc", "management_pb2",
                                       "management_pb2_grpc")}
    try:
        # The server's own protos.inference_pb2 registered the same descriptors: the client
        # modules must reuse them rather than add duplicates to the default pool.
        yield {name: _load_client(name) for name in
               ("inference_pb2", "inference_pb2_grpc", "management_pb2", "management_pb2_grpc")}
    finally:
        sys.path.remove(str(out))
        for name in ("inference_pb2", "inference_pb2_grpc", "management_pb2",
                     "management_pb2_grpc"):
            sys.modules.pop(name, None)
        sys.modules.update(saved)


def _load_client(name: str) -> ModuleType:
    if name.endswith("_pb2"):
        # Same descriptors as the server's generated module (a process can hold one copy).
        server_module = importlib.import_module(f"protos.{name}")
        sys.modules[name] = server_module
        return server_module
    return importlib.import_module(name)


def _channel(port: int | None) -> grpc.Channel:
    assert port is not None
    return grpc.insecure_channel(f"127.0.0.1:{port}")


def _inference(stubs: dict[str, ModuleType], server: RunningServer) -> object:
    return stubs["inference_pb2_grpc"].InferenceAPIsServiceStub(
        _channel(server.grpc_inference_port))


def _management(stubs: dict[str, ModuleType], server: RunningServer) -> object:
    return stubs["management_pb2_grpc"].ManagementAPIsServiceStub(
        _channel(server.grpc_management_port))


def test_ping_and_predictions(stubs, build_mar, start_server) -> None:
    build_mar("echo", "echo")
    server = start_server("echo.mar")
    client = _inference(stubs, server)
    pb2 = stubs["inference_pb2"]

    health = client.Ping(empty_pb2.Empty(), timeout=10)
    assert json.loads(health.health) == {"status": "Healthy"}

    answer = client.Predictions(pb2.PredictionsRequest(model_name="echo",
                                                       input={"data": b"over grpc"}),
                                timeout=30)
    assert answer.prediction == b"over grpc"

    with pytest.raises(grpc.RpcError) as missing:
        client.Predictions(pb2.PredictionsRequest(model_name="nope", input={"data": b"x"}),
                           timeout=10)
    assert missing.value.code() == grpc.StatusCode.NOT_FOUND
    assert missing.value.details() == "Model not found: nope"


def test_handler_failure_maps_to_internal(stubs, build_mar, start_server) -> None:
    build_mar("raises", "raises")
    server = start_server("raises.mar")
    client = _inference(stubs, server)
    pb2 = stubs["inference_pb2"]
    with pytest.raises(grpc.RpcError) as boom:
        client.Predictions(pb2.PredictionsRequest(model_name="raises", input={"body": b"x"}),
                           timeout=30)
    assert boom.value.code() == grpc.StatusCode.INTERNAL
    assert "RuntimeError: boom" in boom.value.details()
    with pytest.raises(grpc.RpcError) as invalid:
        client.Predictions(pb2.PredictionsRequest(model_name="raises",
                                                  input={"body": b"invalid"}), timeout=30)
    assert invalid.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_every_management_rpc(stubs, build_mar, start_server) -> None:
    build_mar("echo", "echo")
    server = start_server()
    client = _management(stubs, server)
    pb2 = stubs["management_pb2"]

    registered = client.RegisterModel(pb2.RegisterModelRequest(
        url="echo.mar", model_name="g", batch_size=4, max_batch_delay=20, initial_workers=1,
        synchronous=True), timeout=60)
    assert json.loads(registered.msg) == {
        "status": 'Model "g" Version: 1.0 registered with 1 initial workers'}
    with pytest.raises(grpc.RpcError) as twice:
        client.RegisterModel(pb2.RegisterModelRequest(url="echo.mar", model_name="g"),
                             timeout=60)
    assert twice.value.code() == grpc.StatusCode.ALREADY_EXISTS
    with pytest.raises(grpc.RpcError) as no_url:
        client.RegisterModel(pb2.RegisterModelRequest(model_name="x"), timeout=10)
    assert no_url.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    listed = json.loads(client.ListModels(pb2.ListModelsRequest(limit=10), timeout=10).msg)
    assert listed == {"models": [{"modelName": "g", "modelUrl": "echo.mar"}]}
    described = json.loads(client.DescribeModel(pb2.DescribeModelRequest(model_name="g"),
                                                timeout=10).msg)
    assert described[0]["batchSize"] == 4 and described[0]["maxBatchDelay"] == 20
    with pytest.raises(grpc.RpcError) as unknown:
        client.DescribeModel(pb2.DescribeModelRequest(model_name="nope"), timeout=10)
    assert unknown.value.code() == grpc.StatusCode.NOT_FOUND

    scaled = client.ScaleWorker(pb2.ScaleWorkerRequest(model_name="g", min_worker=2,
                                                       max_worker=2, synchronous=True),
                                timeout=60)
    assert json.loads(scaled.msg) == {"status": "Workers scaled to 2 for model: g"}
    assert len(server.describe("g")["workers"]) == 2  # type: ignore[arg-type]

    default = client.SetDefault(pb2.SetDefaultRequest(model_name="g", model_version="1.0"),
                                timeout=10)
    assert "Default version successfully updated" in json.loads(default.msg)["status"]
    with pytest.raises(grpc.RpcError) as bad_version:
        client.SetDefault(pb2.SetDefaultRequest(model_name="g", model_version="9"), timeout=10)
    assert bad_version.value.code() == grpc.StatusCode.NOT_FOUND

    removed = client.UnregisterModel(pb2.UnregisterModelRequest(model_name="g"), timeout=60)
    assert json.loads(removed.msg) == {"status": 'Model "g" unregistered'}


def test_model_api_control_and_token_auth(stubs, build_mar, start_server,
                                          tmp_path: Path) -> None:
    build_mar("echo", "echo")
    key_file = tmp_path / "key_file.json"
    server = start_server("echo.mar", enable_model_api=False, disable_token_authorization=False,
                          key_file=key_file)
    keys = json.loads(key_file.read_text())
    inference, management = _inference(stubs, server), _management(stubs, server)
    request = stubs["inference_pb2"].PredictionsRequest(model_name="echo", input={"b": b"k"})

    with pytest.raises(grpc.RpcError) as anonymous:
        inference.Predictions(request, timeout=10)
    assert anonymous.value.code() == grpc.StatusCode.UNAUTHENTICATED
    token = (("authorization", f"Bearer {keys['inference']['key']}"),)
    assert inference.Predictions(request, metadata=token, timeout=30).prediction == b"k"

    admin = (("authorization", f"Bearer {keys['management']['key']}"),)
    with pytest.raises(grpc.RpcError) as disabled:
        management.RegisterModel(stubs["management_pb2"].RegisterModelRequest(url="echo.mar"),
                                 metadata=admin, timeout=10)
    assert disabled.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "--enable-model-api" in disabled.value.details()


def test_server_streaming_delivers_each_part(stubs, build_mar, start_server) -> None:
    build_mar("gen", "streamer")
    build_mar("tsstyle", "streamer:torchserve_style")
    server = start_server("gen.mar", "tsstyle.mar")
    client = _inference(stubs, server)
    for model in ("gen", "tsstyle"):
        parts = list(client.StreamPredictions(stubs["inference_pb2"].PredictionsRequest(
            model_name=model, input={"body": b"s"}), timeout=30))
        assert [p.prediction for p in parts] == [b"s part 1\n", b"s part 2\n", b"s part 3\n"]


def test_bidirectional_stream_of_20_in_order(stubs, build_mar, start_server) -> None:
    build_mar("echo", "echo")
    server = start_server()
    import requests

    requests.post(f"{server.management}/models",
                  params={"url": "echo.mar", "batch_size": 4, "max_batch_delay": 5,
                          "initial_workers": 2, "synchronous": "true"},
                  timeout=60).raise_for_status()
    pb2 = stubs["inference_pb2"]
    outgoing = [pb2.PredictionsRequest(model_name="echo", sequence_id=f"seq-{i}",
                                       input={"body": f"message {i}".encode()})
                for i in range(20)]
    outgoing.insert(7, pb2.PredictionsRequest(model_name="absent", sequence_id="bad",
                                              input={"body": b"x"}))
    answers = list(_inference(stubs, server).StreamPredictions2(iter(outgoing), timeout=60))
    assert [a.sequence_id for a in answers] == [r.sequence_id for r in outgoing]
    for request, answer in zip(outgoing, answers, strict=True):
        if request.model_name == "absent":
            assert answer.status.code == grpc.StatusCode.NOT_FOUND.value[0]
            assert "absent" in answer.status.message
        else:
            assert answer.prediction == request.input["body"]


def test_client_deadline_drops_the_request_before_the_worker(stubs, build_mar, start_server,
                                                             tmp_path: Path) -> None:
    build_mar("gate", "gate")
    server = start_server("gate.mar")
    client = _inference(stubs, server)
    pb2 = stubs["inference_pb2"]
    gate = tmp_path / "open"
    with ThreadPoolExecutor(1) as pool:
        held = pool.submit(client.Predictions, pb2.PredictionsRequest(
            model_name="gate", input={"body": str(gate).encode()}), timeout=60)
        server.wait_for(lambda: server.describe("gate")["batching"]["inFlightBatches"] == 1,  # type: ignore[index]
                        "the first request to reach the worker")
        with pytest.raises(grpc.RpcError) as late:
            client.Predictions(pb2.PredictionsRequest(model_name="gate",
                                                      input={"body": b"/expired"}), timeout=0.3)
        assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        gate.touch()
        assert held.result(timeout=30).prediction == str(gate).encode()
    assert server.predict("gate", str(gate).encode()).status_code == 200
    # The expired request never reached the worker: 2 requests ran, in 2 batches of 1.
    batching = server.describe("gate")["batching"]
    assert batching["requestsTotal"] == 2, batching  # type: ignore[index]


def test_http_and_grpc_requests_share_one_batch(stubs, build_mar, start_server) -> None:
    build_mar("batch_len", "batch_len")
    server = start_server()
    import requests

    requests.post(f"{server.management}/models",
                  params={"url": "batch_len.mar", "batch_size": 2, "max_batch_delay": 10000,
                          "batch_policy": "fixed",
                          "initial_workers": 1, "synchronous": "true"},
                  timeout=60).raise_for_status()
    client = _inference(stubs, server)
    pb2 = stubs["inference_pb2"]
    with ThreadPoolExecutor(2) as pool:
        over_grpc = pool.submit(client.Predictions, pb2.PredictionsRequest(
            model_name="batch_len", input={"body": b"g"}), timeout=60)
        over_http = pool.submit(server.predict, "batch_len", b"h")
        assert over_grpc.result(timeout=60).prediction == b"2"
        assert over_http.result(timeout=60).text == "2"
    assert server.describe("batch_len")["batching"]["recentBatchSizes"] == [2]  # type: ignore[index]


def test_health_checking_and_reflection(build_mar, start_server) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    server = start_server()
    channel = _channel(server.grpc_inference_port)
    checked = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(
        service="org.pytorch.serve.grpc.inference.InferenceAPIsService"), timeout=10)
    assert checked.status == health_pb2.HealthCheckResponse.SERVING
    listing = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10)
    names = {s.name for answer in listing for s in answer.list_services_response.service}
    assert "org.pytorch.serve.grpc.inference.InferenceAPIsService" in names


def test_management_rpcs_refuse_what_rest_refuses(stubs, build_mar, start_server) -> None:
    """A number the client sets is checked as its REST parameter is (0 included); scaling up a
    model whose workers cannot start fails as over REST."""
    build_mar("echo", "echo")
    server = start_server(default_workers_per_model=0)
    client = _management(stubs, server)
    pb2 = stubs["management_pb2"]
    for field, value in (("startup_timeout", 0), ("response_timeout", 0), ("batch_size", 0),
                         ("initial_workers", -1), ("max_batch_delay", -5)):
        with pytest.raises(grpc.RpcError) as refused:
            client.RegisterModel(pb2.RegisterModelRequest(
                url="echo.mar", model_name="r", synchronous=True, **{field: value}), timeout=60)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, field
        rest = requests.post(f"{server.management}/models", timeout=60, params={
            "url": "echo.mar", "model_name": "r", field: str(value)})
        assert rest.status_code == 400, (field, rest.text)
    for name in ("x" * 10_000, "x" * 256, "CON", "a\nb"):  # names no route can carry
        with pytest.raises(grpc.RpcError) as refused:
            client.RegisterModel(pb2.RegisterModelRequest(
                url="echo.mar", model_name=name, synchronous=True), timeout=60)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, name[:10]
        assert "invalid model name" in (refused.value.details() or ""), name[:10]
    assert requests.get(f"{server.management}/models", timeout=10).json()["models"] == []

    # Unset numbers take the REST defaults: no worker (default_workers_per_model is 0).
    registered = client.RegisterModel(pb2.RegisterModelRequest(
        url="echo.mar", model_name="bad", handler="no_such_module", synchronous=True),
        timeout=60)
    assert "registered with 0 initial workers" in json.loads(registered.msg)["status"]
    with pytest.raises(grpc.RpcError) as failed:
        client.ScaleWorker(pb2.ScaleWorkerRequest(model_name="bad", min_worker=1,
                                                  synchronous=True), timeout=120)
    assert failed.value.code() == grpc.StatusCode.INTERNAL
    assert "Failed to start workers" in (failed.value.details() or "")
    # min_worker=0 set explicitly scales to zero (not to the default of 1).
    scaled = client.ScaleWorker(pb2.ScaleWorkerRequest(model_name="bad", min_worker=0,
                                                       synchronous=True), timeout=60)
    assert json.loads(scaled.msg) == {"status": "Workers scaled to 0 for model: bad"}
    assert server.describe("bad")["workers"] == []
