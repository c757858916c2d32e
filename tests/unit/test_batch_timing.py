"""Why each batch leaves the queue (the reasons the Batcher gives its batches, and what
BatchRecords keeps of them), where a request's time goes (the split of a batch's facts, the
Server-Timing and access-log renderings), and how the backend times a handler's steps
(backend/service/phases.py).

The reasons are checked on the real Batcher in simulated time (frontend/serving/simulation.py):
whole workloads through real Dispatchers, and single decisions driven by hand.
"""

from __future__ import annotations

import asyncio
import functools
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from backend.service.phases import instrument
from frontend.config import parse_timing_mode
from frontend.observe import timing
from frontend.observe.batches import BatchRecords, DispatchStats
from frontend.observe.events import ADAPTIVE, DEADLINE, FULL, MAX_DELAY, SEQUENCE, SLOT_FREE, Batch
from frontend.observe.logs import FLUSH_ENTRIES, AccessLog
from frontend.serving.batching import Batcher, Job
from frontend.serving.policies import AdaptivePolicy, BatchPolicy, FixedPolicy
from frontend.serving.simulation import SimulatedTime, linear_service, simulate
from protos import worker_pb2

# ---- whole workloads ---------------------------------------------------------------------------


def test_fixed_policy_at_low_load_waits_out_max_delay() -> None:
    result = simulate(FixedPolicy(8, 0.01), max_batch_size=8,
                      service_s=linear_service(0.002, 0.0002), rate_per_s=20, duration_s=5)
    assert result.batches > 50
    assert result.reasons.get(MAX_DELAY, 0) >= 0.9 * result.batches, result.reasons


def test_fixed_policy_under_closed_loop_load_sends_full_batches() -> None:
    result = simulate(FixedPolicy(4, 0.05), max_batch_size=4,
                      service_s=linear_service(0.002, 0.0005), clients=16, duration_s=2)
    assert result.reasons.get(FULL, 0) >= 0.9 * result.batches, result.reasons
    assert set(result.reasons) <= {FULL, MAX_DELAY}


def test_adaptive_policy_at_low_load_lets_batches_go_early() -> None:
    result = simulate(AdaptivePolicy(8, 0.05), max_batch_size=8,
                      service_s=linear_service(0.002, 0.0002), rate_per_s=20, duration_s=5)
    assert result.reasons.get(ADAPTIVE, 0) >= 0.9 * result.batches, result.reasons
    assert result.p50_latency_s < 0.01  # it did not wait out the 50 ms


def test_a_second_slot_takes_full_batches_as_it_comes_free() -> None:
    result = simulate(FixedPolicy(4, 0.05), max_batch_size=4,
                      service_s=linear_service(0.002, 0.0005), clients=32,
                      batches_in_flight=2, duration_s=2)
    assert result.reasons.get(SLOT_FREE, 0) > 0, result.reasons
    assert set(result.reasons) <= {FULL, MAX_DELAY, SLOT_FREE}


# ---- single decisions --------------------------------------------------------------------------


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    """For the jobs' futures only: it never runs."""
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


class Rig:
    def __init__(self, loop: asyncio.AbstractEventLoop, policy: BatchPolicy,
                 max_batch_size: int = 4, **options: Any) -> None:
        self.loop = loop
        self.time = SimulatedTime()
        self.batcher = Batcher(max_batch_size=max_batch_size, capacity=100, policy=policy,
                               clock=self.time, call_later=self.time.call_later, **options)
        self.taken: list[tuple[float, list[Job]]] = []

    def park(self) -> None:
        def take(outcome: list[Job] | Any) -> None:
            assert isinstance(outcome, list)
            self.taken.append((self.time.now, outcome))
        self.batcher.park(take)

    def submit(self, count: int = 1, deadline: float = float("inf")) -> list[Job]:
        jobs = [Job(worker_pb2.Request(), self.loop.create_future(), deadline=deadline)
                for _ in range(count)]
        for job in jobs:
            self.batcher.submit(job)
        return jobs

    def reasons(self) -> list[str]:
        return [jobs[0].batch.reason for _, jobs in self.taken if jobs[0].batch]


