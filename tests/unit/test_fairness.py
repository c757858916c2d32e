"""The fair queue (frontend/serving/fairness.py) alone and under the real Batcher: weighted
shares of batch room between backlogged tenants, work conservation, strict priority levels,
earliest deadline first within a tenant, fair admission, hopeless deadlines refused at once."""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import Iterator

import pytest

from frontend.config.values import tenant_weights
from frontend.errors import BadRequest, QueueFull, ServeError
from frontend.ops.tenants import MAX_TENANTS, Tenancy
from frontend.serving.batching import Batcher, Job
from frontend.serving.fairness import (
    MIN_LEARNED_BATCHES,
    DeadlineUnmeetable,
    Displaced,
    FairQueue,
    LevelFull,
    LevelPolicy,
    Scheduling,
)
from frontend.serving.policies import FixedPolicy
from frontend.serving.simulation import SimulatedTime
from protos import worker_pb2

INF = float("inf")


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    """The jobs' futures' loop (never run)."""
    with contextlib.closing(asyncio.new_event_loop()) as made:
        yield made


def job(loop: asyncio.AbstractEventLoop, tenant: str = "default", name: str = "",
        priority: int = 0, deadline: float = INF) -> Job:
    made = Job(worker_pb2.Request(request_id=name or tenant), loop.create_future(),
               deadline=deadline, budget_s=1.0)
    made.tenant, made.priority = tenant, priority
    return made


def test_backlogged_tenants_share_by_weight_and_an_idle_ones_share_goes_to_the_others(
        loop: asyncio.AbstractEventLoop) -> None:
    queue = FairQueue(Scheduling({"a": 3, "b": 1}), capacity=1000)
    for index in range(200):
        queue.append(job(loop, "a", f"a{index}"))
        queue.append(job(loop, "b", f"b{index}"))
    first = collections.Counter(queue.popleft().tenant for _ in range(80))
    assert first == {"a": 60, "b": 20}
    # a alone (b's jobs all taken out): everything goes to a, nothing is held back for b.
    solo = FairQueue(Scheduling({"a": 1, "b": 1}), capacity=1000)
    for index in range(10):
        solo.append(job(loop, "b", f"b{index}"))
    assert [solo.popleft().tenant for _ in range(10)] == ["b"] * 10


def test_a_tenant_that_was_idle_does_not_bank_credit(loop: asyncio.AbstractEventLoop) -> None:
    """SFQ: a tenant arriving late starts at the virtual time now, not at 0."""
    queue = FairQueue(Scheduling(), capacity=1000)
    for index in range(50):
        queue.append(job(loop, "a", f"a{index}"))
    for _ in range(40):
        queue.popleft()
    for index in range(20):
        queue.append(job(loop, "b", f"b{index}"))
    taken = [queue.popleft().tenant for _ in range(20)]
    assert 8 <= taken.count("a") <= 12  # alternating, not twenty b's in a row


def test_levels_are_strict_and_deadlines_order_a_tenants_jobs(
        loop: asyncio.AbstractEventLoop) -> None:
    queue = FairQueue(Scheduling(levels=3, default_level=2), capacity=100)
    queue.append(job(loop, "a", "low", priority=3))
    queue.append(job(loop, "a", "default"))
    queue.append(job(loop, "a", "late", priority=1, deadline=20.0))
    queue.append(job(loop, "a", "soon", priority=1, deadline=10.0))
    assert [queue.popleft().request.request_id for _ in range(4)] == \
        ["soon", "late", "default", "low"]
    with pytest.raises(BadRequest, match=r"from 1 .* to 3"):
        queue.check(job(loop, priority=4))


def test_a_level_over_its_max_queue_size_is_refused(loop: asyncio.AbstractEventLoop) -> None:
    queue = FairQueue(Scheduling(levels=2, policies={2: LevelPolicy(max_queue_size=2)}),
                      capacity=100)
    for _ in range(2):
        queue.append(job(loop, priority=2))
    with pytest.raises(LevelFull) as refused:
        queue.check(job(loop, priority=2))
    assert refused.value.http_status == 503 and refused.value.headers["Retry-After"]
    queue.check(job(loop, priority=1))  # another level has room


def test_a_full_queue_takes_a_tenant_under_its_share_by_displacing_the_newest_of_the_most_over(
        loop: asyncio.AbstractEventLoop) -> None:
    queue = FairQueue(Scheduling(), capacity=4)
    heavy = [job(loop, "heavy", f"h{index}") for index in range(4)]
    for queued in heavy:
        queue.append(queued)
    with pytest.raises(QueueFull):  # heavy holds more than its share already
        queue.check(job(loop, "heavy"))
    light = job(loop, "light")
    queue.check(light)
    displaced = queue.enter(light, now=0.0, service_s=0.0)
    assert displaced is heavy[-1] and len(queue) == 4
    error = displaced.future.exception()
    assert isinstance(error, Displaced) and error.headers["Retry-After"] == "1"
    assert queue.queued == {"heavy": 3, "light": 1}
    # At their shares (2 each of 4), nobody is displaced any more.
    queue.enter(job(loop, "light"), now=0.0, service_s=0.0)
    with pytest.raises(QueueFull):
        queue.check(job(loop, "light"))


