"""The /predictions fast path: a connection protocol that answers TorchServe predictions from
httptools' parser callbacks, without an ASGI task per request (the route table's ``fast``
routes: /predictions, the legacy /{model}/predict routes, and SageMaker's /invocations and
/models/{model}/invoke).

A POST or PUT is resolved here, once, in the listener's route table
(frontend/api/http/routes.py). Everything else on the port (``/ping``, KServe, the API
description, pipelined or upgraded requests, other methods) goes through uvicorn's own
``HttpToolsProtocol``, which this class extends, to our ASGI apps, with the route found here
(if it was looked for) in its scope. A prediction here follows the same phases as the ASGI
route (frontend/api/http/predictions.py: ``open``, ``send``, ``answer``): it may be
refused as soon as its headers are parsed (before the body is read), is queued when its body
is complete, and is answered from a callback on its job's future. This module imports only
what it serves: not the ASGI apps, KServe, workflows or the API description
(tests/unit/test_routes.py). That removes the
per-request task, the ASGI message dicts and a second task watching for a hang-up, which
were most of the frontend's cost per request (benchmarks/RESULTS.md, "What bounds the echo
throughput").

Relies on uvicorn's private ``HttpToolsProtocol`` state (``cycle``, ``scope``, ``url``,
``headers``, ``parser``, ``flow``, ``expect_100_continue``, ``on_response_complete``), its
``STATUS_LINE`` and header checks, and its ``RequestResponseCycle`` for streamed answers:
setup.py pins uvicorn's minor version, tests/unit/test_uvicorn_contract.py checks each of
them, and tests/integration cover the behaviour end to end. Request-head limits, the head
deadline and upgrades are handled below it, in ``frontend/api/http/protocol.py``.
"""

from __future__ import annotations

import asyncio
import logging
import urllib.parse
from collections.abc import Callable
from typing import ClassVar

import httptools
from httptools.parser.url_parser import URL
from uvicorn.protocols.http.httptools_impl import (
    HEADER_RE,
    HEADER_VALUE_RE,
    STATUS_LINE,
    RequestResponseCycle,
)

from frontend.api.http import common
from frontend.api.http.calls import with_timing
from frontend.api.http.cors import CorsPolicy, with_cors
from frontend.api.http.predictions import PredictionRoutes
from frontend.api.http.protocol import ServerProtocol
from frontend.api.http.routes import TARGET, RouteTable, Target
from frontend.errors import (
    InternalError,
    PayloadTooLarge,
    ServeError,
    ServiceUnavailable,
    error_body,
    header_pairs,
)
from frontend.ops.plane import Call, InferencePlane, Origin, ResponseStream
from protos import worker_pb2

logger = logging.getLogger(__name__)

#: The methods of the fast routes, as the scope writes them.
_FAST_METHODS = {b"POST": "POST", b"PUT": "PUT"}
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
#: Longest a connection refused for a full queue goes unread (its 503 says Retry-After: 1).
REFUSED_PAUSE_MAX_S = 1.0
# What HTTP forbids in a header name or value (a handler's header must not split a response):
# uvicorn's own checks, so both paths of this port refuse the same headers.
_BAD_NAME = HEADER_RE
_BAD_VALUE = HEADER_VALUE_RE


#: A finished job's answer, as a transport renders it: None (cancelled: the client left), a
#: refusal, a stream, or (status, content type, body, other headers).
Settled = tuple[int, bytes, bytes, common.Headers] | ServeError | ResponseStream | None
#: What a response with an invalid header becomes.
BAD_HEADER_ANSWER: tuple[int, bytes, bytes, common.Headers] = (
    500, common.JSON,
    error_body(InternalError("the handler's response has an invalid HTTP header")), [])


def resolve(table: RouteTable, method: str, raw_url: bytes
            ) -> tuple[Target | None, str, URL]:
    """A request's route in ``table`` from its request line: (target or None, the decoded
    path, the parsed URL). Here, in the front processes and in their owner alike."""
    url = httptools.parse_url(raw_url)
    path = url.path.decode("ascii")
    if "%" in path:
        path = urllib.parse.unquote(path)
    return table.resolve(method, path), path, url


