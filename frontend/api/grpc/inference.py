"""TorchServe's ``org.pytorch.serve.grpc.inference.InferenceAPIsService``: Ping, Predictions
and its two streams. Predictions go through the same queues and batches as HTTP requests."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

from frontend.api.grpc import wire
from frontend.api.grpc.common import (
    Context,
    PredictionServicer,
    Rpc,
    abort,
    answer,
    body_of,
    rpc_status,
    send_timing,
    unary,
)
from frontend.errors import ServeError
from frontend.ops import health
from frontend.ops.auth import KeyKind
from frontend.ops.plane import Answer, Call, ResponseStream
from protos import inference_pb2, inference_pb2_grpc, worker_pb2


class InferenceServicer(PredictionServicer, inference_pb2_grpc.InferenceAPIsServiceServicer):
    """Predictions, whole or streamed: StreamPredictions records its refusal before it streams
    (no such model, a full queue, a bad token) with its own status; StreamPredictions2 answers
    many requests on one stream."""

    service = inference_pb2.DESCRIPTOR.services_by_name["InferenceAPIsService"].full_name

    @unary()
    async def Ping(self, request: Any, context: Context) -> Any:
        _, body = health.ping(self.registry)
        return inference_pb2.TorchServeHealthResponse(health=json.dumps(body, indent=2))

    def _parsed(self, raw: bytes) -> Any:
        """The PredictionsRequest in ``raw``, or the error that refuses it."""
        try:
            return wire.predictions_request(raw, self.max_inputs)
        except ServeError as error:
            return error

    async def _start(self, request: Any, rpc: Rpc, call: Call) -> Answer:
        """Run one parsed request (or raise the error that refused it) through the plane."""
        if isinstance(request, ServeError):
            raise request
        call.origin = rpc.origin(f"/{request.model_name}")
        return await self.plane.predict(
            call, request.model_name, request.model_version or None, rpc.headers,
            [(name, data, None) for name, data in request.input.items()],
            deadline_s=rpc.time_remaining(),
            sequence_id=request.sequence_id if request.HasField("sequence_id") else None)

    async def _predict_whole(self, request: Any, rpc: Rpc, context: Context | None = None
                             ) -> tuple[bytes, str | None]:
        """One request's whole answer (its parts joined), and its sequence when its model is
        stateful (the id the server made, when the request named none); with the unary RPC's
        ``context``, its Server-Timing goes in the trailing metadata (``send_timing``)."""
        async with self.plane.call(rpc.origin("/-")) as call:
            if context is not None:  # the unary RPC's token (a stream's is checked once)
                self.check(KeyKind.INFERENCE, rpc.headers)
            result = await self._start(request, rpc, call)
            if isinstance(result, ResponseStream):
                body = b"".join([body_of(part) async for part in result])
            else:
                body = body_of(result)
            call.status = 200
            if context is not None:
                send_timing(context, call)
            return body, call.sequence_id

    @unary(prediction=True)  # the token is checked inside the call, which records a refusal
    async def Predictions(self, raw: bytes, context: Context) -> Any:
        body, sequence_id = await self._predict_whole(
            self._parsed(raw), self.rpc(context, "Predictions"), context)
        response = inference_pb2.PredictionResponse(prediction=body)
        if sequence_id is not None:
            response.sequence_id = sequence_id
        return response

    async def StreamPredictions(self, raw: bytes, context: Context
                                ) -> AsyncIterator[Any]:
        rpc = self.rpc(context, "StreamPredictions")
        async with self.plane.call(rpc.origin("/-")) as call:
            async def start() -> list[worker_pb2.Response] | ResponseStream:
                try:
                    self.check(KeyKind.INFERENCE, rpc.headers)
                    result = await self._start(self._parsed(raw), rpc, call)
                except ServeError as error:
                    # Recorded here: answer() turns it into grpc's abort, which the plane's
                    # call does not see as a ServeError (it would record a 500).
                    call.fail(error)
                    raise
                return result if isinstance(result, ResponseStream) else [result]

            parts = await answer(context, start())
            try:
                async for part in _iterate(parts):
                    yield inference_pb2.PredictionResponse(prediction=body_of(part))
                call.status = 200
            except ServeError as error:
                call.fail(error)
                await abort(context, error)

    async def StreamPredictions2(self, request_iterator: AsyncIterator[bytes],
                                 context: Context
                                 ) -> AsyncIterator[Any]:
        """One bidirectional stream for many requests: answered in order, each carrying its
        sequence_id; a failed request answers with its ``status`` and the stream goes on.
        Each request is a prediction of its own (an access-log line each).

        When the RPC ends early (the client cancels or goes away) every request of the stream
        still waiting is cancelled: a queued one leaves the queue undispatched, one in a
        worker has its answer dropped.
        """
        rpc = self.rpc(context, "StreamPredictions2")
        try:
            self.check(KeyKind.INFERENCE, rpc.headers)
        except ServeError as error:
            async with self.plane.call(rpc.origin("/-")) as call:  # recorded, as a refusal
                call.fail(error)
            await abort(context, error)
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
                response = inference_pb2.PredictionResponse()
                if not isinstance(request, ServeError) and request.HasField("sequence_id"):
                    response.sequence_id = request.sequence_id
                try:
                    response.prediction, sequence_id = await task
                    if sequence_id is not None:
                        response.sequence_id = sequence_id
                except ServeError as error:
                    response.status.CopyFrom(rpc_status(error.http_status, error.message))
                yield response
        finally:
            reader.cancel()
            for task in list(running):
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader



async def _iterate(parts: list[worker_pb2.Response] | ResponseStream
                   ) -> AsyncIterator[worker_pb2.Response]:
    if isinstance(parts, ResponseStream):
        async for part in parts:
            yield part
    else:
        for part in parts:
            yield part


