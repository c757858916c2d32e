"""Batch buckets (issue 33, item 2): the padding arithmetic, the model's buckets from its
workers' reports, the adaptive policy's preference for batches that need no padding (driven
by injected time: it never waits longer than without buckets), the batcher taking what the
policy says, the exchange noting each batch's rows, and the observer counting hits and padding
for the metrics page, describe and the live page."""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Iterator

import pytest

from frontend.errors import ServeError
from frontend.observe.batches import BatchRecords
from frontend.observe.dashboard import Dashboard
from frontend.observe.events import Batch, JobFacts
from frontend.observe.metrics import ServerMetrics
from frontend.observe.status import ExecutionStatus, ModelStatus, WorkerStatus
from frontend.serving.batching import Batcher, Job
from frontend.serving.buckets import BucketTable, in_effect, normalise, padded_rows
from frontend.serving.exchange import PredictExchange
from frontend.serving.launcher import execution_of
from frontend.serving.policies import AdaptivePolicy, FixedPolicy
from frontend.serving.simulation import SimulatedTime, linear_service, simulate
from protos import worker_pb2

B = 8
D = 0.050
BUCKETS = (1, 2, 4, 8)


class FakeClock:
    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> float:
        self.now += seconds
        return self.now


def _learned(clock: FakeClock, overhead_s: float, per_row_s: float,
             buckets: tuple[int, ...] = BUCKETS) -> AdaptivePolicy:
    """A policy told ``buckets`` whose workers ran batches of every size at a + b * rows, then
    a quiet spell (long past any echo)."""
    policy = AdaptivePolicy(B, D)
    policy.use_buckets(buckets)
    for size in (1, 3, 8, 2, 5, 8, 4, 7, 1, 6):
        policy.on_completed(size, overhead_s + per_row_s * padded_rows(size, BUCKETS),
                            clock.advance(0.1))
    clock.advance(10.0)
    return policy


# -- the arithmetic ---------------------------------------------------------------------------


def test_a_batch_runs_in_the_smallest_bucket_that_holds_it_or_in_chunks_of_the_largest() -> None:
    assert [padded_rows(n, BUCKETS) for n in range(10)] == [0, 1, 2, 4, 4, 8, 8, 8, 8, 9]
    assert padded_rows(11, BUCKETS) == 12  # a chunk of 8, then 3 padded to 4
    assert padded_rows(13, (4,)) == 16 and padded_rows(12, (4,)) == 12
    assert padded_rows(5, ()) == 5  # no buckets: any size as it is
    table = BucketTable((1, 2, 4), 8)  # batch_size 8, buckets up to 4: chunks of 4
    assert table.rows == [0, 1, 2, 4, 4, 5, 6, 8, 8]
    assert table.fits == [0, 1, 2, 2, 4, 5, 6, 6, 8]  # the largest size <= n with no padding
    assert table.rows_of(11) == 12 and table.rows_of(3) == 4


def test_a_workers_report_is_normalised_and_the_model_takes_what_its_padding_workers_share(
) -> None:
    assert normalise([8, 1, 4, 4, 0, -2, 2]) == (1, 2, 4, 8)
    reported = worker_pb2.Execution(batch_buckets=[8, 2, 1, 4, 2], mode="cuda_graphs",
                                    graph_pool_bytes=1 << 20)
    assert execution_of(reported) == ExecutionStatus("cuda_graphs", (1, 2, 4, 8), "", 1 << 20)
    assert execution_of(worker_pb2.Execution()) == ExecutionStatus()  # said nothing: eager
    assert in_effect([(1, 2, 4, 8), (1, 2, 4, 8, 16)]) == (1, 2, 4, 8)
    # A worker that fell back to eager runs any size: the others' buckets stay in effect.
    assert in_effect([(1, 2, 4, 8), ()]) == (1, 2, 4, 8)
    assert in_effect([(), ()]) == () and in_effect([]) == ()
    assert in_effect([(3,), (4,)]) == ()  # nothing shared: no buckets


# -- the policy -------------------------------------------------------------------------------


def test_it_releases_a_bucket_and_keeps_the_rest_when_the_rest_loses_nothing() -> None:
    clock = FakeClock()
    # Mostly per row (2 ms + 1 ms a row): 5 padded to 8 costs 10 ms; 4 then 1 cost 6 + 3 ms.
    policy = _learned(clock, 0.002, 0.001)
    assert policy.batch_items(5, 1, clock.now) == 4
    # 7 padded to 8 (10 ms) against 4, then 3 padded to 4 (6 + 6 ms): the padded batch.
    assert policy.batch_items(7, 1, clock.now) == B
    assert policy.batch_items(3, 1, clock.now) == B  # 2 then 1 (4 + 3 ms) against 4 (6 ms)
    # A size with no padding, or more than a batch, goes as before.
    assert policy.batch_items(4, 1, clock.now) == B
    assert policy.batch_items(13, 1, clock.now) == B


