"""Sequence batching (frontend/serving/sequences.py): a stateful model's requests routed by
sequence to one worker each, one at a time, in order, batched across sequences.

Time is simulated (``SimulatedTime``, as tests/unit/test_batching.py does); the workers are
fakes that take a lane's batches and answer them when told.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from frontend.errors import SequenceLost, SequenceRefused, ServeError, ServiceUnavailable
from frontend.serving.batching import Job
from frontend.serving.policies import FixedPolicy
from frontend.serving.sequences import (
    SEQUENCE_END_HEADER,
    SEQUENCE_ID_HEADER,
    SEQUENCE_START_HEADER,
    SequenceBatcher,
    SequenceLane,
    name_sequence,
)
from frontend.serving.simulation import SimulatedTime
from protos import worker_pb2


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    """A loop for the jobs' futures; ``tick`` runs the callbacks they scheduled."""
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def tick(loop: asyncio.AbstractEventLoop) -> None:
    loop.run_until_complete(asyncio.sleep(0))


class Worker:
    """A worker's dispatcher as its lane sees it: takes one batch at a time when free, and
    answers it (after telling the sequences, as the model's batch record does) when told."""

    def __init__(self, sequences: SequenceBatcher, lane: SequenceLane) -> None:
        self.sequences = sequences
        self.lane = lane
        self.running: list[Job] | None = None
        self.batches: list[list[str]] = []

    def start(self) -> Worker:
        self.lane.came_up()
        self.lane.batcher.park(self._take)
        return self

    def _take(self, outcome: list[Job] | ServeError) -> None:
        if isinstance(outcome, ServeError):  # the model is going away
            return
        self.running = outcome
        for job in outcome:
            job.dispatched = True
        self.batches.append([job.request.request_id for job in outcome])

    def finish(self, closes: tuple[str, ...] = ()) -> list[str]:
        """Answer the running batch (the handler closing ``closes``); returns its ids."""
        jobs, self.running = self.running, None
        assert jobs is not None, "nothing running"
        responses = []
        for job in jobs:
            response = worker_pb2.Response(request_id=job.request.request_id, status=200)
            if job.request.headers[SEQUENCE_ID_HEADER] in closes:
                response.headers[SEQUENCE_END_HEADER] = ";".join(closes)
            responses.append(response)
        self.sequences.finished(jobs, responses)
        for job, response in zip(jobs, responses, strict=True):
            job.resolve(response)
        self.lane.batcher.park(self._take)
        return [job.request.request_id for job in jobs]


class Rig:
    def __init__(self, loop: asyncio.AbstractEventLoop, *, lanes: int = 2, size: int = 4,
                 max_sequences: int = 8, max_waiting: int = 2, idle_s: float = 10.0,
                 duration_s: float | None = None) -> None:
        self.loop = loop
        self.time = SimulatedTime()
        self.sequences = SequenceBatcher(
            model="m", max_batch_size=size, policy=lambda: FixedPolicy(size, 0.0),
            max_sequences=max_sequences, max_waiting=max_waiting, max_idle_s=idle_s,
            max_duration_s=duration_s, clock=self.time, call_later=self.time.call_later)
        self.lanes = [self.sequences.add_lane() for _ in range(lanes)]

    def workers(self) -> list[Worker]:
        return [Worker(self.sequences, lane).start() for lane in self.lanes]

    def submit(self, sequence: str, value: int, *, end: bool = False) -> Job:
        request = worker_pb2.Request(request_id=f"{sequence}{value}",
                                     headers={SEQUENCE_ID_HEADER: sequence})
        if end:
            request.headers[SEQUENCE_END_HEADER] = "true"
        job = Job(request, self.loop.create_future())
        self.sequences.submit(job)
        return job


def test_a_sequence_runs_on_one_worker_one_request_at_a_time_in_order(loop) -> None:
    r = Rig(loop)
    w0, w1 = r.workers()
    for value in (1, 2, 3):
        r.submit("a", value)
    r.submit("b", 1)
    assert w0.batches == [["a1"]] and w1.batches == [["b1"]]
    assert r.sequences.depth == 2  # a2 and a3 wait for a1
    assert w0.finish() == ["a1"]
    assert w0.batches[-1] == ["a2"]  # handed on before a1's answer is delivered
    w0.finish()
    w0.finish()
    assert w0.batches == [["a1"], ["a2"], ["a3"]] and w1.batches == [["b1"]]


def test_a_batch_mixes_sequences_and_never_holds_two_requests_of_one(loop) -> None:
    r = Rig(loop, lanes=1)
    for sequence in "abc":
        r.submit(sequence, 1)
    r.submit("a", 2)
    (worker,) = r.workers()  # comes up with four requests of three sequences waiting
    assert worker.batches == [["a1", "b1", "c1"]]
    worker.finish()
    assert worker.batches[-1] == ["a2"]


