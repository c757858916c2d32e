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

from typing import Protocol

#: The phases, in the order a request meets them (``batchserve_request_phase_seconds``' label).
PHASES = ("queue", "batch_form", "worker", "preprocess", "inference", "postprocess",
          "frontend")
#: The request header (and gRPC metadata key) by which a request asks for Server-Timing.
SERVER_TIMING_REQUEST = "x-server-timing"
#: The response header (and gRPC trailing metadata key) that carries it.
SERVER_TIMING = "server-timing"
#: ``server_timing`` (config.properties, as ``config.parse_timing_mode`` gives it): no request
#: gets the header; a request that asks for it gets it; every request gets it.
OFF, REQUEST, ALWAYS = "off", "request", "always"
_YES = frozenset(("1", "true", "on", "yes"))


class Timing(Protocol):
    """What is read of a batch's times (``batching.BatchTiming``), in seconds."""

    @property
    def reason(self) -> str: ...

    @property
    def answered(self) -> bool: ...

    @property
    def round_s(self) -> float: ...

    @property
    def worker_s(self) -> float: ...

    @property
    def steps(self) -> bool: ...

    @property
    def preprocess_s(self) -> float: ...

    @property
    def inference_s(self) -> float: ...

    @property
    def postprocess_s(self) -> float: ...


def asks(value: str | None) -> bool:
    """Whether a request's ``X-Server-Timing`` value asks for the header (1, true, on, yes)."""
    return value is not None and value.strip().lower() in _YES


def frontend_s(queue_wait_s: float, timing: Timing, total_s: float) -> float:
    """The ``frontend`` phase of a request a worker answered: its time so far (``total_s``)
    less its wait in the queue and its batch's round trip (never below 0)."""
    own_s = total_s - queue_wait_s - timing.round_s
    return own_s if own_s > 0 else 0.0


def split(queue_wait_s: float, form_s: float, timing: Timing | None, total_s: float
          ) -> tuple[float, ...] | None:
    """The seconds of each of ``PHASES`` for a request answered by a worker (None: it was not;
    then all of its time is the frontend's, or the queue's). ``total_s``: its time so far."""
    if timing is None or not timing.answered:
        return None
    return (queue_wait_s - form_s, form_s, timing.worker_s, timing.preprocess_s,
            timing.inference_s, timing.postprocess_s, frontend_s(queue_wait_s, timing, total_s))


def header(queue_wait_s: float, form_s: float, timing: Timing | None, total_s: float) -> str:
    """The ``Server-Timing`` value: each phase's duration in ms, the batch's reason as the
    ``batch_form`` description, then ``total`` (the parts never add up to more); only
    ``total`` for a request no worker answered."""
    phases = split(queue_wait_s, form_s, timing, total_s)
    parts = []
    if phases is not None and timing is not None:
        for name, seconds in zip(PHASES, phases, strict=True):
            if not timing.steps and name in ("preprocess", "postprocess"):
                continue
            part = f"{name};dur={seconds * 1000:.3f}"
            if name == "batch_form":
                part += f';desc="{timing.reason}"'
            parts.append(part)
    parts.append(f"total;dur={total_s * 1000:.3f}")
    return ", ".join(parts)


_NOT_DISPATCHED = ("form_ms=- worker_ms=- preprocess_ms=- inference_ms=- postprocess_ms=- "
                   "frontend_ms=- reason=-")
_FAILED = ("form_ms=%.2f worker_ms=- preprocess_ms=- inference_ms=- postprocess_ms=- "
           "frontend_ms=- reason=%s")
#: The fields of a request's batch (shared by every request of it: formatted once per batch).
_WITH_STEPS = "worker_ms=%.2f preprocess_ms=%.2f inference_ms=%.2f postprocess_ms=%.2f"
_WITHOUT_STEPS = "worker_ms=%.2f preprocess_ms=- inference_ms=%.2f postprocess_ms=-"
_ANSWERED = "form_ms=%.2f %s frontend_ms=%.2f reason=%s"


def log_fields(queue_wait_s: float, form_s: float, timing: Timing | None, total_s: float,
               batches: dict[int, str] | None = None) -> str:
    """The access log's fields after its ``batch=``: the phases in ms (``-`` for a request no
    worker answered) and the batch's reason. ``queue_ms`` before them is ``queue`` plus
    ``batch_form``. (Written for every request as the log is flushed, on the event loop;
    ``batches``: the fields of the batches met so far in this flush, by ``id`` of their
    timing, which their requests' entries keep alive.)"""
    if timing is None:  # never dispatched
        return _NOT_DISPATCHED
    if not timing.answered:  # dispatched, and its batch failed as a whole (or never came back)
        return _FAILED % (form_s * 1000, timing.reason)
    batch = batches.get(id(timing)) if batches is not None else None
    if batch is None:
        batch = (_WITH_STEPS % (timing.worker_s * 1000, timing.preprocess_s * 1000,
                                timing.inference_s * 1000, timing.postprocess_s * 1000)
                 if timing.steps else
                 _WITHOUT_STEPS % (timing.worker_s * 1000, timing.inference_s * 1000))
        if batches is not None:
            batches[id(timing)] = batch
    return _ANSWERED % (form_s * 1000, batch, frontend_s(queue_wait_s, timing, total_s) * 1000,
                        timing.reason)