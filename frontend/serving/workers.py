"""Worker subprocesses: start, connect, load, serve batches, restart with backoff.

For each worker the frontend listens on a fresh Unix socket in the private run directory,
starts the worker and waits for its HELLO, then sends LOAD; the worker is READY once its
LOADED says the handler is initialised and warmed up. A worker is forked by the server's fork
server (frontend/serving/forkserver.py) where its model allows (``WorkerLaunch.forkserver``),
else started fresh as ``python -P -m backend --socket PATH``; either way it is supervised
alike. One supervisor task per worker pulls batches from the model's Batcher through its
Dispatcher (frontend/serving/dispatch.py), which holds up to ``batches_in_flight`` batches at
a time.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import enum
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import psutil

from frontend.errors import GatewayTimeout, InternalError, WorkerDied
from frontend.observe.logs import log_output, output_lines
from frontend.observe.metrics import METRICS_MARK
from frontend.processes import python_module, worker_environment
from frontend.serving.batching import Batcher, Job
from frontend.serving.connection import WorkerConnection, WorkerProcess
from frontend.serving.dispatch import Dispatcher
from frontend.serving.exchange import PredictExchange
from frontend.serving.forkserver import ForkOrder, ForkServer, ForkUnavailable
from frontend.serving.sequences import SequenceLane
from frontend.serving.wire import read_frame
from protos import worker_pb2
from protos.framing import Frame, Kind, ProtocolError

logger = logging.getLogger(__name__)

BACKOFF_FIRST_S = 0.5
BACKOFF_MAX_S = 30.0
#: A worker that stayed up this long has its restart backoff reset.
STABLE_AFTER_S = 60.0
#: Consecutive deaths (or failed starts) after which a worker counts as unhealthy.
UNHEALTHY_AFTER_FAILURES = 3



class WorkerState(enum.Enum):
    STARTING = "STARTING"
    READY = "READY"  # serving batches (describe's inFlightBatches says how many it holds)
    BACKOFF = "RESTARTING"
    STOPPING = "STOPPING"
    STOPPED = "STOPPED"


class StartMode(enum.Enum):
    """How a worker's process was started (describe's ``startMode``)."""

    FORKED = "forked"  # by the fork server
    FRESH = "fresh"  # a new interpreter


class WorkerStartError(InternalError):
    """The worker process could not be started or its model failed to load."""


class WorkerEvents(Protocol):
    """What a worker tells the server's metrics (``frontend.observe.metrics.ServerMetrics``)."""

    def worker_loaded(self, worker: str, load_ms: float,
                      metrics: Iterable[worker_pb2.Metric] = ()) -> None:
        """``worker`` loaded its model ``load_ms`` after it was started; ``metrics``: what its
        handler reported while initialising."""

    def batch_overhead(self, overhead_ms: float) -> None:
        """The frontend's own time on one batch (its frame, its reply, its answers)."""


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
    events: WorkerEvents | None = None
    #: Forks the workers (None: each starts as a fresh interpreter).
    forkserver: ForkServer | None = None


def backoff_s(failures: int) -> float:
    """Seconds to wait before restart number ``failures`` (1-based): none before the first
    (a worker that dies once is back at once, as TorchServe's first retry is), then 0.5, 1,
    2, ... capped: a worker that keeps dying, or keeps failing to load, backs off."""
    if failures <= 1:
        return 0.0
    return min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2.0 ** (failures - 2))


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


