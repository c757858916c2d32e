"""One worker's dispatcher: takes batches from the model's batcher, sends them, and routes
the worker's replies back to the batches' jobs.

Up to ``max_in_flight`` batches are outstanding on the worker (two by default): while batch n
computes, batch n+1 is already in the worker, which prepares it (decodes its images, copies
them to the GPU) instead of waiting for the frontend to send it. The second slot takes only a
*full* batch of more than one request: a worker with a batch in flight is busy, and while it
is, the queue should fill the next batch, not send it half empty. Replies come in the order the
batches went; each request's answer is delivered as soon as its batch's reply is read (after
the next batch is on its way).

Everything runs in callbacks (the batcher's, the connection's reader's, timers), with no task
per batch. The states:

    IDLE      no batch in flight; parked in the batcher until one is released
    BUSY      batches in flight and room for another (parked for a full batch)
    FULL      max_in_flight batches in flight
    STOPPING  asked to stop: no new batch; waits for the ones in flight
    DONE      stopped, or the connection is gone (``on_done`` was called)

A model in a device group (frontend/serving/devices.py) asks its share of the device for a
grant before each batch goes: the batch waits, out of the queue, until the group's scheduler
gives the device to this model (``waiting``; no other batch is taken meanwhile), and the grant
goes back, with the batch's service time, when its reply is read or it is lost. A waiting batch
of a dispatcher that stops goes back to the queue.

The response timeout of a batch runs from when the worker could start it: from its sending
when nothing was ahead of it, else from the reply to the batch before it. When it passes, the
batch is answered 504, the batches behind it 500 (their worker is killed), and the worker is
replaced.
"""

from __future__ import annotations

import collections
import enum
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from frontend.errors import GatewayTimeout, InternalError, ServeError, WorkerDied
from frontend.serving.batching import Batcher, CallLater, Job, Take, Timer, fail_jobs
from frontend.serving.devices import DeviceShare
from protos import worker_pb2
from protos.framing import Frame

logger = logging.getLogger(__name__)


class DispatchState(enum.Enum):
    IDLE = "idle"
    BUSY = "busy"
    FULL = "full"
    STOPPING = "stopping"
    DONE = "done"


class Connection(Protocol):
    """What the dispatcher needs of a worker connection (``connection.WorkerConnection``)."""

    on_partial: Callable[[worker_pb2.Response], None] | None

    def send(self, frame: Frame, on_reply: Callable[[Frame | BaseException], None]) -> None: ...

    def forget_replies(self) -> None: ...

    def kill(self) -> None: ...


@dataclass(slots=True, eq=False)
class InFlight:
    """A batch sent to the worker."""

    jobs: list[Job]
    #: clock() when the worker could start it (None: a batch is still ahead of it).
    started: float | None = None
    timer: Timer | None = None
    #: It holds a grant of its model's device share (given back as it ends).
    granted: bool = False

    @property
    def weight(self) -> int:
        """Its batch items (a KServe request weighs as many as it has instances)."""
        return sum(job.weight for job in self.jobs)

    def ended(self, now: float) -> float:
        """Its reply came, or it was given up, at ``now``: the seconds the worker had it,
        noted on its facts (``Batch``) with ``now``."""
        service_s = now - (self.started if self.started is not None else now)
        facts = self.jobs[0].batch if self.jobs else None
        if facts is not None:
            facts.ended_at = now
            facts.service_s = service_s
        return service_s


class Exchange(Protocol):
    """What a batch says to the worker and what its reply means (``exchange.PredictExchange``)."""

    def frame(self, jobs: list[Job]) -> Frame:
        """The frame that sends a batch of ``jobs``."""
        ...

    def finish(self, jobs: list[Job], reply: Frame, service_s: float
               ) -> Callable[[], None] | None:
        """Account for a batch's reply (the worker spent ``service_s`` on it); what delivers
        its answers (None: answered already). Raises WorkerDied when the reply breaks the
        protocol."""
        ...

    def lost(self, jobs: list[Job]) -> None:
        """A batch got no reply (timed out, its worker died); its jobs are answered."""
        ...

    def bound(self, response: worker_pb2.Response) -> worker_pb2.Response:
        """A streamed part, within the response size limit."""
        ...


