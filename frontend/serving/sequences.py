"""Sequence batching: the job queue of a stateful model (TorchServe's ``sequenceBatching``).

A stateful handler keeps each sequence's state in its worker (TorchServe's example: a running
sum in an LRU cache keyed by ``context.get_sequence_id(idx)``), so the requests of a sequence
must all run on one worker, one at a time, in the order they came. A stateful model's queue
is a ``SequenceBatcher`` instead of the shared ``Batcher``:

* Each sequence has its own queue (up to ``maxSequenceJobQueueSize`` requests waiting) and at
  most one request handed on, its *current* one (waiting for a batch, or in the worker).
* A sequence is bound, when it opens, to the *lane* of one worker: of the workers that are up,
  the one with the fewest sequences. A lane is an ordinary ``Batcher`` (policy, parking,
  timers), which that worker's ``Dispatcher`` takes batches from as it would from a model's.
  It holds only the current requests of its sequences, so a batch mixes sequences and never
  holds two requests of one.
* When the worker answers a batch (``SequenceLane.finished``: before the answers are delivered
  and before the worker takes its next batch), each of its sequences hands its next request to
  the lane, or, without one, starts to idle. A sequence idle for ``sequenceMaxIdleMSec``, or
  idle after ``sequenceTimeoutMSec`` since it opened, is forgotten; so is one whose last
  request carried the close signal (``ts_request_sequence_end: true``, or the handler naming
  it in that response header, as TorchServe's continuous batching reads it).
* A worker that dies or is stopped takes its sequences' state with it: their requests that
  waited are answered ``SequenceLost`` (500), and for ``sequenceMaxIdleMSec`` so are requests
  that name them, instead of running without their state. Sequences that never reached it
  move to another worker.

Nothing here runs for a model that is not stateful: its queue stays the plain ``Batcher``.
"""

from __future__ import annotations

import asyncio
import collections
import sys
import time
import uuid
from collections.abc import Callable
from collections.abc import Sequence as Items
from dataclasses import dataclass, field

from frontend.errors import (
    SequenceLost,
    SequenceRefused,
    ServeError,
    ServiceUnavailable,
)
from frontend.observe.events import Batch
from frontend.serving.batching import (
    Batcher,
    CallLater,
    Job,
    Timer,
    fail_jobs,
    loop_call_later,
)
from frontend.serving.policies import BatchPolicy
from protos import worker_pb2

#: TorchServe's request headers for a sequence (its ``ts_header_key_sequence_*`` defaults),
#: which the handler reads through ``context.get_sequence_id`` and
#: ``context.header_key_sequence_start``/``_end``.
SEQUENCE_ID_HEADER = "ts_request_sequence_id"
SEQUENCE_START_HEADER = "ts_request_sequence_start"
SEQUENCE_END_HEADER = "ts_request_sequence_end"


def name_sequence(request: worker_pb2.Request) -> str:
    """The sequence a request to a stateful model belongs to: the client's id (the HTTP header,
    or gRPC's ``sequence_id``, both in its headers by now), or a new ``ts-seq-<uuid>`` as
    TorchServe makes one. A client's close signal, the header or (gRPC, as TorchServe reads it)
    an input of that name saying "true", reaches the handler as the header "true"."""
    headers = request.headers
    sequence_id = headers.get(SEQUENCE_ID_HEADER)
    if not sequence_id:
        sequence_id = headers[SEQUENCE_ID_HEADER] = f"ts-seq-{uuid.uuid4()}"
    if (_says_true(headers.get(SEQUENCE_END_HEADER))
            or _says_true(request.inputs.get(SEQUENCE_END_HEADER))):
        headers[SEQUENCE_END_HEADER] = "true"
    return sequence_id


def _says_true(value: str | bytes | None) -> bool:
    if isinstance(value, bytes):
        value = value.decode("latin-1")
    return value is not None and value.strip().lower() == "true"


