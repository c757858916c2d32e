"""TorchServe's gRPC services (grpc.aio, in the frontend's event loop).

``org.pytorch.serve.grpc.inference.InferenceAPIsService`` on ``grpc_inference_port`` and
``org.pytorch.serve.grpc.management.ManagementAPIsService`` on ``grpc_management_port``, so
TorchServe's own stubs work unchanged; KServe's ``inference.GRPCInferenceService`` (Open
Inference Protocol) shares the inference port. Predictions go through the same queues and batches as
HTTP requests; management RPCs run the same operations as REST and answer the same JSON.
Health checking and reflection are on, for grpcurl and Kubernetes gRPC probes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeAlias, TypeVar

import grpc
from google.protobuf import message_factory
from google.protobuf.descriptor import ServiceDescriptor
from google.rpc import status_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from frontend import __version__
from frontend.api import grpc_wire
from frontend.errors import InternalError, ServeError, WorkerError, grpc_code, type_for_status
from frontend.ops import kserve
from frontend.ops.auth import KeyKind
from frontend.ops.management import ManagementOps
from frontend.ops.plane import Answer, Call, Origin, ResponseStream
from frontend.ops.services import Services
from protos import (
    inference_pb2,
    inference_pb2_grpc,
    management_pb2,
    management_pb2_grpc,
    open_inference_pb2,
    open_inference_pb2_grpc,
    worker_pb2,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")
#: A servicer's RPC context (generic in the stubs only).
Context: TypeAlias = "grpc.aio.ServicerContext[Any, Any]"

async def _answer(context: Context, call: Awaitable[T]) -> T:
    """Run an RPC body; map our errors to a gRPC status with the REST message text."""
    try:
        return await call
    except ServeError as error:
        await context.abort(grpc_code(error.http_status), error.message)
    raise AssertionError("unreachable: abort raises")


def _metadata_headers(context: Context) -> list[tuple[bytes, bytes]]:
    return [(key.lower().encode("latin-1"), value.encode("latin-1"))
            for key, value in (context.invocation_metadata() or ())
            if isinstance(value, str)]


@dataclass(frozen=True, slots=True)
class _Rpc:
    """What the requests of one RPC need of it, read once while the RPC is live.

    NOTE: nothing may touch a gRPC context after its RPC has ended: grpc's C core does not
    survive ``context.peer()`` on a finished call (a client that left a StreamPredictions2
    stream early took the whole frontend down with SIGSEGV). Per-request work, which may
    outlive the RPC, reads this snapshot instead.
    """

    peer: str
    headers: list[tuple[bytes, bytes]]
    #: time.monotonic() of the client's deadline (None: it set none).
    deadline: float | None

    @classmethod
    def of(cls, context: Context) -> _Rpc:
        remaining = context.time_remaining()
        return cls(context.peer(), _metadata_headers(context),
                   None if remaining is None else time.monotonic() + remaining)

    def time_remaining(self) -> float | None:
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    def origin(self, path: str) -> Origin:
        return Origin(self.peer, "gRPC", path, "HTTP/2.0", count_status=True)


def _body_of(response: worker_pb2.Response) -> bytes:
    """The body of a worker's answer, or its per-request error raised as a ServeError."""
    if response.error:
        status = response.status or 500
        raise WorkerError(status, type_for_status(status), response.error)
    return response.body

#: The generated registration function, typed (grpcio-tools writes it without annotations).
_add_management: Callable[[management_pb2_grpc.ManagementAPIsServiceServicer, grpc.aio.Server],
                          None] = \
    management_pb2_grpc.add_ManagementAPIsServiceServicer_to_server

class _InferenceRpcs:
    """What both inference services share: the plane, token checks, the limits."""

    def __init__(self, services: Services) -> None:
        self.registry = services.registry
        self.plane = services.plane
        self.auth = services.auth
        self.max_inputs = services.config.max_request_inputs
        self.max_rows = services.config.max_request_instances

    def _check(self, headers: list[tuple[bytes, bytes]]) -> None:
        if self.auth is not None:
            self.auth.check(KeyKind.INFERENCE, headers)


