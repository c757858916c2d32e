"""The frontend's side of the fork server (backend/process/forkserver.py): workers forked from
one pre-started process instead of a fresh interpreter each (docs/workers.md).

A ``ForkServer`` starts ``python -P -m backend.process.forkserver`` on the first ``fork`` (as
workers are started), over a SOCK_SEQPACKET socket pair it alone holds the other end of,
or adopts one started earlier (``launch``): the server starts it before anything else when
it has startup models, so that its imports (torch: seconds) run while the frontend starts.
A FORK request carries the worker's environment, cores, thread budget and handler, and the
write ends of its stdout and stderr pipes; the answer carries the new worker's pid and a
pidfd of it. The worker is the fork server's child, not ours: the fork server reaps it and
reports its exit status (EXITED), and the pidfd tells us it exited even when the fork server is
gone (its status is then unknown: ``UNKNOWN_EXIT``). A ``ForkedProcess`` offers what the worker
supervision uses of a process (frontend/serving/workers.py): pid, returncode, wait, kill,
stdout and stderr.

Whenever forking is not possible (the platform has no fork or pidfd, the fork server cannot
start or died during a request, or it refuses: CUDA initialised in it, a thread running),
``fork`` raises ForkUnavailable and the worker starts fresh. A refusal whose reason lasts
(``Forked.lasting``) turns forking off for the server's life; it is logged once.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from frontend.observe.logs import log_output, output_lines
from frontend.processes import python_module
from protos import worker_pb2
from protos.framing import Frame, FrameDecoder, Kind, ProtocolError, encode

logger = logging.getLogger(__name__)

#: The exit status of a forked worker whose fork server was gone when it exited.
UNKNOWN_EXIT = -1
#: How long after a forked worker's pidfd says it exited its status may take to arrive.
EXIT_REPORT_S = 1.0
#: Failed starts of the fork server after which workers start fresh for good.
MAX_START_FAILURES = 3
MAX_PACKET_BYTES = 1 << 16
STOP_GRACE_S = 5.0


class ForkUnavailable(Exception):
    """This worker cannot be forked: it is to start fresh (the message says why)."""


@dataclass(frozen=True, slots=True)
class ForkOrder:
    """One worker to fork."""

    name: str
    socket_path: str
    environment: Mapping[str, str]
    cpu_threads: int
    cpus: tuple[int, ...] | None
    #: The model's handler and unpacked archive: what the fork server imports first.
    handler: str
    model_dir: str


def fork_unsupported() -> str:
    """Why this platform cannot fork workers ("" when it can): fork, pidfds (Linux 5.3) and
    descriptor passing are needed."""
    if not sys.platform.startswith("linux"):
        return f"workers are forked on Linux only (this is {sys.platform})"
    if not hasattr(os, "pidfd_open") or not hasattr(socket, "send_fds"):
        return "this Python has no os.pidfd_open or socket.send_fds"
    try:
        os.close(os.pidfd_open(os.getpid()))
    except OSError as exc:
        return f"this kernel has no pidfd_open ({exc})"
    return ""


@dataclass(slots=True)
class Launch:
    """A fork server process started and not yet talked to (see ``launch``)."""

    process: subprocess.Popen[bytes]
    control: socket.socket
    #: The read ends of its stdout and stderr pipes (-1 once handed on or closed).
    stdout: int
    stderr: int
    python: str
    environment: dict[str, str]

    def discard(self) -> None:
        """Stop it unused (again: nothing)."""
        self.control.close()
        _close_all(self.stdout, self.stderr)
        self.stdout = self.stderr = -1
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(STOP_GRACE_S)


def launch(python: str, environment: Mapping[str, str], preload: Iterable[str] = (),
           archives: Iterable[Path] = ()) -> Launch:
    """Start a fork server that imports ``preload`` and what the handlers of ``archives``
    (model archives, not yet unpacked) need, then says HELLO; ForkUnavailable when it cannot
    be started. Needs no event loop: the server calls it before it has one."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    command = [*python_module(python, "backend.process.forkserver"),
               "--control-fd", str(theirs.fileno()), "--frontend-pid", str(os.getpid())]
    for module in preload:
        command += ["--preload", module]
    for archive in archives:
        command += ["--preload-archive", str(archive)]
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    try:
        process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=out_w,
                                   stderr=err_w, start_new_session=True, env=dict(environment),
                                   pass_fds=(theirs.fileno(),))
    except OSError as exc:
        ours.close()
        _close_all(out_r, err_r)
        raise ForkUnavailable(f"{type(exc).__name__}: {exc}") from None
    finally:
        theirs.close()
        _close_all(out_w, err_w)
    return Launch(process, ours, out_r, err_r, python, dict(environment))


