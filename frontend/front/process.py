"""One front process (``python -m frontend.front``): accepts on the inference port beside its
owner (SO_REUSEPORT), parses HTTP with the same bounded protocol as the owner's listeners
(``protocol.ServerProtocol``: head limits, deadlines, keep-alive), sends each fast-route
prediction over its link (``linked.py``) and writes the answer back; splices everything else
to the owner's inner listener (``splice.py``); relays each call on the shared gRPC ports to the
owner's inner gRPC server (``relay.py``). Its settings come on stdin, as JSON, from its
owner (``owner.Fronts``). It exits when its link closes (the owner is gone), or, on SIGTERM,
once its open requests are answered (within ``drain_timeout``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import signal
import socket
import sys
from typing import Any, ClassVar

from uvicorn.protocols.http.httptools_impl import STATUS_LINE

from frontend.allocator import tune_allocator
from frontend.api.http import common
from frontend.api.http.app import bind, uvicorn_config
from frontend.api.http.fast import REFUSED_PAUSE_MAX_S, resolve, response_bytes
from frontend.api.http.linked import (
    ANSWER,
    CANCEL,
    END,
    HELLO,
    PART,
    REQUEST,
    ROOM,
    START,
    FrameReader,
    FrameWriter,
    Message,
)
from frontend.api.http.protocol import ServerProtocol, _Refused, error_response, peer_preamble
from frontend.api.http.routes import RouteTable
from frontend.api.http.tls import TlsAcceptor
from frontend.config import Address
from frontend.errors import PayloadTooLarge
from frontend.front import relay
from frontend.front.splice import Splice, message_start

logger = logging.getLogger("frontend.front")

_FAST_METHODS = {b"POST": "POST", b"PUT": "PUT"}
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


class _Linked:
    """A request sent over the link, as uvicorn sees a cycle (``response_complete``,
    ``keep_alive``)."""

    __slots__ = ("chunks", "keep_alive", "method", "response_complete", "rid", "sent", "size",
                 "version")

    def __init__(self, rid: int, method: str, version: str, keep_alive: bool) -> None:
        self.rid = rid
        self.method = method
        self.version = version
        self.keep_alive = keep_alive
        self.chunks: list[bytes] = []
        self.size = 0
        self.sent = False
        self.response_complete = False


class FrontLink(asyncio.Protocol):
    """The front's end of its link: requests out, answers in, each to its connection."""

    def __init__(self, number: int, closed: asyncio.Event) -> None:
        self.number = number
        self._closed = closed
        self._reader = FrameReader()
        self._writer: FrameWriter | None = None
        self._next = 0
        self.waiting: dict[int, FrontProtocol] = {}
        self._paused: dict[int, FrontProtocol] = {}

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._writer = FrameWriter(transport, asyncio.get_running_loop())

    def hello(self) -> None:
        """Tell the owner this front accepts on every shared port (its start waits for it)."""
        if self._writer is not None:
            self._writer.send((HELLO, self.number, os.getpid()))

    def next_id(self) -> int:
        self._next += 1
        return self._next

    def send(self, message: Message, connection: FrontProtocol | None = None) -> None:
        if connection is not None:
            self.waiting[message[1]] = connection
        if self._writer is not None:
            self._writer.send(message)

    def cancel(self, rid: int) -> None:
        self._paused.pop(rid, None)
        if self.waiting.pop(rid, None) is not None and self._writer is not None:
            self._writer.send((CANCEL, rid))

    def data_received(self, data: bytes) -> None:
        for message in self._reader.feed(data):
            kind, rid = message[0], message[1]
            if kind == ROOM:
                paused = self._paused.pop(rid, None)
                if paused is not None:
                    paused.room_again()
                continue
            connection = self.waiting.get(rid)
            if connection is None:
                continue
            if kind == ANSWER:
                del self.waiting[rid]
                if message[6]:
                    self._paused[rid] = connection
                connection.answered(*message[2:])
            elif kind == START:
                connection.stream_start(message[2], message[3])
            elif kind == PART:
                connection.stream_part(message[2])
            elif kind == END:
                del self.waiting[rid]
                connection.stream_end(message[2])

    def connection_lost(self, exc: Exception | None) -> None:
        self._writer = None
        self._closed.set()