def test_a_parked_worker_takes_a_batch_full_or_at_max_delay(
        loop: asyncio.AbstractEventLoop) -> None:
    rig = Rig(loop, FixedPolicy(4, 1.0))
    rig.park()
    rig.submit(4)
    rig.park()
    rig.time.advance(0.5)
    [job] = rig.submit()
    rig.time.advance(2.0)
    assert [at for at, _ in rig.taken] == [0.0, 1.5]
    assert rig.reasons() == [FULL, MAX_DELAY]
    # The wait was the batch's forming, not the queue: a free worker was collecting it.
    assert job.form_s == pytest.approx(1.0) and job.queue_wait_s == pytest.approx(1.0)
    assert job.batch is not None and job.batch.items == 1


def test_a_job_queued_while_no_worker_was_free_waited_in_the_queue(
        loop: asyncio.AbstractEventLoop) -> None:
    rig = Rig(loop, FixedPolicy(4, 1.0))
    [job] = rig.submit()
    rig.time.advance(0.3)
    rig.park()  # a worker comes free: it collects from here
    rig.time.advance(2.0)
    assert job.queue_wait_s == pytest.approx(1.3)
    assert job.form_s == pytest.approx(1.0)


def test_a_deadline_sends_the_batch_before_the_wait_runs_out(
        loop: asyncio.AbstractEventLoop) -> None:
    rig = Rig(loop, FixedPolicy(4, 1.0))
    rig.batcher.completed(1, 0.05)  # a batch takes 50 ms: twice that is kept in reserve
    rig.park()
    [job] = rig.submit(deadline=0.3)
    rig.time.advance(2.0)
    [(at, jobs)] = rig.taken
    assert at == pytest.approx(0.2)
    assert jobs == [job] and rig.reasons() == [DEADLINE]
    assert job.is_live()  # sent in time, not expired


def test_without_a_known_service_time_a_deadline_still_leaves_before_it(
        loop: asyncio.AbstractEventLoop) -> None:
    rig = Rig(loop, AdaptivePolicy(4, 1.0))
    rig.park()
    rig.submit(deadline=0.3)
    assert rig.reasons() == [ADAPTIVE]  # nothing says waiting pays: at once
    rig = Rig(loop, FixedPolicy(4, 1.0))
    rig.park()
    [job] = rig.submit(deadline=0.3)
    rig.time.advance(2.0)
    [(at, _)] = rig.taken
    assert at < 0.3 and job.is_live() and rig.reasons() == [DEADLINE]


def test_a_busy_worker_takes_a_full_batch_when_a_slot_comes_free(
        loop: asyncio.AbstractEventLoop) -> None:
    rig = Rig(loop, FixedPolicy(4, 1.0))
    rig.submit(8)
    taken = rig.batcher.take_full()
    assert taken is not None and taken[0].batch is not None
    assert taken[0].batch.reason == SLOT_FREE
    parked: list[list[Job]] = []
    rig.batcher.park_for_full(lambda outcome: parked.append(outcome))  # type: ignore[arg-type]
    assert len(parked) == 1 and parked[0][0].batch is not None
    assert parked[0][0].batch.reason == FULL  # waited for the batch to fill, slot free already


def test_a_sequence_lane_counts_every_batch_as_sequence(
        loop: asyncio.AbstractEventLoop) -> None:
    records = BatchRecords()
    records.registered(("m", "1.0"))
    rig = Rig(loop, FixedPolicy(4, 0.0), on_formed=functools.partial(
        records.batch_formed, ("m", "1.0")), sequence=True)
    rig.park()
    rig.submit()
    assert rig.reasons() == [SEQUENCE]
    stats = records.of("m", "1.0")
    assert stats is not None and stats.dispatch.reasons[SEQUENCE] == 1


def test_dispatch_stats_keep_totals_and_the_recent_batches() -> None:
    stats = DispatchStats()
    for reason, fill in [(FULL, 1.0), (MAX_DELAY, 0.25), (MAX_DELAY, 0.125), (ADAPTIVE, 0.5),
                         (FULL, 2.0)]:
        stats.add(reason, fill)
    assert stats.reasons[FULL] == 2 and stats.reasons[DEADLINE] == 0
    assert stats.fill_counts == [1, 1, 1, 0, 1, 1]  # per bucket, the last above 1.0
    reasons, fill = stats.recent_summary()
    assert reasons == {FULL: 2, MAX_DELAY: 2, ADAPTIVE: 1}
    assert fill == {"batches": 5, "mean": 0.775, "over": 1,
                    "buckets": {"0.125": 1, "0.25": 1, "0.5": 1, "0.75": 0, "1": 1}}
    for _ in range(100):
        stats.add(ADAPTIVE, 0.5)
    reasons, fill = stats.recent_summary()
    assert reasons == {ADAPTIVE: 64} and fill["batches"] == 64
    assert stats.batches == 105


