"""The batcher: batches of up to B, released when full or D after the first job.

Time is simulated (frontend/serving/simulation.py): the batcher reads the simulated clock and
sets its wake-ups on the simulated timer, so every wait is exact and nothing sleeps.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

from frontend.errors import GatewayTimeout, ServeError, ServiceUnavailable
from frontend.serving.batching import Batcher, Job, loop_call_later
from frontend.serving.policies import STALE_GAPS, AdaptivePolicy, BatchPolicy, FixedPolicy
from frontend.serving.simulation import SimulatedTime
from protos import worker_pb2

INF = float("inf")


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    """A loop for the jobs' futures only: it never runs."""
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@dataclass
class Worker:
    """A free worker's side of park(): what it was handed, in order."""

    outcomes: list[list[Job] | ServeError] = field(default_factory=list)

    def take(self, outcome: list[Job] | ServeError) -> None:
        self.outcomes.append(outcome)

    @property
    def batches(self) -> list[list[str]]:
        return [_ids(outcome) for outcome in self.outcomes if isinstance(outcome, list)]


@dataclass
class Rig:
    loop: asyncio.AbstractEventLoop
    time: SimulatedTime
    batcher: Batcher

    def submit(self, *ids: str, deadline: float = INF) -> list[Job]:
        jobs = [Job(worker_pb2.Request(request_id=i), self.loop.create_future(),
                    deadline=deadline) for i in ids]
        for job in jobs:
            self.batcher.submit(job)
        return jobs

    def park(self) -> Worker:
        worker = Worker()
        self.batcher.park(worker.take)
        return worker


def _rig(loop: asyncio.AbstractEventLoop, size: int, delay_s: float, capacity: int = 100,
         policy: BatchPolicy | None = None) -> Rig:
    time = SimulatedTime()
    batcher = Batcher(max_batch_size=size, capacity=capacity,
                      policy=policy or FixedPolicy(size, delay_s),
                      clock=time, call_later=time.call_later)
    return Rig(loop, time, batcher)


def _ids(jobs: list[Job]) -> list[str]:
    return [job.request.request_id for job in jobs]


def test_a_full_batch_is_released_at_once(loop: asyncio.AbstractEventLoop) -> None:
    r = _rig(loop, 4, delay_s=10.0)
    r.submit("r0", "r1", "r2", "r3", "r4", "r5")
    worker = r.park()
    assert worker.batches == [["r0", "r1", "r2", "r3"]]
    assert r.batcher.depth == 2 and r.time.now == 0.0


def test_a_partial_batch_is_released_after_the_delay(loop: asyncio.AbstractEventLoop) -> None:
    r = _rig(loop, 8, delay_s=0.05)
    r.submit("first")
    worker = r.park()  # the worker finds the first job: the delay runs from now
    r.time.run_until(0.01)
    r.submit("second")  # a later arrival does not restart it
    r.time.run_until(0.0499)
    assert worker.outcomes == []
    r.time.run_until(0.05)
    assert worker.batches == [["first", "second"]]
    batch = worker.outcomes[0]
    assert isinstance(batch, list)
    assert [job.queue_wait_s for job in batch] == pytest.approx([0.05, 0.04])


def test_late_arrivals_that_fill_the_batch_release_it_early(
        loop: asyncio.AbstractEventLoop) -> None:
    r = _rig(loop, 3, delay_s=30.0)
    r.submit("a")
    worker = r.park()
    r.time.advance(0.001)
    r.submit("b")
    assert worker.outcomes == []
    r.submit("c")  # the arrival that fills the batch hands it over, long before D
    assert worker.batches == [["a", "b", "c"]] and r.time.now == 0.001


def test_full_queue_raises_service_unavailable_with_retry_after(
        loop: asyncio.AbstractEventLoop) -> None:
    r = _rig(loop, 1, 0.0, capacity=2)
    r.submit("a", "b")
    with pytest.raises(ServiceUnavailable) as caught:
        r.submit("c")
    assert caught.value.headers == {"Retry-After": "1"}