class FrontProtocol(ServerProtocol):
    """A client's connection to a front (``cycle``: the linked request being answered)."""

    link: ClassVar[FrontLink]
    table: ClassVar[RouteTable]
    inner_path: ClassVar[str]
    max_body_bytes: ClassVar[int]
    cycle: _Linked | None  # type: ignore[assignment]

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        client = self.client or ("-", 0)
        self._peer = f"/{client[0]}:{client[1]}"
        #: The reads since the connection was between requests at the end of a read, and how
        #: many requests completed in them: where a spliced request's bytes are.
        self._window: list[bytes] = []
        self._complete = 0
        self._splice_wanted = False
        self._splice: Splice | None = None
        #: The owner's bytes held while a linked answer is still due (pipelining).
        self._held: list[bytes] = []
        self._inner_done = False

    def data_received(self, data: bytes) -> None:
        if self._splice is not None:
            self._splice.send(data)
            return
        if self._in_head or self._in_body:
            self._window.append(data)
        else:
            self._window = [data]
            self._complete = 0
        super().data_received(data)
        if self._splice_wanted:
            self._start_splice()

    # -- parser callbacks -----------------------------------------------------------------------

    def handle_request(self) -> None:
        parser = self.parser
        method = _FAST_METHODS.get(parser.get_method())
        target = None
        cycle = self.cycle
        if method is not None and not parser.should_upgrade() and (
                cycle is None or cycle.response_complete):
            with contextlib.suppress(UnicodeDecodeError):
                target = resolve(self.table, method, self.url)[0]
        if method is None or target is None or not target.route.fast:
            # The owner's, whole, from this request on.
            self._splice_wanted = self._refused = True
            raise _Refused
        version = parser.get_http_version()
        keep_alive = version != "1.0" and parser.should_keep_alive()
        self.cycle = _Linked(self.link.next_id(), method, version, keep_alive)
        if self.expect_100_continue:
            self.transport.write(_CONTINUE)

    def on_body(self, body: bytes) -> None:
        linked = self.cycle
        if linked is None or self._splice_wanted:
            return
        linked.size += len(body)
        if linked.size > self.max_body_bytes:
            linked.response_complete = True
            error = PayloadTooLarge(f"request body exceeds max_request_size "
                                    f"({self.max_body_bytes} bytes)")
            self._stop_reading(error)
            self.transport.write(error_response(error))
            self.close_lingering()
            raise _Refused
        linked.chunks.append(body)

    def on_message_complete(self) -> None:
        if self._upgrade_framing is not None or self._splice_wanted:
            return
        self._in_body = False
        self._complete += 1
        linked = self.cycle
        if linked is None or linked.response_complete:
            return
        chunks, linked.chunks = linked.chunks, []
        linked.sent = True
        self.link.send((REQUEST, linked.rid, self._peer, linked.method, self.url,
                        linked.version, self.headers,
                        chunks[0] if len(chunks) == 1 else b"".join(chunks)), self)

    # -- answers ----------------------------------------------------------------------------------

    def answered(self, status: int, content_type: bytes, headers: common.Headers, body: bytes,
                 paused: bool) -> None:
        linked = self.cycle
        if linked is None or linked.response_complete:
            return
        self.transport.write(response_bytes(status, content_type, body, headers,
                                            linked.keep_alive))
        self._completed(linked)
        if paused and not self.transport.is_closing():
            # The queue is full: this client is not read until it has room (its 503 says
            # Retry-After), as on the owner's own connections (fast.py).
            self.flow.pause_reading()
            self.loop.call_later(REFUSED_PAUSE_MAX_S, self.room_again)

    def room_again(self) -> None:
        if not self.transport.is_closing() and self._splice is None:
            self.flow.resume_reading()

    def stream_start(self, status: int, headers: common.Headers) -> None:
        linked = self.cycle
        if linked is None or linked.response_complete:
            return
        head = [STATUS_LINE[status]]
        for name, value in headers:
            head += (name, b": ", value, b"\r\n")
        head.append(b"transfer-encoding: chunked\r\n")
        if not linked.keep_alive:
            head.append(b"connection: close\r\n")
        head.append(b"\r\n")
        self.transport.write(b"".join(head))

    def stream_part(self, body: bytes) -> None:
        self.transport.write(b"%x\r\n%b\r\n" % (len(body), body))

    def stream_end(self, whole: bool) -> None:
        linked = self.cycle
        if linked is None or linked.response_complete:
            return
        if not whole:
            self.transport.close()
            return
        self.transport.write(b"0\r\n\r\n")
        self._completed(linked)

    def _completed(self, linked: _Linked) -> None:
        linked.response_complete = True
        if not linked.keep_alive:
            self.transport.close()
        self.on_response_complete()
        if self._held:  # the spliced requests' answers, held behind this one
            held, self._held = self._held, []
            self.transport.write(b"".join(held))
        if self._inner_done:
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        linked, self.cycle = self.cycle, None  # (uvicorn's would wake an ASGI cycle)
        if linked is not None and linked.sent and not linked.response_complete:
            linked.response_complete = True
            self.link.cancel(linked.rid)  # the owner drops its job (never dispatched)
        if self._splice is not None:
            self._splice.close()
        super().connection_lost(exc)

    # -- splicing ---------------------------------------------------------------------------------

    def _start_splice(self) -> None:
        window = b"".join(self._window)
        self._window = []
        if self._complete:
            window = window[message_start(window, self._complete):]
        client = self.client or ("-", 0)
        splice = self._splice = Splice(self._from_inner, self._inner_closed, self._pause_client)
        splice.send(peer_preamble(str(client[0]), int(client[1])) + window)
        self.flow.resume_reading()
        self.loop.create_task(self._connect(splice))

    async def _connect(self, splice: Splice) -> None:
        try:
            await self.loop.create_unix_connection(lambda: splice, self.inner_path)
        except OSError as exc:
            logger.error("cannot reach the owner's inner listener: %s", exc)
            self.transport.close()

    def _from_inner(self, data: bytes) -> None:
        linked = self.cycle
        if linked is not None and not linked.response_complete:
            self._held.append(data)
            return
        transport = self.transport
        transport.write(data)
        if transport.get_write_buffer_size() > 4 * 65536 and self._splice is not None \
                and self._splice.transport is not None:
            self._splice.transport.pause_reading()

    def _inner_closed(self) -> None:
        linked = self.cycle
        if linked is not None and not linked.response_complete:
            self._inner_done = True
        else:
            self.transport.close()

    def _pause_client(self, pause: bool) -> None:
        if pause:
            self.transport.pause_reading()
        elif not self.transport.is_closing():
            self.transport.resume_reading()

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._splice is not None and self._splice.transport is not None:
            self._splice.transport.resume_reading()

    def shutdown(self) -> None:
        """At the front's stop: a spliced connection ends when the owner ends it."""
        if self._splice is None:
            super().shutdown()


