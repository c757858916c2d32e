"""A front's spliced connections: what is not a fast-route prediction goes to the owner's inner
listener, whole, byte for byte from the request that was not one (``start``), for the rest of
the connection.

The bytes of that request are the reads since the connection was last between requests at the
end of a read; when requests were pipelined in one read, where the spliced one begins is found
by parsing that read again (``message_start``): llhttp says nothing of offsets, but it does say
when a message is complete, which a prefix either holds or not.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import httptools

#: The client's unsent bytes past which the owner's answers are no longer read (and the
#: client's no longer read past the owner's), until they drain.
HIGH_WATER_BYTES = 256 * 1024


class _Counter:
    """Parser callbacks that count complete messages."""

    def __init__(self) -> None:
        self.complete = 0

    def on_message_complete(self) -> None:
        self.complete += 1


def _completes(data: bytes, count: int) -> bool:
    counter = _Counter()
    parser = httptools.HttpRequestParser(counter)
    try:
        parser.feed_data(data)
    except httptools.HttpParserError:
        pass
    return counter.complete >= count


def message_start(window: bytes, complete: int) -> int:
    """Where in ``window`` (reads from a point between requests) the request after its first
    ``complete`` requests begins: the shortest prefix that holds them all."""
    low, high = 0, len(window)
    while low < high:
        middle = (low + high) // 2
        if _completes(window[:middle], complete):
            high = middle
        else:
            low = middle + 1
    return low


class Splice(asyncio.Protocol):
    """The owner's side of one spliced connection: what the owner sends goes to the client
    (``to_client``); what the client sends, to the owner (``send``)."""

    def __init__(self, to_client: Callable[[bytes], None], closed: Callable[[], None],
                 pause_client: Callable[[bool], None]) -> None:
        self._to_client = to_client
        self._closed = closed
        self._pause_client = pause_client
        self.transport: asyncio.Transport | None = None
        self._early: list[bytes] = []

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self.transport = transport
        transport.set_write_buffer_limits(high=HIGH_WATER_BYTES)
        if self._early:
            transport.write(b"".join(self._early))
            self._early.clear()

    def send(self, data: bytes) -> None:
        if self.transport is None:
            self._early.append(data)
        elif not self.transport.is_closing():
            self.transport.write(data)

    def data_received(self, data: bytes) -> None:
        self._to_client(data)

    def eof_received(self) -> bool:
        return False  # close: the owner closed its side

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed()

    def pause_writing(self) -> None:  # the owner reads slower than the client sends
        self._pause_client(True)

    def resume_writing(self) -> None:
        self._pause_client(False)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