def test_abandoned_and_expired_jobs_are_never_dispatched(
        loop: asyncio.AbstractEventLoop) -> None:
    r = _rig(loop, 4, delay_s=0.05)
    (gone,) = r.submit("gone")
    (expiring,) = r.submit("expiring", deadline=0.03)
    r.submit("live")
    gone.future.cancel()
    r.time.run_until(0.05)  # the deadline passes while no worker is free
    worker = r.park()
    r.time.run_until(0.2)
    assert worker.batches == [["live"]]
    assert isinstance(expiring.future.exception(), GatewayTimeout)
    assert r.batcher.depth == 0


def test_a_deadline_sends_the_batch_a_worker_collects_before_it_passes(
        loop: asyncio.AbstractEventLoop) -> None:
    r = _rig(loop, 4, delay_s=0.05)
    (gone,) = r.submit("gone")
    (expiring,) = r.submit("expiring", deadline=0.03)
    r.submit("live")
    worker = r.park()  # collects: three of four, for up to D
    gone.future.cancel()
    r.time.run_until(0.05)  # the deadline would pass while the worker collects: it goes first
    assert worker.batches == [["expiring", "live"]]
    assert not expiring.future.done() and expiring.batch is not None
    assert expiring.batch.reason == "deadline" and expiring.queue_wait_s < 0.03
    assert r.batcher.depth == 0


def test_an_unparked_worker_takes_no_job(loop: asyncio.AbstractEventLoop) -> None:
    r = _rig(loop, 4, delay_s=30.0)
    r.submit("a")
    worker = Worker()
    r.batcher.park(worker.take)  # collecting: one job, waiting for more
    r.time.advance(0.01)
    assert r.batcher.unpark(worker.take) and not r.batcher.unpark(worker.take)
    r.submit("b")
    r.time.advance(60.0)  # the wake-up it had asked for finds no worker
    assert worker.outcomes == [] and r.batcher.depth == 2
    other = r.park()  # a worker that comes later collects from its own arrival
    parked_at = r.time.now
    r.time.run_until(parked_at + 29.0)
    assert other.outcomes == []
    r.time.run_until(parked_at + 30.0)  # exactly D: a remainder of a few ulps is no wait
    assert other.batches == [["a", "b"]]


def test_close_fails_queued_jobs_and_wakes_parked_workers(
        loop: asyncio.AbstractEventLoop) -> None:
    r = _rig(loop, 4, delay_s=30.0)
    (queued,) = r.submit("queued")
    collecting, busy = r.park(), Worker()
    r.batcher.park_for_full(busy.take)
    assert r.time.pending == 1  # the wake-up at D
    error = ServiceUnavailable("going away")
    r.batcher.close(error)
    assert collecting.outcomes == [error] and busy.outcomes == [error]
    assert queued.future.exception() is error
    assert r.time.pending == 0  # the wake-up is cancelled
    with pytest.raises(ServiceUnavailable):
        r.submit("late")
    late = r.park()  # a worker that parks afterwards is let go at once
    assert late.outcomes == [error]


def test_weighted_jobs_fill_batches_by_items_and_an_oversized_job_goes_whole(
        loop: asyncio.AbstractEventLoop) -> None:
    r = _rig(loop, 8, delay_s=0.0)
    for weight in (3, 4, 2, 12, 1):
        job = Job(worker_pb2.Request(), loop.create_future(), weight=weight)
        r.batcher.submit(job)
    batches = []
    while r.batcher.depth:
        worker = r.park()
        (batch,) = worker.outcomes
        assert isinstance(batch, list)
        batches.append([job.weight for job in batch])
        assert all(job.batch_size == sum(batches[-1]) for job in batch)
    assert batches == [[3, 4], [2], [12], [1]]


def test_take_ready_takes_only_what_the_policy_would_send_at_once(
        loop: asyncio.AbstractEventLoop) -> None:
    r = _rig(loop, 3, delay_s=30.0)
    assert r.batcher.take_ready() is None  # nothing queued
    r.submit("a", "b")
    assert r.batcher.take_ready() is None  # fixed policy: a partial batch waits
    assert r.batcher.depth == 2
    r.submit("c", "d")
    batch = r.batcher.take_ready()
    assert batch is not None and _ids(batch) == ["a", "b", "c"]
    assert all(job.dispatched and job.batch_size == 3 for job in batch)
    assert r.batcher.depth == 1