def test_padding_is_kept_when_a_second_batch_costs_more_than_the_padding() -> None:
    clock = FakeClock()
    policy = _learned(clock, 0.020, 0.001)  # 20 ms a batch: 3 rows of padding are cheap
    assert policy.batch_items(5, 1, clock.now) == B
    # ...but another free worker takes the rest at once: nobody waits for it.
    assert policy.batch_items(5, 2, clock.now) == 4
    assert policy.batch_items(7, 3, clock.now) == 4


def test_without_a_known_cost_or_buckets_nothing_is_kept_back() -> None:
    fresh = AdaptivePolicy(B, D)
    fresh.use_buckets(BUCKETS)
    assert fresh.batch_items(5, 1, 0.0) == B  # no batch ran yet: the cost is unknown
    assert fresh.batch_items(5, 2, 0.0) == 4
    clock = FakeClock()
    no_buckets = _learned(clock, 0.002, 0.001, buckets=())
    assert no_buckets.batch_items(5, 2, clock.now) == B
    fixed = FixedPolicy(B, D)
    fixed.use_buckets(BUCKETS)  # TorchServe's rule, unchanged: it knows no buckets
    assert fixed.batch_items(5, 2, 0.0) == B and fixed.wait_s(5, 0.0, 1, 0.0) == D


def test_a_closed_loop_is_released_at_a_bucket_rather_than_padded_for_one_more() -> None:
    """Five clients answer ~3 ms after their batch; with buckets 4 and 8 a fifth request
    turns 4 rows into 8. Without buckets the policy waits for it; with them it sends 4."""
    waits = []
    for buckets in ((), BUCKETS):
        clock = FakeClock()
        policy = _learned(clock, 0.005, 0.001, buckets)
        cost = 0.005 + 0.001 * 8
        for _ in range(30):
            policy.on_completed(5, cost, clock.advance(cost))
            for echo in range(5):
                policy.on_arrival(clock.advance(0.003 if echo == 0 else 0.0001))
        policy.on_completed(5, cost, clock.advance(cost))
        for echo in range(4):
            policy.on_arrival(clock.advance(0.003 if echo == 0 else 0.0001))
        waits.append(policy.wait_s(4, 0.0, 1, clock.now))
    without, with_buckets = waits
    assert 0 < without < 0.005 and with_buckets <= 0


def test_with_buckets_a_wait_is_never_longer_than_without() -> None:
    """Two policies told the same events, one of them the buckets: whatever happens, the one
    with buckets never waits longer (and it does wait less, sometimes)."""
    rng = random.Random(20260311)
    shorter = 0
    for trial in range(300):
        size = rng.choice((4, 8, 16, 32))
        delay = rng.choice((0.001, 0.01, 0.05, 0.5))
        buckets = tuple(2 ** i for i in range(6) if 2 ** i <= size)
        plain, bucketed = AdaptivePolicy(size, delay), AdaptivePolicy(size, delay)
        bucketed.use_buckets(buckets)
        clock = FakeClock(rng.uniform(0, 1e6))
        overhead, per_row = rng.uniform(0, 0.03), rng.uniform(0, 0.003)
        for _ in range(rng.randrange(1, 150)):
            event = rng.random()
            if event < 0.6:
                clock.advance(rng.choice((0.0, 1e-5, 1e-3, 0.003, 3.0)) * rng.random())
                for policy in (plain, bucketed):
                    policy.on_arrival(clock.now)
            elif event < 0.8:
                n = rng.randrange(1, size + 1)
                took = overhead + per_row * padded_rows(n, buckets) * rng.uniform(0.8, 1.2)
                clock.advance(rng.random() * 0.05)
                for policy in (plain, bucketed):
                    policy.on_completed(n, took, clock.now)
            else:
                queued, waited = rng.randrange(1, size + 1), rng.uniform(0, 2 * delay)
                wait = bucketed.wait_s(queued, waited, 1, clock.now)
                before = plain.wait_s(queued, waited, 1, clock.now)
                assert math.isfinite(wait) and wait <= max(0.0, before) + 1e-12, trial
                shorter += max(0.0, wait) < before
                assert 1 <= bucketed.batch_items(queued, 1, clock.now) <= size
    assert shorter > 0