# ---- the split and its renderings ------------------------------------------------------------


def _answered(round_s: float, phases: worker_pb2.HandlerPhases | None,
              handler_ms: float = 0.0) -> Batch:
    """The facts of a batch of 2 answered ``round_s`` after it left the queue."""
    batch = Batch(MAX_DELAY, 2, 4, 0.0, 0.0)
    batch.ended_at = round_s
    batch.replied = True
    result = worker_pb2.PredictResult(handler_time_ms=handler_ms)
    if phases is not None:
        result.phases.CopyFrom(phases)
    batch.note_reply(result)
    return batch


def test_the_worker_phase_is_the_round_trip_less_the_handler_steps() -> None:
    batch = _answered(0.2, worker_pb2.HandlerPhases(
        steps=True, preprocess_ms=20, inference_ms=60, postprocess_ms=30))
    worker_s, preprocess_s, inference_s, postprocess_s = timing.batch_split(batch)
    assert (preprocess_s, inference_s, postprocess_s) == pytest.approx((0.02, 0.06, 0.03))
    assert worker_s == pytest.approx(0.09)
    # A handler without steps: its whole time is inference.
    plain = _answered(0.2, None, handler_ms=150)
    worker_s, _, inference_s, _ = timing.batch_split(plain)
    assert not plain.steps and inference_s == pytest.approx(0.15)
    assert worker_s == pytest.approx(0.05)
    # Preprocessing done ahead overlapped the wait: the parts never exceed the round trip.
    ahead = _answered(0.1, worker_pb2.HandlerPhases(
        steps=True, preprocess_ms=80, inference_ms=40, postprocess_ms=0))
    worker_s, preprocess_s, inference_s, _ = timing.batch_split(ahead)
    assert worker_s == 0.0
    assert preprocess_s + inference_s == pytest.approx(0.1)


_PART = re.compile(r'^(\w+);dur=([0-9.]+)(?:;desc="(\w+)")?$')


def parse_server_timing(value: str) -> dict[str, tuple[float, str | None]]:
    parts = {}
    for part in value.split(", "):
        match = _PART.match(part)
        assert match, part
        parts[match[1]] = (float(match[2]), match[3])
    return parts


def test_server_timing_parts_add_up_to_no_more_than_the_total() -> None:
    batch = _answered(0.2, worker_pb2.HandlerPhases(
        steps=True, preprocess_ms=20, inference_ms=60, postprocess_ms=30))
    parts = parse_server_timing(timing.header(0.5, 0.4, batch, 0.75))
    assert list(parts) == [*timing.PHASES, "total"]
    assert parts["queue"][0] == pytest.approx(100) and parts["batch_form"] == (400.0, MAX_DELAY)
    assert parts["frontend"][0] == pytest.approx(50)
    total = parts.pop("total")[0]
    assert sum(ms for ms, _ in parts.values()) <= total + 0.01
    plain = parse_server_timing(timing.header(0.0, 0.0, _answered(0.2, None, 150), 0.21))
    assert "preprocess" not in plain and "postprocess" not in plain
    assert list(parse_server_timing(timing.header(0.0, 0.0, None, 0.01))) == ["total"]


def test_access_log_fields() -> None:
    batch = _answered(0.2, worker_pb2.HandlerPhases(
        steps=True, preprocess_ms=20, inference_ms=60, postprocess_ms=30))
    assert timing.log_fields(0.5, 0.4, batch, 0.75) == (
        "form_ms=400.00 worker_ms=90.00 preprocess_ms=20.00 inference_ms=60.00 "
        "postprocess_ms=30.00 frontend_ms=50.00 reason=max_delay")
    assert timing.log_fields(0.0, 0.0, None, 0.01).endswith("frontend_ms=- reason=-")


def test_a_request_asks_for_server_timing_with_a_yes() -> None:
    assert all(timing.asks(value) for value in ("1", "true", "On", " yes "))
    assert not any(timing.asks(value) for value in (None, "", "0", "false", "no"))
    assert parse_timing_mode("") == timing.OFF and parse_timing_mode("TRUE") == timing.REQUEST
    assert parse_timing_mode("always") == timing.ALWAYS
    with pytest.raises(ValueError, match="off, request or always"):
        parse_timing_mode("sometimes")


# ---- the backend's step clock -----------------------------------------------------------------


