"""frontend/observe/tracing.py on its own: the W3C traceparent as Trace Context reads it, and
what is (not) exported for unsampled callers, failed batches and clients that left, told of
batches and calls as the serving core tells its observers. The spans' structure against a
real server and receiver: tests/integration/test_traces.py."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Iterator, Sequence

import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from frontend.observe import tracing as tracing_module
from frontend.observe.events import Batch, CallFacts, ModelKey, Origin
from frontend.observe.tracing import Tracing, caller_context
from frontend.serving.batching import Job
from protos import worker_pb2

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
SPAN = "00f067aa0ba902b7"
#: The model version the batches and requests are of.
KEY = ("m", "1.0")


@pytest.mark.parametrize(("value", "sampled"), [
    (f"00-{TRACE}-{SPAN}-01", True),
    (f"00-{TRACE}-{SPAN}-00", False),
    (f" 00-{TRACE}-{SPAN}-01 ", True),  # optional whitespace
    (f"01-{TRACE}-{SPAN}-03-future", True),  # a later version may add fields; unknown flags
])
def test_a_valid_traceparent(value: str, sampled: bool) -> None:
    context = caller_context({"traceparent": value, "tracestate": "a=1,b=2"})
    assert context is not None
    assert (f"{context.trace_id:032x}", f"{context.span_id:016x}") == (TRACE, SPAN)
    assert context.is_remote and context.trace_flags.sampled is sampled
    assert context.trace_state.to_header() == "a=1,b=2"


@pytest.mark.parametrize("value", [
    "", "garbage", f"00-{TRACE}-{SPAN}", f"00-{TRACE.upper()}-{SPAN}-01",
    f"ff-{TRACE}-{SPAN}-01", f"00-{TRACE}-{SPAN}-01-extra", f"00-{'0' * 32}-{SPAN}-01",
    f"00-{TRACE}-{'0' * 16}-01", f"00-{TRACE[:-1]}-{SPAN}-01",
])
def test_a_malformed_traceparent_is_no_caller(value: str) -> None:
    assert caller_context({"traceparent": value}) is None


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def _job(loop: asyncio.AbstractEventLoop, traceparent: str | None = None) -> Job:
    """A request that came 10 ms ago and left the queue 4 ms later, alone in batch 1-1."""
    request = worker_pb2.Request(request_id="r1")
    if traceparent is not None:
        request.headers["traceparent"] = traceparent
    job = Job(request, loop.create_future(), enqueued_at=time.monotonic() - 0.01,
              batch_id="1-1")
    _batched(job)
    return job


def _batched(*jobs: Job) -> Batch:
    """``jobs`` left the queue together, 4 ms after the first came, and their batch's reply
    was just read."""
    left = jobs[0].enqueued_at + 0.004
    batch = Batch("full", len(jobs), 8, left, left)
    batch.ended_at, batch.replied = time.monotonic(), True
    for job in jobs:
        job.batch, job.dispatched = batch, True
    return batch


def _batch_ended(tracing: Tracing, jobs: list[Job],
                 result: worker_pb2.PredictResult | None) -> None:
    """The batch of ``jobs`` ended (``result`` None: it failed as a whole)."""
    batch = _batched(*jobs)
    if result is not None:
        batch.note_reply(result)
    tracing.batch_ended(KEY, batch, jobs, result)


def _call_ended(tracing: Tracing, job: Job, key: ModelKey | None = KEY, *,
                method: str = "POST", path: str = "/predictions/m",
                protocol: str = "HTTP/1.1", status: int = 200, latency_s: float = 0.01
                ) -> None:
    """A request of ``job`` ended, ``latency_s`` after it began."""
    call = CallFacts(Origin("/127.0.0.1:1", method, path, protocol), job,
                     time.perf_counter() - latency_s)
    call.key, call.status, call.latency_s = key, status, latency_s
    tracing.call_ended(call)


def _exported(run: object) -> list[ReadableSpan]:
    exporter = InMemorySpanExporter()
    tracing = Tracing(exporter)
    run(tracing)  # type: ignore[operator]
    tracing.close()
    return list(exporter.get_finished_spans())


def test_an_unsampled_caller_exports_nothing_of_its_request(
        loop: asyncio.AbstractEventLoop) -> None:
    job = _job(loop, f"00-{TRACE}-{SPAN}-00")

    def run(tracing: Tracing) -> None:
        _batch_ended(tracing, [job], worker_pb2.PredictResult(handler_time_ms=1.0))
        _call_ended(tracing, job)

    assert [span.name for span in _exported(run)] == ["batch m"]  # a trace of its own


def test_errors_a_failed_batch_and_a_client_that_left(loop: asyncio.AbstractEventLoop) -> None:
    job = _job(loop)

    def run(tracing: Tracing) -> None:
        _batch_ended(tracing, [job], None)
        _call_ended(tracing, job, method="gRPC", path="/m", protocol="HTTP/2.0", status=0)

    spans = {span.name: span for span in _exported(run)}
    # A failed batch reports no handler time: no worker child.
    assert set(spans) == {"batch m", "gRPC /m", "queue", "batch"}
    assert spans["batch m"].status.status_code is StatusCode.ERROR
    assert spans["batch"].parent == spans["gRPC /m"].context
    request = spans["gRPC /m"]
    assert request.kind is SpanKind.SERVER and request.parent is None
    assert request.status.status_code is StatusCode.ERROR
    assert request.attributes is not None and request.attributes["rpc.system"] == "grpc"
    assert [link.context for link in request.links] == [spans["batch m"].context]


def test_a_request_refused_before_its_model_is_named_by_its_method(
        loop: asyncio.AbstractEventLoop) -> None:
    job = Job(worker_pb2.Request(), loop.create_future())

    def run(tracing: Tracing) -> None:
        _call_ended(tracing, job, None, path="/predictions/\x1bnot-a-model", status=404,
                    latency_s=0.001)

    [span] = _exported(run)
    assert span.name == "POST" and span.status.status_code is StatusCode.UNSET


def test_the_sampler_of_opentelemetrys_variables_is_asked(
        loop: asyncio.AbstractEventLoop, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "always_off")
    job = _job(loop, f"00-{TRACE}-{SPAN}-01")

    def run(tracing: Tracing) -> None:
        _batch_ended(tracing, [job], worker_pb2.PredictResult(handler_time_ms=1.0))
        _call_ended(tracing, job)

    assert _exported(run) == []


def test_spans_dropped_by_a_full_queue_warn_once_not_per_span(
        loop: asyncio.AbstractEventLoop, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """The receiver is stuck: the processor's queue (4 spans here) fills and it drops spans;
    the SDK's warning for each is let through once."""
    monkeypatch.setenv("OTEL_BSP_MAX_QUEUE_SIZE", "4")
    monkeypatch.setenv("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "4")
    drops = logging.getLogger(tracing_module._DROPS_LOGGER)
    for old in list(drops.filters):  # a fresh interval for this test
        drops.removeFilter(old)
    release = threading.Event()

    class Stuck(SpanExporter):
        def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
            release.wait(10)
            return SpanExportResult.SUCCESS

    tracing = Tracing(Stuck())
    try:
        with caplog.at_level(logging.WARNING, logger=tracing_module._DROPS_LOGGER):
            for _ in range(50):
                _call_ended(tracing, _job(loop), latency_s=0.001)
    finally:
        release.set()
        tracing.close()
    warned = [record for record in caplog.records if "dropping" in record.getMessage()]
    assert len(warned) == 1


def test_a_batch_is_kept_when_a_caller_of_its_asks_for_sampling(
        loop: asyncio.AbstractEventLoop, monkeypatch: pytest.MonkeyPatch) -> None:
    """Sampling 0 % of the requests without a caller's decision: a batch with a sampled
    caller's request is exported (and linked), one without is not."""
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "parentbased_traceidratio")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "0")
    traced, untraced, alone = _job(loop, f"00-{TRACE}-{SPAN}-01"), _job(loop), _job(loop)

    def run(tracing: Tracing) -> None:
        result = worker_pb2.PredictResult(handler_time_ms=1.0)
        _batch_ended(tracing, [traced, untraced], result)
        _batch_ended(tracing, [alone], result)
        for job in (traced, untraced, alone):
            _call_ended(tracing, job)

    spans = _exported(run)
    [batch] = [span for span in spans if span.name == "batch m"]
    [request] = [span for span in spans if span.kind is SpanKind.SERVER]
    assert f"{request.context.trace_id:032x}" == TRACE
    assert [link.context for link in request.links] == [batch.context]
    assert sorted(span.name for span in spans) == sorted(
        ["batch m", "POST /predictions/m", "queue", "batch", "worker"])


def test_closing_waits_for_a_receiver_that_is_away_only_so_long(
        loop: asyncio.AbstractEventLoop) -> None:
    release = threading.Event()

    class Away(SpanExporter):
        def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
            release.wait(30)
            return SpanExportResult.FAILURE

    tracing = Tracing(Away())
    _call_ended(tracing, _job(loop), latency_s=0.001)
    start = time.monotonic()
    try:
        tracing.close(timeout_s=0.5)
        assert time.monotonic() - start < 5
    finally:
        release.set()