# -- the batcher ------------------------------------------------------------------------------


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    """A loop for the jobs' futures only: it never runs."""
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def _batcher(policy: AdaptivePolicy, time: SimulatedTime) -> Batcher:
    return Batcher(max_batch_size=B, capacity=100, policy=policy, clock=time,
                   call_later=time.call_later)


def _submit(loop: asyncio.AbstractEventLoop, batcher: Batcher, count: int) -> list[Job]:
    jobs = [Job(worker_pb2.Request(request_id=str(i)), loop.create_future())
            for i in range(count)]
    for job in jobs:
        batcher.submit(job)
    return jobs


def _park(batcher: Batcher) -> list[list[Job]]:
    """A free worker parked in ``batcher``: the batches it is handed, in order."""
    taken: list[list[Job]] = []

    def take(outcome: list[Job] | ServeError) -> None:
        assert isinstance(outcome, list), outcome
        taken.append(outcome)

    batcher.park(take)
    return taken


def test_a_free_worker_takes_a_bucket_and_the_rest_waits_for_it(
        loop: asyncio.AbstractEventLoop) -> None:
    time = SimulatedTime(start=1000.0)
    clock = FakeClock(time.now)
    policy = _learned(clock, 0.002, 0.001)
    time.advance(clock.now - time.now)
    batcher = _batcher(policy, time)
    _submit(loop, batcher, 5)
    taken = _park(batcher)
    assert [len(batch) for batch in taken] == [4] and batcher.depth == 1
    facts = taken[0][0].batch
    assert facts is not None and facts.items == 4 and facts.limit == B
    # The worker's next batch is the rest (take_ready: what the policy sends at once).
    rest = batcher.take_ready()
    assert rest is not None and len(rest) == 1 and batcher.depth == 0


def test_the_rest_goes_at_once_to_another_free_worker(loop: asyncio.AbstractEventLoop) -> None:
    time = SimulatedTime(start=1000.0)
    clock = FakeClock(time.now)
    policy = _learned(clock, 0.020, 0.001)  # padding is cheaper than a second batch...
    for _ in range(20):  # a dense stream: one job a millisecond
        policy.on_arrival(clock.advance(0.001))
    time.advance(clock.now - time.now)
    batcher = _batcher(policy, time)
    first = _park(batcher)
    # The stream goes on: the free worker waits for it to fill its batch.
    for i in range(5):
        time.advance(0.001)
        batcher.submit(Job(worker_pb2.Request(request_id=str(i)), loop.create_future()))
    assert first == [] and batcher.depth == 5
    # ...but with a second worker free, 4 go to the first and the 1 left to the second at
    # once, instead of 5 padded to 8 on one of them.
    second = _park(batcher)
    assert [len(batch) for batch in first] == [4] and [len(batch) for batch in second] == [1]
    assert batcher.depth == 0


# -- the exchange and the observer ------------------------------------------------------------


def test_the_exchange_notes_the_rows_a_batch_runs_as_on_its_worker(
        loop: asyncio.AbstractEventLoop) -> None:
    time = SimulatedTime()
    batcher = Batcher(max_batch_size=B, capacity=100, policy=FixedPolicy(B, 0.0), clock=time,
                      call_later=time.call_later)
    exchange = PredictExchange("W-1", "1", batcher, 1000, lambda jobs, result: None)
    rows = []
    for buckets in ((), BUCKETS):
        exchange.buckets = buckets
        _submit(loop, batcher, 5)
        taken = _park(batcher)
        exchange.frame(taken[0])
        facts = taken[0][0].batch
        assert facts is not None and facts.worker == "1"
        rows.append(facts.rows)
    assert rows == [0, 8]  # a worker with no buckets runs any size: no rows noted


def _ended(records: BatchRecords, key: tuple[str, str], items: int, rows: int,
           replied: bool = True) -> None:
    batch = Batch("adaptive", items, B, 0.0, 0.0)
    batch.rows, batch.replied = rows, replied
    records.batch_ended(key, batch, [JobFacts(worker_pb2.Request())] * items, None)


