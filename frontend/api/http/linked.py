"""Predictions a front process parsed (frontend/front/), answered here, in the server process
that owns the models: the link's frames, and the owner's end of a link.

A front process (``number_of_netty_threads`` > 1) accepts on the inference port beside this
process and parses HTTP; what the route table calls a fast route it sends over its link, one
message per request, and this end runs it through the fast path's phases (``fast.py``: the
token check, ``PredictionRoutes.open`` and ``send``, the job's future, ``settle``, Server-Timing,
CORS, ``plane.end`` once), answering with one message, or with a stream's parts. Everything
else a front splices to the inner listener (``app.py``), whole.

The link is a Unix socket in the run directory (mode 0600). A frame is a 4-byte little-endian
length and a ``marshal``-ed tuple: both ends are this interpreter running this code, and the
socket is private, so marshal, the cheapest way Python has to move a tuple of bytes and ints,
is safe here. Frames are coalesced: what one side says in one turn of its event loop goes out
in one write, and one read parses all the frames it holds. Messages (kind, request id, ...):

* front to owner: ``(REQUEST, id, peer, method, target, http_version, headers, body)``,
  ``(CANCEL, id)`` (its client hung up), ``(HELLO, front_number, pid)``;
* owner to front: ``(ANSWER, id, status, content_type, headers, body, paused)`` (``paused``:
  a 503 whose queue is full: read nothing more from that client until ``(ROOM, id)`` or
  ``fast.REFUSED_PAUSE_MAX_S``), a stream as ``(START, id, status, headers)``,
  ``(PART, id, body)``... ``(END, id, whole)`` (``whole`` false: close the connection).
"""

from __future__ import annotations

import asyncio
import logging
import marshal
import struct
from collections.abc import Callable
from typing import Any

from frontend.api.http import common
from frontend.api.http.cors import CorsPolicy, with_cors
from frontend.api.http.fast import (
    BAD_HEADER_ANSWER,
    has_bad_header,
    refusal,
    resolve,
    settle,
)
from frontend.api.http.predictions import PredictionRoutes
from frontend.api.http.routes import RouteTable
from frontend.errors import InternalError, RouteNotFound, ServeError, ServiceUnavailable
from frontend.ops.plane import Call, InferencePlane, Origin, ResponseStream

logger = logging.getLogger(__name__)

REQUEST, CANCEL, HELLO, ANSWER, START, PART, END, ROOM = range(1, 9)
_LENGTH = struct.Struct("<I")
Message = tuple[Any, ...]


class FrameReader:
    """Frames in, messages out, whatever the reads' sizes."""

    __slots__ = ("_buffer",)

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, data: bytes) -> list[Message]:
        buffer = self._buffer + data if self._buffer else data
        messages = []
        offset, size = 0, len(buffer)
        view = memoryview(buffer)
        while size - offset >= 4:
            end = offset + 4 + _LENGTH.unpack_from(buffer, offset)[0]
            if end > size:
                break
            messages.append(marshal.loads(view[offset + 4:end]))
            offset = end
        view.release()
        self._buffer = buffer[offset:] if offset < size else b""
        return messages


class FrameWriter:
    """Messages out, coalesced: those sent in one turn of the event loop leave in one write."""

    __slots__ = ("_loop", "_out", "_transport")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._out: list[bytes] = []

    def send(self, message: Message) -> None:
        data = marshal.dumps(message)
        out = self._out
        if not out:
            self._loop.call_soon(self._flush)
        out += (_LENGTH.pack(len(data)), data)

    def _flush(self) -> None:
        out, self._out = self._out, []
        if not self._transport.is_closing():
            self._transport.write(b"".join(out))


class _Linked:
    """One linked prediction, from its request to its answer."""

    __slots__ = ("call", "headers", "streaming")

    def __init__(self, call: Call, headers: common.Headers) -> None:
        self.call = call
        self.headers = headers
        self.streaming = False