async def _exited(process: subprocess.Popen[bytes]) -> int:
    """Wait (without blocking the loop) until ``process`` has exited; its status."""
    if process.poll() is not None:
        return process.returncode
    loop = asyncio.get_running_loop()
    pidfd = os.pidfd_open(process.pid)
    gone: asyncio.Future[None] = loop.create_future()

    def readable() -> None:
        if not gone.done():
            gone.set_result(None)

    loop.add_reader(pidfd, readable)
    try:
        await gone
    finally:
        loop.remove_reader(pidfd)
        os.close(pidfd)
    return process.wait()


class ForkedProcess:
    """A worker the fork server forked, as the frontend sees it (see the module docstring)."""

    def __init__(self, pid: int, pidfd: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self.stdout: asyncio.StreamReader | None = None
        self.stderr: asyncio.StreamReader | None = None
        self._loop = asyncio.get_running_loop()
        self._pidfd: int | None = pidfd
        self._done: asyncio.Future[int] = self._loop.create_future()
        self._gone = False  # its pidfd said it exited
        self._orphaned = False  # its fork server is gone: no status will come
        self._timer: asyncio.TimerHandle | None = None
        self._loop.add_reader(pidfd, self._on_pidfd)
        self._watching = True

    async def wait(self) -> int:
        """Wait until the worker has exited; its exit status (``UNKNOWN_EXIT``: unknown)."""
        return await asyncio.shield(self._done)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def send_signal(self, number: int) -> None:
        """Signal the worker through its pidfd: never another process that got its pid."""
        if self._pidfd is not None and not self._gone:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self._pidfd, number)

    async def attach_output(self, stdout: int, stderr: int) -> None:
        """Read the worker's stdout and stderr from these pipe read ends, which are its to
        close from now on, whatever happens."""
        try:
            self.stdout = await _pipe_reader(stdout)
        except BaseException:
            _close_all(stderr)
            raise
        self.stderr = await _pipe_reader(stderr)

    def exited(self, code: int) -> None:
        """The fork server reaped the worker: its exit status."""
        self._finish(code)

    def orphaned(self) -> None:
        """The fork server is gone: the worker's exit, when its pidfd shows it, has no known
        status."""
        self._orphaned = True
        if self._gone:
            self._finish(UNKNOWN_EXIT)

    def _on_pidfd(self) -> None:
        self._unwatch()
        self._gone = True
        if self._orphaned:
            self._finish(UNKNOWN_EXIT)
        elif not self._done.done():
            self._timer = self._loop.call_later(EXIT_REPORT_S, self._finish, UNKNOWN_EXIT)

    def _finish(self, code: int) -> None:
        if self._done.done():
            return
        self.returncode = code
        self._done.set_result(code)
        if self._timer is not None:
            self._timer.cancel()
        self._unwatch()
        self._gone = True
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None

    def _unwatch(self) -> None:
        if self._watching and self._pidfd is not None:
            self._watching = False
            self._loop.remove_reader(self._pidfd)


class _PipeProtocol(asyncio.StreamReaderProtocol):
    """A pipe's reader whose transport closes at end of file (a StreamReaderProtocol keeps a
    socket half-open there, which leaves a pipe's transport open for ever)."""

    def eof_received(self) -> bool:
        super().eof_received()
        return False


def _libuv_closes_pipes(loop: asyncio.AbstractEventLoop) -> bool:
    """Whether ``loop`` closes a read pipe's descriptor itself (uvloop: libuv does, and then
    closes the file object it was given too)."""
    return type(loop).__module__.startswith("uvloop")


async def _pipe_reader(fd: int) -> asyncio.StreamReader:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=1 << 16, loop=loop)
    # One owner closes ``fd``, once. uvloop's transport closes it through libuv and then
    # closes the file object as well, expecting EBADF; another thread may have been given the
    # same number in between (a client socket, an archive being read), and that is what the
    # second close would close. So under uvloop the file object does not own the descriptor.
    pipe = os.fdopen(fd, "rb", buffering=0, closefd=not _libuv_closes_pipes(loop))
    try:
        await loop.connect_read_pipe(lambda: _PipeProtocol(reader, loop=loop), pipe)
    except BaseException:
        pipe.close()
        raise
    return reader


_Reply = ForkedProcess | worker_pb2.Forked