def test_the_observer_counts_hits_rows_and_padding_for_the_metrics_page() -> None:
    metrics = ServerMetrics(system_metrics=False)
    records, key, plain = metrics.records, ("padded", "1.0"), ("plain", "1.0")
    records.registered(key)
    records.registered(plain)
    for items, rows in ((4, 4), (5, 8), (1, 1), (3, 4)):
        _ended(records, key, items, rows)
    _ended(records, key, 6, 8, replied=False)  # lost with its worker: not counted
    _ended(records, plain, 5, 0)  # its worker runs any size
    model = records.of(*key)
    assert model is not None
    assert model.buckets.fields() == {"batches": 4, "hits": 2, "rows": 17, "paddedRows": 4,
                                      "paddingShare": round(4 / 17, 3)}
    assert records.of(*plain).buckets.batches == 0  # type: ignore[union-attr]
    page = metrics.exposition().decode()
    labels = 'model_name="padded",model_version="1.0",'
    for name, value in (("batchserve_batch_bucket_batches_total", 4),
                        ("batchserve_batch_bucket_hits_total", 2),
                        ("batchserve_batch_bucket_rows_total", 17),
                        ("batchserve_batch_padding_rows_total", 4)):
        assert f"# TYPE {name} counter\n" in page
        assert f"{name}{{{labels}}} {value}.0\n" in page, name
    assert 'model_name="plain"' not in page.split("batchserve_batch_bucket_batches_total")[-1]
    # Registered again: its records start afresh.
    records.registered(key)
    assert records.of(*key).buckets.batches == 0  # type: ignore[union-attr]


def test_the_live_page_carries_the_buckets_the_workers_executions_and_the_shares() -> None:
    clock = FakeClock()
    key = ("padded", "1.0")
    execution = ExecutionStatus("padded", BUCKETS, "", 0)
    status = ModelStatus(*key, "Healthy", "adaptive", B, 50, 0, 100,
                         (WorkerStatus("0", "READY", True, 0, 0, 42, None, None, execution),),
                         BUCKETS)
    metrics = ServerMetrics(lambda: [status], system_metrics=False)
    metrics.records.registered(key)
    dashboard = Dashboard(lambda: [status], metrics, clock=clock, monotonic=clock)
    assert dashboard.tick() is None  # the baseline
    clock.advance(1.0)
    for items, rows in ((4, 4), (5, 8), (2, 2), (3, 4)):
        _ended(metrics.records, key, items, rows)
    (row,) = dashboard.tick()["models"]  # type: ignore[index]
    assert row["buckets"] == {"batches": 4.0, "hitShare": 0.5, "paddingShare": 0.2222}
    clock.advance(1.0)
    (quiet,) = dashboard.tick()["models"]  # type: ignore[index]
    assert "buckets" not in quiet  # no batch in that second: no share to speak of
    (model,) = dashboard.document()["models"]  # type: ignore[misc]
    assert model["buckets"] == {"sizes": [1, 2, 4, 8], "batches": 4, "hits": 2, "rows": 18,
                                "paddedRows": 4, "paddingShare": 0.222}
    assert model["workers"][0]["execution"] == {"mode": "padded", "batchBuckets": [1, 2, 4, 8],
                                                "fallbackReason": "", "graphPoolBytes": 0}


# -- simulated workloads ----------------------------------------------------------------------


@pytest.mark.parametrize("load", [{"rate_per_s": 1244.0}, {"clients": 33}])
def test_simulated_batches_waste_less_padding_and_wait_no_longer(load: dict[str, float]) -> None:
    """batch_size 64, buckets 1, 2, 4, ... 64, a batch of n costing 4 ms + 0.5 ms a padded
    row: at 70 % of capacity (open loop), and 33 clients, one more than a bucket (closed)."""
    buckets = tuple(2 ** i for i in range(7))
    service = lambda items: 0.004 + 0.0005 * padded_rows(items, buckets)  # noqa: E731
    before, after = (simulate(AdaptivePolicy(64, 0.02), max_batch_size=64, service_s=service,
                              duration_s=5.0, seed=7, buckets=buckets,
                              policy_knows_buckets=knows, **load)  # type: ignore[arg-type]
                     for knows in (False, True))
    for result in (before, after):  # what the simulated workers counted adds up
        assert result.rows == result.jobs + result.padded_rows
    assert after.padding_share <= 0.6 * before.padding_share
    assert after.mean_latency_s <= before.mean_latency_s
    assert after.p99_latency_s <= before.p99_latency_s
    assert after.throughput_per_s >= 0.99 * before.throughput_per_s


def test_a_simulation_without_buckets_counts_no_padding() -> None:
    result = simulate(AdaptivePolicy(B, D), max_batch_size=B,
                      service_s=linear_service(0.02, 0.001), rate_per_s=100, duration_s=2.0)
    assert result.padded_rows == 0 and result.bucket_hits == 0 and result.padding_share == 0.0
    assert result.rows == result.jobs