def test_sequences_bind_to_the_up_worker_with_the_fewest(loop) -> None:
    r = Rig(loop)
    w0, w1 = r.workers()
    for sequence in "abcd":
        r.submit(sequence, 1)
    assert w0.batches == [["a1"]] and w1.batches == [["b1"]]
    w0.finish()
    assert w0.batches[-1] == ["c1"]  # c went to w0's lane, d to w1's
    w1.finish()
    assert w1.batches[-1] == ["d1"]
    assert {s.id: r.lanes.index(s.lane) for lane in r.lanes for s in lane.sequences} == \
        {"a": 0, "b": 1, "c": 0, "d": 1}


def test_requests_wait_for_a_worker_that_is_up(loop) -> None:
    r = Rig(loop)
    r.submit("a", 1)
    r.submit("a", 2)
    assert r.sequences.depth == 2 and all(not lane.sequences for lane in r.lanes)
    w0 = Worker(r.sequences, r.lanes[0]).start()
    assert w0.batches == [["a1"]]


def test_the_first_request_of_a_sequence_says_it_starts(loop) -> None:
    r = Rig(loop)
    r.workers()
    first, second = r.submit("a", 1), r.submit("a", 2)
    assert first.request.headers[SEQUENCE_START_HEADER] == "true"
    assert SEQUENCE_START_HEADER not in second.request.headers


def test_max_num_sequence_refuses_a_new_sequence(loop) -> None:
    r = Rig(loop, max_sequences=2)
    r.workers()
    r.submit("a", 1)
    r.submit("b", 1)
    with pytest.raises(SequenceRefused, match="maxNumSequence") as refused:
        r.submit("c", 1)
    assert refused.value.http_status == 503
    r.submit("a", 2)  # open sequences still take requests


def test_max_sequence_job_queue_size_bounds_what_one_sequence_has_waiting(loop) -> None:
    r = Rig(loop, max_waiting=1)
    w0, _ = r.workers()
    r.submit("a", 1)
    r.submit("a", 2)
    with pytest.raises(SequenceRefused, match="maxSequenceJobQueueSize"):
        r.submit("a", 3)
    w0.finish()
    r.submit("a", 3)  # a2 runs now: room again


def test_an_idle_sequence_is_forgotten_after_max_idle(loop) -> None:
    r = Rig(loop, max_sequences=1, idle_s=10.0)
    w0, _ = r.workers()
    r.submit("a", 1)
    r.time.run_until(3.0)
    w0.finish()  # idle from t=3
    r.time.run_until(12.9)
    with pytest.raises(SequenceRefused):
        r.submit("b", 1)
    r.time.run_until(13.0)
    assert r.sequences.open_sequences == 0
    again = r.submit("a", 2)  # a fresh sequence under the old id
    assert again.request.headers[SEQUENCE_START_HEADER] == "true"


def test_a_request_keeps_its_sequence_alive(loop) -> None:
    r = Rig(loop, idle_s=10.0)
    w0, _ = r.workers()
    r.submit("a", 1)
    w0.finish()
    r.time.run_until(9.0)
    second = r.submit("a", 2)
    r.time.run_until(30.0)  # running: never idle meanwhile
    assert r.sequences.open_sequences == 1
    assert SEQUENCE_START_HEADER not in second.request.headers


def test_sequence_timeout_ends_a_sequence_once_idle(loop) -> None:
    r = Rig(loop, idle_s=10.0, duration_s=5.0)
    w0, _ = r.workers()
    r.submit("a", 1)
    r.submit("a", 2)
    r.time.run_until(6.0)
    w0.finish()
    assert r.sequences.open_sequences == 1  # past its 5 s, but a2 still runs
    w0.finish()
    r.time.run_until(6.0)
    assert r.sequences.open_sequences == 0


def test_the_close_signal_ends_the_sequence_once_answered(loop) -> None:
    r = Rig(loop)
    w0, _ = r.workers()
    r.submit("a", 1)
    r.submit("a", 2, end=True)
    with pytest.raises(SequenceRefused, match="closing"):
        r.submit("a", 3)
    w0.finish()
    assert r.sequences.open_sequences == 1
    w0.finish()
    assert r.sequences.open_sequences == 0
    assert r.submit("a", 4).request.headers[SEQUENCE_START_HEADER] == "true"


def test_the_handler_closes_a_sequence_by_naming_it(loop) -> None:
    r = Rig(loop)
    w0, _ = r.workers()
    r.submit("a", 1)
    behind = r.submit("a", 2)
    w0.finish(closes=("x", "a"))
    assert r.sequences.open_sequences == 0
    with pytest.raises(SequenceRefused, match="closed by its handler"):
        behind.future.result()


