"""The batcher: batches of up to B, released when full or D after the first job."""

from __future__ import annotations

import asyncio
import time

import pytest

from frontend.errors import GatewayTimeout, ServiceUnavailable
from frontend.serving.batching import Batcher, Job
from frontend.serving.policies import FixedPolicy
from protos import worker_pb2


def _job(loop: asyncio.AbstractEventLoop, rid: str = "r", deadline: float = float("inf")) -> Job:
    return Job(worker_pb2.Request(request_id=rid), loop.create_future(), deadline=deadline)


def _batcher(size: int, delay_s: float, capacity: int = 100) -> Batcher:
    return Batcher(max_batch_size=size, capacity=capacity,
                   policy=FixedPolicy(size, delay_s))


def test_a_full_batch_is_released_at_once() -> None:
    async def scenario() -> list[str]:
        loop = asyncio.get_running_loop()
        batcher = _batcher(4, delay_s=10.0)
        for i in range(6):
            batcher.submit(_job(loop, f"r{i}"))
        batch = await asyncio.wait_for(batcher.next_batch(), 1.0)
        assert batcher.depth == 2
        return [job.request.request_id for job in batch]

    assert asyncio.run(scenario()) == ["r0", "r1", "r2", "r3"]


def test_a_partial_batch_is_released_after_the_delay() -> None:
    async def scenario() -> tuple[int, float]:
        loop = asyncio.get_running_loop()
        batcher = _batcher(8, delay_s=0.05)
        batcher.submit(_job(loop))
        started = time.monotonic()
        waiting = asyncio.ensure_future(batcher.next_batch())
        await asyncio.sleep(0.01)
        batcher.submit(_job(loop))
        batch = await asyncio.wait_for(waiting, 2.0)
        return len(batch), time.monotonic() - started

    size, elapsed = asyncio.run(scenario())
    assert size == 2
    assert elapsed >= 0.045


def test_late_arrivals_that_fill_the_batch_release_it_early() -> None:
    async def scenario() -> int:
        loop = asyncio.get_running_loop()
        batcher = _batcher(3, delay_s=30.0)
        batcher.submit(_job(loop))
        waiting = asyncio.ensure_future(batcher.next_batch())
        await asyncio.sleep(0)
        batcher.submit(_job(loop))
        batcher.submit(_job(loop))
        return len(await asyncio.wait_for(waiting, 2.0))

    assert asyncio.run(scenario()) == 3


def test_full_queue_raises_service_unavailable_with_retry_after() -> None:
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        batcher = _batcher(1, 0.0, capacity=2)
        batcher.submit(_job(loop))
        batcher.submit(_job(loop))
        with pytest.raises(ServiceUnavailable) as caught:
            batcher.submit(_job(loop))
        assert caught.value.headers == {"Retry-After": "1"}

    asyncio.run(scenario())


def test_abandoned_and_expired_jobs_are_never_dispatched() -> None:
    async def scenario() -> list[str]:
        loop = asyncio.get_running_loop()
        batcher = _batcher(4, delay_s=0.0)
        gone, expired, live = _job(loop, "gone"), _job(loop, "expired", deadline=0.0), \
            _job(loop, "live")
        for job in (gone, expired, live):
            batcher.submit(job)
        gone.future.cancel()
        batch = await asyncio.wait_for(batcher.next_batch(), 1.0)
        assert isinstance(expired.future.exception(), GatewayTimeout)
        return [job.request.request_id for job in batch]

    assert asyncio.run(scenario()) == ["live"]


def test_a_cancelled_collector_loses_no_job() -> None:
    async def scenario() -> int:
        loop = asyncio.get_running_loop()
        batcher = _batcher(4, delay_s=30.0)
        batcher.submit(_job(loop))
        collecting = asyncio.ensure_future(batcher.next_batch())
        await asyncio.sleep(0.01)
        collecting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await collecting
        assert batcher.depth == 1
        batcher.policy = FixedPolicy(4, 0.0)
        return len(await asyncio.wait_for(batcher.next_batch(), 1.0))

    assert asyncio.run(scenario()) == 1


def test_close_fails_queued_jobs_and_wakes_collectors() -> None:
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        batcher = _batcher(4, delay_s=30.0)
        waiting = asyncio.ensure_future(batcher.next_batch())
        await asyncio.sleep(0)
        batcher.close(ServiceUnavailable("going away"))
        with pytest.raises(ServiceUnavailable):
            await asyncio.wait_for(waiting, 1.0)
        with pytest.raises(ServiceUnavailable):
            batcher.submit(_job(loop))

    asyncio.run(scenario())