def test_a_hopeless_deadline_is_refused_once_costs_are_learned(
        loop: asyncio.AbstractEventLoop) -> None:
    queue = FairQueue(Scheduling(), capacity=100)
    cold = job(loop, "b", deadline=0.000001)
    assert queue.enter(cold, now=0.0, service_s=0.0) is None  # nothing learned: let in
    queue.popleft()
    for _ in range(MIN_LEARNED_BATCHES):
        queue.costs.learn([job(loop) for _ in range(4)], 0.04)  # 10 ms an item
    assert queue.costs.learned
    for _ in range(20):  # 200 ms of a's, each due before the one that comes next
        queue.append(job(loop, "a", deadline=0.09))
    # b's first job goes after one of a's at most: about 20 ms ahead of its answer.
    queue.enter(job(loop, "b", deadline=0.05), now=0.0, service_s=0.0)
    hopeless = job(loop, "a", deadline=0.1)
    with pytest.raises(DeadlineUnmeetable) as refused:
        queue.enter(hopeless, now=0.0, service_s=0.0)
    assert refused.value.http_status == 503 and refused.value.headers["Retry-After"] == "1"
    assert hopeless not in list(queue) and len(queue) == 21
    queue.workers = 4  # four workers take the work ahead four times as fast
    queue.enter(job(loop, "a", deadline=0.1), now=0.0, service_s=0.0)


def test_the_batcher_fills_batches_in_fair_order_and_keeps_its_fifo_deque_without_one(
        loop: asyncio.AbstractEventLoop) -> None:
    time = SimulatedTime()
    fair = FairQueue(Scheduling({"a": 1, "b": 1}), capacity=100)
    batcher = Batcher(max_batch_size=4, capacity=100, policy=FixedPolicy(4, 0.01),
                      clock=time, call_later=time.call_later, fair=fair)
    for index in range(8):
        batcher.submit(job(loop, "a", f"a{index}"))
    for index in range(2):
        batcher.submit(job(loop, "b", f"b{index}"))
    taken: list[list[Job] | ServeError] = []
    batcher.park(taken.append)
    first = taken[0]
    assert isinstance(first, list)
    assert sorted(j.tenant for j in first) == ["a", "a", "b", "b"]
    assert batcher.depth == 6
    plain = Batcher(max_batch_size=4, capacity=100, policy=FixedPolicy(4, 0.01),
                    clock=time, call_later=time.call_later)
    assert type(plain._queue) is collections.deque


def test_the_batcher_answers_a_displaced_job_and_counts_the_newcomer(
        loop: asyncio.AbstractEventLoop) -> None:
    time = SimulatedTime()
    batcher = Batcher(max_batch_size=4, capacity=3, policy=FixedPolicy(4, 10.0),
                      clock=time, call_later=time.call_later,
                      fair=FairQueue(Scheduling(), capacity=3))
    heavy = [job(loop, "heavy") for _ in range(3)]
    for queued in heavy:
        batcher.submit(queued)
    with pytest.raises(QueueFull):
        batcher.refuse_if_full(job(loop, "heavy"))
    batcher.submit(job(loop, "light"))
    assert isinstance(heavy[-1].future.exception(), Displaced)
    assert batcher.depth == 3 and batcher._queued_weight == 3


@pytest.mark.parametrize(("text", "message"), [
    ("a:0", "must be > 0"), ("a:x", "must be a number"), ("a:1,a:2", "listed twice"),
    ("a b:1", "letters, digits"), ("a:1001", "<= 1000")])
def test_tenant_weights_name_what_is_wrong(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        tenant_weights(text)
    assert tenant_weights("a:3, b ,c:0.5") == (("a", 3.0), ("b", 1.0), ("c", 0.5))


def test_clients_cannot_make_tenants_without_end(loop: asyncio.AbstractEventLoop) -> None:
    """Every tenant name is a queue and metric series: past MAX_TENANTS names (those listed in
    tenant_weights first), a request naming a new one is the default tenant's."""
    tenancy = Tenancy("X-Tenant", "", listed=["gold"])
    seen = []
    for number in range(MAX_TENANTS + 50):
        named = job(loop)
        tenancy.stamp(named, [(b"x-tenant", f"t{number}".encode())])
        seen.append(named.tenant)
    assert len(set(seen) - {"default"}) == MAX_TENANTS - 1  # "gold" holds one place
    assert seen[-50:] == ["default"] * 50
    gold = job(loop)
    tenancy.stamp(gold, [(b"x-tenant", b"gold")])
    assert gold.tenant == "gold"  # a listed tenant is always told apart