def test_a_dead_worker_takes_its_sequences_and_moves_those_that_never_ran(loop) -> None:
    r = Rig(loop, idle_s=10.0)
    w0, w1 = r.workers()
    r.submit("a", 1)        # w0
    r.submit("b", 1)        # w1
    w0.finish()             # a ran on w0
    a2, a3 = r.submit("a", 2), r.submit("a", 3)
    c1 = r.submit("c", 1)   # bound to w0 (tie, first); waits behind a2 there
    r.lanes[0].went_down("its worker W-1 failed (killed)")
    for job in (a2, a3):
        with pytest.raises(SequenceLost, match='Sequence "a" of model "m" ended: its worker W-1'):
            job.future.result()
    assert not c1.future.done()
    w1.finish()             # b1; c moved to w1
    assert w1.batches[-1] == ["c1"]
    with pytest.raises(SequenceLost, match="killed"):
        r.submit("a", 4)    # refused rather than run without its state...
    r.time.run_until(10.0)
    fresh = r.submit("a", 5)  # ...until it would have expired anyway
    assert fresh.request.headers[SEQUENCE_START_HEADER] == "true"


def test_a_restarted_worker_takes_new_sequences_again(loop) -> None:
    r = Rig(loop)
    w0, w1 = r.workers()
    r.submit("a", 1)
    r.lanes[0].went_down("its worker failed")
    r.submit("b", 1)
    assert w0.batches == [["a1"]] and w1.batches == [["b1"]]
    restarted = Worker(r.sequences, r.lanes[0]).start()
    r.submit("c", 1)
    assert restarted.batches == [["c1"]]


def test_a_request_that_leaves_before_its_worker_does_not_hold_up_its_sequence(loop) -> None:
    r = Rig(loop)
    first = r.submit("a", 1)   # no worker is up yet: a1 waits unbound
    second = r.submit("a", 2)
    first.future.cancel()      # its client went away
    tick(loop)
    (w0, _) = r.workers()
    assert w0.batches == [["a2"]] and second.is_live()


def test_a_stopped_worker_is_retired_and_its_sequences_end(loop) -> None:
    r = Rig(loop)
    w0, _ = r.workers()
    r.submit("a", 1)
    w0.finish()
    r.lanes[0].draining()
    r.submit("b", 1)  # not to the worker being stopped
    assert [sequence.id for sequence in r.lanes[0].sequences] == ["a"]
    r.lanes[0].retire()
    assert r.sequences.open_sequences == 1
    with pytest.raises(SequenceLost, match="was stopped"):
        r.submit("a", 2)


def test_fail_queued_and_close_spare_what_runs(loop) -> None:
    r = Rig(loop)
    w0, _ = r.workers()
    running, waiting = r.submit("a", 1), r.submit("a", 2)
    r.sequences.fail_queued(ServiceUnavailable("down"))
    assert isinstance(waiting.future.exception(), ServiceUnavailable)
    assert not running.future.done()
    late = r.submit("b", 1)  # to w1
    r.sequences.close(ServiceUnavailable("unregistered"))
    assert not running.future.done() and not late.future.done()  # both in a worker
    with pytest.raises(ServiceUnavailable, match="unregistered"):
        r.submit("c", 1)
    assert w0.finish() == ["a1"] and w0.batches == [["a1"]]


def test_a_describe_goes_to_any_worker_that_is_up(loop) -> None:
    r = Rig(loop)
    _, w1 = r.workers()
    r.lanes[0].draining()
    describe = Job(worker_pb2.Request(request_id="d", describe=True), loop.create_future())
    r.sequences.submit(describe)
    assert w1.batches == [["d"]] and r.sequences.open_sequences == 0


def test_name_sequence_keeps_the_clients_id_or_makes_one() -> None:
    given = worker_pb2.Request(headers={SEQUENCE_ID_HEADER: "s-1"})
    assert name_sequence(given) == "s-1"
    made = worker_pb2.Request()
    sequence_id = name_sequence(made)
    assert sequence_id.startswith("ts-seq-") and made.headers[SEQUENCE_ID_HEADER] == sequence_id
    assert name_sequence(worker_pb2.Request(headers={SEQUENCE_ID_HEADER: ""})) != ""


@pytest.mark.parametrize(("headers", "inputs", "ends"), [
    ({SEQUENCE_END_HEADER: "True"}, {}, True),
    ({}, {SEQUENCE_END_HEADER: b"true"}, True),  # gRPC: an input, as TorchServe reads it
    ({SEQUENCE_END_HEADER: "false"}, {}, False),
    ({}, {"data": b"1"}, False),
])
def test_the_close_signal_reaches_the_handler_as_the_header(headers, inputs, ends) -> None:
    request = worker_pb2.Request(headers=headers, inputs=inputs)
    name_sequence(request)
    assert (request.headers.get(SEQUENCE_END_HEADER) == "true") is ends