def settle(predictions: PredictionRoutes, call: Call,
           future: asyncio.Future[worker_pb2.Response | ResponseStream]) -> Settled:
    """What the call's finished job says, as the client is to be answered (``Settled``)."""
    if future.cancelled():
        return None
    error = future.exception()
    if error is not None:
        if isinstance(error, ServeError):
            return error
        logger.error("prediction failed", exc_info=error)
        return InternalError(f"prediction failed: {error}")
    result = future.result()
    if isinstance(result, ResponseStream):
        return result
    try:
        status, content_type, body, headers = predictions.answer(
            result, call.job.request.request_id, call.sequence_id)
    except ServeError as refused:
        return refused
    if call.wants_timing:  # server_timing: off by default, one attribute read
        headers = with_timing(call, headers)
    return status, content_type, body, headers


def refusal(error: ServeError) -> tuple[int, bytes, bytes, common.Headers]:
    """A refused prediction's answer: TorchServe's error body."""
    return error.http_status, common.JSON, error_body(error), header_pairs(error)


def has_bad_header(content_type: bytes, headers: common.Headers) -> bool:
    """Whether an answer's header would split the response (what HTTP forbids)."""
    return bool(_BAD_VALUE.search(content_type)) or any(
        _BAD_NAME.search(name) or _BAD_VALUE.search(value) for name, value in headers)


def response_bytes(status: int, content_type: bytes, body: bytes, headers: common.Headers,
                   keep_alive: bool) -> bytes:
    """A whole HTTP/1.1 response (headers checked already: ``has_bad_header``)."""
    head = [STATUS_LINE[status], b"content-type: ", content_type, b"\r\ncontent-length: ",
            b"%d" % len(body), b"\r\n"]
    for name, value in headers:
        head += (name, b": ", value, b"\r\n")
    if not keep_alive:
        head.append(b"connection: close\r\n")
    head += (b"\r\n", body)
    return b"".join(head)


class _Prediction:
    """One /predictions request on a connection: what uvicorn calls its cycle (it reads
    ``response_complete``, and sets ``keep_alive`` at shutdown), plus its call in the
    inference plane."""

    __slots__ = ("body_done", "call", "chunks", "keep_alive", "response_complete", "scope",
                 "size", "submitted", "target")

    def __init__(self, scope: common.Scope, keep_alive: bool, call: Call,
                 target: Target | None = None) -> None:
        self.scope = scope
        self.keep_alive = keep_alive
        self.call = call
        #: Its route, and what its path names.
        self.target = target
        self.chunks: list[bytes] = []
        self.size = 0
        self.body_done = False
        self.submitted = False
        self.response_complete = False


