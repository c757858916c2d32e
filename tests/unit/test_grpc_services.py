"""The gRPC servicers (frontend/api/grpc/) without a gRPC server: their pure pieces,
and RPCs called with a stand-in context on a server's real services (no worker, no port).
The servers themselves run in tests/integration/test_grpc*.py."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest

from frontend import __version__
from frontend.api.grpc import servers
from frontend.api.grpc.common import Rpc, answer, body_of, rpc_status, torchserve_peer
from frontend.api.grpc.inference import InferenceServicer
from frontend.api.grpc.management import ManagementServicer, _params
from frontend.api.grpc.open_inference import OpenInferenceServicer
from frontend.api.grpc.servers import RAW_REQUEST_METHODS, service_handler
from frontend.errors import GatewayTimeout, ModelNotFound, WorkerError
from frontend.models.loader import RegisterRequest
from frontend.ops.services import Services
from protos import inference_pb2, management_pb2, open_inference_pb2, worker_pb2
from tests.unit.services import run_with_services


class Aborted(Exception):
    """What grpc.aio's ``context.abort`` raises to end the RPC."""


class Context:
    """The parts of ``grpc.aio.ServicerContext`` the servicers use."""

    def __init__(self, metadata: Sequence[tuple[str, str | bytes]] = (),
                 peer: str = "ipv4:127.0.0.1:50000", remaining: float | None = None) -> None:
        self.metadata = tuple(metadata)
        self._peer = peer
        self.remaining = remaining
        self.aborted: tuple[grpc.StatusCode, str] | None = None

    def invocation_metadata(self) -> tuple[tuple[str, str | bytes], ...]:
        return self.metadata

    def peer(self) -> str:
        return self._peer

    def time_remaining(self) -> float | None:
        return self.remaining

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.aborted = (code, details)
        raise Aborted(code, details)


# ---- pure pieces -----------------------------------------------------------------------------


def test_rpc_snapshot_reads_the_context_once() -> None:
    context = Context([("Authorization", "Bearer k"), ("trace-bin", b"\x00\x01"),
                       ("X-Request-Timeout", "3")], remaining=10.0)
    rpc = Rpc.of(context, "org.pytorch.serve.grpc.inference.InferenceAPIsService/Predictions")
    assert rpc.peer == "/127.0.0.1:50000"  # as TorchServe's access log writes a client
    # Header names in lower case, as HTTP's; binary metadata is no header.
    assert rpc.headers == [(b"authorization", b"Bearer k"), (b"x-request-timeout", b"3")]
    context._peer, context.remaining = "gone", None  # the RPC ended: never read again
    remaining = rpc.time_remaining()
    assert remaining is not None and 9.0 < remaining <= 10.0
    origin = rpc.origin("/echo")
    assert (origin.peer, origin.method, origin.path, origin.protocol, origin.count_status) == \
        ("/127.0.0.1:50000", "gRPC", "/echo", "HTTP/2.0", True)
    # The access log names the RPC as TorchServe's does: its service and method.
    assert origin.uri == "org.pytorch.serve.grpc.inference.InferenceAPIsService/Predictions"


def test_a_grpc_peer_is_written_as_torchserve_writes_a_client() -> None:
    assert torchserve_peer("ipv4:10.0.0.7:41696") == "/10.0.0.7:41696"
    assert torchserve_peer("ipv6:%5B::1%5D:41696") == "/[::1]:41696"
    assert torchserve_peer("ipv6:[::1]:41696") == "/[::1]:41696"
    assert torchserve_peer("unix:/tmp/s.sock") == "unix:/tmp/s.sock"


def test_rpc_without_a_deadline_has_no_time_limit() -> None:
    rpc = Rpc.of(Context(), "s/M")
    assert rpc.deadline is None and rpc.time_remaining() is None


def test_rpc_time_remaining_never_goes_negative() -> None:
    rpc = Rpc.of(Context(remaining=0.0), "s/M")
    time.sleep(0.01)
    assert rpc.time_remaining() == 0.0


