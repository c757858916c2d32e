"""The HTTP/1.1 connection protocol of every port: uvicorn's httptools protocol, bounded.

uvicorn reads a request head without limit (a 64 MB header grew the frontend by 235 MiB and
stalled everyone; a 32 MB URL was appended to itself piece by piece) and without a deadline
(a slowloris connection was held forever). Here:

- the request line (its URL) may take ``MAX_URL_BYTES`` (414 past it), one header line
  ``MAX_HEADER_LINE_BYTES``, the whole head ``MAX_HEAD_BYTES`` and ``MAX_HEADERS`` lines (431);
  a refused request is answered at once and its connection closed. The head's bytes are
  counted as they arrive (a head that spans reads); the lines are checked once the head is
  parsed, and only when its read was large enough to hold an oversized line (the common
  request pays one comparison);
- a request's head must arrive within ``header_timeout_s`` of its first byte (of the
  connection, for the first request): 408, or a plain close when nothing came at all;
- an ``Upgrade`` we do not perform (``h2c``: what ``curl --http2`` sends with its body) is
  ignored, as TorchServe ignores it: the request and its body are read as HTTP/1.1. llhttp
  stops at an upgrade request's head and skips its body, so the body is then read by a fresh
  parser primed with the request's own framing.

A connection idle between requests for ``timeout_keep_alive`` (``keep_alive_timeout``, 5 s)
is closed, as uvicorn does, but by the connection's one timer, not by a timer armed for each
response. Every response a connection sends is counted by status (``Requests2XX/4XX/5XX``).

``HttpToolsProtocol`` is private to uvicorn: setup.py pins uvicorn's minor version, and
tests/unit/test_uvicorn_contract.py checks every name used here (``data_received`` and
``on_response_complete`` are replaced whole; the test checks that uvicorn's do nothing else we
would be missing).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import ClassVar

import httptools
from uvicorn._types import ASGI3Application, ASGIReceiveCallable, ASGISendCallable, Scope
from uvicorn.protocols.http.httptools_impl import (
    STATUS_LINE,
    HttpToolsProtocol,
    RequestResponseCycle,
)

from frontend.errors import (
    BadRequest,
    HeaderFieldsTooLarge,
    RequestHeadTimeout,
    ServeError,
    UriTooLong,
    error_body,
)

logger = logging.getLogger(__name__)

MAX_URL_BYTES = 8 * 1024
MAX_HEADER_LINE_BYTES = 16 * 1024
MAX_HEAD_BYTES = 64 * 1024
MAX_HEADERS = 100
#: After a refusal, how long what the client still sends is read and dropped before the
#: connection closes (closing on unread input would reset it and lose the answer).
LINGER_S = 2.0
#: At a server stop, how long an idle TLS connection's close may wait for the client's
#: close_notify before the connection is dropped (``shutdown``).
TLS_CLOSE_GRACE_S = 1.0


class _Refused(Exception):
    """Raised from a parser callback to stop parsing a request that was refused."""


def error_response(error: ServeError) -> bytes:
    """A whole HTTP response carrying TorchServe's error body, closing the connection."""
    body = error_body(error)
    return b"".join([STATUS_LINE[error.http_status], b"content-type: application/json\r\n",
                     b"content-length: %d\r\nconnection: close\r\n\r\n" % len(body), body])


class ServerProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with bounded request heads, a head deadline, ignored
    upgrades and responses counted by status."""

    header_timeout_s: ClassVar[float] = 30.0

    def count_status(self, status: int) -> None:
        """Called with the status of every response the connection sends: a listener's
        protocol class (``fast.protocol_for``) replaces it with its metrics counter."""

    # uvicorn narrows asyncio.Protocol's BaseTransport to Transport in the same way.
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_bytes = 0
        #: The size of the read being parsed.
        self._read_bytes = 0
        #: True from a request's first byte to its parsed head.
        self._in_head = False
        #: True when the request being read began in the chunk being parsed.
        self._began_in_chunk = False
        #: True from a request's parsed head to its complete body.
        self._in_body = False
        self._refused = False
        #: A refusal written once the requests before it are answered (pipelining).
        self._refusal: bytes | None = None
        #: The framing of a body that follows an ignored upgrade request's head.
        self._upgrade_framing: bytes | None = None
        #: loop.time() when the head being read began (or the connection was made).
        self._head_since = self.loop.time()
        #: loop.time() since when the connection waits for its next request (None: it does
        #: not: a request is being read or answered).
        self._idle_since: float | None = None
        self._spoken = False
        # One timer per connection, not one per request: it looks at the connection when it
        # fires (a head too slow, idle past keep-alive) and sets itself again for what is
        # left; never further ahead than the keep-alive time, so nothing has to re-arm it.
        self._head_timer: asyncio.TimerHandle | None = self.loop.call_later(
            min(self.header_timeout_s, self.timeout_keep_alive), self._check_head)

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_head_timer()
        super().connection_lost(exc)

    # -- reading ----------------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        # NOTE: no _unset_keepalive_if_required(): it cancels the timer uvicorn's
        # on_response_complete arms, which ours replaces (the connection's own timer).
        self._began_in_chunk = False
        self._read_bytes = len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade as upgrade:
            self._read_past_upgrade(data[upgrade.args[0]:])
            return
        except httptools.HttpParserError as exc:
            if not self._refused:  # else: our own callback refused the request
                if isinstance(exc, httptools.HttpParserCallbackError):
                    logger.error("parsing an HTTP request failed", exc_info=exc)
                error = BadRequest(f"Invalid HTTP request: {exc}")
                if self._in_body:
                    self._refuse_body(error)
                else:
                    self._refuse_head(error)
            return
        if self._in_head and not self._began_in_chunk:
            # A head that spans reads: this whole read belongs to it. (Where in its first read
            # a head begins is not known, so that read is not counted: the bound is
            # MAX_HEAD_BYTES plus one read; its lines are checked when it is complete.)
            self._head_bytes += len(data)
            if self._head_bytes > MAX_HEAD_BYTES:
                if len(self.url) > MAX_URL_BYTES:  # still in the request line
                    self._refuse_head(UriTooLong(f"request URL exceeds {MAX_URL_BYTES} bytes"))
                else:
                    self._refuse_head(HeaderFieldsTooLarge(
                        f"request headers exceed {MAX_HEAD_BYTES} bytes"))

    def _read_past_upgrade(self, rest: bytes) -> None:
        """llhttp stops after the head of a request that asks for an upgrade; we perform
        none, so what follows is this request's body (if it declared one) and then more
        HTTP/1.1. A fresh parser, primed with a head that declares the same framing, reads
        on; the primed head's callbacks are dropped (``_AfterUpgrade``)."""
        framing, self._upgrade_framing = self._upgrade_framing, None
        if framing is None:
            self.parser = httptools.HttpRequestParser(self)
        else:
            self.parser = httptools.HttpRequestParser(_AfterUpgrade(self))
            self.parser.feed_data(b"POST / HTTP/1.1\r\n" + framing + b"\r\n\r\n")
        self.parser.set_dangerous_leniencies(lenient_data_after_close=True)
        if rest:
            self.data_received(rest)

    # -- parser callbacks -------------------------------------------------------------------

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_body = False
        self._in_head = self._began_in_chunk = self._spoken = True
        self._idle_since = None
        self._head_bytes = 0
        self._head_since = self.loop.time()

    def on_headers_complete(self) -> None:
        self._in_head = False
        if ((self._head_bytes or self._read_bytes > MAX_URL_BYTES
                or len(self.headers) > MAX_HEADERS) and self._head_too_large()):
            raise _Refused
        if self.parser.should_upgrade():
            self._upgrade_framing = self._body_framing()
        self._in_body = True
        self.handle_request()

    def handle_request(self) -> None:
        """The head of a request is parsed: start answering it (uvicorn's ASGI cycle)."""
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        if self._upgrade_framing is not None:
            return  # llhttp's early end of an upgrade request: its body comes next
        self._in_body = False
        super().on_message_complete()

    def _head_too_large(self) -> bool:
        """Refuse a parsed head whose URL, one line or number of lines is over its limit."""
        if len(self.url) > MAX_URL_BYTES:
            self._refuse_head(UriTooLong(f"request URL exceeds {MAX_URL_BYTES} bytes"))
        elif len(self.headers) > MAX_HEADERS:
            self._refuse_head(HeaderFieldsTooLarge(
                f"a request may carry at most {MAX_HEADERS} headers"))
        elif any(len(name) + len(value) > MAX_HEADER_LINE_BYTES for name, value in self.headers):
            self._refuse_head(HeaderFieldsTooLarge(
                f"a request header exceeds {MAX_HEADER_LINE_BYTES} bytes"))
        return self._refused

    def _body_framing(self) -> bytes | None:
        """The header that frames this request's body, if it has one."""
        for name, value in self.headers:
            if name == b"transfer-encoding" and b"chunked" in value.lower():
                return b"transfer-encoding: chunked"
        for name, value in self.headers:
            if name == b"content-length" and value.strip() not in (b"", b"0"):
                return b"content-length: " + value.strip()
        return None

    # -- refusing -----------------------------------------------------------------------------

    def _check_head(self) -> None:
        """The connection's timer: a head that takes longer than ``header_timeout_s`` is
        answered 408; a connection silent since it was made, for as long, is closed; one idle
        between requests for ``timeout_keep_alive`` is closed (uvicorn's keep-alive)."""
        self._head_timer = None
        if self.transport.is_closing() or self._refused:
            return
        now = self.loop.time()
        if self._in_head or not self._spoken:
            remaining_s = self._head_since + self.header_timeout_s - now
            if remaining_s <= 0:
                if self._in_head:
                    self._refuse_head(RequestHeadTimeout(
                        f"the request head did not arrive within {self.header_timeout_s:g} s"))
                else:  # connected, and silent since: nothing to answer
                    self._refused = True
                    self.transport.close()
                return
        elif self._idle_since is not None:
            remaining_s = self._idle_since + self.timeout_keep_alive - now
            if remaining_s <= 0:
                self.transport.close()
                return
        else:  # answering a request: look again later
            remaining_s = self.timeout_keep_alive
        self._head_timer = self.loop.call_later(min(remaining_s, self.timeout_keep_alive),
                                                self._check_head)

    def _refuse_head(self, error: ServeError) -> None:
        """Answer ``error`` and close, once the requests before this one are answered."""
        self._stop_reading(error)
        self._answer_refusal(error)

    def _refuse_body(self, error: ServeError) -> None:
        """The body of the request being read is malformed (a bad chunk size, chunk data
        longer than its size, ...): that request can never be complete, so it is the one
        answered ``error``, in its turn, and the connection closed. Its ASGI app, waiting for
        the rest of the body, sees the client gone (``http.disconnect``)."""
        self._stop_reading(error)
        cycle = self.cycle
        assert isinstance(cycle, RequestResponseCycle)
        for index, (queued, _) in enumerate(self.pipeline):
            if queued is cycle:  # behind unanswered requests: answered when its turn comes
                cycle.keep_alive = False
                self.pipeline[index] = (cycle, _refusal_app(error, self.count_status))
                return
        if cycle.response_started:  # answered, or answering, already: nothing more to say
            cycle.keep_alive = False
            if cycle.response_complete:
                self.transport.close()
            return
        cycle.disconnected = True
        cycle.message_event.set()
        self._answer_refusal(error)

    def _answer_refusal(self, error: ServeError) -> None:
        """Answer ``error`` and close, once the requests before it are answered."""
        self._refusal = error_response(error)
        self.count_status(error.http_status)
        self._write_refusal()

    def _stop_reading(self, error: ServeError) -> None:
        """Read no more requests from this connection: it is refused with ``error``."""
        self._refused = True
        self._in_body = False
        self._stop_head_timer()
        self.flow.pause_reading()
        client = f"{self.client[0]}:{self.client[1]}" if self.client else "?"
        logger.warning("HTTP request from %s refused (%d): %s", client, error.http_status,
                       error.message)

    def _write_refusal(self) -> None:
        if self._refusal is None or self._answer_pending():
            return
        refusal, self._refusal = self._refusal, None
        transport = self.transport
        if transport.is_closing():
            return
        transport.write(refusal)
        self.close_lingering()

    def close_lingering(self) -> None:
        """Close after an answer that leaves input unread: the answer goes out with a FIN,
        and what the client is still sending is read and dropped (``data_received`` ignores
        it once refused) until it stops or for LINGER_S at most. (Closing on unread input
        would reset the connection and could lose the answer.)"""
        transport = self.transport
        if not transport.can_write_eof():
            transport.close()
            return
        self._refused = True
        transport.write_eof()
        self.flow.resume_reading()
        self.loop.call_later(LINGER_S, transport.close)

    def _answer_pending(self) -> bool:
        cycle = self.cycle
        return bool(self.pipeline) or (cycle is not None and not cycle.response_complete
                                       and not getattr(cycle, "disconnected", False))

    def on_response_complete(self) -> None:
        """uvicorn's, but for one thing: no keep-alive timer armed per response (and
        cancelled by the next request); the connection's own timer (``_check_head``) closes
        it once idle for ``timeout_keep_alive``."""
        self.server_state.total_requests += 1
        if self.transport.is_closing():
            return
        self.flow.resume_reading()
        if self.pipeline:
            cycle, app = self.pipeline.pop()
            self._start_asgi_task(cycle, app)
        elif not self._in_head:
            self._idle_since = self.loop.time()
        if self._refusal is not None:
            self._write_refusal()

    def shutdown(self) -> None:
        """uvicorn's (at a server stop: an idle connection is closed, a busy one after its
        answer); and an idle TLS connection is dropped ``TLS_CLOSE_GRACE_S`` after: closing TLS
        waits for the client's close_notify (up to asyncio's ssl_shutdown_timeout, 30 s),
        which a client idle in a connection pool never sends, and the stop waits for it."""
        super().shutdown()
        transport = self.transport
        if transport.is_closing() and transport.get_extra_info("sslcontext") is not None:
            self.loop.call_later(TLS_CLOSE_GRACE_S, transport.abort)

    def _stop_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None


