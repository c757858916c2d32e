"""One live worker process and its Unix socket: frames sent, replies read in order, the
process's exit watched (its death ends the connection even while a child it forked holds the
socket open)."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import signal
from collections.abc import Callable
from typing import Protocol

from frontend.errors import GatewayTimeout, WorkerDied
from frontend.serving.wire import read_frame, write_frame
from protos import worker_pb2
from protos.framing import Frame, Kind, ProtocolError

logger = logging.getLogger(__name__)

#: How long after a worker process exits its socket is read before being dropped.
EXIT_GRACE_S = 0.1


class WorkerProcess(Protocol):
    """What the frontend uses of a worker process: a fresh one (``asyncio.subprocess.Process``)
    or one the fork server forked (``frontend.serving.forkserver.ForkedProcess``)."""

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None: ...

    @property
    def stdout(self) -> asyncio.StreamReader | None: ...

    @property
    def stderr(self) -> asyncio.StreamReader | None: ...

    async def wait(self) -> int: ...

    def kill(self) -> None: ...


class WorkerConnection:
    """One live worker process and its socket. Frames sent are answered in order: each
    sender's ``on_reply`` is called with its reply as the replies are read."""

    def __init__(
        self,
        name: str,
        process: WorkerProcess,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> None:
        self.name = name
        self.process = process
        self._reader = reader
        self._writer = writer
        loop = asyncio.get_running_loop()
        #: Called, oldest first, with the replies to the frames outstanding (or with the error
        #: that ends them).
        self._replies: collections.deque[Callable[[Frame | BaseException], None]] = (
            collections.deque())
        #: Receives each intermediate response (PARTIAL frame) of the batches in flight.
        self.on_partial: Callable[[worker_pb2.Response], None] | None = None
        self.closed: asyncio.Future[None] = loop.create_future()
        self._read_task = loop.create_task(self._read_loop())
        self._exit_task = loop.create_task(self._watch_exit())

    async def _watch_exit(self) -> None:
        """End the connection when the process exits, whether or not its socket closes.

        A child the handler forked (multiprocessing, DataLoader workers) may hold the socket
        open after the worker itself died, so end of file alone would leave its batch waiting
        for the response timeout. What the worker wrote before it exited is still read first:
        the socket is dropped a moment after the exit, not at once.
        """
        await self.process.wait()
        if not self.closed.done():
            asyncio.get_running_loop().call_later(EXIT_GRACE_S, self._drop_socket)

    def _drop_socket(self) -> None:
        if not self.closed.done():
            self._writer.transport.abort()  # the reader sees end of file

    async def _read_loop(self) -> None:
        reason = "closed its socket"
        try:
            while True:
                frame = await read_frame(self._reader)
                if frame.kind is Kind.PARTIAL:
                    if self.on_partial is not None:
                        self.on_partial(worker_pb2.Response.FromString(frame.payload))
                elif self._replies:
                    self._reply(frame)
                else:
                    logger.warning("%s sent an unexpected %s frame", self.name, frame.kind.name)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        except ProtocolError as exc:
            reason = f"broke the protocol ({exc})"
            self.kill()
        finally:
            code = await self._exit_code(0.5)
            if code is not None:
                reason = f"exited with code {code}"
            while self._replies:
                self._reply(WorkerDied(
                    f"Worker died: {self.name} (pid {self.process.pid}) {reason}"))
            if not self.closed.done():
                self.closed.set_result(None)

    def _reply(self, outcome: Frame | BaseException) -> None:
        on_reply = self._replies.popleft()
        try:
            on_reply(outcome)
        except Exception:  # the reader must go on whatever a callback does
            logger.exception("%s: handling a reply failed", self.name)

    async def _exit_code(self, wait_s: float) -> int | None:
        try:
            return await asyncio.wait_for(self.process.wait(), wait_s)
        except TimeoutError:
            return None

    def send(self, frame: Frame, on_reply: Callable[[Frame | BaseException], None]) -> None:
        """Send one frame; ``on_reply`` is called, from the reader, with the worker's reply
        frame as soon as it is read, or with WorkerDied if the worker goes first. Raises
        WorkerDied if the worker is gone already."""
        if self.closed.done():
            raise WorkerDied(f"Worker died: {self.name} is gone")
        try:
            write_frame(self._writer, frame)
        except (ConnectionError, RuntimeError) as exc:
            raise WorkerDied(f"Worker died: {self.name}: {exc}") from None
        self._replies.append(on_reply)

    def forget_replies(self) -> None:
        """Stop waiting for the outstanding replies (their senders gave up on them; the
        worker is being killed)."""
        self._replies.clear()

    async def request(self, frame: Frame, timeout_s: float) -> Frame:
        """Send one frame and wait for the worker's reply frame."""
        loop = asyncio.get_running_loop()
        reply: asyncio.Future[Frame] = loop.create_future()

        def on_reply(outcome: Frame | BaseException) -> None:
            if reply.done():
                return
            if isinstance(outcome, BaseException):
                reply.set_exception(outcome)
            else:
                reply.set_result(outcome)

        self.send(frame, on_reply)
        timer = loop.call_later(timeout_s, _expire, reply, timeout_s, self.name)
        try:
            await self._writer.drain()
            return await reply
        except ConnectionError as exc:
            raise WorkerDied(f"Worker died: {self.name}: {exc}") from None
        finally:
            timer.cancel()
            if not reply.done():
                self.forget_replies()

    def kill(self) -> None:
        if self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.kill()

    async def close(self, grace_s: float = 5.0) -> None:
        """Ask the worker to exit, kill it if it does not, and reap it."""
        if self.process.returncode is None and not self.closed.done():
            with contextlib.suppress(ConnectionError, RuntimeError):
                write_frame(self._writer, Frame(Kind.SHUTDOWN))
                await self._writer.drain()
        self._writer.close()
        if await self._exit_code(grace_s) is None:
            self.kill()
            await self.process.wait()
        # The worker leads its own process group (start_new_session): whatever it forked and
        # left running goes with it, so no orphan keeps its GPU memory, socket or pipes.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        with contextlib.suppress(asyncio.CancelledError):
            await self._read_task
        self._exit_task.cancel()


def _expire(reply: asyncio.Future[Frame], timeout_s: float, name: str) -> None:
    if not reply.done():
        reply.set_exception(GatewayTimeout(
            f"{name} did not answer within the response timeout of {timeout_s:g} s"))
