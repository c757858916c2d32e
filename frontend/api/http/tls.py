"""An HTTPS listener: TLS on a bound socket, and a clear answer to plain HTTP sent to it.

The listener accepts its connections itself, to look at each one's first byte before anything
reads it (``MSG_PEEK``): a TLS record (a ClientHello) goes through the handshake to the
listener's HTTP protocol (``loop.connect_accepted_socket`` with the certificate's context),
after which it is served exactly as a connection to a plain port; anything else is plain HTTP
sent to an HTTPS port, answered 403 as TorchServe answers it and closed, where a failed
handshake would leave the client with a reset it cannot explain.

Plain listeners never come here (uvicorn's own listener serves them): their connections and
requests pay nothing for TLS.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import ssl
from collections.abc import Callable

from uvicorn.protocols.http.httptools_impl import STATUS_LINE

from frontend.api.http.protocol import LINGER_S

logger = logging.getLogger(__name__)

#: TorchServe's words to a plain HTTP request on an HTTPS port (its ExtendedSSLHandler).
PLAIN_HTTP_REFUSAL = "This TorchServe instance only accepts HTTPS requests"
#: The first byte of every TLS record a client starts with (handshake: 22), and of the other
#: record types (change_cipher_spec, alert, application_data), which the handshake refuses.
_TLS_RECORD_TYPES = frozenset(range(20, 24))
#: After a failed accept (out of file descriptors), how long before accepting again
#: (asyncio's own servers wait a second).
ACCEPT_RETRY_S = 1.0


def plain_http_refusal() -> bytes:
    """The whole answer to plain HTTP on an HTTPS port: 403 with TorchServe's JSON."""
    body = json.dumps({"status": PLAIN_HTTP_REFUSAL}, indent=2).encode()
    return b"".join([STATUS_LINE[403], b"content-type: application/json\r\n",
                     b"content-length: %d\r\nconnection: close\r\n\r\n" % len(body), body])


class TlsAcceptor:
    """Accepts the connections of one HTTPS listener: TLS ones are handed, once their
    handshake is done, to ``protocol_factory``'s protocol; plain ones are answered 403.

    ``first_byte_timeout_s`` bounds both the wait for a connection's first byte and its
    handshake (the listener's request head deadline: a connection that says nothing, or
    stalls its handshake, is closed)."""

    def __init__(self, sock: socket.socket, context: ssl.SSLContext,
                 protocol_factory: Callable[[], asyncio.Protocol], *,
                 first_byte_timeout_s: float, count_status: Callable[[int], None],
                 backlog: int) -> None:
        self._sock = sock
        self._context = context
        self._protocol_factory = protocol_factory
        self._timeout_s = first_byte_timeout_s
        self._count_status = count_status
        self._backlog = backlog
        self._accepting: asyncio.Task[None] | None = None
        #: Connections accepted and not yet handed over or refused.
        self._admitting: set[asyncio.Task[None]] = set()

    def start(self) -> None:
        """Listen and accept (the socket is bound and non-blocking)."""
        self._sock.listen(self._backlog)
        self._accepting = asyncio.get_running_loop().create_task(self._accept())

    async def close(self) -> None:
        """Stop accepting; connections still being admitted are closed. (Those handed over
        are the HTTP server's: its shutdown drains them.)"""
        tasks = [*self._admitting, *([self._accepting] if self._accepting else [])]
        self._accepting = None
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _accept(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, peer = await loop.sock_accept(self._sock)
            except OSError as exc:  # EMFILE, ENFILE, ENOBUFS: the next accept may succeed
                logger.error("HTTPS listener %s: accepting a connection failed: %s",
                             _shown(self._sock.getsockname()), exc)
                await asyncio.sleep(ACCEPT_RETRY_S)
                continue
            task = loop.create_task(self._admit(conn, peer))
            self._admitting.add(task)
            task.add_done_callback(self._admitting.discard)

    async def _admit(self, conn: socket.socket, peer: object) -> None:
        """Hand ``conn`` over to TLS, or refuse it; ``conn`` is closed here unless handed."""
        loop = asyncio.get_running_loop()
        handed = False
        try:
            conn.setblocking(False)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            first = await asyncio.wait_for(_peek(loop, conn), self._timeout_s)
            if not first:
                return  # closed before saying anything
            if first[0] in _TLS_RECORD_TYPES:
                handed = True  # from here the transport owns the socket, failing or not
                await loop.connect_accepted_socket(
                    self._protocol_factory, conn, ssl=self._context,
                    ssl_handshake_timeout=self._timeout_s)
                return
            await self._refuse(loop, conn, peer)
        except (OSError, TimeoutError) as exc:
            # A handshake the client gave up (an unknown CA, a wrong host name), a reset, a
            # silent connection: nothing to answer.
            logger.debug("HTTPS connection from %s closed: %r", _shown(peer), exc)
        finally:
            if not handed:
                conn.close()

    async def _refuse(self, loop: asyncio.AbstractEventLoop, conn: socket.socket,
                      peer: object) -> None:
        logger.warning("plain HTTP from %s on the HTTPS listener %s: refused (403)",
                       _shown(peer), _shown(self._sock.getsockname()))
        self._count_status(403)
        await loop.sock_sendall(conn, plain_http_refusal())
        conn.shutdown(socket.SHUT_WR)
        with contextlib.suppress(TimeoutError, OSError):
            await asyncio.wait_for(_drain(loop, conn), LINGER_S)


async def _peek(loop: asyncio.AbstractEventLoop, conn: socket.socket) -> bytes:
    """The connection's first byte, left unread; b"" when it closed without one."""
    while True:
        readable = loop.create_future()

        def ready(readable: asyncio.Future[None] = readable) -> None:
            if not readable.done():
                readable.set_result(None)

        loop.add_reader(conn.fileno(), ready)
        try:
            await readable
        finally:
            loop.remove_reader(conn.fileno())
        try:
            return conn.recv(1, socket.MSG_PEEK)
        except BlockingIOError:  # woken with nothing to read after all: wait again
            continue


async def _drain(loop: asyncio.AbstractEventLoop, conn: socket.socket) -> None:
    """Read and drop what the client still sends, until it closes."""
    while await loop.sock_recv(conn, 65536):
        pass


def _shown(address: object) -> str:
    """A peer or listener address for the log: ``host:port``."""
    if isinstance(address, tuple) and len(address) >= 2:
        return f"{address[0]}:{address[1]}"
    return repr(address)
