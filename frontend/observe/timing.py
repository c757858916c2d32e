"""Where one prediction's time went, split into phases (docs/batches.md), and how the split is
written: in the access log's fields, and in the ``Server-Timing`` response header (W3C Server
Timing: ``name;dur=<ms>``, comma-separated) that a client may ask for.

The phases, in the order a request meets them, add up to its time in the server:

* ``queue``: in its model's queue while no worker was free to collect a batch;
* ``batch_form``: in the queue while a free worker collected its batch (the policy's wait);
* ``worker``: from its batch leaving the queue to the worker's reply being read, less the
  handler's steps: sending, waiting in the worker behind the batch ahead (two in flight),
  decoding the requests, encoding the answers, the way back;
* ``preprocess``, ``inference``, ``postprocess``: the handler's steps on its batch (a
  handler without those steps: its whole time is ``inference``);
* ``frontend``: the rest: reading and parsing the request, queueing it, answering it.

The handler's steps are the batch's, shared by every request of it; the queue and the batch's
forming are each request's own.
"""

from __future__ import annotations

from collections.abc import Sequence

from frontend.observe.events import Batch, CallFacts, JobFacts, ModelKey
from frontend.observe.histograms import MODEL_LABELS, PHASE_BUCKETS, Histogram
from protos import worker_pb2

#: The phases, in the order a request meets them (``batchserve_request_phase_seconds``' label).
PHASES = ("queue", "batch_form", "worker", "preprocess", "inference", "postprocess",
          "frontend")
PHASE_LABELS = (*MODEL_LABELS, "phase")
#: The request header (and gRPC metadata key) by which a request asks for Server-Timing.
SERVER_TIMING_REQUEST = "x-server-timing"
#: The response header (and gRPC trailing metadata key) that carries it.
SERVER_TIMING = "server-timing"
#: ``server_timing`` (config.properties, as ``config.parse_timing_mode`` gives it): no request
#: gets the header; a request that asks for it gets it; every request gets it.
OFF, REQUEST, ALWAYS = "off", "request", "always"
_YES = frozenset(("1", "true", "on", "yes"))


def asks(value: str | None) -> bool:
    """Whether a request's ``X-Server-Timing`` value asks for the header (1, true, on, yes)."""
    return value is not None and value.strip().lower() in _YES


def round_s(batch: Batch) -> float:
    """A batch's round trip: from leaving the queue to its reply being read."""
    return batch.ended_at - batch.left_at


def batch_split(batch: Batch) -> tuple[float, float, float, float]:
    """The seconds of an answered batch's ``worker``, ``preprocess``, ``inference`` and
    ``postprocess`` phases (a handler without the three steps: its whole time is inference;
    the steps never add up to more than the round trip: preprocessing ahead overlapped the
    wait behind the batch before)."""
    trip_s = round_s(batch)
    if batch.step_ms is not None:
        pre_ms, inference_ms, post_ms = batch.step_ms
        pre, inference, post = pre_ms / 1000, inference_ms / 1000, post_ms / 1000
    else:
        pre, inference, post = 0.0, batch.handler_ms / 1000, 0.0
    handler_s = pre + inference + post
    if handler_s > trip_s:
        scale = trip_s / handler_s if handler_s > 0 else 0.0
        pre, inference, post = pre * scale, inference * scale, post * scale
        handler_s = trip_s
    return trip_s - handler_s, pre, inference, post


def frontend_s(queue_wait_s: float, batch: Batch, total_s: float) -> float:
    """The ``frontend`` phase of a request a worker answered: its time so far (``total_s``)
    less its wait in the queue and its batch's round trip (never below 0)."""
    own_s = total_s - queue_wait_s - round_s(batch)
    return own_s if own_s > 0 else 0.0


def split(queue_wait_s: float, form_s: float, batch: Batch | None, total_s: float
          ) -> tuple[float, ...] | None:
    """The seconds of each of ``PHASES`` for a request answered by a worker (None: it was not;
    then all of its time is the frontend's, or the queue's). ``total_s``: its time so far."""
    if batch is None or not batch.answered:
        return None
    return (queue_wait_s - form_s, form_s, *batch_split(batch),
            frontend_s(queue_wait_s, batch, total_s))


def header(queue_wait_s: float, form_s: float, batch: Batch | None, total_s: float) -> str:
    """The ``Server-Timing`` value: each phase's duration in ms, the batch's reason as the
    ``batch_form`` description, then ``total`` (the parts never add up to more); only
    ``total`` for a request no worker answered."""
    phases = split(queue_wait_s, form_s, batch, total_s)
    parts = []
    if phases is not None and batch is not None:
        for name, seconds in zip(PHASES, phases, strict=True):
            if not batch.steps and name in ("preprocess", "postprocess"):
                continue
            part = f"{name};dur={seconds * 1000:.3f}"
            if name == "batch_form":
                part += f';desc="{batch.reason}"'
            parts.append(part)
    parts.append(f"total;dur={total_s * 1000:.3f}")
    return ", ".join(parts)