def test_a_worker_answer_is_its_body() -> None:
    assert body_of(worker_pb2.Response(status=200, body=b"ok")) == b"ok"
    assert body_of(worker_pb2.Response(body=b"")) == b""


@pytest.mark.parametrize(("status", "http_status", "type_name"), [
    (0, 500, "InternalServerException"),
    (400, 400, "InvalidInputException"),
    (418, 418, "BadRequestException"),
    (507, 507, "OutOfResourcesException"),
])
def test_a_worker_error_is_raised_with_its_status(status: int, http_status: int,
                                                  type_name: str) -> None:
    with pytest.raises(WorkerError, match=r"^boom$") as raised:
        body_of(worker_pb2.Response(status=status, error="boom", body=b"ignored"))
    assert (raised.value.http_status, raised.value.type_name) == (http_status, type_name)


def test_proto3_zero_values_are_absent_parameters() -> None:
    assert _params(url="a.mar", model_name="", batch_size=0, max_batch_delay=None,
                   initial_workers=3, synchronous=False, customized=True) == {
        "url": "a.mar", "initial_workers": "3", "synchronous": "false", "customized": "true"}


@pytest.mark.parametrize(("http_status", "code"), [
    (400, grpc.StatusCode.INVALID_ARGUMENT),
    (404, grpc.StatusCode.NOT_FOUND),
    (405, grpc.StatusCode.PERMISSION_DENIED),
    (503, grpc.StatusCode.UNAVAILABLE),
    (504, grpc.StatusCode.DEADLINE_EXCEEDED),
    (500, grpc.StatusCode.INTERNAL),
    (502, grpc.StatusCode.INTERNAL),
])
def test_stream_status_carries_the_grpc_code_of_the_http_status(http_status: int,
                                                                code: grpc.StatusCode) -> None:
    status = rpc_status(http_status, "why")
    assert (status.code, status.message) == (code.value[0], "why")


def test_answer_aborts_with_the_rest_message_text() -> None:
    async def refused() -> None:
        raise ModelNotFound("Model not found: ghost")

    async def timed_out() -> None:
        raise GatewayTimeout("no answer within 2 s")

    async def fine() -> str:
        return "ok"

    async def run() -> None:
        for body, code, text in ((refused, grpc.StatusCode.NOT_FOUND, "Model not found: ghost"),
                                 (timed_out, grpc.StatusCode.DEADLINE_EXCEEDED,
                                  "no answer within 2 s")):
            context = Context()
            with pytest.raises(Aborted):
                await answer(context, body())  # type: ignore[arg-type]
            assert context.aborted == (code, text)
        context = Context()
        assert await answer(context, fine()) == "ok"  # type: ignore[arg-type]
        assert context.aborted is None

    asyncio.run(run())


def test_an_error_that_is_not_a_serve_error_is_not_turned_into_a_status() -> None:
    async def broken() -> None:
        raise KeyError("bug")

    async def run() -> None:
        context = Context()
        with pytest.raises(KeyError):
            await answer(context, broken())  # type: ignore[arg-type]
        assert context.aborted is None  # grpc answers UNKNOWN and logs it

    asyncio.run(run())


class _Details(grpc.HandlerCallDetails):
    def __init__(self, method: str) -> None:
        self.method = method
        self.invocation_metadata = ()


@pytest.mark.parametrize(("descriptor", "servicer"), [
    (inference_pb2.DESCRIPTOR.services_by_name["InferenceAPIsService"], InferenceServicer),
    (open_inference_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"],
     OpenInferenceServicer),
])
def test_prediction_methods_receive_their_request_undecoded(descriptor: Any,
                                                             servicer: type) -> None:
    instance = servicer.__new__(servicer)  # the handler table only looks its methods up
    handler = service_handler(descriptor, instance, RAW_REQUEST_METHODS)
    for method in descriptor.methods:
        rpc = handler.service(_Details(f"/{descriptor.full_name}/{method.name}"))
        assert rpc is not None, method.name
        raw = method.name in RAW_REQUEST_METHODS
        assert (rpc.request_deserializer is None) is raw, method.name
        assert (rpc.request_streaming, rpc.response_streaming) == \
            (method.client_streaming, method.server_streaming), method.name
        assert rpc.response_serializer is not None
    assert handler.service(_Details(f"/{descriptor.full_name}/Nope")) is None