class Worker:
    """Supervises one worker slot of a model: start, serve, restart with backoff, stop."""

    def __init__(
        self,
        launch: WorkerLaunch,
        batcher: Batcher,
        number: int,
        gpu_id: int | None,
        cpus: tuple[int, ...] | None = None,
        threads: int = 0,
        on_batch: Callable[[list[Job], worker_pb2.PredictResult | None], None] | None = None,
        on_down: Callable[[], None] | None = None,
        model_log: logging.Logger | None = None,
        lane: SequenceLane | None = None,
    ) -> None:
        self.id = str(number)
        self.name = f"W-{number}-{launch.load.model_name}_{launch.load.model_version}"
        self.gpu_id = gpu_id
        self.cpus = cpus
        #: Its share of the cores (0: not set): its thread pools are sized to it.
        self.threads = len(cpus) if cpus else threads
        self.state = WorkerState.STARTING
        self.pid: int | None = None
        self.start_time = time.time()
        self.restarts = 0
        #: Deaths and failed starts since the worker last served a batch; backoff grows with it.
        self.failures = 0
        self.last_error = ""
        #: How this life's process was started (None before the first start).
        self.start_mode: StartMode | None = None
        #: Milliseconds from this life's start until it was READY (None until it is).
        self.load_time_ms: float | None = None
        self._launch = launch
        self._batcher = batcher
        self._on_batch = on_batch
        #: Builds its batches' frames and answers their jobs from the replies (one for all
        #: its lives: batch ids go on counting across restarts).
        self._exchange = PredictExchange(
            self.name, self.id, batcher, launch.max_response_bytes, self._batch_done,
            launch.events.batch_overhead if launch.events is not None else None)
        self._started_at = time.monotonic()
        loop = asyncio.get_running_loop()
        #: The outcome of the first start: None when the model loaded, else the error.
        self.first_start: asyncio.Future[WorkerStartError | None] = loop.create_future()
        self._stop_requested: asyncio.Future[None] = loop.create_future()
        self._stderr_tail: collections.deque[str] = collections.deque(maxlen=20)
        self._log_tasks: list[asyncio.Task[None]] = []
        self._dispatcher: Dispatcher | None = None
        #: Busy seconds of its past lives' dispatchers (``busy_seconds``).
        self._busy_before_s = 0.0
        self._on_down = on_down or (lambda: None)
        #: A stateful model's: the sequences this worker serves (``batcher`` is its batcher).
        self._lane = lane
        #: Where the worker's stdout and stderr go, line by line (its server's model log).
        self._model_log = model_log or logger
        self._task: asyncio.Task[None]
        self._supervise()

    @property
    def is_stopping(self) -> bool:
        return self._stop_requested.done()

    async def _run(self) -> None:
        """Start, serve and restart the worker until it is asked to stop.

        Every failure goes through the same backoff and retry, whatever raised it: a model
        that fails to load, an OSError from starting the process (EMFILE, a failed fork), or a
        bug of ours. A worker slot never silently stops trying.
        """
        while not self.is_stopping:
            self.state = WorkerState.STARTING
            try:
                await self._run_once()
            except Exception as exc:
                self._note_failure(exc)
            if self.is_stopping:
                break
            await self._wait_backoff(self.failures)
        self.state = WorkerState.STOPPED
        if self._lane is not None:
            self._lane.retire()

    async def _run_once(self) -> None:
        """One life of the worker process: start it, serve batches until it dies or is asked
        to stop, then close it."""
        try:
            connection = await self._start()
        except WorkerStartError:
            raise
        except Exception as exc:  # OSError: EMFILE, a failed fork, a run dir gone, ...
            raise WorkerStartError(f"{self.name} could not be started: {describe_error(exc)}"
                                   ) from exc
        self.state = WorkerState.READY
        self.last_error = ""
        if self._lane is not None and not self.is_stopping:
            self._lane.came_up()
        if not self.first_start.done():
            self.first_start.set_result(None)
        try:
            await self._serve(connection, up_since=time.monotonic())
        except WorkerDied as exc:
            logger.error("%s", exc)
        finally:
            self.state = WorkerState.STOPPING
            await connection.close()
            self.pid = None
        if not self.is_stopping:
            self._on_down()

    def _died(self, error: BaseException, up_since: float) -> None:
        """This life ended in ``error``: counted the moment it is seen, in the same call as
        its batches' answers, so a client told "Worker died" then finds it counted (and the
        model Unhealthy once it keeps dying)."""
        self.state = WorkerState.STOPPING
        self.last_error = str(error)
        stable = time.monotonic() - up_since > STABLE_AFTER_S
        self.failures = 1 if stable else self.failures + 1

    def _note_failure(self, exc: Exception) -> None:
        """A start (or a life) of the worker failed: log it, count it, report it."""
        if isinstance(exc, WorkerStartError):
            logger.error("%s failed to start: %s", self.name, exc, exc_info=exc.__cause__)
            error = exc
        else:  # a bug of ours while serving: the worker is restarted all the same
            logger.error("%s failed: %s", self.name, describe_error(exc), exc_info=exc)
            error = WorkerStartError(f"{self.name} failed: {describe_error(exc)}")
        self.last_error = str(error)
        self.pid = None
        if not self.first_start.done():
            self.first_start.set_result(error)
        self.failures += 1
        self._on_down()

    def _supervisor_ended(self, task: asyncio.Task[None]) -> None:
        """The supervisor task must only end when the worker was asked to stop: if it ends
        otherwise (a bug of ours), say so, count the worker as failing, and start it again."""
        if self.is_stopping:
            return
        error = None if task.cancelled() else task.exception()
        logger.error("%s: its supervisor ended unexpectedly (%s); restarting it", self.name,
                     describe_error(error) if error is not None else "cancelled",
                     exc_info=error)
        self.last_error = f"supervisor ended: {describe_error(error) if error else 'cancelled'}"
        self.state = WorkerState.BACKOFF
        self.failures = max(self.failures + 1, UNHEALTHY_AFTER_FAILURES)
        self._on_down()
        asyncio.get_running_loop().call_later(backoff_s(self.failures), self._supervise)

    def _supervise(self) -> None:
        if self.is_stopping:
            self.state = WorkerState.STOPPED
            return
        self._task = asyncio.get_running_loop().create_task(self._run(), name=self.name)
        self._task.add_done_callback(self._supervisor_ended)

    async def _wait_backoff(self, failures: int) -> None:
        if self.is_stopping:
            return
        self.state = WorkerState.BACKOFF
        self.restarts += 1
        delay = backoff_s(failures)
        logger.info("%s restarting in %.1f s (attempt %d)", self.name, delay, failures)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(self._stop_requested), delay)

    async def _start(self) -> WorkerConnection:
        launch = self._launch
        self._started_at = time.monotonic()
        path = launch.run_dir / f"{self.id}.{self.restarts}.sock"
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
        try:
            hello = await asyncio.wait_for(read_frame(reader), launch.startup_timeout_s)
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError, ProtocolError) as exc:
            writer.close()
            process.kill()
            await process.wait()
            raise WorkerStartError(f"{self.name} sent no HELLO ({type(exc).__name__})"
                                   f"{self._tail_text()}") from None
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
        launch = self._launch
        self.load_time_ms = None
        environment = self._environment()
        if launch.forkserver is not None:
            order = ForkOrder(name=self.name, socket_path=str(path), environment=environment,
                              cpu_threads=self.threads, cpus=self.cpus,
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
        if self.cpus:
            try:
                psutil.Process(process.pid).cpu_affinity(list(self.cpus))
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
            await asyncio.wait(waited, timeout=self._launch.startup_timeout_s,
                               return_when=asyncio.FIRST_COMPLETED)
        finally:
            exited.cancel()
        if connected.done():
            return connected.result()
        if process.returncode is not None:
            raise WorkerStartError(
                f"{self.name} exited with code {process.returncode} before connecting"
                f"{self._tail_text()}")
        raise WorkerStartError(
            f"{self.name} did not connect within {self._launch.startup_timeout_s:g} s")

    def _environment(self) -> dict[str, str]:
        env = worker_environment(self._launch.env_blocklist)
        if self.threads:
            # The worker's math libraries (torch's intra-op pool among them) size their thread
            # pools to its share of the cores: workers that each took every core would fight
            # over them, and more workers would be slower than one.
            threads = str(self.threads)
            env.update(OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads)
        return env

    def _tail_text(self) -> str:
        return (": " + " | ".join(list(self._stderr_tail)[-5:])) if self._stderr_tail else ""

    async def _load(self, connection: WorkerConnection) -> None:
        launch = self._launch
        load = worker_pb2.LoadModel()
        load.CopyFrom(launch.load)
        load.worker_id = self.id
        load.gpu_id = -1 if self.gpu_id is None else self.gpu_id
        load.cpu_threads = self.threads
        try:
            reply = await connection.request(Frame(Kind.LOAD, load.SerializeToString()),
                                             launch.startup_timeout_s)
        except (WorkerDied, GatewayTimeout) as exc:
            raise WorkerStartError(f"{self.name} failed while loading the model: {exc}"
                                   f"{self._tail_text()}") from None
        if reply.kind is Kind.LOADED:
            loaded = worker_pb2.Loaded.FromString(reply.payload)
            self.load_time_ms = (time.monotonic() - self._started_at) * 1000
            logger.info("%s (%s) is ready %.0f ms after its start (the handler took %.0f ms)",
                        self.name, self.start_mode.value if self.start_mode else "-",
                        self.load_time_ms, loaded.load_time_ms)
            if launch.events is not None:
                launch.events.worker_loaded(self.name, self.load_time_ms, loaded.metrics)
            return
        if reply.kind is Kind.ERROR:
            error = worker_pb2.Error.FromString(reply.payload)
            raise WorkerStartError(f"Failed to load model {launch.load.model_name!r}: "
                                   f"{error.message}")
        raise WorkerStartError(f"{self.name} sent {reply.kind.name} instead of LOADED")

    async def _serve(self, connection: WorkerConnection, up_since: float) -> None:
        """Run batches on the worker until it is to stop (returns) or is gone (WorkerDied).

        A ``Dispatcher`` does the work, in callbacks: it parks in the batcher, sends up to
        ``batches_in_flight`` batches, and routes the replies (``frontend/serving/dispatch.py``).
        """
        loop = asyncio.get_running_loop()
        finished: asyncio.Future[None] = loop.create_future()

        def done(error: BaseException | None) -> None:
            if finished.done():
                return
            self._lane_down(error)
            if error is not None and not self.is_stopping:
                self._died(error, up_since)
            if error is None:
                finished.set_result(None)
            else:
                finished.set_exception(error)

        dispatcher = Dispatcher(
            self.name, self._batcher, connection,
            timeout_s=self._launch.response_timeout_s,
            max_in_flight=self._launch.batches_in_flight,
            exchange=self._exchange, on_done=done, call_later=loop.call_later, clock=time.monotonic)
        self._dispatcher = dispatcher

        def on_exit(_: object) -> None:
            dispatcher.connection_lost(WorkerDied(
                f"Worker died: {self.name} (pid {self.pid}) exited with code "
                f"{connection.process.returncode} while idle"))

        def on_stop(_: object) -> None:
            dispatcher.stop()

        connection.closed.add_done_callback(on_exit)
        self._stop_requested.add_done_callback(on_stop)
        try:
            if connection.closed.done():
                on_exit(None)
            elif self.is_stopping:
                dispatcher.stop()
            else:
                dispatcher.start()
            await finished
        finally:
            connection.closed.remove_done_callback(on_exit)
            self._stop_requested.remove_done_callback(on_stop)
            # Cancelled with batches in flight: nobody will deliver their answers now.
            dispatcher.abandon(WorkerDied(f"{self.name} stopped during a batch"))
            self._busy_before_s += dispatcher.busy_s
            self._dispatcher = None
            self._lane_down(None)

    def _lane_down(self, error: BaseException | None) -> None:
        """This life of the worker is over (``error``: why, None: it was stopped): the
        sequences whose state it held end at once, before a new one could bind to it."""
        if self._lane is not None:
            self._lane.went_down(f"its worker {self.name} failed ({error})" if error is not None
                                 else f"its worker {self.name} was stopped")

    @property
    def in_flight(self) -> int:
        """Batches sent to the worker and not answered yet."""
        return len(self._dispatcher.in_flight) if self._dispatcher is not None else 0

    def busy_seconds(self) -> float:
        """Seconds this worker slot has spent on batches, over all its lives (the live page
        reads it each second: its utilisation is the increase over the time passed)."""
        dispatcher = self._dispatcher
        return self._busy_before_s + (dispatcher.busy_seconds() if dispatcher is not None
                                      else 0.0)

    def _batch_done(self, jobs: list[Job], result: worker_pb2.PredictResult | None) -> None:
        """A batch's reply was read (``result`` None: the batch failed as a whole)."""
        if result is not None:
            self.failures = 0
        if self._on_batch is not None:
            self._on_batch(jobs, result)

    async def stop(self, timeout_s: float | None) -> None:
        """Stop after the batches in flight (waiting at most ``timeout_s``; None: no limit)."""
        if self._lane is not None:
            self._lane.draining()
        if not self._stop_requested.done():
            self._stop_requested.set_result(None)
        try:
            await asyncio.wait_for(asyncio.shield(self._task), timeout_s)
        except TimeoutError:
            logger.warning("%s did not finish its batch within %s s; killing it",
                           self.name, timeout_s)
            if self.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.pid, signal.SIGKILL)
            await self._task

    @property
    def is_unhealthy(self) -> bool:
        """Keeps dying or failing to start (TorchServe reports such a model unhealthy)."""
        return self.failures >= UNHEALTHY_AFTER_FAILURES

    @property
    def is_up(self) -> bool:
        """Its process is loaded and can take a batch."""
        return self.state is WorkerState.READY

    @property
    def is_down(self) -> bool:
        """Keeps failing and is not up now: nothing queued for it will run soon."""
        return self.is_unhealthy and not self.is_up


async def start_failures(workers: Iterable[Worker]) -> list[WorkerStartError]:
    """Wait until each of ``workers`` has loaded its model or failed to; the failures."""
    outcomes = await asyncio.gather(*(worker.first_start for worker in workers))
    return [outcome for outcome in outcomes if outcome is not None]


def describe_error(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
