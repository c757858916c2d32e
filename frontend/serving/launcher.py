"""Launching one worker process, apart from its supervision (frontend/serving/workers.py), as
python_backend's ``stub_launcher`` is apart from its model instance.

For each life of a worker slot the launcher listens on a fresh Unix socket in the private run
directory, starts the process and waits for its HELLO, then sends LOAD; what it hands back is a
connection to a worker whose handler is initialised and warmed up (its LOADED came), or a
``WorkerStartError`` that says why not, with the last lines the worker wrote on stderr. A
worker is forked by the server's fork server (frontend/serving/forkserver.py) where its model
allows (``WorkerLaunch.forkserver``), else started fresh as ``python -P -m backend --socket
PATH``; its stdout and stderr go to the model log line by line either way.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import enum
import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from frontend.errors import GatewayTimeout, InternalError, WorkerDied
from frontend.observe.events import NO_EVENTS, ModelEvents
from frontend.observe.logs import log_output, output_lines
from frontend.observe.model_metrics import METRICS_MARK
from frontend.observe.status import ExecutionStatus
from frontend.processes import python_module, worker_environment
from frontend.serving.buckets import normalise
from frontend.serving.connection import WorkerConnection, WorkerProcess
from frontend.serving.devices import DeviceShare
from frontend.serving.forkserver import ForkOrder, ForkServer, ForkUnavailable
from frontend.serving.wire import read_frame
from protos import worker_pb2
from protos.framing import Frame, Kind, ProtocolError

# NOTE: the workers' logger: a worker's start and its supervision are one story in the server
# log (and a log configuration that names the logger sees both).
logger = logging.getLogger("frontend.serving.workers")


class StartMode(enum.Enum):
    """How a worker's process was started (describe's ``startMode``)."""

    FORKED = "forked"  # by the fork server
    FRESH = "fresh"  # a new interpreter


class WorkerStartError(InternalError):
    """The worker process could not be started or its model failed to load."""


@dataclass(frozen=True, slots=True)
class WorkerLaunch:
    """What every worker of one model version needs to start."""

    load: worker_pb2.LoadModel  # template: worker_id and gpu_id are filled per worker
    run_dir: Path
    startup_timeout_s: float
    response_timeout_s: float
    #: max_response_size: a larger response (or streamed part) fails its own request.
    max_response_bytes: int = 6553500
    #: Batches outstanding on a worker at once (the second only when full): see dispatch.py.
    batches_in_flight: int = 2
    python: str = sys.executable
    #: A regular expression (``blacklist_env_vars``): the server's environment variables whose
    #: names match it in full are not passed to the worker; "" passes them all.
    env_blocklist: str = ""
    #: What its batches and workers publish through (frontend/observe/events.py).
    events: ModelEvents = NO_EVENTS
    #: Forks the workers (None: each starts as a fresh interpreter).
    forkserver: ForkServer | None = None
    #: Its share of a device's time (``deviceGroup``; None: it names none): its workers ask
    #: it before each batch (frontend/serving/devices.py).
    device: DeviceShare | None = None


async def _forward_output(stream: asyncio.StreamReader | None, name: str,
                          tail: collections.deque[str], model_log: logging.Logger,
                          stderr: bool = False) -> None:
    """Copy a worker's stdout or stderr into the model log, one line at a time, escaped (a
    handler may print what a client sent), as TorchServe's reader threads do: under the name
    ``<worker>-stdout`` (INFO) or ``<worker>-stderr`` (WARN).

    No line is a metric, not even one that begins with TorchServe's ``[METRICS]`` mark (which
    TorchServe's frontend reads as one): a handler that prints a client's text, a newline in
    it, would let the client write that line, and forge any model's metric. Metrics travel
    only in the worker's frames (``context.metrics``); a worker that prints a marked line is
    told so, once."""
    if stream is None:
        return
    thread, level = (f"{name}-stderr", logging.WARNING) if stderr else \
        (f"{name}-stdout", logging.INFO)
    told = False
    async for text in output_lines(stream):
        if not told and text.startswith(METRICS_MARK):
            told = True
            logger.warning("%s printed a %s line: it is logged, not read as a metric (a "
                           "handler reports metrics through context.metrics)", name,
                           METRICS_MARK)
        tail.append(text)
        log_output(model_log, thread, text, level)


class Launcher:
    """Starts the processes of one worker slot, one life at a time (see the module docstring).
    What describe shows of the life being started (its pid, start, mode, load time) is here."""

    def __init__(self, launch: WorkerLaunch, name: str, worker_id: str, gpu_id: int | None,
                 cpus: tuple[int, ...] | None, threads: int,
                 model_log: logging.Logger) -> None:
        self.launch = launch
        self.name = name
        self._worker_id = worker_id
        self._gpu_id = gpu_id
        self._cpus = cpus
        self._threads = threads
        self._model_log = model_log
        self.pid: int | None = None
        #: time.time() when this life's process was started.
        self.start_time = time.time()
        #: How this life's process was started (None before the first start).
        self.start_mode: StartMode | None = None
        #: Milliseconds from this life's start until it was READY (None until it is).
        self.load_time_ms: float | None = None
        #: Of those, the milliseconds until its process said HELLO: forked or spawned, not yet
        #: loading (None until it did).
        self.hello_ms: float | None = None
        #: How this life runs batches, as its LOADED said (None until it is loaded).
        self.execution: ExecutionStatus | None = None
        self._started_at = time.monotonic()
        self._stderr_tail: collections.deque[str] = collections.deque(maxlen=20)
        self._log_tasks: list[asyncio.Task[None]] = []

    async def start(self, life: int) -> WorkerConnection:
        """Start life number ``life`` of the worker: a loaded worker's connection, or
        WorkerStartError (any other exception: the process could not be started at all)."""
        self._started_at = time.monotonic()
        path = self.launch.run_dir / f"{self._worker_id}.{life}.sock"
        loop = asyncio.get_running_loop()
        connected: asyncio.Future[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = (
            loop.create_future())

        def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            if connected.done():
                writer.close()  # only the worker we started may connect
            else:
                connected.set_result((reader, writer))

        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        listener = await asyncio.start_unix_server(on_connect, path=str(path))
        process: WorkerProcess | None = None
        try:
            os.chmod(path, 0o600)
            process = await self._start_process(path)
            self.pid = process.pid
            self.start_time = time.time()
            # Keep hard references: the loop holds tasks only weakly.
            self._log_tasks = [
                loop.create_task(_forward_output(stream, self.name, self._stderr_tail,
                                                 self._model_log, stderr))
                for stream, stderr in ((process.stdout, False), (process.stderr, True))
            ]
            reader, writer = await self._await_connection(process, connected)
        except BaseException:
            if process is not None and process.returncode is None:
                process.kill()
                await process.wait()
            raise
        finally:
            listener.close()
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        return await self._hello_and_load(process, reader, writer)

    async def _hello_and_load(self, process: WorkerProcess, reader: asyncio.StreamReader,
                              writer: asyncio.StreamWriter) -> WorkerConnection:
        """The connected worker's HELLO, then its model loaded."""
        try:
            hello = await asyncio.wait_for(read_frame(reader), self.launch.startup_timeout_s)
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError, ProtocolError) as exc:
            writer.close()
            process.kill()
            await process.wait()
            raise WorkerStartError(f"{self.name} sent no HELLO ({type(exc).__name__})"
                                   f"{self.tail_text()}") from None
        self.hello_ms = (time.monotonic() - self._started_at) * 1000
        connection = WorkerConnection(self.name, process, reader, writer)
        try:
            if hello.kind is not Kind.HELLO:
                raise WorkerStartError(f"{self.name} sent {hello.kind.name} instead of HELLO")
            await self._load(connection)
        except BaseException:
            await connection.close(grace_s=1.0)
            raise
        return connection

    async def _start_process(self, path: Path) -> WorkerProcess:
        """Fork the worker from the fork server, or, where that is not possible (or not
        wanted), start it as a fresh interpreter."""
        launch = self.launch
        self.load_time_ms = self.hello_ms = self.execution = None
        environment = self._environment()
        if launch.forkserver is not None:
            order = ForkOrder(name=self.name, socket_path=str(path), environment=environment,
                              cpu_threads=self._threads, cpus=self._cpus,
                              handler=launch.load.handler, model_dir=launch.load.model_dir)
            try:
                forked = await launch.forkserver.fork(order, launch.startup_timeout_s)
            except ForkUnavailable as exc:
                logger.info("%s starts as a fresh interpreter: %s", self.name, exc)
            else:
                self.start_mode = StartMode.FORKED
                return forked
        process = await asyncio.create_subprocess_exec(
            *python_module(launch.python, "backend"), "--socket", str(path),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            # Own session: a Ctrl-C in the terminal reaches the frontend only, which then
            # drains and stops its workers in order.
            start_new_session=True,
            env=environment,
        )
        self.start_mode = StartMode.FRESH
        if self._cpus:
            try:
                psutil.Process(process.pid).cpu_affinity(list(self._cpus))
            except BaseException:
                process.kill()
                await process.wait()
                raise
        return process

    async def _await_connection(
        self,
        process: WorkerProcess,
        connected: asyncio.Future[tuple[asyncio.StreamReader, asyncio.StreamWriter]],
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        exited = asyncio.ensure_future(process.wait())
        try:
            waited: set[asyncio.Future[Any]] = {connected, exited}
            await asyncio.wait(waited, timeout=self.launch.startup_timeout_s,
                               return_when=asyncio.FIRST_COMPLETED)
        finally:
            exited.cancel()
        if connected.done():
            return connected.result()
        if process.returncode is not None:
            raise WorkerStartError(
                f"{self.name} exited with code {process.returncode} before connecting"
                f"{self.tail_text()}")
        raise WorkerStartError(
            f"{self.name} did not connect within {self.launch.startup_timeout_s:g} s")

    def _environment(self) -> dict[str, str]:
        env = worker_environment(self.launch.env_blocklist)
        if self._threads:
            # The worker's math libraries (torch's intra-op pool among them) size their thread
            # pools to its share of the cores: workers that each took every core would fight
            # over them, and more workers would be slower than one.
            threads = str(self._threads)
            env.update(OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads)
        return env

    def tail_text(self) -> str:
        """The last lines the worker wrote on stderr, for an error's text ("" for none)."""
        return (": " + " | ".join(list(self._stderr_tail)[-5:])) if self._stderr_tail else ""

    async def _load(self, connection: WorkerConnection) -> None:
        launch = self.launch
        load = worker_pb2.LoadModel()
        load.CopyFrom(launch.load)
        load.worker_id = self._worker_id
        load.gpu_id = -1 if self._gpu_id is None else self._gpu_id
        load.cpu_threads = self._threads
        try:
            reply = await connection.request(Frame(Kind.LOAD, load.SerializeToString()),
                                             launch.startup_timeout_s)
        except (WorkerDied, GatewayTimeout) as exc:
            raise WorkerStartError(f"{self.name} failed while loading the model: {exc}"
                                   f"{self.tail_text()}") from None
        if reply.kind is Kind.LOADED:
            loaded = worker_pb2.Loaded.FromString(reply.payload)
            self.load_time_ms = (time.monotonic() - self._started_at) * 1000
            logger.info("%s (%s) is ready %.0f ms after its start (the handler took %.0f ms)",
                        self.name, self.start_mode.value if self.start_mode else "-",
                        self.load_time_ms, loaded.load_time_ms)
            self.execution = execution = execution_of(loaded.execution)
            if execution.program:
                logger.info("%s serves %s", self.name, execution.program)
            if execution.buckets or execution.fallback_reason:
                logger.info("%s runs its batches %s%s%s", self.name, execution.mode,
                            f" in batch buckets {list(execution.buckets)}"
                            if execution.buckets else "",
                            f" (it fell back: {execution.fallback_reason})"
                            if execution.fallback_reason else "")
            if launch.events.loaded is not None:
                launch.events.loaded(self.name, self.load_time_ms, loaded.metrics)
            return
        if reply.kind is Kind.ERROR:
            error = worker_pb2.Error.FromString(reply.payload)
            raise WorkerStartError(f"Failed to load model {launch.load.model_name!r}: "
                                   f"{error.message}")
        raise WorkerStartError(f"{self.name} sent {reply.kind.name} instead of LOADED")


def execution_of(reported: worker_pb2.Execution) -> ExecutionStatus:
    """A worker's ``Execution`` as it reported it (its buckets ascending, each once; no mode
    is "eager")."""
    return ExecutionStatus(reported.mode or "eager", normalise(reported.batch_buckets),
                           reported.fallback_reason, reported.graph_pool_bytes,
                           reported.program)


def describe_error(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
