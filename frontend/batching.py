"""Per-model job queue that releases batches to idle workers.

The batcher only groups jobs; it never touches sockets or processes. Each worker pulls a
batch when it is idle (as TorchServe's WorkerThread does), so there is at most one batch in
flight per worker and the queue fills naturally while every worker is busy. *When* a batch is
released is decided by a small pure policy object, so other policies plug in without touching
the queue.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from frontend.errors import GatewayTimeout, ServeError, ServiceUnavailable
from frontend.policies import BatchPolicy
from frontend.streams import ResponseStream
from protos import worker_pb2


@dataclass(slots=True, eq=False)
class Job:
    """One client request waiting for its response."""

    request: worker_pb2.Request
    #: Resolves to the Response, or to a ResponseStream once a first intermediate part came.
    future: asyncio.Future[worker_pb2.Response | ResponseStream]
    #: loop.time() when the job entered the queue.
    enqueued_at: float = 0.0
    #: loop.time() after which the answer is no use to the client.
    deadline: float = float("inf")
    #: wall-clock seconds the job waited in the queue, set when it is dispatched.
    queue_wait_s: float = field(default=0.0)
    stream: ResponseStream | None = None
    #: True once the job left the queue for a worker.
    dispatched: bool = False
    #: Size of the batch the job rode in (0 until dispatched).
    batch_size: int = 0
    #: Items this job adds to a batch: 1 for a request, its instance count for KServe
    #: instance-level batching (a batch holds up to max_batch_size items).
    weight: int = 1
    #: Which batch the job rode in (KServe's batchId), set by the worker.
    batch_id: str = ""

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


class Batcher:
    """Groups the queued jobs of one model (version) into batches of up to ``max_batch_size``."""

    def __init__(
        self,
        *,
        max_batch_size: int,
        capacity: int,
        policy: BatchPolicy,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.max_batch_size = max_batch_size
        self.capacity = capacity
        self.policy = policy
        self._clock = clock
        self._queue: collections.deque[Job] = collections.deque()
        self._arrived = asyncio.Event()
        self._emptied = asyncio.Event()
        self._emptied.set()
        # One worker assembles a batch at a time; the others wait their turn, as TorchServe's
        # per-model lock does. Jobs leave the deque only in the final synchronous step, so a
        # worker cancelled while it collects loses nothing.
        self._assembling = asyncio.Lock()
        self._closed: ServeError | None = None
        #: Workers inside next_batch (waiting their turn or collecting): the free ones.
        self._idle_workers = 0
        #: Sum of the queued jobs' weights (items, not requests).
        self._queued_weight = 0

    @property
    def depth(self) -> int:
        """Jobs waiting in the queue (including ones whose client has gone)."""
        return len(self._queue)

    @property
    def remaining_capacity(self) -> int:
        return max(0, self.capacity - len(self._queue))

    def refuse_if_full(self) -> None:
        """Raise ServiceUnavailable now if a job would be refused: lets the HTTP layer answer
        503 before it reads the body (overload must stay cheap to turn away)."""
        if self._closed is not None:
            raise self._closed
        if len(self._queue) >= self.capacity:
            self._drop_finished()
            if len(self._queue) >= self.capacity:
                # A full queue answers at once instead of holding memory and latency for
                # requests that would time out anyway (job_queue_size).
                raise ServiceUnavailable(
                    f"job queue is full ({self.capacity} requests waiting); retry later",
                    headers={"Retry-After": "1"},
                )

    def submit(self, job: Job) -> None:
        """Queue a job, or raise ServiceUnavailable at once when the queue is full."""
        self.refuse_if_full()
        job.enqueued_at = now = self._clock()
        self.policy.on_arrival(now)
        self._queue.append(job)
        self._queued_weight += job.weight
        self._emptied.clear()
        self._arrived.set()

    def _drop_finished(self) -> None:
        """Forget jobs whose future is already done (client gone, or expired)."""
        if any(not job.is_live() for job in self._queue):
            self._queue = collections.deque(job for job in self._queue if job.is_live())
            self._queued_weight = sum(job.weight for job in self._queue)
            if not self._queue:
                self._emptied.set()

    def _expire(self, now: float) -> None:
        for job in self._queue:
            if job.deadline <= now and job.is_live():
                job.future.set_exception(
                    GatewayTimeout("request timed out in the queue before a worker was free"))
        self._drop_finished()

    async def next_batch(self) -> list[Job]:
        """Wait for jobs and return the next batch (1..max_batch_size live jobs)."""
        self._idle_workers += 1
        try:
            return await self._collect()
        finally:
            self._idle_workers -= 1

    def take_ready(self) -> list[Job] | None:
        """The next batch if the policy would send it at once to one more free worker (the
        caller, which has just finished a batch), else None: lets a worker start its next
        batch before it delivers the answers of the last one. Never waits."""
        if self._assembling.locked() or not self._queue or self._closed is not None:
            return None  # another worker is collecting, or there is nothing to take
        now = self._clock()
        self._expire(now)
        if not self._queue or self.policy.wait_s(self._queued_weight, 0.0,
                                                 self._idle_workers + 1, now) > 0:
            return None
        return self._take(now)

    def completed(self, size: int, service_s: float) -> None:
        """A worker answered a batch of ``size`` in ``service_s`` (feeds the policy)."""
        self.policy.on_completed(size, service_s, self._clock())

    async def _collect(self) -> list[Job]:
        async with self._assembling:
            while True:
                await self._wait_for_jobs()
                started = self._clock()
                while True:
                    now = self._clock()
                    self._expire(now)
                    if not self._queue:
                        break  # everything expired or was abandoned: wait afresh
                    wait = self.policy.wait_s(self._queued_weight, now - started,
                                              self._idle_workers, now)
                    if wait <= 0:
                        return self._take(now)
                    self._arrived.clear()
                    try:
                        # asyncio.timeout, not wait_for: on Python 3.11 wait_for can swallow
                        # a cancellation that lands as the event fires.
                        async with asyncio.timeout(wait):
                            await self._arrived.wait()
                    except TimeoutError:
                        pass

    async def _wait_for_jobs(self) -> None:
        while not self._queue:
            if self._closed is not None:
                raise self._closed
            self._arrived.clear()
            await self._arrived.wait()

    def _take(self, now: float) -> list[Job]:
        # Up to max_batch_size items; the first job always goes, so a request with more
        # instances than that is processed whole rather than rejected (KServe's rule).
        batch = [self._queue.popleft()]
        items = batch[0].weight
        while self._queue and items + self._queue[0].weight <= self.max_batch_size:
            job = self._queue.popleft()
            items += job.weight
            batch.append(job)
        self._queued_weight -= items
        count = items
        for job in batch:
            job.queue_wait_s = now - job.enqueued_at
            job.dispatched = True
            job.batch_size = count
        if not self._queue:
            self._emptied.set()
        self.policy.on_dispatch(count, now)
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
            job.batch_size = 0
            if job.is_live():
                self._queue.appendleft(job)
                self._queued_weight += job.weight
        if self._queue:
            self._emptied.clear()
            self._arrived.set()

    def close(self, error: ServeError) -> None:
        """Fail every queued job with ``error`` and refuse new ones."""
        self._closed = error
        while self._queue:
            job = self._queue.popleft()
            if job.is_live():
                job.future.set_exception(error)
        self._queued_weight = 0
        self._emptied.set()
        self._arrived.set()  # wake a waiting worker so it sees the close


def fail_jobs(jobs: list[Job], error: BaseException) -> None:
    for job in jobs:
        job.fail(error)