def _ends(response: worker_pb2.Response, sequence_id: str) -> bool:
    """Whether the handler closed the sequence: its response's end header names it (a list
    separated by ";", as TorchServe reads it) or says "true"."""
    value = response.headers.get(SEQUENCE_END_HEADER)
    if not value:
        return False
    named = [part.strip() for part in value.split(";")]
    return sequence_id in named or value.strip().lower() == "true"


@dataclass(slots=True, eq=False)
class Sequence:
    """One open sequence of a stateful model."""

    id: str
    #: clock() when it opened (sequenceTimeoutMSec runs from here).
    opened_at: float
    #: Requests behind the current one, in order.
    waiting: collections.deque[Job] = field(default_factory=collections.deque)
    #: Its request handed to its lane: waiting for a batch there, or in the worker.
    current: Job | None = None
    #: The worker lane it is bound to (None: not yet, or its worker went down first).
    lane: SequenceLane | None = None
    #: A request of it has been answered by its worker: its state lives there.
    ran: bool = False
    #: Its last request (the one with the close signal): no more are taken after it.
    last: Job | None = None
    #: clock() since when it has had nothing to run.
    idle_since: float = 0.0
    #: The timer that forgets it when it has idled too long.
    timer: Timer | None = None


class SequenceLane:
    """One worker's share of a stateful model's sequences: the ``Batcher`` its dispatcher
    takes batches from, and what the worker tells the sequences (see the module docstring)."""

    def __init__(self, owner: SequenceBatcher, batcher: Batcher) -> None:
        self._owner = owner
        self.batcher = batcher
        #: The sequences bound to it (an ordered set).
        self.sequences: dict[Sequence, None] = {}
        #: Its worker is up: new sequences may bind to it.
        self.is_up = False

    def came_up(self) -> None:
        """The worker is loaded and serving: sequences may bind to it."""
        self._owner._came_up(self)

    def draining(self) -> None:
        """The worker is being stopped: no new sequence binds to it."""
        self.is_up = False

    def went_down(self, reason: str) -> None:
        """The worker died or stopped (``reason`` says which, for the clients): its sequences
        end, those that never reached it move to another worker."""
        self._owner._went_down(self, reason)

    def retire(self) -> None:
        """The worker is gone for good (scaled down, or the model unregistered)."""
        self._owner._retire(self)