def test_weighted_jobs_fill_batches_by_items_and_an_oversized_job_goes_whole() -> None:
    async def scenario() -> list[list[int]]:
        loop = asyncio.get_running_loop()
        batcher = _batcher(8, delay_s=0.0)
        for weight in (3, 4, 2, 12, 1):
            job = _job(loop)
            job.weight = weight
            batcher.submit(job)
        batches = []
        while batcher.depth:
            batch = await asyncio.wait_for(batcher.next_batch(), 1.0)
            batches.append([job.weight for job in batch])
            assert all(job.batch_size == sum(batches[-1]) for job in batch)
        return batches

    assert asyncio.run(scenario()) == [[3, 4], [2], [12], [1]]


def test_take_ready_takes_only_what_the_policy_would_send_at_once() -> None:
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        batcher = _batcher(3, delay_s=30.0)
        assert batcher.take_ready() is None  # nothing queued
        batcher.submit(_job(loop, "a"))
        batcher.submit(_job(loop, "b"))
        assert batcher.take_ready() is None  # fixed policy: a partial batch waits
        assert batcher.depth == 2
        batcher.submit(_job(loop, "c"))
        batcher.submit(_job(loop, "d"))
        batch = batcher.take_ready()
        assert batch is not None and [job.request.request_id for job in batch] == ["a", "b", "c"]
        assert all(job.dispatched and job.batch_size == 3 for job in batch)
        assert batcher.depth == 1

    asyncio.run(scenario())


def test_a_parked_worker_gets_a_batch_before_take_ready_does() -> None:
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        batcher = _batcher(2, delay_s=30.0)
        batcher.submit(_job(loop, "first"))
        collecting = asyncio.ensure_future(batcher.next_batch())
        await asyncio.sleep(0)  # the collector is parked, waiting for a second job
        batcher.submit(_job(loop, "second"))
        batcher.submit(_job(loop, "third"))
        assert batcher.take_ready() is None
        batch = await asyncio.wait_for(collecting, 2.0)
        assert [job.request.request_id for job in batch] == ["first", "second"]

    asyncio.run(scenario())


def test_take_ready_never_takes_expired_or_abandoned_jobs() -> None:
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        batcher = _batcher(2, delay_s=30.0)
        expired = _job(loop, "expired", deadline=time.monotonic() - 1)
        abandoned = _job(loop, "abandoned")
        batcher.submit(expired)
        batcher.submit(abandoned)
        abandoned.future.cancel()
        assert batcher.take_ready() is None
        assert isinstance(expired.future.exception(), GatewayTimeout)
        assert batcher.depth == 0

    asyncio.run(scenario())


def test_take_full_gives_only_full_batches_of_more_than_one() -> None:
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        batcher = _batcher(3, delay_s=30.0)
        batcher.submit(_job(loop, "a"))
        batcher.submit(_job(loop, "b"))
        assert batcher.take_full() is None
        batcher.submit(_job(loop, "c"))
        batcher.submit(_job(loop, "d"))
        full = batcher.take_full()
        assert full is not None and [job.request.request_id for job in full] == ["a", "b", "c"]
        single = _batcher(1, delay_s=0.0)
        single.submit(_job(loop, "x"))
        assert single.take_full() is None  # batch_size 1: no second batch in flight

    asyncio.run(scenario())


def test_a_worker_parked_for_a_full_batch_gets_it_when_the_queue_fills() -> None:
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        batcher = _batcher(2, delay_s=30.0)
        got: list[list[str]] = []

        def take(outcome: object) -> None:
            got.append([job.request.request_id for job in outcome])  # type: ignore[attr-defined]

        batcher.park_for_full(take)
        batcher.submit(_job(loop, "a"))
        assert got == []  # half a batch: the busy worker does not take it
        batcher.submit(_job(loop, "b"))
        assert got == [["a", "b"]]
        # Free workers come first: with one parked, the busy one waits.
        batcher.park_for_full(take)
        free: list[object] = []
        batcher.park(free.append)
        batcher.submit(_job(loop, "c"))
        batcher.submit(_job(loop, "d"))
        assert len(free) == 1 and got == [["a", "b"]]
        assert batcher.unpark(take) and not batcher.unpark(take)

    asyncio.run(scenario())