class ForkServer:
    """One server's fork server process, started on first use and again after it dies."""

    def __init__(self, python: str, environment: Mapping[str, str], model_log: logging.Logger,
                 preload: tuple[str, ...] = (), launched: Launch | None = None) -> None:
        self._python = python
        self._environment = dict(environment)
        self._model_log = model_log
        self._preload = preload
        #: Started early (``launch``), adopted on the first fork.
        self._launched = launched
        self._process: subprocess.Popen[bytes] | None = None
        self._control: socket.socket | None = None
        self._hello: asyncio.Future[int] | None = None
        #: Answers awaited, in the order the requests went.
        self._pending: collections.deque[asyncio.Future[_Reply]] = collections.deque()
        self._children: dict[int, ForkedProcess] = {}
        self._start_lock: asyncio.Lock | None = None
        self._start_failures = 0
        #: Why forking is off for good ("" while it is on).
        self.refusal = ""
        self._closed = False
        self._log_tasks: list[asyncio.Task[None]] = []

    @property
    def pid(self) -> int | None:
        """The fork server's pid while it runs."""
        return self._process.pid if self._process is not None and self._control else None

    async def fork(self, order: ForkOrder, timeout_s: float) -> ForkedProcess:
        """Fork one worker; ForkUnavailable when it cannot be (it is to start fresh)."""
        control = await self._started(timeout_s)
        out_r, out_w = os.pipe()
        try:
            err_r, err_w = os.pipe()
        except BaseException:
            _close_all(out_r, out_w)
            raise
        try:
            reply = self._ask(control, order, out_w, err_w)
            try:
                outcome = await asyncio.wait_for(asyncio.shield(reply), timeout_s)
            except asyncio.CancelledError:
                reply.cancel()  # the worker forked for it, if any, is killed as it comes
                raise
            except TimeoutError:
                self._lost(f"did not answer within {timeout_s:g} s", kill=True)
                raise ForkUnavailable(
                    f"the fork server did not answer within {timeout_s:g} s") from None
            if isinstance(outcome, worker_pb2.Forked):
                if outcome.lasting and not self.refusal:
                    self.refusal = outcome.refused
                    logger.warning("workers start fresh from now on: %s", outcome.refused)
                raise ForkUnavailable(outcome.refused)
            ends, out_r, err_r = (out_r, err_r), -1, -1
            try:
                await outcome.attach_output(*ends)
            except BaseException:
                outcome.kill()
                raise
            return outcome
        finally:
            _close_all(out_r, err_r)

    def _ask(self, control: socket.socket, order: ForkOrder, out_w: int, err_w: int
             ) -> asyncio.Future[_Reply]:
        """Send one FORK with the write ends (closed here either way); its answer."""
        request = worker_pb2.ForkRequest(
            socket_path=order.socket_path, environment=dict(order.environment),
            cpu_threads=order.cpu_threads, cpus=order.cpus or (), handler=order.handler,
            model_dir=order.model_dir, name=order.name)
        try:
            socket.send_fds(control, [encode(Frame(Kind.FORK, request.SerializeToString()))],
                            [out_w, err_w])
        except OSError as exc:  # gone (EPIPE), or its queue is full (EAGAIN)
            raise ForkUnavailable(f"the fork server could not be asked: {exc}") from None
        finally:
            _close_all(out_w, err_w)
        reply: asyncio.Future[_Reply] = asyncio.get_running_loop().create_future()
        self._pending.append(reply)
        return reply

    async def _started(self, timeout_s: float) -> socket.socket:
        """The control socket of a running fork server, started now if need be."""
        if self._start_lock is None:
            self._start_lock = asyncio.Lock()
        async with self._start_lock:
            if self.refusal:
                raise ForkUnavailable(self.refusal)
            if self._closed:
                raise ForkUnavailable("the server is stopping")
            if self._control is not None:
                return self._control
            if self._start_failures >= MAX_START_FAILURES:
                raise ForkUnavailable(f"the fork server failed to start "
                                      f"{self._start_failures} times")
            try:
                control = await self._start(timeout_s)
            except ForkUnavailable as exc:
                self._start_failures += 1
                logger.warning("the fork server could not be started: %s", exc)
                raise
            self._start_failures = 0
            return control

    async def _start(self, timeout_s: float) -> socket.socket:
        loop = asyncio.get_running_loop()
        launched, self._launched = self._launched, None
        if launched is not None and (launched.python, launched.environment) != (
                self._python, self._environment):
            launched.discard()  # started for other settings: not this server's
            launched = None
        if launched is None:
            launched = launch(self._python, self._environment, self._preload)
        process, ours = launched.process, launched.control
        ours.setblocking(False)
        self._process, self._control = process, ours
        self._hello = loop.create_future()
        # Kept: the loop holds tasks only weakly (an earlier fork server's may still run).
        self._log_tasks = [task for task in self._log_tasks if not task.done()]
        for fd, stderr in ((launched.stdout, False), (launched.stderr, True)):
            self._log_tasks.append(loop.create_task(
                self._forward(await _pipe_reader(fd), stderr)))
        launched.stdout = launched.stderr = -1
        loop.add_reader(ours.fileno(), self._on_readable)
        try:
            await asyncio.wait_for(asyncio.shield(self._hello), timeout_s)
        except TimeoutError:
            self._lost(f"did not start within {timeout_s:g} s", kill=True)
            raise ForkUnavailable(f"it did not start within {timeout_s:g} s") from None
        logger.info("fork server started (pid %d)", process.pid)
        return ours

    async def _forward(self, stream: asyncio.StreamReader | None, stderr: bool) -> None:
        """The fork server's own output into the model log, escaped, as a worker's (named
        ``forkserver-stdout`` or ``forkserver-stderr``)."""
        if stream is None:
            return
        thread, level = ("forkserver-stderr", logging.WARNING) if stderr else \
            ("forkserver-stdout", logging.INFO)
        async for text in output_lines(stream):
            log_output(self._model_log, thread, text, level)

    def _on_readable(self) -> None:
        control = self._control
        while control is not None:
            try:
                data, fds, _, _ = socket.recv_fds(control, MAX_PACKET_BYTES, 4)
            except BlockingIOError:
                return
            except OSError as exc:
                self._lost(f"broke its socket ({exc})")
                return
            if not data:
                self._lost("exited", kill=False)
                return
            try:
                self._on_packet(data, fds)
            except ProtocolError as exc:
                _close_all(*fds)
                self._lost(f"broke the protocol ({exc})", kill=True)
                return

    def _on_packet(self, data: bytes, fds: list[int]) -> None:
        frames = FrameDecoder().feed(data)
        if len(frames) != 1:
            raise ProtocolError(f"a packet holds {len(frames)} frames")
        [frame] = frames
        if frame.kind is Kind.HELLO:
            if self._hello is not None and not self._hello.done():
                self._hello.set_result(worker_pb2.Hello.FromString(frame.payload).pid)
        elif frame.kind is Kind.FORKED:
            self._on_forked(worker_pb2.Forked.FromString(frame.payload), fds)
        elif frame.kind is Kind.EXITED:
            exited = worker_pb2.ChildExited.FromString(frame.payload)
            child = self._children.pop(exited.pid, None)
            if child is not None:
                child.exited(exited.returncode)
        else:
            raise ProtocolError(f"unexpected frame {frame.kind.name}")

    def _on_forked(self, forked: worker_pb2.Forked, fds: list[int]) -> None:
        if not self._pending:
            raise ProtocolError("an answer to no request")  # its fds closed by the caller
        reply = self._pending.popleft()
        if forked.refused or not fds:
            _close_all(*fds)
            outcome: _Reply = forked if forked.refused else worker_pb2.Forked(
                refused="the fork server sent no pidfd")
        else:
            _close_all(*fds[1:])
            outcome = ForkedProcess(forked.pid, fds[0])
            self._children[forked.pid] = outcome
        if reply.done():  # its requester gave up: nobody will run this worker
            if isinstance(outcome, ForkedProcess):
                outcome.kill()
            return
        reply.set_result(outcome)

    def _lost(self, reason: str, kill: bool = True) -> None:
        """The fork server is gone (or is to be): fail what waits on it; it starts again on
        the next fork."""
        control, process = self._control, self._process
        if control is None:
            return
        self._control = None
        loop = asyncio.get_running_loop()
        loop.remove_reader(control.fileno())
        control.close()
        if not self._closed:
            logger.warning("the fork server %s", reason)
        error = ForkUnavailable(f"the fork server {reason}")
        if self._hello is not None and not self._hello.done():
            self._hello.set_exception(error)
            self._hello.exception()  # retrieved: nobody else may be waiting
        while self._pending:
            reply = self._pending.popleft()
            if not reply.done():
                reply.set_exception(error)
        for child in self._children.values():
            child.orphaned()
        self._children.clear()
        if process is not None and process.poll() is None:
            if kill:
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
            # Reaped in the background: its workers live on without it.
            self._log_tasks.append(loop.create_task(_reap(process)))

    def drop_unused_launch(self) -> None:
        """Stop the fork server started early if no worker was forked from it (the startup
        models all start fresh): it would hold its imports for nothing."""
        if self._launched is not None:
            logger.info("the fork server started for the startup models was not needed")
            self._launched.discard()
            self._launched = None

    async def close(self) -> None:
        """Stop the fork server (its workers were stopped before)."""
        self._closed = True
        self.drop_unused_launch()
        control, process = self._control, self._process
        if control is not None:
            with contextlib.suppress(OSError):
                socket.send_fds(control, [encode(Frame(Kind.SHUTDOWN))], [])
        if process is not None:
            try:
                await asyncio.wait_for(_exited(process), STOP_GRACE_S)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
                await _exited(process)
        self._lost("was stopped", kill=True)
        tasks, self._log_tasks = self._log_tasks, []
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(task, STOP_GRACE_S)


async def _reap(process: subprocess.Popen[bytes]) -> None:
    await _exited(process)


def _close_all(*fds: int) -> None:
    for fd in fds:
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)
