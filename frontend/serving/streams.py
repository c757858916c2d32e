"""Responses that arrive in parts: a handler's intermediate responses, then its final one."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from protos import worker_pb2


class ResponseStream:
    """The parts of one request's answer, in order; ends with the final response or an error.

    A job's future resolves to a ResponseStream (instead of a Response) as soon as its first
    intermediate part arrives, so the usual one-future hot path costs nothing extra.
    """

    def __init__(self) -> None:
        self._parts: asyncio.Queue[worker_pb2.Response | BaseException | None] = asyncio.Queue()
        self.final: worker_pb2.Response | None = None

    def put(self, part: worker_pb2.Response) -> None:
        self._parts.put_nowait(part)

    def finish(self, final: worker_pb2.Response) -> None:
        """The final response: its body (if any) is the last part."""
        self.final = final
        if final.body or final.error:
            self._parts.put_nowait(final)
        self._parts.put_nowait(None)

    def fail(self, error: BaseException) -> None:
        self._parts.put_nowait(error)
        self._parts.put_nowait(None)

    async def __aiter__(self) -> AsyncIterator[worker_pb2.Response]:
        while (part := await self._parts.get()) is not None:
            if isinstance(part, BaseException):
                raise part
            yield part
