"""KServe's ``inference.GRPCInferenceService`` (the Open Inference Protocol, v2), on the
inference port and, under KServe, on its own."""

from __future__ import annotations

from typing import Any

from frontend import __version__
from frontend.api.grpc import wire
from frontend.api.grpc.common import (
    Context,
    PredictionServicer,
    body_of,
    send_timing,
    unary,
)
from frontend.errors import InternalError
from frontend.ops import kserve
from frontend.ops.auth import KeyKind
from frontend.ops.plane import ResponseStream
from protos import open_inference_pb2, open_inference_pb2_grpc, worker_pb2


class OpenInferenceServicer(PredictionServicer,
                            open_inference_pb2_grpc.GRPCInferenceServiceServicer):
    """KServe's ``inference.GRPCInferenceService`` (Open Inference Protocol, v2).

    ModelInfer batches by the rows of the tensors' first dimension, with the REST requests of
    the same model; the worker decodes the request and encodes the response (raw contents
    when the request came raw).
    """

    service = open_inference_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name

    @unary()
    async def ServerLive(self, request: Any, context: Context) -> Any:
        return open_inference_pb2.ServerLiveResponse(live=True)

    @unary()
    async def ServerReady(self, request: Any, context: Context) -> Any:
        return open_inference_pb2.ServerReadyResponse(
            ready=kserve.is_server_ready(self.registry))

    @unary(KeyKind.INFERENCE)
    async def ModelReady(self, request: Any, context: Context) -> Any:
        model = self.registry.get(request.name, request.version or None)
        return open_inference_pb2.ModelReadyResponse(ready=model.is_ready())

    @unary(KeyKind.INFERENCE)
    async def ServerMetadata(self, request: Any, context: Context) -> Any:
        return open_inference_pb2.ServerMetadataResponse(**kserve.server_metadata(__version__))

    @unary(KeyKind.INFERENCE)
    async def ModelMetadata(self, request: Any, context: Context) -> Any:
        model = self.registry.get(request.name, request.version or None)
        versions = [m.version for m in self.registry.versions(request.name)]
        return open_inference_pb2.ModelMetadataResponse(**kserve.model_metadata(model, versions))

    @unary(prediction=True)  # the token is checked inside the call, which records a refusal
    async def ModelInfer(self, raw: bytes, context: Context) -> Any:
        """Never decoded here: the worker gets the request's bytes as they came."""
        rpc = self.rpc(context, "ModelInfer")
        async with self.plane.call(rpc.origin("/v2/models/-/infer")) as call:
            self.check(KeyKind.INFERENCE, rpc.headers)
            head = wire.infer_request_head(raw, self.max_inputs)
            call.origin = rpc.origin(f"/v2/models/{head.model_name}/infer")
            result = await self.plane.predict(
                call, head.model_name, head.model_version or None, rpc.headers,
                [("body", raw, None)], deadline_s=rpc.time_remaining(),
                weight=kserve.v2_grpc_rows(head.shapes, self.max_rows),
                tensor_format=worker_pb2.TENSOR_FORMAT_GRPC)
            if isinstance(result, ResponseStream):
                raise InternalError("the handler sent intermediate responses, which "
                                    "ModelInfer cannot carry")
            response = open_inference_pb2.ModelInferResponse.FromString(body_of(result))
            call.status = 200
            send_timing(context, call)
            return response
