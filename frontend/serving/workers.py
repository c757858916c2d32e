"""Worker supervision: one supervisor per worker slot starts its process (through its
``Launcher``, frontend/serving/launcher.py), serves batches on it, and restarts it with
backoff when it dies or fails to start, until the slot is asked to stop.

One supervisor task per worker pulls batches from the model's Batcher through its Dispatcher
(frontend/serving/dispatch.py), which holds up to ``batches_in_flight`` batches at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import os
import signal
import time
from collections.abc import Callable, Iterable

from frontend.errors import WorkerDied
from frontend.observe.status import ExecutionStatus
from frontend.serving.batching import Batcher, Job
from frontend.serving.connection import WorkerConnection
from frontend.serving.dispatch import Dispatcher
from frontend.serving.exchange import PredictExchange
from frontend.serving.launcher import Launcher as Launcher
from frontend.serving.launcher import StartMode as StartMode
from frontend.serving.launcher import WorkerLaunch as WorkerLaunch
from frontend.serving.launcher import WorkerStartError as WorkerStartError
from frontend.serving.launcher import describe_error as describe_error
from frontend.serving.sequences import SequenceLane
from protos import worker_pb2

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


def backoff_s(failures: int) -> float:
    """Seconds to wait before restart number ``failures`` (1-based): none before the first
    (a worker that dies once is back at once, as TorchServe's first retry is), then 0.5, 1,
    2, ... capped: a worker that keeps dying, or keeps failing to load, backs off."""
    if failures <= 1:
        return 0.0
    return min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2.0 ** (failures - 2))


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
        on_loaded: Callable[[], None] | None = None,
    ) -> None:
        self.id = str(number)
        self.name = f"W-{number}-{launch.load.model_name}_{launch.load.model_version}"
        self.gpu_id = gpu_id
        self.cpus = cpus
        #: Its share of the cores (0: not set): its thread pools are sized to it.
        self.threads = len(cpus) if cpus else threads
        self.state = WorkerState.STARTING
        self.restarts = 0
        #: Deaths and failed starts since the worker last served a batch; backoff grows with it.
        self.failures = 0
        self.last_error = ""
        self._launch = launch
        #: Starts its processes; what describe shows of the current life is there.
        self._launcher = Launcher(launch, self.name, self.id, gpu_id, cpus, self.threads,
                                  model_log or logger)
        self._batcher = batcher
        self._on_batch = on_batch
        #: Builds its batches' frames and answers their jobs from the replies (one for all
        #: its lives: batch ids go on counting across restarts).
        self._exchange = PredictExchange(
            self.name, self.id, batcher, launch.max_response_bytes, self._batch_done,
            launch.events)
        loop = asyncio.get_running_loop()
        #: The outcome of the first start: None when the model loaded, else the error.
        self.first_start: asyncio.Future[WorkerStartError | None] = loop.create_future()
        self._stop_requested: asyncio.Future[None] = loop.create_future()
        self._dispatcher: Dispatcher | None = None
        self._on_down = on_down or (lambda: None)
        #: Told each time a life of the worker has loaded its model (its ``execution`` is new).
        self._on_loaded = on_loaded
        #: A stateful model's: the sequences this worker serves (``batcher`` is its batcher).
        self._lane = lane
        self._task: asyncio.Task[None]
        self._supervise()

    @property
    def pid(self) -> int | None:
        """Its process's pid (None while it has none)."""
        return self._launcher.pid

    @property
    def start_time(self) -> float:
        """time.time() when this life's process was started."""
        return self._launcher.start_time

    @property
    def start_mode(self) -> StartMode | None:
        """How this life's process was started (None before the first start)."""
        return self._launcher.start_mode

    @property
    def load_time_ms(self) -> float | None:
        """Milliseconds from this life's start until it was READY (None until it is)."""
        return self._launcher.load_time_ms

    @property
    def hello_ms(self) -> float | None:
        """Of ``load_time_ms``, the milliseconds until its process said HELLO (forked or
        spawned, before loading; None until it did)."""
        return self._launcher.hello_ms

    @property
    def batcher(self) -> Batcher:
        """The queue it takes batches from (its model's, or its lane of a stateful model)."""
        return self._batcher

    @property
    def execution(self) -> ExecutionStatus | None:
        """How this life runs batches, as it reported when it loaded (None until then)."""
        return self._launcher.execution

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
            connection = await self._launcher.start(self.restarts)
        except WorkerStartError:
            raise
        except Exception as exc:  # OSError: EMFILE, a failed fork, a run dir gone, ...
            raise WorkerStartError(f"{self.name} could not be started: {describe_error(exc)}"
                                   ) from exc
        self.state = WorkerState.READY
        self.last_error = ""
        execution = self._launcher.execution
        self._exchange.buckets = execution.buckets if execution is not None else ()
        if self._on_loaded is not None:
            self._on_loaded()
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
            self._launcher.pid = None
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
        self._launcher.pid = None
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
            exchange=self._exchange, on_done=done, call_later=loop.call_later, clock=time.monotonic,
            device=self._launch.device)
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

    @property
    def working_since(self) -> float | None:
        """time.monotonic() since when the worker has been on the batch it is on (None: it is
        idle); the time it spent on its batches before is told with each batch's end."""
        dispatcher = self._dispatcher
        return dispatcher.working_since if dispatcher is not None else None

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