class InferenceServicer(_InferenceRpcs, inference_pb2_grpc.InferenceAPIsServiceServicer):
    async def Ping(self, request: Any, context: Context) -> Any:
        healthy = all(model.is_healthy() for model in self.registry)
        status = json.dumps({"status": "Healthy" if healthy else "Unhealthy"}, indent=2)
        return inference_pb2.TorchServeHealthResponse(health=status)

    def _parsed(self, raw: bytes) -> Any:
        """The PredictionsRequest in ``raw``, or the error that refuses it."""
        try:
            return grpc_wire.predictions_request(raw, self.max_inputs)
        except ServeError as error:
            return error

    async def _start(self, request: Any, rpc: _Rpc, call: Call) -> Answer:
        """Run one parsed request (or raise the error that refused it) through the plane."""
        if isinstance(request, ServeError):
            raise request
        call.origin = rpc.origin(f"/{request.model_name}")
        return await self.plane.predict(
            call, request.model_name, request.model_version or None, rpc.headers,
            [(name, data, None) for name, data in request.input.items()],
            deadline_s=rpc.time_remaining(),
            sequence_id=request.sequence_id if request.HasField("sequence_id") else None)

    async def _predict_whole(self, request: Any, rpc: _Rpc) -> tuple[bytes, str | None]:
        """One request's whole answer (its parts joined), and its sequence when its model is
        stateful (the id the server made, when the request named none)."""
        async with self.plane.call(rpc.origin("/-")) as call:
            result = await self._start(request, rpc, call)
            if isinstance(result, ResponseStream):
                body = b"".join([_body_of(part) async for part in result])
            else:
                body = _body_of(result)
            call.status = 200
            return body, call.sequence_id

    async def Predictions(self, raw: bytes, context: Context) -> Any:
        rpc = _Rpc.of(context)

        async def run() -> Any:
            self._check(rpc.headers)
            body, sequence_id = await self._predict_whole(self._parsed(raw), rpc)
            answer = inference_pb2.PredictionResponse(prediction=body)
            if sequence_id is not None:
                answer.sequence_id = sequence_id
            return answer

        return await _answer(context, run())

    async def StreamPredictions(self, raw: bytes, context: Context
                                ) -> AsyncIterator[Any]:
        rpc = _Rpc.of(context)
        async with self.plane.call(rpc.origin("/-")) as call:
            async def start() -> list[worker_pb2.Response] | ResponseStream:
                try:
                    self._check(rpc.headers)
                    result = await self._start(self._parsed(raw), rpc, call)
                except ServeError as error:
                    # Recorded here: _answer turns it into grpc's abort, which the plane's
                    # call does not see as a ServeError (it would record a 500).
                    call.fail(error)
                    raise
                return result if isinstance(result, ResponseStream) else [result]

            parts = await _answer(context, start())
            try:
                async for part in _iterate(parts):
                    yield inference_pb2.PredictionResponse(prediction=_body_of(part))
                call.status = 200
            except ServeError as error:
                call.fail(error)
                await context.abort(grpc_code(error.http_status), error.message)

    async def StreamPredictions2(self, request_iterator: AsyncIterator[bytes],
                                 context: Context
                                 ) -> AsyncIterator[Any]:
        """One bidirectional stream for many requests: answered in order, each carrying its
        sequence_id; a failed request answers with its ``status`` and the stream goes on.

        When the RPC ends early (the client cancels or goes away) every request of the stream
        still waiting is cancelled: a queued one leaves the queue undispatched, one in a
        worker has its answer dropped.
        """
        rpc = _Rpc.of(context)
        await _answer(context, _async(lambda: self._check(rpc.headers)))
        pending: asyncio.Queue[tuple[Any, asyncio.Task[tuple[bytes, str | None]]] | None] = \
            asyncio.Queue()
        running: set[asyncio.Task[tuple[bytes, str | None]]] = set()

        def finished(task: asyncio.Task[tuple[bytes, str | None]]) -> None:
            running.discard(task)
            if not task.cancelled():
                task.exception()  # retrieved: the stream may have ended before its answer

        async def read() -> None:
            try:
                async for raw in request_iterator:
                    request = self._parsed(raw)
                    task = asyncio.ensure_future(self._predict_whole(request, rpc))
                    running.add(task)
                    task.add_done_callback(finished)
                    await pending.put((request, task))
            finally:
                await pending.put(None)

        reader = asyncio.ensure_future(read())
        try:
            while (item := await pending.get()) is not None:
                request, task = item
                answer = inference_pb2.PredictionResponse()
                if not isinstance(request, ServeError) and request.HasField("sequence_id"):
                    answer.sequence_id = request.sequence_id
                try:
                    answer.prediction, sequence_id = await task
                    if sequence_id is not None:
                        answer.sequence_id = sequence_id
                except ServeError as error:
                    answer.status.CopyFrom(_rpc_status(error.http_status, error.message))
                yield answer
        finally:
            reader.cancel()
            for task in list(running):
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader


class OpenInferenceServicer(_InferenceRpcs, open_inference_pb2_grpc.GRPCInferenceServiceServicer):
    """KServe's ``inference.GRPCInferenceService`` (Open Inference Protocol, v2).

    ModelInfer batches by the rows of the tensors' first dimension, with the REST requests of
    the same model; the worker decodes the request and encodes the response (raw contents
    when the request came raw).
    """

    async def ServerLive(self, request: Any, context: Context) -> Any:
        return open_inference_pb2.ServerLiveResponse(live=True)

    async def ServerReady(self, request: Any, context: Context) -> Any:
        return open_inference_pb2.ServerReadyResponse(
            ready=kserve.is_server_ready(self.registry))

    async def ModelReady(self, request: Any, context: Context) -> Any:
        async def run() -> Any:
            self._check(_metadata_headers(context))
            model = self.registry.get(request.name, request.version or None)
            return open_inference_pb2.ModelReadyResponse(ready=model.is_ready())

        return await _answer(context, run())

    async def ServerMetadata(self, request: Any, context: Context) -> Any:
        async def run() -> Any:
            self._check(_metadata_headers(context))
            return open_inference_pb2.ServerMetadataResponse(
                **kserve.server_metadata(__version__))

        return await _answer(context, run())

    async def ModelMetadata(self, request: Any, context: Context) -> Any:
        async def run() -> Any:
            self._check(_metadata_headers(context))
            model = self.registry.get(request.name, request.version or None)
            versions = [m.version for m in self.registry.versions(request.name)]
            return open_inference_pb2.ModelMetadataResponse(
                **kserve.model_metadata(model, versions))

        return await _answer(context, run())

    async def ModelInfer(self, raw: bytes, context: Context) -> Any:
        """Never decoded here: the worker gets the request's bytes as they came."""
        rpc = _Rpc.of(context)

        async def run() -> Any:
            async with self.plane.call(rpc.origin("/v2/models/-/infer")) as call:
                self._check(rpc.headers)
                head = grpc_wire.infer_request_head(raw, self.max_inputs)
                call.origin = rpc.origin(f"/v2/models/{head.model_name}/infer")
                result = await self.plane.predict(
                    call, head.model_name, head.model_version or None, rpc.headers,
                    [("body", raw, None)], deadline_s=rpc.time_remaining(),
                    weight=kserve.v2_grpc_rows(head.shapes, self.max_rows),
                    tensor_format=worker_pb2.TENSOR_FORMAT_GRPC)
                if isinstance(result, ResponseStream):
                    raise InternalError("the handler sent intermediate responses, which "
                                        "ModelInfer cannot carry")
                answer = open_inference_pb2.ModelInferResponse.FromString(_body_of(result))
                call.status = 200
                return answer

        return await _answer(context, run())


