"""Submitting one request to a model and waiting for its answer: shared by HTTP and gRPC."""

from __future__ import annotations

import asyncio
import time

from frontend.batching import Job
from frontend.registry import Model
from frontend.streams import ResponseStream
from protos import worker_pb2


async def submit(model: Model, request: worker_pb2.Request,
                 timeout_s: float | None = None) -> worker_pb2.Response | ResponseStream:
    """Queue ``request`` on ``model`` and wait for the worker's answer.

    The request's deadline is the model's ``response_timeout``, or the client's own deadline
    (``timeout_s``) when that is sooner; a request still queued at its deadline is answered
    504 and never reaches a worker.
    """
    budget_s = float(model.settings.response_timeout_s)
    if timeout_s is not None:
        budget_s = min(budget_s, timeout_s)
    job = Job(request, asyncio.get_running_loop().create_future(),
              deadline=time.monotonic() + budget_s)
    model.submit(job)
    return await job.future
