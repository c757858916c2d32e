"""Junk numbers and deep JSON against every route and RPC of the real server: each is a 400
(gRPC INVALID_ARGUMENT) naming the parameter, never a 500, and the server stays up.

The probes are what found issue 31: ``batch_size=2147483648``, ``response_timeout=2**62``,
``maxBatchSize=1e20``, ``max_batch_size=1e300`` failed where protobuf stored them (500), a
registration body nested 50,000 deep failed in the JSON reader (500), and
``min_worker=100000`` forked until ``/ping`` died. One server, with the default worker caps
(what the host allows), serves the module.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator

import grpc
import pytest
import requests

from model_archiver.packaging import ArchiveOptions, build_archive
from protos import (
    inference_pb2,
    inference_pb2_grpc,
    management_pb2,
    management_pb2_grpc,
    open_inference_pb2,
    open_inference_pb2_grpc,
)
from tests.conftest import HANDLERS, RunningServer, launch_server

INT32_MAX = 2**31 - 1
#: Numbers no parameter takes, in the forms a client may send them.
HUGE = ["2147483648", str(2**62), "99999999999999999999", "1e20", "1e300", "1e400"]
NOT_NUMBERS = ["NaN", "nan", "inf", "-inf", "Infinity", "abc", "", "1.5", "0x10", "9" * 5000]
JUNK = HUGE + [value for value in NOT_NUMBERS if value != ""] + ["-2"]
#: Deeper than any parser's recursion: what a JSON body may not be.
DEEP = "[" * 50_000 + "]" * 50_000
DEEP_OBJECT = '{"a":' * 50_000 + "1" + "}" * 50_000
JSON = {"Content-Type": "application/json"}

@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    store = tmp_path_factory.mktemp("ranges") / "model_store"
    store.mkdir()
    for name in ("echo", "tensors"):
        build_archive(ArchiveOptions(model_name=name, version="1.0",
                                     handler=str(HANDLERS / f"{name}.py"), export_path=store,
                                     force=True))
    running = launch_server(store, "echo.mar", "tensors.mar", workflow_store=store)
    yield running
    running.stop()


def _refused(answer: requests.Response, *named: str) -> str:
    """A 400 whose message names each of ``named``; its message."""
    assert answer.status_code == 400, (answer.request.url, answer.status_code,
                                       answer.text[:300])
    body = answer.json()
    message = str(body.get("message", body.get("error", "")))
    for name in named:
        assert name in message, (name, message)
    assert "Traceback" not in answer.text
    return message


def _healthy(server: RunningServer) -> None:
    ping = requests.get(f"{server.inference}/ping", timeout=10)
    assert (ping.status_code, ping.json()) == (200, {"status": "Healthy"})
    assert server.predict("echo", b"still here").content == b"still here"


def _registered(server: RunningServer) -> list[str]:
    listed = requests.get(f"{server.management}/models", timeout=10).json()
    return [model["modelName"] for model in listed["models"]]


# ---- the management API -------------------------------------------------------------------

#: Registration parameters and the values below their range.
REGISTER = {"batch_size": "0", "max_batch_delay": "-1", "initial_workers": "-1",
            "response_timeout": "0", "startup_timeout": "0", "max_batch_size": "-1",
            "maxBatchSize": "0", "max_batch_time": "-1", "maxLatency": "-1"}


@pytest.mark.parametrize("parameter", sorted(REGISTER))
def test_registration_parameters_out_of_range_are_400_in_query_and_json(
        server: RunningServer, parameter: str) -> None:
    models = f"{server.management}/models"
    session = requests.Session()
    # A fraction is a number of seconds or milliseconds to MLServer's and KServe's delays.
    fractions_taken = parameter in ("max_batch_time", "maxLatency")
    for value in [*JUNK, REGISTER[parameter]]:
        if fractions_taken and value == "1.5":
            continue
        params = {"url": "echo.mar", "model_name": "junk", parameter: value}
        message = _refused(session.post(models, params=params, timeout=30), parameter)
        assert "in [" in message, message  # the range is named
        body = {**params, parameter: json.loads(value) if value in HUGE[:3] else value}
        _refused(session.post(models, json=body, timeout=30), parameter)
    # As JSON numbers too: what the issue's probes sent.
    for number in (2**31, 2**62, 1e20, 1e300, -1):
        _refused(session.post(models, json={"url": "echo.mar", "model_name": "junk",
                                            parameter: number}, timeout=30), parameter)
    assert "junk" not in _registered(server)
    _healthy(server)


def test_the_issue_s_probes_are_400(server: RunningServer) -> None:
    models = f"{server.management}/models"
    for params, named in (({"batch_size": "2147483648"}, "batch_size"),
                          ({"response_timeout": str(2**62)}, "response_timeout"),
                          ({"maxBatchSize": "1e20"}, "maxBatchSize"),
                          ({"max_batch_size": "1e300"}, "max_batch_size")):
        query = {"url": "echo.mar", "model_name": "probe", **params}
        _refused(requests.post(models, params=query, timeout=30), named)
        _refused(requests.post(models, json=query, timeout=30), named)
    for path in ("/models", "/workflows"):
        for deep in (DEEP, DEEP_OBJECT, "[" * 50_000):
            message = _refused(requests.post(f"{server.management}{path}", data=deep,
                                             headers=JSON, timeout=30))
            assert "nested deeper than 100 levels" in message
    _healthy(server)


def test_a_registration_body_too_large_is_refused_before_it_is_read(
        server: RunningServer) -> None:
    """Its size is bounded by max_request_size from the Content-Length header: the body is
    never sent, the answer comes at once."""
    host, port = server.management.rsplit("/", 1)[-1].split(":")
    for path in ("/models", "/workflows"):
        with socket.create_connection((host, int(port)), timeout=10) as connection:
            connection.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: "
                               "application/json\r\nContent-Length: 1000000000\r\n\r\n"
                               .encode())
            answer = b""
            while b"}\n" not in answer:  # the error body's end (it may come in parts)
                chunk = connection.recv(65536)
                if not chunk:
                    break
                answer += chunk
        assert answer.startswith(b"HTTP/1.1 413 "), answer[:200]
        assert b"exceeds max_request_size" in answer
    _healthy(server)


def test_the_largest_values_in_range_register(server: RunningServer) -> None:
    """The ranges are what the values are stored in: their largest values work."""
    answer = requests.post(f"{server.management}/models", timeout=60, params={
        "url": "echo.mar", "model_name": "largest", "initial_workers": "0",
        "batch_size": str(INT32_MAX), "max_batch_delay": str(INT32_MAX),
        "response_timeout": str((2**32 - 1) // 1000), "startup_timeout": "4294967"})
    assert answer.status_code == 200, answer.text
    described = server.describe("largest")
    assert (described["batchSize"], described["responseTimeout"]) == (INT32_MAX, 4294967)
    assert requests.delete(f"{server.management}/models/largest", timeout=60).ok


@pytest.mark.parametrize(("parameter", "below"), [
    ("min_worker", "-1"), ("max_worker", "-1"), ("number_gpu", "-1"), ("timeout", "-2")])
def test_scale_parameters_out_of_range_are_400(server: RunningServer, parameter: str,
                                               below: str) -> None:
    before = server.describe("echo")
    session = requests.Session()
    for value in [*JUNK, below]:
        if value == "-2" and parameter != "timeout":
            continue
        answer = session.put(f"{server.management}/models/echo",
                             params={parameter: value, "min_worker": "1"}
                             if parameter != "min_worker" else {parameter: value}, timeout=30)
        _refused(answer, parameter)
    after = server.describe("echo")
    assert (after["minWorkers"], after["maxWorkers"], len(after["workers"])) == (
        before["minWorkers"], before["maxWorkers"], len(before["workers"]))
    _healthy(server)


def test_more_workers_than_the_host_allows_is_400_and_nothing_forks(
        server: RunningServer) -> None:
    """The issue's ``PUT /models/m?min_worker=100000`` (202, then 143 forks and a dead
    /ping), against the default caps."""
    caps = server.server.services.loader._placement.caps  # type: ignore[union-attr]
    assert caps is not None and caps.per_model >= 1
    before = len(server.describe("echo")["workers"])  # type: ignore[arg-type]
    for params in ({"min_worker": "100000"}, {"min_worker": "1", "max_worker": "100000"},
                   {"min_worker": str(caps.per_model + 1)}):
        _refused(requests.put(f"{server.management}/models/echo", params=params, timeout=30),
                 "max_workers_per_model")
    _refused(requests.post(f"{server.management}/models", timeout=30, params={
        "url": "echo.mar", "model_name": "many", "initial_workers": "100000"}),
        "max_workers_per_model")
    assert len(server.describe("echo")["workers"]) == before  # type: ignore[arg-type]
    assert "many" not in _registered(server)
    _healthy(server)


def test_list_and_describe_parameters(server: RunningServer) -> None:
    session = requests.Session()
    for path in ("/models", "/workflows"):
        for parameter in ("limit", "next_page_token"):
            for value in [*HUGE, "NaN", "inf", "abc", "1.5"]:
                _refused(session.get(f"{server.management}{path}",
                                     params={parameter: value}, timeout=30), parameter)
        # In range, TorchServe's reading: a limit outside 1..100 is 100.
        assert session.get(f"{server.management}{path}", params={"limit": "-5"},
                           timeout=30).status_code == 200
    _refused(session.get(f"{server.management}/models", params={"next_page_token": "-1"},
                         timeout=30), "next_page_token")
    _refused(session.get(f"{server.management}/models/echo", params={"customized": "1e300"},
                         timeout=30), "customized")
    for version in ("9" * 5000, "1e300", "-1"):
        answer = session.put(f"{server.management}/models/echo/{version}/set-default",
                             timeout=30)
        assert answer.status_code == 404, answer.text[:200]
    _healthy(server)


def test_workflow_registration_parameters(server: RunningServer) -> None:
    session = requests.Session()
    for parameter in ("response_timeout", "startup_timeout"):
        for value in [*JUNK, "-1"]:
            _refused(session.post(f"{server.management}/workflows",
                                  params={"url": "wf.war", parameter: value}, timeout=30),
                     parameter)
            _refused(session.post(f"{server.management}/workflows", timeout=30,
                                  json={"url": "wf.war", parameter: value}), parameter)
    assert session.get(f"{server.management}/workflows", timeout=30).json()["workflows"] == []
    _healthy(server)


# ---- the inference API --------------------------------------------------------------------

TENSOR = '{"inputs": [{"name": "a", "shape": [1], "datatype": "FP32", "data": [1]}]}'


def test_request_timeout_header_out_of_range_is_400(server: RunningServer) -> None:
    session = requests.Session()
    for value in ("NaN", "inf", "-inf", "1e400", "0", "-1", "abc"):
        for path, body in (("/predictions/echo", "{}"), ("/v2/models/tensors/infer", TENSOR),
                           ("/v1/models/echo:predict", '{"instances": [1]}')):
            answer = session.post(f"{server.inference}{path}", data=body, timeout=30,
                                  headers={"X-Request-Timeout": value})
            _refused(answer, "x-request-timeout")
    _healthy(server)


def test_deep_json_inference_bodies_are_400(server: RunningServer) -> None:
    """KServe's bodies are read by the frontend, a /predictions or SageMaker body by the
    worker that decodes it for the handler: either way 400 before anything recurses."""
    inference = server.inference
    tensor = TENSOR.replace("[1]}", DEEP + "}")
    bodies = {
        f"{inference}/v1/models/echo:predict": '{"instances": [' + DEEP + "]}",
        f"{inference}/v1/models/echo:explain": DEEP_OBJECT,
        f"{inference}/v2/models/tensors/infer": tensor,
        f"{inference}/v2/models/tensors/versions/1.0/infer": "[" * 50_000,
        f"{inference}/predictions/echo": DEEP,
        f"{inference}/predictions/tensors/1.0": DEEP_OBJECT,
        f"{inference}/explanations/echo": DEEP,
        f"{inference}/invocations?model_name=echo": DEEP,
        f"{inference}/models/echo/invoke": DEEP,
        f"{inference}/echo/predict": DEEP,
    }
    session = requests.Session()
    for url, body in bodies.items():
        message = _refused(session.post(url, data=body, headers=JSON, timeout=30))
        assert "nested deeper than 100 levels" in message, (url, message)
    # Just within the bound, a body is served as before.
    within = "[" * 99 + "]" * 99
    assert session.post(f"{inference}/predictions/echo", data=within, headers=JSON,
                        timeout=30).status_code == 200
    answer = session.post(f"{inference}/v1/models/echo:predict", headers=JSON, timeout=30,
                          data='{"instances": [' + "[" * 98 + "]" * 98 + "]}")
    assert answer.status_code == 200, answer.text[:200]
    _healthy(server)


def test_kserve_numbers_out_of_range_are_400(server: RunningServer) -> None:
    session = requests.Session()
    url = f"{server.inference}/v2/models/tensors/infer"
    for value in (*HUGE, "-1", "NaN", "abc"):
        _refused(session.post(url, data=TENSOR, timeout=30,
                              headers={"Inference-Header-Content-Length": value}),
                 "inference-header-content-length")
    for shape, named in (([2**62], "rows"), ([-1], "rows"), ([1, 2**62], "shape"),
                         ([1e300], "shape"), (["NaN"], "shape")):
        answer = session.post(url, timeout=30, data=json.dumps({"inputs": [
            {"name": "a", "shape": shape, "datatype": "FP32", "data": [1]}]}))
        _refused(answer, named)
    for value in (2**62, 1e300):
        answer = session.post(url, timeout=30, data=json.dumps({"inputs": [
            {"name": "a", "shape": [1], "datatype": "INT32", "data": [value]}]}))
        _refused(answer)
    _healthy(server)


# ---- gRPC ---------------------------------------------------------------------------------

def _invalid(call: object, *named: str) -> None:
    with pytest.raises(grpc.RpcError) as refused:
        call()  # type: ignore[operator]
    assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT, refused.value.details()
    for name in named:
        assert name in (refused.value.details() or ""), (name, refused.value.details())


def test_management_rpcs_out_of_range_are_invalid_argument(server: RunningServer) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_management_port}") as channel:
        stub = management_pb2_grpc.ManagementAPIsServiceStub(channel)
        register = management_pb2.RegisterModelRequest
        for field, value, named in (
                ("response_timeout", INT32_MAX, "response_timeout"),
                ("startup_timeout", INT32_MAX, "startup_timeout"),
                ("response_timeout", -1, "response_timeout"),
                ("batch_size", -(2**31), "batch_size"),
                ("max_batch_delay", -1, "max_batch_delay"),
                ("initial_workers", -1, "initial_workers"),
                ("initial_workers", INT32_MAX, "max_workers_per_model")):
            _invalid(lambda field=field, value=value: stub.RegisterModel(register(
                url="echo.mar", model_name="grpc_junk", **{field: value}), timeout=30), named)
        scale = management_pb2.ScaleWorkerRequest
        for fields, named in (({"min_worker": INT32_MAX}, "max_workers_per_model"),
                              ({"min_worker": 1, "max_worker": INT32_MAX},
                               "max_workers_per_model"),
                              ({"min_worker": -1}, "min_worker"),
                              ({"min_worker": 1, "number_gpu": -1}, "number_gpu"),
                              ({"min_worker": 1, "timeout": -2}, "timeout")):
            _invalid(lambda fields=fields: stub.ScaleWorker(scale(model_name="echo", **fields),
                                                           timeout=30), named)
        _invalid(lambda: stub.ListModels(management_pb2.ListModelsRequest(next_page_token=-1),
                                         timeout=30), "next_page_token")
        listed = stub.ListModels(management_pb2.ListModelsRequest(limit=-(2**31)), timeout=30)
        assert "echo" in listed.msg
    assert "grpc_junk" not in _registered(server)
    assert len(server.describe("echo")["workers"]) == 1  # type: ignore[arg-type]
    _healthy(server)


def test_inference_rpcs_out_of_range_are_invalid_argument(server: RunningServer) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_inference_port}") as channel:
        stub = inference_pb2_grpc.InferenceAPIsServiceStub(channel)
        request = inference_pb2.PredictionsRequest(model_name="echo", input={"body": b"x"})
        for value in ("nan", "inf", "-1", "1e400"):
            _invalid(lambda value=value: stub.Predictions(
                request, metadata=(("x-request-timeout", value),), timeout=30),
                "x-request-timeout")
        oip = open_inference_pb2_grpc.GRPCInferenceServiceStub(channel)
        for shape in ([2**62], [-1], [0]):
            infer = open_inference_pb2.ModelInferRequest(model_name="tensors")
            tensor = infer.inputs.add(name="a", datatype="FP32", shape=shape)
            tensor.contents.fp32_contents.append(1.0)
            _invalid(lambda infer=infer: oip.ModelInfer(infer, timeout=30), "rows")
    _healthy(server)