async def _async(function: Callable[[], None]) -> None:
    function()


async def _iterate(parts: list[worker_pb2.Response] | ResponseStream
                   ) -> AsyncIterator[worker_pb2.Response]:
    if isinstance(parts, ResponseStream):
        async for part in parts:
            yield part
    else:
        for part in parts:
            yield part


def _rpc_status(http_status: int, message: str) -> status_pb2.Status:
    return status_pb2.Status(code=grpc_code(http_status).value[0], message=message)


def _pretty(body: object) -> str:
    return json.dumps(body, indent=2)


def _set_numbers(request: Any, *names: str) -> dict[str, str]:
    """The ``optional`` number fields the client set (0 included), as REST parameters."""
    return {name: str(getattr(request, name)) for name in names if request.HasField(name)}


def _params(**values: object) -> dict[str, str]:
    """gRPC fields as REST query parameters; proto3's zero values mean "not given"."""
    params: dict[str, str] = {}
    for name, value in values.items():
        if isinstance(value, bool):
            params[name] = "true" if value else "false"
        elif value not in (0, "", None):
            params[name] = str(value)
    return params


class ManagementServicer(management_pb2_grpc.ManagementAPIsServiceServicer):
    def __init__(self, services: Services) -> None:
        self.auth = services.auth
        self.ops = ManagementOps(services)

    async def _run(self, context: Context,
                   operation: Callable[[], Awaitable[object]]) -> Any:
        async def run() -> Any:
            if self.auth is not None:
                self.auth.check(KeyKind.MANAGEMENT, _metadata_headers(context))
            body = await operation()
            return management_pb2.ManagementResponse(msg=_pretty(body))

        return await _answer(context, run())

    async def DescribeModel(self, request: Any, context: Context) -> Any:
        return await self._run(context, lambda: self.ops.describe(
            request.model_name, request.model_version or None, request.customized))

    async def ListModels(self, request: Any, context: Context) -> Any:
        params = _params(limit=request.limit, next_page_token=request.next_page_token)
        return await self._run(context, lambda: _async_value(self.ops.list_models(params)))

    async def RegisterModel(self, request: Any, context: Context) -> Any:
        params = {**_params(url=request.url, model_name=request.model_name,
                            handler=request.handler, runtime=request.runtime,
                            synchronous=request.synchronous),
                  **_set_numbers(request, "batch_size", "max_batch_delay", "initial_workers",
                                 "response_timeout", "startup_timeout")}

        async def register() -> object:
            _, body = await self.ops.register(params)
            return body

        return await self._run(context, register)

    async def ScaleWorker(self, request: Any, context: Context) -> Any:
        # NOTE: an unset timeout means "wait for the batch in flight" (-1); only a timeout
        # of 0 the client set kills busy workers at once.
        params = {**_params(synchronous=request.synchronous),
                  **_set_numbers(request, "min_worker", "max_worker", "number_gpu", "timeout")}

        async def scale() -> object:
            _, body = await self.ops.scale(request.model_name, request.model_version or None,
                                           params)
            return body

        return await self._run(context, scale)

    async def SetDefault(self, request: Any, context: Context) -> Any:
        return await self._run(context, lambda: _async_value(
            self.ops.set_default(request.model_name, request.model_version)))

    async def UnregisterModel(self, request: Any, context: Context) -> Any:
        return await self._run(context, lambda: self.ops.unregister(
            request.model_name, request.model_version or None))


async def _async_value(value: T) -> T:
    return value


#: Prediction RPCs get their request's bytes: they are read within bounds (grpc_wire), never
#: decoded whole in the event loop by grpc first.
RAW_REQUEST_METHODS = frozenset({"Predictions", "StreamPredictions", "StreamPredictions2",
                                 "ModelInfer"})