class SequenceBatcher:
    """A stateful model's job queue: per-sequence queues routed to per-worker lanes.

    The model-facing methods are ``Batcher``'s (``submit``, ``depth``, ``refuse_if_full``,
    ``fail_queued``, ``wait_empty``, ``close``...); each worker gets its own lane
    (``add_lane``).
    """

    def __init__(
        self,
        *,
        model: str,
        max_batch_size: int,
        policy: Callable[[], BatchPolicy],
        max_sequences: int,
        max_waiting: int,
        max_idle_s: float,
        max_duration_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        call_later: CallLater = loop_call_later,
        on_formed: Callable[[Batch], None] | None = None,
    ) -> None:
        if max_sequences < 1 or max_waiting < 1:
            raise ValueError(f"need max_sequences and max_waiting >= 1, got {max_sequences} "
                             f"and {max_waiting}")
        if not max_idle_s > 0:
            raise ValueError(f"max_idle_s must be > 0, got {max_idle_s}")
        self.model = model
        self.max_batch_size = max_batch_size
        self.max_sequences = max_sequences
        self.max_waiting = max_waiting
        self.max_idle_s = max_idle_s
        self.max_duration_s = max_duration_s
        self._policy = policy
        #: Told of each batch as it leaves a lane (for the whole model; None: nobody listens).
        self._on_formed = on_formed
        self._clock = clock
        self._call_later = call_later
        self._sequences: dict[str, Sequence] = {}
        #: Sequences with a request to run and no lane yet (no worker was up): an ordered set.
        self._unbound: dict[Sequence, None] = {}
        #: Sequences lost with their worker: id -> (what to answer, until when).
        self._lost: dict[str, tuple[str, float]] = {}
        self._lanes: list[SequenceLane] = []
        self._closed: ServeError | None = None
        #: Set whenever a sequence moves on or ends (``wait_empty`` looks again).
        self._progress = asyncio.Event()

    # -- the model's queue ----------------------------------------------------------------

    @property
    def open_sequences(self) -> int:
        return len(self._sequences)

    @property
    def depth(self) -> int:
        """Requests waiting for a worker: in their sequences' queues, or handed to a lane and
        not sent yet."""
        count = 0
        for sequence in self._sequences.values():
            count += sum(1 for job in sequence.waiting if job.is_live())
            current = sequence.current
            if current is not None and not current.dispatched and current.is_live():
                count += 1
        return count

    @property
    def capacity(self) -> int:
        return self.max_sequences * (self.max_waiting + 1)

    @property
    def remaining_capacity(self) -> int:
        return max(0, self.capacity - self.depth)

    @property
    def is_full(self) -> bool:
        """Never, for the whole model: limits are per sequence, known once its id is read."""
        return False

    def refuse_if_full(self, job: Job | None = None) -> None:
        if self._closed is not None:
            raise self._closed

    def when_room(self, callback: Callable[[], None]) -> None:
        callback()  # never full (``is_full``)

    def submit(self, job: Job) -> None:
        """Queue a request of a sequence (named by ``name_sequence``), or raise: SequenceRefused
        (503) when maxNumSequence sequences are open, its queue is full or it is closing;
        SequenceLost (500) when it was lost with its worker."""
        if self._closed is not None:
            raise self._closed
        request = job.request
        if request.describe:  # the server's own question: any worker answers it
            self._hand_loose(job)
            return
        sequence_id = request.headers[SEQUENCE_ID_HEADER]
        now = self._clock()
        sequence = self._sequences.get(sequence_id)
        if sequence is not None and self._expired(sequence, now):
            self._forget(sequence)  # its timer is late: it is over all the same
            sequence = None
        if sequence is None:
            sequence = self._open(sequence_id, request, now)
        elif sequence.last is not None:
            raise SequenceRefused(
                f'Sequence "{sequence_id}" of model "{self.model}" is closing: a request with '
                f"{SEQUENCE_END_HEADER} came before this one")
        elif sequence.current is not None and \
                sum(1 for queued in sequence.waiting if queued.is_live()) >= self.max_waiting:
            raise SequenceRefused(
                f'Sequence "{sequence_id}" of model "{self.model}" already has '
                f"{self.max_waiting} request(s) waiting (maxSequenceJobQueueSize); retry "
                "when one is answered")
        if request.headers.get(SEQUENCE_END_HEADER) == "true":
            sequence.last = job
        if sequence.timer is not None:
            sequence.timer.cancel()
            sequence.timer = None
        if sequence.current is None:
            self._hand(sequence, job)
        else:
            sequence.waiting.append(job)

    def fail_queued(self, error: ServeError) -> None:
        """Answer every request that waits with ``error`` (no worker can serve it soon); a
        sequence with nothing running ends."""
        for sequence in list(self._sequences.values()):
            jobs = list(sequence.waiting)
            sequence.waiting.clear()
            current = sequence.current
            if current is None or not current.dispatched:
                if current is not None:
                    jobs.insert(0, current)
                self._forget(sequence)
            fail_jobs(jobs, error)
        for lane in self._lanes:
            lane.batcher.fail_queued(error)

    async def wait_empty(self, timeout_s: float | None) -> bool:
        """Wait until no request waits for a worker; False on timeout."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else loop.time() + timeout_s
        while self.depth:
            self._progress.clear()
            remaining = None if deadline is None else deadline - loop.time()
            if remaining is not None and remaining <= 0:
                return False
            try:
                await asyncio.wait_for(self._progress.wait(), remaining)
            except TimeoutError:
                return False
        return True

    def close(self, error: ServeError) -> None:
        """Answer every waiting request with ``error``, refuse new ones, let the workers go
        (requests in a worker still get their answers)."""
        self._closed = error
        for sequence in list(self._sequences.values()):
            jobs = list(sequence.waiting)
            current = sequence.current
            if current is not None and not current.dispatched:
                jobs.insert(0, current)
            self._forget(sequence)
            fail_jobs(jobs, error)
        for lane in self._lanes:
            lane.batcher.close(error)

    # -- lanes --------------------------------------------------------------------------------

    def add_lane(self) -> SequenceLane:
        """A new worker's lane (it binds sequences once the worker comes up)."""
        lane = SequenceLane(self, Batcher(
            max_batch_size=self.max_batch_size, capacity=sys.maxsize, policy=self._policy(),
            clock=self._clock, call_later=self._call_later, on_formed=self._on_formed,
            sequence=True))
        self._lanes.append(lane)
        return lane

    def _came_up(self, lane: SequenceLane) -> None:
        lane.is_up = True
        self._bind_unbound()

    def finished(self, jobs: list[Job], responses: Items[worker_pb2.Response] | None) -> None:
        """A worker answered the batch of ``jobs`` (``responses``: its responses, None when
        it failed the batch as a whole): their sequences go on. Called before that worker
        takes its next batch (the sequences of this one may be in it)."""
        if responses is not None and len(responses) != len(jobs):
            responses = None
        for index, job in enumerate(jobs):
            sequence_id = job.request.headers.get(SEQUENCE_ID_HEADER)
            sequence = self._sequences.get(sequence_id) if sequence_id else None
            if sequence is None or sequence.current is not job:
                continue  # not a sequence's (a describe), or its sequence is over already
            sequence.ran = True
            if job is sequence.last or (responses is not None
                                        and _ends(responses[index], sequence.id)):
                self._close(sequence)
            else:
                self._advance(sequence)

    def _went_down(self, lane: SequenceLane, reason: str) -> None:
        lane.is_up = False
        loose = lane.batcher.take_queued()
        now = self._clock()
        self._lost = {key: lost for key, lost in self._lost.items() if lost[1] > now}
        for sequence in list(lane.sequences):
            del lane.sequences[sequence]
            sequence.lane = None
            current = sequence.current
            if sequence.ran or (current is not None and current.dispatched):
                self._lose(sequence, reason, now)
            elif current is not None:
                self._unbound[sequence] = None  # it never reached the worker: it moves on
        for job in loose:
            if job.request.describe:
                self._hand_loose(job)
        self._bind_unbound()

    def _retire(self, lane: SequenceLane) -> None:
        self._went_down(lane, "its worker was stopped")
        if lane in self._lanes:
            self._lanes.remove(lane)

    # -- inside ---------------------------------------------------------------------------

    def _open(self, sequence_id: str, request: worker_pb2.Request, now: float) -> Sequence:
        lost = self._lost.get(sequence_id)
        if lost is not None:
            if lost[1] > now:
                raise SequenceLost(lost[0])
            del self._lost[sequence_id]
        if len(self._sequences) >= self.max_sequences:
            for sequence in list(self._sequences.values()):
                if self._expired(sequence, now):
                    self._forget(sequence)
            if len(self._sequences) >= self.max_sequences:
                raise SequenceRefused(
                    f'Model "{self.model}" has {len(self._sequences)} sequences open, its '
                    f'maxNumSequence: sequence "{sequence_id}" cannot start until one closes '
                    "or expires (sequenceMaxIdleMSec)")
        # The handler learns that this worker starts the sequence afresh (TorchServe says so
        # of the ids it makes; here of every sequence, whose id may have been used before).
        request.headers[SEQUENCE_START_HEADER] = "true"
        sequence = self._sequences[sequence_id] = Sequence(sequence_id, now)
        return sequence

    def _hand(self, sequence: Sequence, job: Job) -> None:
        """Make ``job`` the sequence's current request: into its lane's batcher."""
        sequence.current = job
        job.future.add_done_callback(lambda _: self._left(sequence, job))
        lane = sequence.lane or self._bind(sequence)
        if lane is None:
            self._unbound[sequence] = None  # the first worker that comes up takes it
        else:
            lane.batcher.submit(job)

    def _bind(self, sequence: Sequence) -> SequenceLane | None:
        """Bind to the lane of an up worker with the fewest sequences (None: none is up)."""
        best: SequenceLane | None = None
        for lane in self._lanes:
            if lane.is_up and (best is None or len(lane.sequences) < len(best.sequences)):
                best = lane
        if best is not None:
            sequence.lane = best
            best.sequences[sequence] = None
        return best

    def _bind_unbound(self) -> None:
        while self._unbound:
            sequence = next(iter(self._unbound))
            lane = self._bind(sequence)
            if lane is None:
                return
            del self._unbound[sequence]
            current = sequence.current
            if current is None or not current.is_live():
                self._advance(sequence)
            else:
                lane.batcher.submit(current)

    def _left(self, sequence: Sequence, job: Job) -> None:
        """``job`` was answered: if it never reached the worker (it expired in the queue, or
        its client went away), the sequence goes on without it."""
        if sequence.current is job and not job.dispatched \
                and self._sequences.get(sequence.id) is sequence:
            self._advance(sequence)

    def _advance(self, sequence: Sequence) -> None:
        """The current request is done: hand on the next one, or idle."""
        sequence.current = None
        while sequence.waiting:
            job = sequence.waiting.popleft()
            if job.is_live():
                self._hand(sequence, job)
                return
        self._unbound.pop(sequence, None)
        self._progress.set()
        if sequence.last is not None:  # its last request left without running
            self._forget(sequence)
            return
        now = sequence.idle_since = self._clock()
        sequence.timer = self._call_later(max(0.0, self._expiry(sequence) - now),
                                          lambda: self._expire(sequence))

    def _expiry(self, sequence: Sequence) -> float:
        """When an idle sequence is forgotten."""
        at = sequence.idle_since + self.max_idle_s
        if self.max_duration_s:
            at = min(at, sequence.opened_at + self.max_duration_s)
        return at

    def _expired(self, sequence: Sequence, now: float) -> bool:
        return sequence.current is None and now >= self._expiry(sequence)

    def _expire(self, sequence: Sequence) -> None:
        sequence.timer = None
        if self._sequences.get(sequence.id) is sequence and sequence.current is None:
            self._forget(sequence)

    def _close(self, sequence: Sequence) -> None:
        """The close signal was answered: the sequence ends (what still waits, when its handler
        closed it early, is refused)."""
        jobs = list(sequence.waiting)
        sequence.waiting.clear()
        self._forget(sequence)
        fail_jobs(jobs, SequenceRefused(
            f'Sequence "{sequence.id}" of model "{self.model}" was closed by its handler '
            "before this request ran"))

    def _lose(self, sequence: Sequence, reason: str, now: float) -> None:
        message = (f'Sequence "{sequence.id}" of model "{self.model}" ended: {reason}, and its '
                   "state with it. Start a new sequence (a new id, or none to be given one).")
        jobs = list(sequence.waiting)
        if sequence.current is not None:
            jobs.insert(0, sequence.current)
        sequence.waiting.clear()
        self._forget(sequence)
        self._lost[sequence.id] = (message, now + self.max_idle_s)
        fail_jobs(jobs, SequenceLost(message))

    def _forget(self, sequence: Sequence) -> None:
        if self._sequences.get(sequence.id) is sequence:
            del self._sequences[sequence.id]
        if sequence.timer is not None:
            sequence.timer.cancel()
            sequence.timer = None
        if sequence.lane is not None:
            sequence.lane.sequences.pop(sequence, None)
            sequence.lane = None
        self._unbound.pop(sequence, None)
        self._progress.set()

    def _hand_loose(self, job: Job) -> None:
        """A request of no sequence (a describe): to an up worker, else to any."""
        lanes = [lane for lane in self._lanes if lane.is_up] or self._lanes
        if not lanes:
            raise ServiceUnavailable(f'Model "{self.model}" has no worker')
        lanes[0].batcher.submit(job)
