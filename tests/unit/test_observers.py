"""The serving core publishes facts and observers subscribe (frontend/observe/events.py):
what the core may know of observe/, what a job keeps, who is subscribed as the configuration
says (and who is not: an observer that is off does none of its work), how an event reaches
its subscribers, and what the exchange notes of a batch for whom."""

from __future__ import annotations

import asyncio
import dataclasses
import re
from collections.abc import Iterator
from typing import Any

import pytest

from frontend.observe.events import (
    FULL,
    Batch,
    CallFacts,
    JobFacts,
    ModelKey,
    Observers,
    Origin,
)
from frontend.observe.logs import AccessLog
from frontend.observe.metrics import ServerMetrics
from frontend.observe.torchserve_metrics import HOSTNAME
from frontend.server import observers
from frontend.serving.batching import Batcher, Job
from frontend.serving.exchange import PredictExchange
from frontend.serving.policies import FixedPolicy
from protos import worker_pb2
from protos.framing import Frame, Kind
from tests.unit.test_layout import _module_imports

KEY = ("m", "1.0")

#: What the serving core (serving/, models/) may import of observe/: the facts it notes and
#: the hooks it publishes them through (events), what it is read by (status), the model log
#: its workers' output is written to (logs), and what it tells a worker of TorchServe's
#: metrics (metric_specs: the configuration; model_metrics: the [METRICS] mark). No observer.
CORE_MAY_IMPORT = frozenset({"frontend.observe.events", "frontend.observe.status",
                             "frontend.observe.logs", "frontend.observe.metric_specs",
                             "frontend.observe.model_metrics"})


def test_the_serving_core_imports_no_observer() -> None:
    graph = _module_imports()
    core = [module for module in graph if module.startswith(("frontend.serving.",
                                                              "frontend.models."))]
    assert "frontend.serving.batching" in core and "frontend.models.model" in core
    imported = {(module, name) for module in core for name in graph[module]
                if name.startswith("frontend.observe")}
    assert ("frontend.serving.batching", "frontend.observe.events") in imported
    wrong = sorted(f"{module} imports {name}" for module, name in imported
                   if name not in CORE_MAY_IMPORT)
    assert not wrong, "\n".join(wrong)


def test_a_job_keeps_facts_only() -> None:
    """What a queued request is (its request, future, deadline, weight, stream, who sent it
    and at which priority level: the fair queue orders by them) and what is known of its trip
    (when it came, the batch it left in): nothing kept for an observer."""
    facts = {field.name for field in dataclasses.fields(JobFacts)}
    assert facts == {"request", "enqueued_at", "batch", "batch_id", "tenant", "priority"}
    assert {field.name for field in dataclasses.fields(Job)} - facts == {
        "future", "deadline", "budget_s", "stream", "dispatched", "weight"}


# ---- who is subscribed -------------------------------------------------------------------------


def _names(subscribers: list[Any]) -> set[str]:
    return {getattr(subscriber, "__qualname__", type(subscriber).__name__)
            for subscriber in subscribers}


def test_an_observer_that_is_off_is_not_subscribed() -> None:
    """request_phases=false, dispatch_stats=false, no access log, no traces: none of them is
    told anything, and a batch leaving its queue is told to nobody."""
    metrics = ServerMetrics(system_metrics=False, phases=False, dispatch_stats=False)
    subscribed = observers(metrics, None, None, None)
    assert _names(subscribed.call_ended) == {"TorchServeMetrics.call_ended",
                                              "RequestMetrics.call_ended"}
    assert _names(subscribed.batch_ended) == {"TorchServeMetrics.batch_ended",
                                               "BatchMetrics.batch_ended",
                                               "BatchRecords.batch_ended"}
    assert subscribed.batch_formed == []
    events = subscribed.of_model(*KEY)
    assert events.formed is None
    batcher = Batcher(max_batch_size=2, capacity=10, policy=FixedPolicy(2, 0.0),
                      on_formed=events.formed)
    taken: list[list[Job]] = []

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        batcher.park(lambda outcome: taken.append(outcome))  # type: ignore[arg-type]
        batcher.submit(Job(worker_pb2.Request(), loop.create_future()))

    asyncio.run(scenario())
    [[job]] = taken  # batched all the same, its facts noted for the core's own use
    assert job.batch is not None and job.batch.reason == "max_delay" and job.dispatched


def test_each_observer_that_is_on_is_subscribed_once(tmp_path: Any) -> None:
    metrics = ServerMetrics(system_metrics=False)
    access = AccessLog(tmp_path / "access_log.log")
    subscribed = observers(metrics, access, None, None)
    assert _names(subscribed.call_ended) == {
        "TorchServeMetrics.call_ended", "RequestMetrics.call_ended", "PhaseMetrics.call_ended",
        "AccessLog.call_ended"}
    assert len(subscribed.call_ended) == 4
    assert _names(subscribed.batch_formed) == {"BatchRecords.batch_formed"}
    assert "PhaseMetrics.batch_ended" in _names(subscribed.batch_ended)
    # TorchServe's default metrics keep WorkerThreadTime: each batch's frontend time is marked.
    assert subscribed.of_model(*KEY).frontend_time


