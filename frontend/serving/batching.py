"""Per-model job queue that releases batches to idle workers.

The batcher only groups jobs; it never touches sockets or processes. Each worker pulls a
batch when it is free (as TorchServe's WorkerThread does; a worker with a batch in flight
takes a second only when it is full, ``park_for_full``), and the queue fills naturally while
every worker is busy. *When* a batch is released is decided by a small pure policy object, so
other policies plug in without touching the queue; *which* jobs go is the queue's order: FIFO,
or fair between tenants and priority levels (frontend/serving/fairness.py). Time comes in
through two seams, a ``clock`` and a ``call_later`` timer, so tests and
frontend/serving/simulation.py drive the same batcher with simulated time.

It keeps no record for anyone to read: each batch that leaves is a ``Batch`` of raw facts
(why, how many items, when), shared by its jobs and told to ``on_formed``
(frontend/observe/events.py).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from frontend.errors import QueueFull, ServeError, ServiceUnavailable, expired
from frontend.observe.events import (
    ADAPTIVE,
    DEADLINE,
    FULL,
    MAX_DELAY,
    SEQUENCE,
    SLOT_FREE,
    Batch,
    JobFacts,
)
from frontend.serving.fairness import FairQueue
from frontend.serving.policies import BatchPolicy
from frontend.serving.streams import ResponseStream
from frontend.serving.timers import CallLater as CallLater
from frontend.serving.timers import Timer as Timer
from frontend.serving.timers import loop_call_later as loop_call_later
from protos import worker_pb2

logger = logging.getLogger(__name__)

#: A policy's wait at most this long is no wait. "D - waited" from float times can come out a few
#: ulps above 0 at the very wake-up that asked for it; asyncio runs a timer up to 1 ns early.
MIN_WAIT_S = 1e-9

#: Weight of one completed batch in the service-time estimate a deadline keeps in reserve.
SERVICE_ALPHA = 0.2
#: A batch leaves this many expected service times before a queued job's deadline (a batch
#: that could not be answered in time would be answered 504 anyway).
DEADLINE_RESERVE = 2.0
#: ...and at least this long before it (before any batch was answered).
DEADLINE_MIN_RESERVE_S = 0.001


@dataclass(slots=True, eq=False)
class Job(JobFacts):
    """One client request waiting for its response (what is known of its trip: ``JobFacts``)."""

    #: Resolves to the Response, or to a ResponseStream once a first intermediate part came.
    future: asyncio.Future[worker_pb2.Response | ResponseStream]
    #: time.monotonic() after which the answer is no use to the client.
    deadline: float = float("inf")
    #: The seconds from submission to ``deadline`` (for the 504's text).
    budget_s: float = float("inf")
    stream: ResponseStream | None = None
    #: True once the job left the queue for a worker (in ``batch``).
    dispatched: bool = False
    #: Items this job adds to a batch: 1 for a request, its instance count for KServe
    #: instance-level batching (a batch holds up to max_batch_size items).
    weight: int = 1

    def add_part(self, part: worker_pb2.Response) -> None:
        """An intermediate response: the first one turns the answer into a stream."""
        if self.stream is None:
            if self.future.done():
                return  # the client went away
            self.stream = ResponseStream()
            self.future.set_result(self.stream)
        self.stream.put(part)

    def resolve(self, response: worker_pb2.Response) -> None:
        if self.stream is not None:
            self.stream.finish(response)
        elif not self.future.done():
            self.future.set_result(response)

    def fail(self, error: BaseException) -> None:
        if self.stream is not None:
            self.stream.fail(error)
        elif not self.future.done():
            self.future.set_exception(error)

    def is_live(self) -> bool:
        return not self.future.done()


#: What a parked worker is called with: its batch, or the error that closed the batcher.
Take = Callable[[list[Job] | ServeError], None]


class Batcher:
    """Groups the queued jobs of one model (version) into batches of up to ``max_batch_size``.

    A free worker *parks* a callback here; the batcher calls it with a batch as soon as the
    policy releases one: from the arrival that completes it, or from a timer when the policy's
    wait runs out. No task waits per worker and no event-loop turn passes between the decision
    and the batch leaving for the worker.
    """

    def __init__(
        self,
        *,
        max_batch_size: int,
        capacity: int,
        policy: BatchPolicy,
        clock: Callable[[], float] = time.monotonic,
        call_later: CallLater = loop_call_later,
        on_formed: Callable[[Batch], None] | None = None,
        sequence: bool = False,
        fair: FairQueue[Job] | None = None,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.max_batch_size = max_batch_size
        self.capacity = capacity
        self.policy = policy
        #: Told of each batch as it leaves the queue (None: nobody listens).
        self._on_formed = on_formed
        #: A stateful model's lane: every batch's reason is ``SEQUENCE``.
        self._sequence = sequence
        #: The batcher's clock (monotonic seconds), which its jobs' times are read on.
        self._clock = clock
        self._call_later = call_later
        self._fair = fair  # None: the queue is FIFO
        self._queue: collections.deque[Job] | FairQueue[Job] = collections.deque()
        if fair is not None:
            self._queue = fair
        self._emptied = asyncio.Event()
        self._emptied.set()
        self._closed: ServeError | None = None
        #: Free workers, first come first served.
        self._parked: collections.deque[Take] = collections.deque()
        #: Busy workers with room for one more batch, if it is full (``park_for_full``).
        self._parked_full: collections.deque[Take] = collections.deque()
        #: When the parked workers found the first job of the batch being collected.
        self._collecting_since: float | None = None
        #: The timer that asks the policy again when its wait runs out, and when.
        self._wake: Timer | None = None
        self._wake_at = float("inf")
        #: Sum of the queued jobs' weights (items, not requests).
        self._queued_weight = 0
        #: Called, one per job taken, when the full queue makes room (see ``when_room``).
        self._room_waiters: collections.deque[Callable[[], None]] = collections.deque()
        #: The earliest deadline of a queued job (stale: to be found again when asked).
        self._earliest = float("inf")
        self._earliest_stale = False
        #: What a batch is expected to take in the worker (an EWMA of the answered ones): a
        #: batch leaves ``DEADLINE_RESERVE`` times that before its first job's deadline.
        self._service_s = 0.0

    @property
    def depth(self) -> int:
        """Jobs waiting in the queue for an answer (not those whose client has gone or whose
        deadline passed: they leave the queue lazily, and are never dispatched)."""
        return sum(1 for job in self._queue if job.is_live())

    @property
    def remaining_capacity(self) -> int:
        return max(0, self.capacity - self.depth)

    @property
    def is_full(self) -> bool:
        """No room for one more job (cheap: what refuse_if_full just found)."""
        return len(self._queue) >= self.capacity

    def refuse_if_full(self, job: Job | None = None) -> None:
        """Raise QueueFull (503) now if ``job`` would be refused (a fair queue's rules: its
        ``check``): the HTTP layer answers before it reads the body (cheap to turn away)."""
        if self._closed is not None:
            raise self._closed
        if self._fair is not None and job is not None:
            self._drop_finished()
            self._fair.check(job)
        elif len(self._queue) >= self.capacity:
            self._drop_finished()
            if len(self._queue) >= self.capacity:
                # A full queue answers at once instead of holding memory and latency for
                # requests that would time out anyway (job_queue_size).
                raise QueueFull(self.capacity)

    def when_room(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once a job has left the full queue (or the batcher closed): the
        HTTP layer stops reading a connection it has just refused, until then."""
        self._room_waiters.append(callback)

    def _make_room(self, count: int) -> None:
        waiters = self._room_waiters
        while count > 0 and waiters:
            count -= 1
            try:
                waiters.popleft()()
            except Exception:
                logger.exception("a queue-room callback failed")

    def submit(self, job: Job) -> None:
        """Queue a job, or raise QueueFull (503) at once when the queue is full (a fair queue
        may displace another tenant's job instead, or refuse a hopeless deadline)."""
        self.refuse_if_full(job)
        job.enqueued_at = now = self._clock()
        if self._fair is None:
            self._queue.append(job)
        elif (displaced := self._fair.enter(job, now, self._service_s)) is not None:
            self._queued_weight -= displaced.weight
        if job.deadline < self._earliest:
            self._earliest = job.deadline
        self.policy.on_arrival(now)
        self._queued_weight += job.weight
        self._emptied.clear()
        if self._parked or self._parked_full:
            self._release()

    def _drop_finished(self) -> None:
        """Forget jobs whose future is already done (client gone, or expired)."""
        if any(not job.is_live() for job in self._queue):
            self._earliest_stale = True
            if self._fair is not None:
                self._fair.retain_live()
            else:
                self._queue = collections.deque(job for job in self._queue if job.is_live())
            self._queued_weight = sum(job.weight for job in self._queue)
            if not self._queue:
                self._emptied.set()

    def _expire(self, now: float) -> None:
        for job in self._queue:
            if job.deadline <= now and job.is_live():
                job.future.set_exception(expired(job.budget_s, dispatched=False))
        self._drop_finished()

    def park(self, take: Take) -> None:
        """A free worker waits for its next batch: ``take`` is called, from an arrival or a
        timer (or at once), with the batch the policy releases, or with the error that closed
        the batcher. It must not raise."""
        if self._closed is not None:
            take(self._closed)
            return
        if not self._parked:
            self._collecting_since = None  # a collection starts when a free worker comes
        self._parked.append(take)
        self._release()

    def park_for_full(self, take: Take) -> None:
        """A worker with a batch in flight and room for one more waits for a *full* batch
        (more than one request, ``max_batch_size`` items): ``take`` is called as ``park``'s
        is. Free workers come first; while any is parked, the policy decides for them."""
        if self._closed is not None:
            take(self._closed)
            return
        self._parked_full.append(take)
        self._release()

    def unpark(self, take: Take) -> bool:
        """Withdraw a parked worker; False if it was not parked (it got a batch already)."""
        # NOTE: membership first (a handful of parked workers): a busy worker waits in
        # _parked_full, and unparking it happens once a batch, so no exception per batch.
        if take in self._parked:
            self._parked.remove(take)
            if not self._parked:
                self._collecting_since = None
            return True
        if take in self._parked_full:
            self._parked_full.remove(take)
            return True
        return False

    def take_full(self, reason: str = SLOT_FREE) -> list[Job] | None:
        """A full batch if the queue holds one (and batches hold more than one request),
        for a worker that has a batch in flight; else None. Never waits. ``reason``: a
        dispatcher asks as a slot comes free (``SLOT_FREE``); the batcher, for a busy worker
        parked for it, as an arrival fills the batch (``FULL``)."""
        if (self.max_batch_size < 2 or self._queued_weight < self.max_batch_size
                or self._closed is not None):
            return None
        now = self._clock()
        self._expire(now)
        if self._queued_weight < self.max_batch_size:
            return None
        jobs = self._take(now, now, reason)
        if not self._queue:
            self._collecting_since = None
        return jobs

    def _release(self) -> None:
        """Hand batches to parked workers: to free ones as long as the policy says go, then
        full batches to busy ones with room."""
        self._release_free()
        while self._parked_full and not self._parked:
            jobs = self.take_full(FULL)
            if jobs is None:
                return
            self._hand(self._parked_full.popleft(), jobs)

    def _hand(self, take: Take, jobs: list[Job]) -> None:
        try:
            take(jobs)
        except Exception:  # a worker's callback must not stop the others' batches
            logger.exception("a worker failed to take its batch")
            fail_jobs(jobs, ServiceUnavailable("the worker could not take the batch"))

    def _release_free(self) -> None:
        owed = False  # the policy kept jobs back for the next free worker: they go at once
        while self._parked:
            now = self._clock()
            self._expire(now)
            if not self._queue:
                self._collecting_since = None
                return
            since = self._collecting_since
            if since is None:
                since = self._collecting_since = now
            waited_s, queued, idle = now - since, self._queued_weight, len(self._parked)
            wait = 0.0 if owed else self.policy.wait_s(queued, waited_s, idle, now)
            if wait > MIN_WAIT_S:
                left = self._before_deadline(now)
                if left >= wait:
                    self._wake_in(now, wait)
                    return
                if left > MIN_WAIT_S:
                    self._wake_in(now, left)
                    return
                reason = DEADLINE
            else:
                reason = self._reason(waited_s)
            limit = self.policy.batch_items(queued, idle, now)
            jobs = self._take(now, since, reason, limit)
            owed = limit < min(queued, self.max_batch_size)
            self._collecting_since = now if self._queue else None
            self._hand(self._parked.popleft(), jobs)

    def _reason(self, waited_s: float) -> str:
        """Why the policy let a batch go now (it said: no more waiting)."""
        if self._sequence:
            return SEQUENCE
        if self._queued_weight >= self.max_batch_size:
            return FULL
        if waited_s >= self.policy.max_delay_s - MIN_WAIT_S:
            return MAX_DELAY
        return ADAPTIVE

    def _before_deadline(self, now: float) -> float:
        """Seconds the batch may still wait so that the queued job with the earliest deadline
        leaves with twice the time a batch takes in the worker still ahead of it."""
        if self._earliest_stale:
            self._earliest = min((job.deadline for job in self._queue), default=float("inf"))
            self._earliest_stale = False
        reserve = DEADLINE_RESERVE * self._service_s
        return self._earliest - max(reserve, DEADLINE_MIN_RESERVE_S) - now

    def _wake_in(self, now: float, wait_s: float) -> None:
        at = now + wait_s
        if self._wake is not None:
            if self._wake_at <= at:
                return  # an earlier wake-up asks again anyway
            self._wake.cancel()
        self._wake_at = at
        self._wake = self._call_later(wait_s, self._woken)

    def _woken(self) -> None:
        self._wake = None
        self._wake_at = float("inf")
        self._release()

    def take_ready(self) -> list[Job] | None:
        """The next batch if the policy would send it at once to one more free worker (the
        caller, which has just finished a batch), else None: lets a worker start its next
        batch before it delivers the answers of the last one. Never waits."""
        if not self._queue or self._closed is not None:
            return None
        now = self._clock()
        self._expire(now)
        if not self._queue or self.policy.wait_s(self._queued_weight, 0.0,
                                                 len(self._parked) + 1, now) > MIN_WAIT_S:
            return None
        # The jobs the policy keeps back wait for this worker (the caller): the policy's
        # rule for one free worker.
        jobs = self._take(now, now, self._reason(0.0),
                          self.policy.batch_items(self._queued_weight, 1, now))
        if not self._queue or not self._parked:
            self._collecting_since = None
        return jobs

    def use_buckets(self, buckets: tuple[int, ...]) -> None:
        """The model's batch buckets, for the policy (frontend/serving/buckets.py)."""
        self.policy.use_buckets(buckets)

    def completed(self, size: int, service_s: float, jobs: list[Job] | None = None) -> None:
        """A worker answered a batch of ``size`` (``jobs``) in ``service_s``."""
        self.policy.on_completed(size, service_s, self._clock())
        if self._fair is not None and jobs:
            self._fair.costs.learn(jobs, service_s)
        if self._service_s == 0.0:
            self._service_s = service_s
        else:
            self._service_s += SERVICE_ALPHA * (service_s - self._service_s)

    def _take(self, now: float, since: float, reason: str, limit: int = 0) -> list[Job]:
        """The next batch out of the queue (``since``: when a free worker began collecting it;
        ``reason``: why it leaves), of up to ``limit`` items (0: ``max_batch_size``)."""
        # The first job always goes, so a request with more instances than the limit is
        # processed whole rather than rejected (KServe's rule).
        limit = limit or self.max_batch_size
        batch = [self._queue.popleft()]
        items = batch[0].weight
        while self._queue and items + self._queue[0].weight <= limit:
            job = self._queue.popleft()
            items += job.weight
            batch.append(job)
        self._queued_weight -= items
        self._earliest_stale = True
        facts = Batch(SEQUENCE if self._sequence else reason, items, self.max_batch_size,
                      now, since)
        for job in batch:
            job.batch = facts
            job.dispatched = True
        if self._on_formed is not None:
            self._on_formed(facts)
        if not self._queue:
            self._emptied.set()
        if self._room_waiters:
            self._make_room(len(batch))
        return batch

    async def wait_empty(self, timeout_s: float | None) -> bool:
        """Wait until every queued job has been dispatched; False on timeout."""
        try:
            await asyncio.wait_for(self._emptied.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    def requeue(self, jobs: list[Job]) -> None:
        """Put jobs that left the queue back at its front, in order (their worker went away
        before running them)."""
        for job in reversed(jobs):
            job.dispatched = False
            job.batch = None
            if job.is_live():
                self._queue.appendleft(job)
                self._queued_weight += job.weight
                self._earliest = min(self._earliest, job.deadline)
        if self._queue:
            self._emptied.clear()
            if self._parked or self._parked_full:
                self._release()

    def take_queued(self) -> list[Job]:
        """Take every queued job out, in order (to be queued elsewhere: a stateful model's
        jobs leave a worker that went down)."""
        jobs = list(self._queue)
        self._queue.clear()
        self._queued_weight = 0
        self._earliest, self._earliest_stale = float("inf"), False
        self._emptied.set()
        self._make_room(len(jobs))
        return jobs

    def fail_queued(self, error: ServeError) -> None:
        """Answer every queued job with ``error`` now (its workers cannot serve it soon)."""
        fail_jobs(self.take_queued(), error)

    def close(self, error: ServeError) -> None:
        """Fail every queued job with ``error``, refuse new ones, and let parked workers go."""
        self._closed = error
        while self._queue:
            job = self._queue.popleft()
            if job.is_live():
                job.future.set_exception(error)
        self._queued_weight = 0
        self._emptied.set()
        if self._wake is not None:
            self._wake.cancel()
            self._wake = None
        parked = [*self._parked, *self._parked_full]
        self._parked, self._parked_full = collections.deque(), collections.deque()
        for take in parked:
            take(error)
        self._make_room(len(self._room_waiters))


def fail_jobs(jobs: list[Job], error: BaseException) -> None:
    for job in jobs:
        job.fail(error)