_HANDLER_KINDS = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def service_handler(service: ServiceDescriptor, servicer: object,
                    raw_requests: frozenset[str]) -> grpc.GenericRpcHandler:
    """What the generated ``add_*_to_server`` registers, from the service's descriptor, except
    that the methods named in ``raw_requests`` receive their requests undecoded (bytes)."""
    handlers = {}
    for method in service.methods:
        kind = _HANDLER_KINDS[(method.client_streaming, method.server_streaming)]
        request = message_factory.GetMessageClass(method.input_type)
        response = message_factory.GetMessageClass(method.output_type)
        handlers[method.name] = kind(
            getattr(servicer, method.name),
            request_deserializer=None if method.name in raw_requests else request.FromString,
            response_serializer=response.SerializeToString)
    return grpc.method_handlers_generic_handler(service.full_name, handlers)


_INFERENCE = inference_pb2.DESCRIPTOR.services_by_name["InferenceAPIsService"]
_OPEN_INFERENCE = open_inference_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"]
INFERENCE_SERVICE = _INFERENCE.full_name
OPEN_INFERENCE_SERVICE = _OPEN_INFERENCE.full_name
MANAGEMENT_SERVICE = (
    management_pb2.DESCRIPTOR.services_by_name["ManagementAPIsService"].full_name)


class GrpcServers:
    """The gRPC listeners (inference, management; KServe's too under KServe): bound at
    start, stopped with a grace period."""

    def __init__(self, services: Services) -> None:
        self.services = services
        self._servers: list[grpc.aio.Server] = []
        self.ports: dict[str, int] = {}

    async def start(self) -> None:
        config = self.services.config
        def open_inference() -> grpc.GenericRpcHandler:
            return service_handler(_OPEN_INFERENCE, OpenInferenceServicer(self.services),
                                   RAW_REQUEST_METHODS)

        def add_inference(server: grpc.aio.Server) -> None:
            server.add_generic_rpc_handlers((
                service_handler(_INFERENCE, InferenceServicer(self.services),
                                RAW_REQUEST_METHODS),
                open_inference()))

        plan = [
            ("inference", config.grpc_inference_address, config.grpc_inference_port,
             (INFERENCE_SERVICE, OPEN_INFERENCE_SERVICE), add_inference),
            ("management", config.grpc_management_address, config.grpc_management_port,
             (MANAGEMENT_SERVICE,), lambda server: _add_management(
                 ManagementServicer(self.services), server)),
        ]
        if config.kserve_protocol and (config.kserve_grpc_port != config.grpc_inference_port
                                       or not config.kserve_grpc_port):
            # Where KServe sends gRPC (8081, its h2c port), on the inference address's host,
            # as TorchServe's wrapper served it: the Open Inference service alone.
            plan.append((
                "kserve", config.inference_address.host, config.kserve_grpc_port,
                (OPEN_INFERENCE_SERVICE,),
                lambda server: server.add_generic_rpc_handlers((open_inference(),))))
        for name, host, port, service_names, add in plan:
            server = grpc.aio.server(options=[
                ("grpc.max_receive_message_length", config.max_request_size_bytes),
                ("grpc.max_send_message_length", config.max_response_size_bytes),
                ("grpc.so_reuseport", 0),
            ])
            add(server)
            health_servicer = health.aio.HealthServicer()
            health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
            reflection.enable_server_reflection(
                (*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
            target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
            try:
                bound = server.add_insecure_port(target)
            except RuntimeError as exc:
                raise OSError(f"cannot bind gRPC {name} port {target}: {exc}") from None
            if bound == 0:
                raise OSError(f"cannot bind gRPC {name} port {target}")
            await server.start()
            for service in ("", *service_names):
                await health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
            self._servers.append(server)
            self.ports[name] = bound

    async def stop(self, grace_s: float) -> None:
        await asyncio.gather(*(server.stop(grace_s) for server in self._servers))
        self._servers.clear()
