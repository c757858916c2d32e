"""The PREDICT exchange with one worker, in one place, as TorchServe's ``BatchAggregator``
both builds a batch and maps its reply: the batch's frame, the reply read back (a result, an
error, or a broken protocol), each response bounded by ``max_response_size``, and each job
resolved or failed. The ``Dispatcher`` decides when batches go; this decides what they say."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence

from frontend.errors import InternalError, WorkerDied, worker_error
from frontend.serving.batching import Batcher, Job, fail_jobs
from protos import worker_pb2
from protos.framing import Frame, Kind

#: Frames whose replies are awaited, at most (a worker holds a batch or two at a time).
_MAX_OPEN_FRAMES = 64
#: Told of each batch's reply (None: the batch failed as a whole), before its jobs are
#: answered.
BatchDone = Callable[[list[Job], "worker_pb2.PredictResult | None"], None]


class PredictExchange:
    """Frames and replies of one worker's batches (see the module docstring)."""

    def __init__(self, name: str, worker_id: str, batcher: Batcher, max_response_bytes: int,
                 on_batch: BatchDone, on_overhead: Callable[[float], None] | None = None
                 ) -> None:
        self.name = name
        self._worker_id = worker_id
        self._batcher = batcher
        self._max_bytes = max_response_bytes
        self._on_batch = on_batch
        self._batch_ids = itertools.count(1)
        #: Told the frontend's own time on each batch, in ms (TorchServe's WorkerThreadTime):
        #: building its frame, reading its reply and answering its requests.
        self._on_overhead = on_overhead
        #: id(jobs) -> seconds its frame took, until its reply (bounded: a dead worker's
        #: batches never get one).
        self._frame_s: dict[int, float] = {}

    def frame(self, jobs: list[Job]) -> Frame:
        """The PREDICT frame of a batch of ``jobs`` (each learns its batch's name)."""
        start = time.perf_counter()
        batch = worker_pb2.PredictBatch(batch_id=next(self._batch_ids))
        batch.requests.extend(job.request for job in jobs)
        batch_name = f"{self._worker_id}-{batch.batch_id}"
        for job in jobs:
            job.batch_id = batch_name
        frame = Frame(Kind.PREDICT, batch.SerializeToString())
        if self._on_overhead is not None:
            if len(self._frame_s) >= _MAX_OPEN_FRAMES:
                self._frame_s.pop(next(iter(self._frame_s)))
            self._frame_s[id(jobs)] = time.perf_counter() - start
        return frame

    def finish(self, jobs: list[Job], reply: Frame, service_s: float
               ) -> Callable[[], None] | None:
        """Account for a batch's reply (``service_s``: the worker's time on it). Returns what
        delivers its answers (the caller runs it once the next batch is on its way), or None
        when the jobs are answered already. Raises WorkerDied when the reply breaks the
        protocol."""
        start = time.perf_counter()
        result = (worker_pb2.PredictResult.FromString(reply.payload)
                  if reply.kind is Kind.PREDICTED else None)
        if result is not None and jobs:
            timing = jobs[0].timing  # one per batch, shared by its jobs
            if timing is not None:
                timing.answer(self._batcher.clock() - timing.dispatched_at,
                              result.handler_time_ms,
                              result.phases if result.HasField("phases") else None)
        self._on_batch(jobs, result)
        if result is not None:
            self._batcher.completed(sum(job.weight for job in jobs), service_s)
            if len(result.responses) != len(jobs):
                fail_jobs(jobs, InternalError(
                    f"{self.name} returned {len(result.responses)} responses for a batch of "
                    f"{len(jobs)} requests"))
                self._overhead(jobs, start)
                return None
            responses = result.responses
            if self._on_overhead is None:
                return lambda: self._resolve(jobs, responses)

            def deliver() -> None:
                self._resolve(jobs, responses)
                self._overhead(jobs, start)

            return deliver
        self._overhead(jobs, start)
        if reply.kind is Kind.ERROR:
            error = worker_pb2.Error.FromString(reply.payload)
            fail_jobs(jobs, worker_error(error.code, error.message))
            return None
        fail_jobs(jobs, InternalError(f"{self.name} sent {reply.kind.name} to a batch"))
        raise WorkerDied(f"{self.name} broke the protocol")

    def _overhead(self, jobs: list[Job], reply_start: float) -> None:
        """Report the frontend's time on the batch of ``jobs``: its frame, and its reply
        from ``reply_start`` until now."""
        frame_s = self._frame_s.pop(id(jobs), 0.0)
        if self._on_overhead is not None:
            self._on_overhead((frame_s + time.perf_counter() - reply_start) * 1000)

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