def job_header(job: JobFacts, total_s: float) -> str:
    """The ``Server-Timing`` value of a request whose job is ``job``."""
    return header(job.queue_wait_s, job.form_s, job.batch, total_s)


_NOT_DISPATCHED = ("form_ms=- worker_ms=- preprocess_ms=- inference_ms=- postprocess_ms=- "
                   "frontend_ms=- reason=-")
_FAILED = ("form_ms=%.2f worker_ms=- preprocess_ms=- inference_ms=- postprocess_ms=- "
           "frontend_ms=- reason=%s")
#: The fields of a request's batch (shared by every request of it: formatted once per batch).
_WITH_STEPS = "worker_ms=%.2f preprocess_ms=%.2f inference_ms=%.2f postprocess_ms=%.2f"
_WITHOUT_STEPS = "worker_ms=%.2f preprocess_ms=- inference_ms=%.2f postprocess_ms=-"
_ANSWERED = "form_ms=%.2f %s frontend_ms=%.2f reason=%s"


def log_fields(queue_wait_s: float, form_s: float, batch: Batch | None, total_s: float,
               batches: dict[int, str] | None = None) -> str:
    """The access log's fields after its ``batch=``: the phases in ms (``-`` for a request no
    worker answered) and the batch's reason. ``queue_ms`` before them is ``queue`` plus
    ``batch_form``. (Written for every request as the log is flushed, on the event loop;
    ``batches``: the fields of the batches met so far in this flush, by ``id`` of their
    facts, which their requests' entries keep alive.)"""
    if batch is None:  # never dispatched
        return _NOT_DISPATCHED
    if not batch.answered:  # dispatched, and its batch failed as a whole (or never came back)
        return _FAILED % (form_s * 1000, batch.reason)
    fields = batches.get(id(batch)) if batches is not None else None
    if fields is None:
        worker_s, pre_s, inference_s, post_s = batch_split(batch)
        fields = (_WITH_STEPS % (worker_s * 1000, pre_s * 1000, inference_s * 1000,
                                 post_s * 1000)
                  if batch.steps else _WITHOUT_STEPS % (worker_s * 1000, inference_s * 1000))
        if batches is not None:
            batches[id(batch)] = fields
    return _ANSWERED % (form_s * 1000, fields, frontend_s(queue_wait_s, batch, total_s) * 1000,
                        batch.reason)


class PhaseMetrics:
    """``batchserve_request_phase_seconds``: each answered request's phases, observed once per
    request (a batch of 8 counts its ``inference`` 8 times, as 8 requests waited for it). The
    queue's, the batch's forming, the worker's and the handler's as a batch ends, the
    frontend's as its request ends. Subscribed only while ``request_phases`` is on; off, the
    family has no samples and nothing of the split is worked out."""

    def __init__(self) -> None:
        self.histogram = Histogram(
            "batchserve_request_phase_seconds",
            "Where a prediction's time went, by phase: queue, batch_form, worker, preprocess, "
            "inference, postprocess, frontend (docs/batches.md)", PHASE_BUCKETS, PHASE_LABELS)
        #: (model, version) -> the keys of its phases' series, in PHASES' order.
        self._keys: dict[ModelKey, tuple[tuple[str, str, str], ...]] = {}

    def _of(self, key: ModelKey) -> tuple[tuple[str, str, str], ...]:
        keys = self._keys.get(key)
        if keys is None:
            keys = self._keys[key] = tuple((*key, phase) for phase in PHASES)
        return keys

    def batch_ended(self, key: ModelKey, batch: Batch, jobs: Sequence[JobFacts],
                    result: worker_pb2.PredictResult | None) -> None:
        """A batch's phases, once per request: the queue and the batch's forming as each job
        waited, the worker's and the handler's as the batch took them."""
        if not batch.answered:
            return
        keys = self._keys.get(key) or self._of(key)
        histogram = self.histogram
        left, since = batch.left_at, batch.since
        enqueued = [job.enqueued_at for job in jobs]
        histogram.observe_all(keys[0], (since - at if since > at else 0.0 for at in enqueued))
        histogram.observe_all(keys[1], (left - (since if since > at else at) for at in enqueued))
        count = len(jobs)
        worker_s, pre_s, inference_s, post_s = batch_split(batch)
        histogram.observe_n(keys[2], worker_s, count)
        if batch.steps:
            histogram.observe_n(keys[3], pre_s, count)
            histogram.observe_n(keys[5], post_s, count)
        histogram.observe_n(keys[4], inference_s, count)

    def call_ended(self, call: CallFacts) -> None:
        """The frontend's own time of a request a worker answered (``frontend_s``, inline:
        this runs for every request)."""
        key, job = call.key, call.job
        batch = job.batch
        if key is None or batch is None or not batch.answered or call.error is not None \
                or not call.status:
            return
        # Its time less its wait in the queue and its batch's round trip.
        own_s = call.latency_s - (batch.ended_at - job.enqueued_at)
        keys = self._keys.get(key) or self._of(key)
        self.histogram.observe(keys[6], own_s if own_s > 0 else 0.0)