class PredictionsProtocol(ServerProtocol):
    """The connection protocol, with /predictions answered without the ASGI cycle."""

    predictions: ClassVar[PredictionRoutes]
    plane: ClassVar[InferencePlane]
    #: The listener's routes (its ASGI app's too).
    table: ClassVar[RouteTable]
    # uvicorn's per-request state, as this class uses it. Its cycle may be a prediction
    # (uvicorn reads only what _Prediction has: the contract test checks) or None (uvicorn
    # checks for None too); its scope is read as our apps read every ASGI scope.
    cycle: RequestResponseCycle | _Prediction | None  # type: ignore[assignment]
    scope: common.Scope  # type: ignore[assignment]

    # uvicorn narrows asyncio.Protocol's BaseTransport to Transport in the same way.
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        client = self.client or ("-", 0)
        #: Who is at the other end, as the access log writes it.
        self._peer = f"/{client[0]}:{client[1]}"

    # -- parser callbacks -------------------------------------------------------------------

    def handle_request(self) -> None:
        parser = self.parser
        method = _FAST_METHODS.get(parser.get_method())
        if method is None:
            super().handle_request()  # never a prediction: the ASGI app finds its route
            return
        scope = self.scope
        target, path, url = resolve(self.table, method, self.url)
        cycle = self.cycle
        if (target is None or not target.route.fast or parser.should_upgrade()
                or (cycle is not None and not cycle.response_complete)):
            # Anything else, and a request pipelined behind an unanswered one, goes the ASGI
            # way (uvicorn queues pipelined requests in order).
            self._hand_over(target)
            return
        http_version = parser.get_http_version()
        scope["method"] = method
        if http_version != "1.1":
            scope["http_version"] = http_version
        scope["path"] = path
        scope["raw_path"] = url.path
        scope["query_string"] = url.query or b""
        keep_alive = http_version != "1.0" and parser.should_keep_alive()
        origin = Origin(self._peer, method, path, f"HTTP/{http_version}",
                        uri=self.url.decode("latin-1"))
        prediction = _Prediction(scope, keep_alive, self.plane.begin(origin, self.loop), target)
        self.cycle = prediction
        try:
            self.predictions.open(prediction.call, target, scope)
        except ServeError as error:
            self._refuse(prediction, error)
            return
        if self.expect_100_continue:
            self.transport.write(_CONTINUE)

    def _hand_over(self, target: Target | None) -> None:
        """To uvicorn's ASGI cycle, with the request's route (found once: its app does not
        look again)."""
        self.scope[TARGET] = target
        super().handle_request()

    def on_body(self, body: bytes) -> None:
        prediction = self.cycle
        if type(prediction) is not _Prediction:
            super().on_body(body)
            return
        if prediction.response_complete:
            return  # answered before its body came (refused): the rest is read and dropped
        prediction.size += len(body)
        limit = self.predictions.max_body_bytes
        if prediction.size > limit:
            self._refuse(prediction, PayloadTooLarge(
                f"request body exceeds max_request_size ({limit} bytes)"))
            return
        prediction.chunks.append(body)

    def on_message_complete(self) -> None:
        prediction = self.cycle
        if type(prediction) is not _Prediction:
            super().on_message_complete()
            return
        self._in_body = False
        prediction.body_done = True
        if prediction.response_complete:
            return
        chunks = prediction.chunks
        body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        prediction.chunks = []
        call = prediction.call
        assert prediction.target is not None
        try:
            self.predictions.send(call, prediction.target, prediction.scope, body,
                                  loop=self.loop)
        except ServeError as error:
            self._refuse(prediction, error)
            return
        prediction.submitted = True
        call.job.future.add_done_callback(lambda future: self._answered(prediction, future))

    def _refuse_body(self, error: ServeError) -> None:
        prediction = self.cycle
        if type(prediction) is not _Prediction:
            super()._refuse_body(error)
            return
        self._stop_reading(error)
        if prediction.response_complete:  # refused before its body: the rest is not read
            self.close_lingering()
            return
        prediction.keep_alive = False
        self._refuse(prediction, error)

    def connection_lost(self, exc: Exception | None) -> None:
        prediction = self.cycle
        if type(prediction) is _Prediction:
            self.cycle = None
            if not prediction.response_complete:
                # The client hung up: its job leaves the queue (a cancelled job is never
                # dispatched), and nothing is written.
                prediction.response_complete = True
                future = prediction.call.job.future
                if prediction.submitted and not future.done():
                    future.cancel()  # _answered records it
                else:  # not queued yet, or answering (a stream): recorded as abandoned
                    self._record(prediction, 0)
        super().connection_lost(exc)

    # -- answering --------------------------------------------------------------------------

    def _answered(self, prediction: _Prediction,
                  future: asyncio.Future[worker_pb2.Response | ResponseStream]) -> None:
        """The job's future is done: write its answer (runs as a callback, never raises)."""
        try:
            answer = settle(self.predictions, prediction.call, future)
            if answer is None:
                self._record(prediction, 0)  # the client went away
            elif isinstance(answer, ServeError):
                self._refuse(prediction, answer)
            elif isinstance(answer, ResponseStream):
                self.loop.create_task(self._stream(
                    prediction, answer, prediction.call.job.request.request_id))
            else:
                self._respond(prediction, *answer)
        except Exception as error:  # a bug of ours must still answer the client
            logger.exception("answering a prediction failed")
            if not prediction.response_complete:
                self._refuse(prediction, InternalError(f"answering failed: {error}"))

    def _refuse(self, prediction: _Prediction, error: ServeError) -> None:
        if not prediction.body_done and (isinstance(error, PayloadTooLarge)
                                         or self.expect_100_continue
                                         or not self._declared_length_ok()):
            # Refused before its body came: a body that is too large or of unknown size is
            # not worth reading, and one held back for "100 Continue" will never come.
            prediction.keep_alive = False
        prediction.call.fail(error)
        self._respond(prediction, *refusal(error))
        if (isinstance(error, ServiceUnavailable) and not self.transport.is_closing()
                and self.plane.when_room(prediction.call, self._room_again)):
            # Overload: this client has its 503; its next request is not read until the queue
            # has room. Reading (and refusing) every connection on every turn of the loop
            # would leave the worker one batch per turn; backpressure keeps it fed.
            # Never longer than Retry-After: a queue that does not drain (no worker) must not
            # leave a sent request unread.
            self.flow.pause_reading()
            self.loop.call_later(REFUSED_PAUSE_MAX_S, self._room_again)

    def _room_again(self) -> None:
        if not self.transport.is_closing():
            self.flow.resume_reading()

    def _declared_length_ok(self) -> bool:
        for name, value in self.headers:
            if name == b"content-length":
                return value.isdigit() and int(value) <= self.predictions.max_body_bytes
        return False

    def _respond(self, prediction: _Prediction, status: int, content_type: bytes, body: bytes,
                 headers: common.Headers) -> None:
        if prediction.response_complete:
            return
        if has_bad_header(content_type, headers):
            self._respond(prediction, *BAD_HEADER_ANSWER)
            return
        self.transport.write(response_bytes(status, content_type, body, headers,
                                            prediction.keep_alive))
        self._complete(prediction, status)

    def _complete(self, prediction: _Prediction, status: int) -> None:
        prediction.response_complete = True
        self.count_status(status)
        if not prediction.keep_alive:
            if prediction.body_done:
                self.transport.close()
            else:  # refused before its body was read (all of it)
                self.close_lingering()
        self._record(prediction, status)
        self.on_response_complete()

    def _record(self, prediction: _Prediction, status: int) -> None:
        prediction.call.status = status
        self.plane.end(prediction.call)

    async def _stream(self, prediction: _Prediction, stream: ResponseStream,
                      request_id: str) -> None:
        """Intermediate responses: chunked transfer encoding, through the ASGI route's
        messages (``respond_in_parts``), written by uvicorn's ASGI response writer, as on the
        ASGI path. The writer calls nothing when done (``on_response``): ``_complete`` does."""
        transport = self.transport
        flow = self.flow
        writer = RequestResponseCycle(
            scope=prediction.scope,  # type: ignore[arg-type]  # the same dict uvicorn made
            transport=transport, flow=flow, logger=self.logger,
            access_logger=self.access_logger, access_log=False,
            default_headers=self.server_state.default_headers, message_event=asyncio.Event(),
            expect_100_continue=False, keep_alive=prediction.keep_alive,
            on_response=lambda: None)

        async def send(message: common.Message) -> None:
            if flow.write_paused:
                await flow.drain()
            # The client went away: the stream is still read to its end, and nothing written.
            writer.disconnected = transport.is_closing()
            await writer.send(message)  # type: ignore[arg-type]  # an ASGI response message

        status = 500
        try:
            status = await self.predictions.respond_in_parts(
                stream, request_id, self._part_sender(prediction, send),
                prediction.call.sequence_id)
        except ServeError as error:
            status = error.http_status
            self._refuse(prediction, error)
            return
        except Exception:
            logger.exception("streaming a prediction failed")
            transport.close()
        if not prediction.response_complete:
            self._complete(prediction, status)

    def _part_sender(self, prediction: _Prediction, send: common.Send) -> common.Send:
        """How a streamed answer's messages are sent (``CorsPredictionsProtocol`` adds its
        headers)."""
        return send