def _refusal_app(error: ServeError, count_status: Callable[[int], None]) -> ASGI3Application:
    """An ASGI app that answers ``error`` (in place of a pipelined request's own app)."""
    body = error_body(error)

    async def refuse(scope: Scope, receive: ASGIReceiveCallable, send: ASGISendCallable
                     ) -> None:
        count_status(error.http_status)
        await send({"type": "http.response.start", "status": error.http_status,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", b"%d" % len(body)),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})

    return refuse


class _AfterUpgrade:
    """The callbacks of the parser that reads on after an ignored upgrade: the head it is
    primed with (to read the request's body) is not a request, so its callbacks are dropped;
    everything after it goes to the connection's protocol."""

    def __init__(self, protocol: ServerProtocol) -> None:
        self._protocol = protocol
        self._priming = True

    def on_message_begin(self) -> None:
        if not self._priming:
            self._protocol.on_message_begin()

    def on_url(self, url: bytes) -> None:
        if not self._priming:
            self._protocol.on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self._priming:
            self._protocol.on_header(name, value)

    def on_headers_complete(self) -> None:
        if self._priming:
            self._priming = False
        else:
            self._protocol.on_headers_complete()

    def on_body(self, body: bytes) -> None:
        self._protocol.on_body(body)

    def on_message_complete(self) -> None:
        self._protocol.on_message_complete()


#: The line a front process writes first on a connection it splices to the inner listener:
#: who the client is (``BATCHSERVE-PEER <host> <port>``); only the inner listener reads it.
PEER_PREAMBLE = b"BATCHSERVE-PEER "
_MAX_PREAMBLE_BYTES = 300


def peer_preamble(host: str, port: int) -> bytes:
    return b"%s%s %d\r\n" % (PEER_PREAMBLE, host.encode("ascii", "replace"), port)


class PeerFirst(ServerProtocol):
    """The inner listener's connections (a Unix socket only front processes reach): the
    first line names the client a front spliced, which the apps and the access log then see
    as the connection's client. A mixin: ``with_peer_first`` puts it before a listener's
    own protocol class."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._preamble: bytes | None = b""

    def data_received(self, data: bytes) -> None:
        if self._preamble is not None:
            data = self._preamble + data
            end = data.find(b"\n")
            if end < 0:
                if len(data) > _MAX_PREAMBLE_BYTES:
                    self.transport.close()
                else:
                    self._preamble = data
                return
            line, data = data[:end].rstrip(b"\r"), data[end + 1:]
            self._preamble = None
            host, _, port = line.removeprefix(PEER_PREAMBLE).rpartition(b" ")
            if not line.startswith(PEER_PREAMBLE) or not port.isdigit():
                self.transport.close()
                return
            self.client = (host.decode("latin-1"), int(port))
            if hasattr(self, "_peer"):  # the fast path's access-log name of its client
                self._peer = f"/{self.client[0]}:{self.client[1]}"
            if not data:
                return
        super().data_received(data)


def with_peer_first(protocol: type[ServerProtocol]) -> type[ServerProtocol]:
    """``protocol`` for the inner listener: its connections' first line names the client."""
    return type(f"PeerFirst{protocol.__name__}", (PeerFirst, protocol), {})