async def _no_app(scope: common.Scope, receive: common.Receive, send: common.Send) -> None:
    raise RuntimeError("a front process serves no ASGI app")  # never called: no cycle here


async def serve(settings: dict[str, Any]) -> None:
    """Link to the owner, accept on the shared listeners, run until SIGTERM or the owner goes."""
    import uvicorn

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    link = FrontLink(settings["number"], stop)
    await loop.create_unix_connection(lambda: link, settings["link"])
    tls = credentials = None
    if settings.get("certificate"):
        import grpc

        from frontend.tls import ServerCertificate

        pem = settings["certificate"]
        certificate = ServerCertificate(pem["key"].encode("latin-1"),
                                        pem["chain"].encode("latin-1"), pem["source"])
        tls = certificate.ssl_context()
        credentials = grpc.ssl_server_credentials(
            [(certificate.key_pem, certificate.chain_pem)])
    servers: list[tuple[uvicorn.Server, socket.socket]] = []
    acceptors: list[TlsAcceptor] = []
    for apis, address_text in settings["listeners"]:
        address = Address.parse(address_text)
        sock = bind(address, reuse_port=True)
        protocol = type("FrontProtocol", (FrontProtocol,), {
            "link": link, "inner_path": settings["inner"],
            "table": RouteTable.of(apis, kserve=settings["kserve"]),
            "header_timeout_s": settings["header_timeout_s"],
            "max_body_bytes": settings["max_body_bytes"]})
        config = uvicorn_config(_no_app, protocol, settings["keep_alive_s"],
                                settings["drain_timeout_s"])
        server = uvicorn.Server(config)
        server.lifespan = config.lifespan_class(config)
        if address.is_tls and tls is not None:
            await server.startup(sockets=[])
            acceptor = TlsAcceptor(sock, tls, functools.partial(
                protocol, config=config, server_state=server.server_state,
                app_state=server.lifespan.state),
                first_byte_timeout_s=settings["header_timeout_s"],
                count_status=lambda status: None, backlog=config.backlog)
            acceptor.start()
            acceptors.append(acceptor)
        else:
            await server.startup(sockets=[sock])
        servers.append((server, sock))
    grpc_served = await relay.serve(settings.get("grpc", []), settings["number"], credentials)
    link.hello()
    await stop.wait()
    # Stop accepting; the open requests finish (the owner still answers them), then exit.
    await asyncio.gather(*(acceptor.close() for acceptor in acceptors))
    await asyncio.gather(relay.stop(grpc_served, settings["drain_timeout_s"]),
                         *(server.shutdown(sockets=[sock]) for server, sock in servers),
                         return_exceptions=True)


def main() -> None:
    tune_allocator()  # as the owner's (frontend/allocator.py)
    settings = json.load(sys.stdin)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops the owner, which stops us
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s front {settings['number']} %(levelname)s "
                               "%(message)s")
    import uvloop

    uvloop.run(serve(settings))
