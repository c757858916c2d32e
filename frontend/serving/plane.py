"""Submitting one request to a model and waiting for its answer: shared by HTTP and gRPC."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from frontend.errors import GatewayTimeout
from frontend.models.registry import Model
from frontend.serving.batching import Job
from frontend.serving.streams import ResponseStream
from protos import worker_pb2


def enqueue(model: Model, job: Job, timeout_s: float | None = None,
            loop: asyncio.AbstractEventLoop | None = None) -> asyncio.TimerHandle:
    """Queue ``job`` on ``model`` with its deadline; returns the timer that answers it 504 at
    that deadline (cancel it once the job is answered).

    The deadline is the model's ``response_timeout``, or the client's own (``timeout_s``) when
    that is sooner; a request still queued at its deadline is answered 504 and never reaches a
    worker, and one whose worker has not answered by then is answered 504 too. Pass the
    running ``loop`` where it is at hand (asking for it costs a getpid() call on 3.11).
    """
    budget_s = float(model.settings.response_timeout_s)
    if timeout_s is not None:
        budget_s = min(budget_s, timeout_s)
    job.deadline = time.monotonic() + budget_s
    model.submit(job)
    # Answer 504 at the deadline itself, even while every worker is busy.
    if loop is None:
        loop = asyncio.get_running_loop()
    return loop.call_later(budget_s, _expire, job, budget_s)


async def submit(model: Model, request: worker_pb2.Request, timeout_s: float | None = None,
                 abandoned: asyncio.Future[Any] | None = None, job: Job | None = None
                 ) -> worker_pb2.Response | ResponseStream:
    """Queue ``request`` on ``model`` (see ``enqueue``) and wait for the worker's answer.

    When ``abandoned`` completes (the client went away) the request is cancelled, and the
    queue forgets it. Pass ``job`` to read its queue wait and batch size afterwards (its
    future must be fresh).
    """
    if job is None:
        job = Job(request, asyncio.get_running_loop().create_future())
    timer = enqueue(model, job, timeout_s)
    if abandoned is not None:
        abandoned.add_done_callback(lambda _: job.future.cancel())
    try:
        return await job.future
    finally:
        timer.cancel()


def _expire(job: Job, budget_s: float) -> None:
    if job.future.done():
        return
    where = "in a worker" if job.dispatched else "in the queue, before a worker was free"
    job.future.set_exception(GatewayTimeout(f"no answer within {budget_s:g} s: the request "
                                            f"timed out {where}"))