def test_an_event_reaches_each_subscriber_told_its_model_version() -> None:
    subscribed = Observers()
    told: list[tuple[str, ModelKey, object]] = []
    subscribed.batch_formed.append(lambda key, batch: told.append(("first", key, batch)))
    events = subscribed.of_model(*KEY)
    batch = Batch(FULL, 2, 2, 0.0, 0.0)
    assert events.formed is not None and events.ended is None and events.loaded is None
    events.formed(batch)
    assert told == [("first", KEY, batch)]
    subscribed.batch_formed.append(lambda key, batch: told.append(("second", key, batch)))
    other = subscribed.of_model("n", "2.0")  # bound when a version is registered
    assert other.formed is not None
    other.formed(batch)
    assert told[1:] == [("first", ("n", "2.0"), batch), ("second", ("n", "2.0"), batch)]


def test_registration_starts_a_versions_records_afresh_and_removal_drops_them() -> None:
    metrics = ServerMetrics(system_metrics=False)
    subscribed = observers(metrics, None, None, None)
    subscribed.registered(*KEY)
    events = subscribed.of_model(*KEY)
    assert events.formed is not None
    events.formed(Batch(FULL, 2, 2, 0.0, 0.0))
    records = metrics.records.of(*KEY)
    assert records is not None and records.dispatch.reasons[FULL] == 1
    subscribed.registered(*KEY)  # the version registered again: a new record
    again = metrics.records.of(*KEY)
    assert again is not None and again.dispatch.batches == 0
    subscribed.removed(*KEY)
    assert metrics.records.of(*KEY) is None
    events.formed(Batch(FULL, 2, 2, 0.0, 0.0))  # a batch of a removed version: no record
    assert metrics.records.of(*KEY) is None


# ---- what the exchange notes and tells ---------------------------------------------------------


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    """For the jobs' futures only: it never runs."""
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def _batch_of(loop: asyncio.AbstractEventLoop, size: int) -> tuple[Batcher, list[Job]]:
    batcher = Batcher(max_batch_size=size, capacity=10, policy=FixedPolicy(size, 0.0))
    for index in range(size):
        batcher.submit(Job(worker_pb2.Request(request_id=str(index)), loop.create_future()))
    jobs = batcher.take_ready()
    assert jobs is not None
    return batcher, jobs


def _reply(jobs: list[Job]) -> Frame:
    result = worker_pb2.PredictResult(
        responses=[worker_pb2.Response(request_id=job.request.request_id, status=200)
                   for job in jobs],
        handler_time_ms=3.0,
        phases=worker_pb2.HandlerPhases(steps=True, preprocess_ms=1.0, inference_ms=1.5,
                                        postprocess_ms=0.5))
    return Frame(Kind.PREDICTED, result.SerializeToString())


def test_the_exchange_notes_the_reply_and_tells_the_end_once_answers_are_delivered(
        loop: asyncio.AbstractEventLoop) -> None:
    subscribed = Observers()
    ended: list[tuple[Batch, bool]] = []
    subscribed.batch_ended.append(
        lambda key, batch, jobs, result: ended.append((batch, jobs[0].future.done())))
    batcher, jobs = _batch_of(loop, 2)
    exchange = PredictExchange("W-1", "1", batcher, 1 << 20, lambda jobs, result: None,
                               subscribed.of_model(*KEY))
    exchange.frame(jobs)
    deliver = exchange.finish(jobs, _reply(jobs), 0.01)
    assert ended == []  # not before the answers are delivered
    assert deliver is not None
    deliver()
    [(batch, answered_first)] = ended
    assert answered_first and batch is jobs[0].batch and batch.worker == "1"
    assert batch.replied and batch.answered and batch.steps
    assert (batch.handler_ms, batch.step_ms) == (3.0, (1.0, 1.5, 0.5))
    assert batch.frontend_marks is None  # nobody reads the frontend's time: not marked
    exchange.lost(jobs)  # a batch lost with its worker ends too, with no reply
    assert len(ended) == 2


def test_the_frontends_time_is_marked_only_for_whom_reads_it(
        loop: asyncio.AbstractEventLoop) -> None:
    """WorkerThreadTime: the frame and the reply until its answers are delivered, marked on
    the batch's facts and read by TorchServe's metrics (a frontend's own time, whole ms)."""
    metrics = ServerMetrics(system_metrics=False)
    subscribed = observers(metrics, None, None, None)
    batcher, jobs = _batch_of(loop, 2)
    exchange = PredictExchange("W-1", "1", batcher, 1 << 20, lambda jobs, result: None,
                               subscribed.of_model(*KEY))
    exchange.frame(jobs)
    deliver = exchange.finish(jobs, _reply(jobs), 0.01)
    assert deliver is not None
    deliver()
    batch = jobs[0].batch
    assert batch is not None and batch.frontend_marks is not None
    assert len(batch.frontend_marks) == 4 and batch.frontend_marks == sorted(
        batch.frontend_marks)
    page = metrics.exposition().decode()
    assert re.search(rf'^WorkerThreadTime{{Level="Host",Hostname="{re.escape(HOSTNAME)}",}} '
                     r"\d+\.0$", page, re.MULTILINE), page


def test_a_calls_facts_say_whether_a_worker_answered_it_or_why_it_was_refused(
        loop: asyncio.AbstractEventLoop) -> None:
    job = Job(worker_pb2.Request(), loop.create_future())
    call = CallFacts(Origin("/127.0.0.1:1", "POST", "/predictions/m", "HTTP/1.1"), job, 0.0)
    call.status = 503
    assert call.refusal() == "unavailable" and not call.answered()
    job.batch = Batch(FULL, 1, 1, 0.0, 0.0)
    call.status = 200
    assert call.refusal() is None and call.answered()