class Steps:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def preprocess(self, data: list[int]) -> list[int]:
        self.calls.append("preprocess")
        return self.inference(data)  # a step calling another counts as the outer one

    def inference(self, data: list[int]) -> list[int]:
        self.calls.append("inference")
        return data

    def postprocess(self, data: list[int]) -> list[int]:
        self.calls.append("postprocess")
        return [item + 1 for item in data]

    def handle(self, data: list[int], context: object) -> list[int]:
        return self.postprocess(self.preprocess(data))


def test_steps_are_timed_on_the_instance_without_changing_what_they_do() -> None:
    handler = Steps()
    clock = instrument(handler)
    assert clock is not None
    assert handler.handle([1, 2], None) == [2, 3]
    assert handler.calls == ["preprocess", "inference", "postprocess"]
    assert clock.called and clock.seconds[0] > 0 and clock.seconds[2] > 0
    assert clock.seconds[1] == 0.0  # inside preprocess
    assert type(handler).preprocess is Steps.preprocess  # the class is untouched
    assert handler.preprocess.__name__ == "preprocess"
    clock.reset()
    assert not clock.called and clock.seconds == [0.0, 0.0, 0.0]


class Slotted:
    __slots__ = ()

    def preprocess(self, data: object) -> object:
        return data

    def inference(self, data: object) -> object:
        return data

    def postprocess(self, data: object) -> object:
        return data


class AsyncSteps(Steps):
    async def inference(self, data: list[int]) -> list[int]:  # type: ignore[override]
        return data


def test_handlers_without_three_plain_steps_are_left_alone() -> None:
    assert instrument(None) is None
    assert instrument(Slotted()) is None
    assert instrument(AsyncSteps()) is None
    assert instrument(object()) is None


def test_a_busy_access_log_is_flushed_every_flush_entries_not_only_every_interval(
        tmp_path: Path) -> None:
    # A flush formats its entries on the event loop: under load it must not wait for the
    # interval and then hold the loop for thousands of them at once.
    path = tmp_path / "access_log.log"
    log = AccessLog(path)
    log.open()

    async def scenario() -> tuple[int, int]:
        for _ in range(FLUSH_ENTRIES - 1):
            log.write("127.0.0.1", "POST", "/predictions/m", "HTTP/1.1", 200, 0.001, "m", "1.0",
                      0.0, 1)
        await asyncio.sleep(0)  # one turn of the loop: nothing written yet (the interval)
        before = path.read_text().count("\n")
        log.write("127.0.0.1", "POST", "/predictions/m", "HTTP/1.1", 200, 0.001, "m", "1.0",
                  0.0, 1)
        await asyncio.sleep(0)  # one turn: the full flush written
        return before, path.read_text().count("\n")

    try:
        assert asyncio.run(scenario()) == (0, FLUSH_ENTRIES)
    finally:
        log.close()


def test_disabled_dispatch_stats_count_nothing() -> None:
    stats = DispatchStats(enabled=False)
    stats.add(FULL, 1.0)
    assert stats.batches == 0 and not any(stats.reasons.values()) and not any(stats.fill_counts)
    assert stats.recent_summary()[0] == {}


def test_an_access_log_without_phases_ends_its_lines_at_the_batch_size(tmp_path: Path) -> None:
    batch = _answered(0.2, None, handler_ms=100)
    lines = {}
    for extended, phases in ((True, True), (True, False), (False, True), (False, False)):
        path = tmp_path / f"{extended}-{phases}.log"
        log = AccessLog(path, phases=phases, extended=extended)
        log.open()
        log.write("/127.0.0.1:1", "POST", "/predictions/m", "HTTP/1.1", 200, 0.5, "m", "1.0",
                  0.1, 2, 0.05, batch)
        log.flush()
        log.close()
        lines[extended, phases] = path.read_text().rstrip("\n")
    # Compared after the time of writing (the clock may tick between two lines).
    after_time = {key: line.split(" ", 1)[1] for key, line in lines.items()}
    assert after_time[True, True].startswith(after_time[True, False]
                                             + " form_ms=50.00 worker_ms=100.00 ")
    assert lines[True, False].endswith(' "POST /predictions/m HTTP/1.1" 200 500 model=m '
                                       "version=1.0 queue_ms=100.00 batch=2")
    # Not extended (the default): TorchServe's line, whatever request_phases says.
    assert after_time[False, True] == after_time[False, False]
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d,\d{3} - "
                        r'/127\.0\.0\.1:1 "POST /predictions/m HTTP/1\.1" 200 500',
                        lines[False, True]), lines[False, True]
