"""The per-request plumbing every HTTP prediction route shares (TorchServe's and KServe's):
headers in and out, waiting for the worker while watching for a hang-up, size limits, and
the metrics and access-log line at the end."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from frontend.api.http import common
from frontend.errors import InternalError, ServeError
from frontend.models.registry import Model
from frontend.observe.logs import AccessLog
from frontend.observe.metrics import ServerMetrics
from frontend.serving.batching import Job
from frontend.serving.plane import submit
from frontend.serving.streams import ResponseStream
from protos import worker_pb2

#: What a job holds until its HTTP request has been read.
_NO_REQUEST = worker_pb2.Request()


def pending_job(loop: asyncio.AbstractEventLoop) -> Job:
    """A job for an HTTP prediction whose request is not built yet."""
    return Job(_NO_REQUEST, loop.create_future())


def copy_headers(scope: common.Scope, request: worker_pb2.Request) -> float | None:
    """The HTTP headers into the worker request; returns the client's own deadline."""
    timeout_s = None
    for raw_name, raw_value in scope["headers"]:
        name = raw_name.decode("latin-1")
        value = raw_value.decode("latin-1")
        request.headers[name] = value
        if name == common.REQUEST_TIMEOUT_HEADER:
            timeout_s = common.parse_timeout(value)
    return timeout_s


def response_headers(request_id: str, response: worker_pb2.Response) -> common.Headers:
    headers: common.Headers = [(b"x-request-id", request_id.encode())]
    # HTTP headers are latin-1; a handler's other characters become "?", not a 500.
    headers.extend((key.lower().encode("latin-1", "replace"),
                    value.encode("latin-1", "replace"))
                   for key, value in response.headers.items())
    return headers


def check_response_size(body: bytes, limit_bytes: int) -> None:
    if len(body) > limit_bytes:
        raise InternalError(f"response of {len(body)} bytes exceeds max_response_size "
                            f"({limit_bytes} bytes)")


async def submit_unless_gone(model: Model, request: worker_pb2.Request, timeout_s: float | None,
                             receive: common.Receive, job: Job
                             ) -> worker_pb2.Response | ResponseStream | None:
    """Queue the job and wait for its answer; None when the client hung up meanwhile.

    A client that hangs up while its request waits is dropped from the queue: the ASGI server
    answers a pending receive() with http.disconnect when it goes.
    """
    disconnected = asyncio.ensure_future(receive())
    try:
        return await submit(model, request, timeout_s, abandoned=disconnected, job=job)
    except asyncio.CancelledError:
        if disconnected.done():
            return None  # nobody is listening for an answer
        raise
    finally:
        disconnected.cancel()


def record_http_request(metrics: ServerMetrics, access: AccessLog, scope: common.Scope,
                        model: Model | None, status: int, latency_s: float, job: Job) -> None:
    metrics.record_request(model, status, latency_s)
    client = scope.get("client") or ("-", 0)
    access.write(f"/{client[0]}:{client[1]}", scope["method"], scope["path"],
                 f"HTTP/{scope.get('http_version', '1.1')}", status, latency_s,
                 model.name if model else "-", model.version if model else "-",
                 job.queue_wait_s, job.batch_size)


async def observed(metrics: ServerMetrics, access: AccessLog, scope: common.Scope,
                   model_of: Callable[[], Model], run: Callable[[Model, Job], Awaitable[int]]
                   ) -> None:
    """A prediction through the ASGI routes, with its metrics and access-log line whatever its
    outcome: ``model_of`` names the model (a ServeError there is recorded without one), ``run``
    answers the request and returns the HTTP status it sent (0: the client went away)."""
    started = time.perf_counter()
    model: Model | None = None
    job = pending_job(asyncio.get_running_loop())
    status = 500
    try:
        model = model_of()
        status = await run(model, job)
    except ServeError as error:
        status = error.http_status
        raise
    finally:
        record_http_request(metrics, access, scope, model, status,
                            time.perf_counter() - started, job)