def test_the_raw_methods_are_methods_of_the_services() -> None:
    names = {method.name
             for service in (inference_pb2.DESCRIPTOR.services_by_name["InferenceAPIsService"],
                             open_inference_pb2.DESCRIPTOR.services_by_name[
                                 "GRPCInferenceService"])
             for method in service.methods}
    assert names >= RAW_REQUEST_METHODS


# ---- RPCs on real services -------------------------------------------------------------------


def _with_services(tmp_path: Path, model_store: Path | None,
                   test: Callable[[Services], Awaitable[None]], **overrides: object) -> None:
    run_with_services(tmp_path, model_store, test, **overrides)


def test_inference_ping_and_open_inference_server_rpcs(tmp_path: Path) -> None:
    async def test(services: Services) -> None:
        ping = await InferenceServicer(services).Ping(None, Context())
        assert json.loads(ping.health) == {"status": "Healthy"}
        oip = OpenInferenceServicer(services)
        assert (await oip.ServerLive(None, Context())).live is True
        assert (await oip.ServerReady(None, Context())).ready is True
        metadata = await oip.ServerMetadata(None, Context())
        assert (metadata.name, metadata.version, list(metadata.extensions)) == \
            ("batchserve", __version__, ["binary_tensor_data", "parameters"])
        context = Context()
        request = open_inference_pb2.ModelReadyRequest(name="ghost")
        with pytest.raises(Aborted):
            await oip.ModelReady(request, context)
        assert context.aborted == (grpc.StatusCode.NOT_FOUND, "Model not found: ghost")

    _with_services(tmp_path, None, test)


def test_predictions_refuse_a_bad_request_before_the_plane(tmp_path: Path) -> None:
    async def test(services: Services) -> None:
        context = Context()
        with pytest.raises(Aborted):
            await InferenceServicer(services).Predictions(b"\xff\xff\xff", context)
        assert context.aborted is not None
        assert context.aborted[0] is grpc.StatusCode.INVALID_ARGUMENT
        context = Context()
        request = inference_pb2.PredictionsRequest(model_name="ghost").SerializeToString()
        with pytest.raises(Aborted):
            await InferenceServicer(services).Predictions(request, context)
        assert context.aborted == (grpc.StatusCode.NOT_FOUND, "Model not found: ghost")

    _with_services(tmp_path, None, test)


def test_management_rpcs_answer_the_rest_json(build_mar, model_store: Path,
                                              tmp_path: Path) -> None:
    # proto3 cannot send initial_workers=0 (it is "not given": the server's default), so the
    # archive's model-config.yaml asks for no worker.
    config = tmp_path / "model-config.yaml"
    config.write_text("minWorkers: 0\n")
    build_mar("echo", "echo", config_file=config)

    async def test(services: Services) -> None:
        servicer = ManagementServicer(services)
        listed = await servicer.ListModels(management_pb2.ListModelsRequest(), Context())
        assert json.loads(listed.msg) == {"models": []}
        registered = await servicer.RegisterModel(
            management_pb2.RegisterModelRequest(url="echo.mar", batch_size=3), Context())
        assert json.loads(registered.msg)["status"].startswith(
            'Model "echo" Version: 1.0 registered with 0 initial workers')
        described = await servicer.DescribeModel(
            management_pb2.DescribeModelRequest(model_name="echo"), Context())
        assert json.loads(described.msg)[0]["batchSize"] == 3
        made_default = await servicer.SetDefault(
            management_pb2.SetDefaultRequest(model_name="echo", model_version="1.0"), Context())
        assert json.loads(made_default.msg) == {
            "status": 'Default version successfully updated for model "echo" to "1.0"'}
        unregistered = await servicer.UnregisterModel(
            management_pb2.UnregisterModelRequest(model_name="echo"), Context())
        assert json.loads(unregistered.msg) == {"status": 'Model "echo" unregistered'}

    _with_services(tmp_path, model_store, test)