def test_a_parked_worker_gets_a_batch_before_take_ready_does(
        loop: asyncio.AbstractEventLoop) -> None:
    r = _rig(loop, 2, delay_s=30.0)
    r.submit("first")
    worker = r.park()  # parked, waiting for a second job
    r.submit("second", "third")
    assert r.batcher.take_ready() is None
    assert worker.batches == [["first", "second"]] and r.batcher.depth == 1


def test_take_ready_never_takes_expired_or_abandoned_jobs(
        loop: asyncio.AbstractEventLoop) -> None:
    r = _rig(loop, 2, delay_s=30.0)
    (expired,) = r.submit("expired", deadline=1.0)
    (abandoned,) = r.submit("abandoned")
    abandoned.future.cancel()
    r.time.advance(1.0)
    assert r.batcher.take_ready() is None
    assert isinstance(expired.future.exception(), GatewayTimeout)
    assert r.batcher.depth == 0


def test_take_full_gives_only_full_batches_of_more_than_one(
        loop: asyncio.AbstractEventLoop) -> None:
    r = _rig(loop, 3, delay_s=30.0)
    r.submit("a", "b")
    assert r.batcher.take_full() is None
    r.submit("c", "d")
    full = r.batcher.take_full()
    assert full is not None and _ids(full) == ["a", "b", "c"]
    single = _rig(loop, 1, delay_s=0.0)
    single.submit("x")
    assert single.batcher.take_full() is None  # batch_size 1: no second batch in flight


def test_a_worker_parked_for_a_full_batch_gets_it_when_the_queue_fills(
        loop: asyncio.AbstractEventLoop) -> None:
    r = _rig(loop, 2, delay_s=30.0)
    busy = Worker()
    r.batcher.park_for_full(busy.take)
    r.submit("a")
    assert busy.outcomes == []  # half a batch: the busy worker does not take it
    r.submit("b")
    assert busy.batches == [["a", "b"]]
    # Free workers come first: with one parked, the busy one waits.
    r.batcher.park_for_full(busy.take)
    free = r.park()
    r.submit("c", "d")
    assert free.batches == [["c", "d"]] and busy.batches == [["a", "b"]]
    assert r.batcher.unpark(busy.take) and not r.batcher.unpark(busy.take)


def test_an_adaptive_wait_fills_the_batch_and_ends_when_the_stream_pauses(
        loop: asyncio.AbstractEventLoop) -> None:
    size, delay_s, gap_s = 8, 0.05, 0.001
    r = _rig(loop, size, delay_s, policy=AdaptivePolicy(size, delay_s))
    for n in (1, 3, 8, 2, 5, 8, 4, 7, 1, 6):  # batches cost 20 ms + 1 ms per item
        r.time.advance(0.1)
        r.batcher.completed(n, 0.020 + 0.001 * n)
    r.time.advance(10.0)  # long past any echo of those answers

    def arrive(count: int) -> None:
        for _ in range(count):
            r.time.advance(gap_s)
            r.submit("j")

    arrive(2 * size)  # one job a millisecond while every worker is busy
    assert r.park().batches == [["j"] * size] and r.park().batches == [["j"] * size]
    worker = r.park()  # free, and the queue is empty
    arrive(size - 1)
    assert worker.outcomes == []  # worth waiting for: the next job is a millisecond away
    arrive(1)
    assert len(worker.batches) == 1 and len(worker.batches[0]) == size

    worker = r.park()
    arrive(3)
    first_arrival, last_arrival = r.time.now - 2 * gap_s, r.time.now
    r.time.run_until(last_arrival + STALE_GAPS * gap_s - 1e-6)
    assert worker.outcomes == []  # the stream may only be a little late
    r.time.run_until(first_arrival + delay_s)
    assert len(worker.batches) == 1 and len(worker.batches[0]) == 3  # it paused: let go
    batch = worker.outcomes[0]
    assert isinstance(batch, list) and batch[0].queue_wait_s < delay_s  # well before D


def test_without_a_timer_the_batcher_wakes_through_the_running_loop() -> None:
    async def scenario() -> None:
        fired: list[bool] = []
        timer = loop_call_later(3600.0, lambda: fired.append(True))
        assert isinstance(timer, asyncio.TimerHandle)
        assert timer.when() >= asyncio.get_running_loop().time() + 3599.0
        timer.cancel()
        assert fired == []

    asyncio.run(scenario())