class LinkedPredictions:
    """The owner's end of one front's link: its requests served, its answers sent."""

    def __init__(self, predictions: PredictionRoutes, table: RouteTable,
                 count_status: Callable[[int], None], cors: CorsPolicy | None = None) -> None:
        self.predictions = predictions
        self.plane: InferencePlane = predictions.plane
        self.table = table
        self.count_status = count_status
        self.cors = cors
        self._open: dict[int, _Linked] = {}
        #: Requests this link brought (``batchserve_front_requests_total``).
        self.requests = 0
        self._writer: FrameWriter | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def connect(self, writer: FrameWriter, loop: asyncio.AbstractEventLoop) -> None:
        self._writer = writer
        self._loop = loop

    def _send(self, message: Message) -> None:
        if self._writer is not None:
            self._writer.send(message)

    # -- the front's messages -----------------------------------------------------------------

    def request(self, message: Message) -> None:
        _, rid, peer, method, raw, version, headers, body = message
        loop = self._loop
        assert loop is not None
        self.requests += 1
        target, path, url = resolve(self.table, method, raw)
        call = self.plane.begin(Origin(peer, method, path, f"HTTP/{version}",
                                       uri=raw.decode("latin-1")), loop)
        scope = {"method": method, "path": path, "raw_path": url.path,
                 "query_string": url.query or b"", "headers": headers,
                 "http_version": version}
        linked = self._open[rid] = _Linked(call, headers)
        try:
            if target is None or not target.route.fast:
                raise RouteNotFound()  # the front's table is this one: never, in practice
            self.predictions.open(call, target, scope)
            self.predictions.send(call, target, scope, body, loop=loop)
        except ServeError as error:
            self._refuse(rid, linked, error)
            return
        call.job.future.add_done_callback(lambda future: self._answered(rid, linked, future))

    def cancel(self, rid: int) -> None:
        """The client hung up: its job leaves the queue (a cancelled job is never
        dispatched, recorded as 0), or its stream is read on and nothing sent."""
        linked = self._open.get(rid)
        if linked is None:
            return
        future = linked.call.job.future
        if not future.done():
            future.cancel()  # _answered records it
            return
        del self._open[rid]
        self._record(linked, 0)

    def lost(self) -> None:
        """The link is gone (its front exited): every open call is a client gone."""
        self._writer = None
        for rid in list(self._open):
            self.cancel(rid)

    # -- answering ----------------------------------------------------------------------------

    def _answered(self, rid: int, linked: _Linked, future: asyncio.Future[Any]) -> None:
        try:
            answer = settle(self.predictions, linked.call, future)
            if answer is None:
                self._open.pop(rid, None)
                self._record(linked, 0)  # the client went away
            elif isinstance(answer, ServeError):
                self._refuse(rid, linked, answer)
            elif isinstance(answer, ResponseStream):
                linked.streaming = True
                assert self._loop is not None
                self._loop.create_task(self._stream(rid, linked, answer))
            else:
                self._answer(rid, linked, *answer)
        except Exception as error:  # a bug of ours must still answer the client
            logger.exception("answering a linked prediction failed")
            if rid in self._open:
                self._refuse(rid, linked, InternalError(f"answering failed: {error}"))

    def _refuse(self, rid: int, linked: _Linked, error: ServeError) -> None:
        linked.call.fail(error)
        paused = isinstance(error, ServiceUnavailable) and self.plane.when_room(
            linked.call, lambda: self._send((ROOM, rid)))
        self._answer(rid, linked, *refusal(error), paused=paused)

    def _answer(self, rid: int, linked: _Linked, status: int, content_type: bytes, body: bytes,
                headers: common.Headers, paused: bool = False) -> None:
        if self._open.pop(rid, None) is None:
            return  # answered, or its client gone
        if has_bad_header(content_type, headers):
            status, content_type, body, headers = BAD_HEADER_ANSWER
        self._send((ANSWER, rid, status, content_type, self._with_cors(linked, headers), body,
                    paused))
        self.count_status(status)
        self._record(linked, status)

    def _with_cors(self, linked: _Linked, headers: common.Headers) -> common.Headers:
        if self.cors is not None:
            added = self.cors.for_request(linked.headers)
            if added:
                return with_cors(headers, added)
        return headers

    def _record(self, linked: _Linked, status: int) -> None:
        linked.call.status = status
        self.plane.end(linked.call)

    async def _stream(self, rid: int, linked: _Linked, stream: ResponseStream) -> None:
        """Intermediate responses as parts (the front writes them chunked), through the ASGI
        route's messages (``respond_in_parts``)."""

        async def send(message: common.Message) -> None:
            if rid not in self._open:
                return  # the client went away: the stream is read to its end, unsent
            if message["type"] == "http.response.start":
                self._send((START, rid, message["status"],
                            self._with_cors(linked, list(message["headers"]))))
                return
            if message.get("body"):
                self._send((PART, rid, message["body"]))
            if not message.get("more_body", False):
                self._send((END, rid, True))

        status = 500
        try:
            status = await self.predictions.respond_in_parts(
                stream, linked.call.job.request.request_id, send, linked.call.sequence_id)
        except ServeError as error:
            self._refuse(rid, linked, error)
            return
        except Exception:
            logger.exception("streaming a linked prediction failed")
            if rid in self._open:
                self._send((END, rid, False))
        if self._open.pop(rid, None) is not None:
            self.count_status(status)
            self._record(linked, status)


class OwnerLink(asyncio.Protocol):
    """A front's link, as its owner reads it."""

    def __init__(self, served: Callable[[], LinkedPredictions],
                 hello: Callable[[OwnerLink, int, int], None],
                 lost: Callable[[OwnerLink], None]) -> None:
        self._served = served
        self._hello = hello
        self._lost = lost
        self._reader = FrameReader()
        self.predictions: LinkedPredictions | None = None
        #: Which front it is (1..N-1) and its process, once it said hello.
        self.front = 0
        self.pid = 0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self.transport = transport
        self.predictions = self._served()
        self.predictions.connect(FrameWriter(transport, asyncio.get_running_loop()),
                                 asyncio.get_running_loop())

    def data_received(self, data: bytes) -> None:
        served = self.predictions
        assert served is not None
        try:
            messages = self._reader.feed(data)
        except (ValueError, EOFError, TypeError, struct.error):
            logger.error("front %d: a malformed frame on its link: closed", self.front)
            self.transport.close()
            return
        for message in messages:
            kind = message[0]
            if kind == REQUEST:
                served.request(message)
            elif kind == CANCEL:
                served.cancel(message[1])
            elif kind == HELLO:
                self.front, self.pid = message[1], message[2]
                self._hello(self, self.front, self.pid)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.predictions is not None:
            self.predictions.lost()
        self._lost(self)