@pytest.mark.parametrize(("rpc", "message_in", "code", "message"), [
    ("DescribeModel", management_pb2.DescribeModelRequest(model_name="ghost"),
     grpc.StatusCode.NOT_FOUND, "Model not found: ghost"),
    ("RegisterModel", management_pb2.RegisterModelRequest(),
     grpc.StatusCode.INVALID_ARGUMENT, "Parameter url is required."),
    ("ScaleWorker", management_pb2.ScaleWorkerRequest(model_name="ghost"),
     grpc.StatusCode.NOT_FOUND, "Model not found: ghost"),

    ("SetDefault", management_pb2.SetDefaultRequest(model_name="ghost", model_version="1"),
     grpc.StatusCode.NOT_FOUND, "Model not found: ghost"),
    ("ListModels", management_pb2.ListModelsRequest(next_page_token=-1),
     grpc.StatusCode.INVALID_ARGUMENT,
     "parameter next_page_token must be an integer in [0, 2147483647], got -1"),
])
def test_management_rpc_errors_are_grpc_statuses(tmp_path: Path, rpc: str, message_in: Any,
                                                 code: grpc.StatusCode, message: str) -> None:
    async def test(services: Services) -> None:
        context = Context()
        with pytest.raises(Aborted):
            await getattr(ManagementServicer(services), rpc)(message_in, context)
        assert context.aborted == (code, message)

    _with_services(tmp_path, None, test)


def test_scale_worker_refusals_are_invalid_argument(build_mar, model_store: Path,
                                                    tmp_path: Path) -> None:
    build_mar("echo", "echo")

    async def test(services: Services) -> None:
        await services.loader.register(RegisterRequest(url="echo.mar",
                                                       settings={"min_workers": 0}))
        for request, message in (
                (management_pb2.ScaleWorkerRequest(model_name="echo", min_worker=3,
                                                   max_worker=2),
                 "max_worker cannot be less than min_worker."),
                (management_pb2.ScaleWorkerRequest(model_name="echo", min_worker=1,
                                                   number_gpu=-2),
                 "parameter number_gpu must be an integer in [0, 2147483647], got -2")):
            context = Context()
            with pytest.raises(Aborted):
                await ManagementServicer(services).ScaleWorker(request, context)
            assert context.aborted == (grpc.StatusCode.INVALID_ARGUMENT, message)
        assert services.registry.get("echo").settings.min_workers == 0

    _with_services(tmp_path, model_store, test)


def test_model_api_disabled_is_permission_denied_as_torchserve(tmp_path: Path) -> None:
    async def test(services: Services) -> None:
        context = Context()
        with pytest.raises(Aborted):
            await ManagementServicer(services).UnregisterModel(
                management_pb2.UnregisterModelRequest(model_name="echo"), context)
        assert context.aborted is not None
        assert context.aborted[0] is grpc.StatusCode.PERMISSION_DENIED
        assert "--enable-model-api" in context.aborted[1]

    _with_services(tmp_path, None, test, enable_model_api=False)


def test_services_have_torchserve_and_kserve_names() -> None:
    """TorchServe's and KServe's own stubs call these names."""
    assert servers.INFERENCE_SERVICE == \
        "org.pytorch.serve.grpc.inference.InferenceAPIsService"
    assert servers.MANAGEMENT_SERVICE == \
        "org.pytorch.serve.grpc.management.ManagementAPIsService"
    assert servers.OPEN_INFERENCE_SERVICE == "inference.GRPCInferenceService"