class Dispatcher:
    """Feeds one worker connection from a batcher (see the module docstring)."""

    def __init__(
        self,
        name: str,
        batcher: Batcher,
        connection: Connection,
        *,
        timeout_s: float,
        max_in_flight: int,
        exchange: Exchange,
        on_done: Callable[[BaseException | None], None],
        call_later: CallLater,
        clock: Callable[[], float],
        device: DeviceShare | None = None,
    ) -> None:
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
        self.name = name
        self._batcher = batcher
        self._connection = connection
        self._timeout_s = timeout_s
        self._max_in_flight = max_in_flight
        self._exchange = exchange
        self._on_done = on_done
        self._call_later = call_later
        self._clock = clock
        self.in_flight: collections.deque[InFlight] = collections.deque()
        self._parked: Take | None = None
        #: Its model's share of a device (None: no device group, nothing to ask).
        self._device = device
        #: A batch waiting for its device grant (only with ``device``).
        self.waiting: list[Job] | None = None
        self._stopping = False
        self._done = False
        connection.on_partial = self._route_partial

    @property
    def state(self) -> DispatchState:
        if self._done:
            return DispatchState.DONE
        if self._stopping:
            return DispatchState.STOPPING
        if not self.in_flight:
            return DispatchState.IDLE
        return (DispatchState.FULL if len(self.in_flight) >= self._max_in_flight
                else DispatchState.BUSY)

    @property
    def working_since(self) -> float | None:
        """clock() since when the worker has been on the batch it is on (None: it has none)."""
        return self.in_flight[0].started if self.in_flight else None

    # -- events -----------------------------------------------------------------------------

    def start(self) -> None:
        self._fill()

    def stop(self) -> None:
        """Take no new batch; finish once the batches in flight are answered."""
        self._stopping = True
        self._unpark()
        self._withdraw()
        if not self.in_flight:
            self._finish(None)

    def connection_lost(self, error: WorkerDied) -> None:
        """The worker is gone: no batch is sent any more. Its batches in flight are failed by
        their replies (the connection calls each with WorkerDied); an idle dispatcher ends
        here."""
        self._stopping = True
        self._unpark()
        self._withdraw()
        if not self.in_flight:
            self._finish(error)

    def abandon(self, error: ServeError) -> None:
        """End now (the supervisor was cancelled): the batches in flight get ``error``."""
        self._unpark()
        self._withdraw()
        self._connection.forget_replies()
        self._fail_in_flight(error)
        self._finish(None)

    # -- sending ------------------------------------------------------------------------------

    def _fill(self) -> None:
        """Send what may go now; park for the rest."""
        while not self._stopping and not self._done and len(self.in_flight) < \
                self._max_in_flight and self.waiting is None:
            jobs = (self._batcher.take_ready() if not self.in_flight
                    else self._batcher.take_full())
            if jobs is None:
                self._park()
                return
            self._go(jobs)

    def _park(self) -> None:
        if self._parked is not None:
            return
        self._parked = self._take
        if self.in_flight:
            self._batcher.park_for_full(self._take)
        else:
            self._batcher.park(self._take)

    def _unpark(self) -> None:
        if self._parked is not None:
            self._batcher.unpark(self._parked)
            self._parked = None

    def _take(self, outcome: list[Job] | ServeError) -> None:
        """The batcher's callback: a batch for this worker, or the error that closed it."""
        self._parked = None
        if isinstance(outcome, ServeError):  # the model is going away
            self.stop()
        elif self._stopping or self._done:
            self._batcher.requeue(outcome)  # for another worker
        else:
            self._go(outcome)
            self._fill()

    def _go(self, jobs: list[Job]) -> None:
        """Send ``jobs`` now, or once its model's device share grants it."""
        if self._device is None:
            self._send(jobs)
            return
        self.waiting = jobs
        self._device.ask(self._granted)

    def _granted(self) -> None:
        """The device share's callback: the waiting batch may go."""
        jobs, self.waiting = self.waiting, None
        if jobs is None or self._stopping or self._done:  # withdrawn meanwhile
            if jobs is not None:
                self._batcher.requeue(jobs)
            self._give_back(0.0)
            return
        self._send(jobs, granted=True)
        self._fill()

    def _withdraw(self) -> None:
        """A waiting batch goes back to the queue (this dispatcher takes no more)."""
        jobs, self.waiting = self.waiting, None
        if jobs is not None:
            assert self._device is not None
            self._device.withdraw(self._granted)
            self._batcher.requeue(jobs)

    def _give_back(self, service_s: float) -> None:
        assert self._device is not None
        self._device.release(service_s)

    def _send(self, jobs: list[Job], granted: bool = False) -> None:
        batch = InFlight(jobs, granted=granted)
        try:
            self._connection.send(self._exchange.frame(jobs),
                                  lambda outcome: self._on_reply(batch, outcome))
        except WorkerDied as exc:
            # Never sent: the jobs go back to the queue for another worker.
            self._batcher.requeue(jobs)
            if granted:
                self._give_back(0.0)
            self.connection_lost(exc)
            return
        self.in_flight.append(batch)
        if len(self.in_flight) == 1:
            self._begin(batch)

    def _begin(self, batch: InFlight) -> None:
        """The worker can start ``batch`` now: its response timeout runs from here."""
        batch.started = self._clock()
        batch.timer = self._call_later(self._timeout_s, lambda: self._on_timeout(batch))

    # -- replies ------------------------------------------------------------------------------

    def _on_reply(self, batch: InFlight, outcome: Frame | BaseException) -> None:
        if not self.in_flight or self.in_flight[0] is not batch:
            return  # abandoned or timed out already
        self.in_flight.popleft()
        self._forget(batch)
        service_s = batch.ended(self._clock())
        if self.in_flight:
            self._begin(self.in_flight[0])
        if isinstance(outcome, BaseException):
            fail_jobs(batch.jobs, WorkerDied(
                f"{outcome} while handling a batch of {len(batch.jobs)}"))
            self._exchange.lost(batch.jobs)
            if batch.granted:
                self._withdraw()  # its worker is gone: the next batch waits elsewhere
                self._give_back(service_s)
            if not self.in_flight:
                self._unpark()
                self._finish(outcome)
            return
        try:
            deliver = self._exchange.finish(batch.jobs, outcome, service_s)
        except BaseException as exc:
            fail_jobs(batch.jobs, exc if isinstance(exc, ServeError)
                      else InternalError(f"{self.name}: {exc}"))
            if batch.granted:
                self._withdraw()
                self._give_back(service_s)
            self._connection.forget_replies()
            self._connection.kill()
            self._fail_in_flight(WorkerDied(f"{self.name} was killed: {exc}"))
            self._unpark()
            self._finish(exc)
            return
        try:
            if self._stopping and not self.in_flight:
                self._finish(None)
            else:
                # The next batch goes before this one's answers are delivered: no event-loop
                # turn passes between the worker's batches.
                self._unpark()
                self._fill()
        finally:
            if batch.granted:
                # The device is free, once this model's next batch (if any) asked for it:
                # the grant goes to whichever model's turn it is, sent at once.
                self._give_back(service_s)
            if deliver is not None:
                deliver()

    def _on_timeout(self, batch: InFlight) -> None:
        if not self.in_flight or self.in_flight[0] is not batch:
            return
        self.in_flight.popleft()
        self._forget(batch)
        service_s = batch.ended(self._clock())
        if batch.granted:
            self._withdraw()
            self._give_back(service_s)
        error = GatewayTimeout(f"{self.name} did not answer within the response timeout of "
                               f"{self._timeout_s:g} s")
        fail_jobs(batch.jobs, error)
        self._exchange.lost(batch.jobs)
        self._connection.forget_replies()
        self._connection.kill()  # a hung worker must not be reused
        self._fail_in_flight(WorkerDied(f"{self.name} was killed: a batch ahead of this one "
                                        "did not finish within the response timeout"))
        self._unpark()
        self._finish(WorkerDied(f"{self.name} killed: {error}"))

    def _route_partial(self, part: worker_pb2.Response) -> None:
        """An intermediate response (rare: found by a scan, not indexed per request)."""
        for batch in self.in_flight:
            for job in batch.jobs:
                if job.request.request_id == part.request_id:
                    job.add_part(self._exchange.bound(part))
                    return
        logger.warning("intermediate response for unknown request %s", part.request_id)

    # -- ending -------------------------------------------------------------------------------

    def _forget(self, batch: InFlight) -> None:
        if batch.timer is not None:
            batch.timer.cancel()

    def _fail_in_flight(self, error: ServeError) -> None:
        while self.in_flight:
            batch = self.in_flight.popleft()
            self._forget(batch)
            fail_jobs(batch.jobs, error)
            if batch.granted:
                started = batch.started
                self._give_back(self._clock() - started if started is not None else 0.0)

    def _finish(self, error: BaseException | None) -> None:
        if self._done:
            return
        self._done = True
        self._on_done(error)
