"""The PREDICT exchange with one worker, in one place, as TorchServe's ``BatchAggregator``
both builds a batch and maps its reply: the batch's frame, the reply read back (a result, an
error, or a broken protocol), each response bounded by ``max_response_size``, and each job
resolved or failed. The ``Dispatcher`` decides when batches go; this decides what they say.

What happened to each batch is noted on its facts (``Batch``: the worker it went to, what the
reply said of the handler's time) and, once its answers are delivered, told to the model's
``ended`` hook (frontend/observe/events.py); the exchange keeps no record of its own.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence

from frontend.errors import InternalError, WorkerDied, worker_error
from frontend.observe.events import NO_EVENTS, Batch, ModelEvents
from frontend.serving.batching import Batcher, Job, fail_jobs
from frontend.serving.buckets import NO_BUCKETS, padded_rows
from protos import worker_pb2
from protos.batch_wire import predict_batch_bytes
from protos.framing import Frame, Kind

#: Told of each batch's reply (None: the batch failed as a whole), before its jobs are
#: answered and before its worker takes another batch.
BatchDone = Callable[[list[Job], "worker_pb2.PredictResult | None"], None]


class PredictExchange:
    """Frames and replies of one worker's batches (see the module docstring)."""

    def __init__(self, name: str, worker_id: str, batcher: Batcher, max_response_bytes: int,
                 on_batch: BatchDone, events: ModelEvents = NO_EVENTS) -> None:
        self.name = name
        self._worker_id = worker_id
        self._batcher = batcher
        self._max_bytes = max_response_bytes
        self._on_batch = on_batch
        self._batch_ids = itertools.count(1)
        #: Told of each batch once it ended (None: nobody listens).
        self._ended = events.ended
        #: The frontend's own time on each batch is read (TorchServe's WorkerThreadTime): its
        #: frame, and its reply until its answers are delivered, are marked.
        self._marks = events.frontend_time
        #: The batch buckets of the worker's life now (its ``Execution``): each batch's facts
        #: note the rows it runs as.
        self.buckets = NO_BUCKETS

    def frame(self, jobs: list[Job]) -> Frame:
        """The PREDICT frame of a batch of ``jobs`` (each learns its batch's name)."""
        began = time.perf_counter() if self._marks else 0.0
        batch_id = next(self._batch_ids)
        batch_name = f"{self._worker_id}-{batch_id}"
        for job in jobs:
            job.batch_id = batch_name
        frame = Frame(Kind.PREDICT, predict_batch_bytes(batch_id, [job.request for job in jobs]))
        facts = jobs[0].batch
        if facts is not None:
            facts.worker = self._worker_id
            if self.buckets:
                facts.rows = padded_rows(facts.items, self.buckets)
            if self._marks:
                facts.frontend_marks = [began, time.perf_counter()]
        return frame

    def finish(self, jobs: list[Job], reply: Frame, service_s: float
               ) -> Callable[[], None] | None:
        """Account for a batch's reply (``service_s``: the worker's time on it). Returns what
        delivers its answers (the caller runs it once the next batch is on its way), or None
        when the jobs are answered already. Raises WorkerDied when the reply breaks the
        protocol."""
        began = time.perf_counter() if self._marks else 0.0
        result = (worker_pb2.PredictResult.FromString(reply.payload)
                  if reply.kind is Kind.PREDICTED else None)
        facts = jobs[0].batch if jobs else None
        if facts is not None:
            facts.replied = True
            if result is not None:
                facts.note_reply(result)
            if facts.frontend_marks is not None:
                facts.frontend_marks.append(began)
        self._on_batch(jobs, result)
        if result is not None:
            self._batcher.completed(sum(job.weight for job in jobs), service_s, jobs)
            if len(result.responses) != len(jobs):
                fail_jobs(jobs, InternalError(
                    f"{self.name} returned {len(result.responses)} responses for a batch of "
                    f"{len(jobs)} requests"))
                self._end(facts, jobs, result)
                return None
            responses = result.responses
            if self._ended is None and not self._marks:
                return lambda: self._resolve(jobs, responses)

            def deliver() -> None:
                self._resolve(jobs, responses)
                self._end(facts, jobs, result)

            return deliver
        if reply.kind is Kind.ERROR:
            error = worker_pb2.Error.FromString(reply.payload)
            fail_jobs(jobs, worker_error(error.code, error.message))
            self._end(facts, jobs, None)
            return None
        fail_jobs(jobs, InternalError(f"{self.name} sent {reply.kind.name} to a batch"))
        self._end(facts, jobs, None)
        raise WorkerDied(f"{self.name} broke the protocol")

    def lost(self, jobs: list[Job]) -> None:
        """The batch of ``jobs`` got no reply (it timed out, its worker died): its jobs are
        answered already; its end is told."""
        facts = jobs[0].batch if jobs else None
        if facts is not None and self._ended is not None:
            self._ended(facts, jobs, None)

    def _end(self, facts: Batch | None, jobs: Sequence[Job],
             result: worker_pb2.PredictResult | None) -> None:
        """The batch's answers are delivered: its end is marked and told."""
        if facts is None:
            return
        if facts.frontend_marks is not None:
            facts.frontend_marks.append(time.perf_counter())
        if self._ended is not None:
            self._ended(facts, jobs, result)

    def bound(self, response: worker_pb2.Response) -> worker_pb2.Response:
        """A response (or a streamed part) within ``max_response_size`` (``bounded``)."""
        return bounded(response, self._max_bytes)

    def _resolve(self, jobs: list[Job], responses: Sequence[worker_pb2.Response]) -> None:
        for job, response in zip(jobs, responses, strict=True):
            job.resolve(bounded(response, self._max_bytes))


def bounded(response: worker_pb2.Response, max_bytes: int) -> worker_pb2.Response:
    """The worker's response, or a 500 in its place when its body exceeds max_response_size:
    the one place that holds the limit, whatever protocol carries the answer."""
    if len(response.body) <= max_bytes:
        return response
    return worker_pb2.Response(
        request_id=response.request_id, status=500,
        error=f"the response of {len(response.body)} bytes exceeds max_response_size "
              f"({max_bytes} bytes)")