class CorsPredictionsProtocol(PredictionsProtocol):
    """The fast path with CORS (``cors_allowed_*`` set): every answer carries the
    Access-Control-* headers for its request's origin (frontend/api/http/cors.py). A
    subclass, so that a server without CORS pays nothing for it."""

    cors: ClassVar[CorsPolicy]

    def _respond(self, prediction: _Prediction, status: int, content_type: bytes, body: bytes,
                 headers: common.Headers) -> None:
        added = self.cors.for_request(prediction.scope["headers"])
        if added:
            headers = with_cors(headers, added)
        super()._respond(prediction, status, content_type, body, headers)

    def _part_sender(self, prediction: _Prediction, send: common.Send) -> common.Send:
        added = self.cors.for_request(prediction.scope["headers"])
        if not added:
            return send

        async def send_with_cors(message: common.Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = with_cors(list(message["headers"]), added)
            await send(message)

        return send_with_cors


def protocol_for(predictions: PredictionRoutes | None, header_timeout_s: float,
                 count_status: Callable[[int], None], cors: CorsPolicy | None = None,
                 table: RouteTable | None = None) -> type[ServerProtocol]:
    """The connection protocol of a listener: the fast path where it serves inference
    (``predictions``; ``table``: the listener's routes, by default the inference API's alone),
    with CORS when ``cors`` is given (the ASGI apps get theirs from ``CorsApp``)."""
    settings: dict[str, object] = {"header_timeout_s": header_timeout_s,
                                   "count_status": staticmethod(count_status)}
    if predictions is None:
        return type("ServerProtocol", (ServerProtocol,), settings)
    settings.update(predictions=predictions, plane=predictions.plane,
                    table=table or RouteTable.of(["inference"]))
    if cors is not None:
        return type("CorsPredictionsProtocol", (CorsPredictionsProtocol,),
                    {**settings, "cors": cors})
    return type("PredictionsProtocol", (PredictionsProtocol,), settings)
