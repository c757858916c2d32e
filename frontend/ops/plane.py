"""The inference plane: the one path a prediction takes, whatever transport brought it.

Transports only parse and render (the ``/predictions`` fast path, the ASGI routes for
TorchServe and KServe v1/v2, both gRPC services). Between the two, every transport calls the
plane in the same two phases, so the order of the steps cannot be got wrong:

* ``begin`` (or ``call``, for the async transports) opens a ``Call`` for one prediction (who
  asked, when, its job);
* ``open``, as soon as the request names its model, before any body is read: the model and
  version it names (404), its tenant and priority (frontend/ops/tenants.py, for a model that
  tells them apart), refused at once (503) when the model's queue has no room for it;
* ``send``, once the request is read: the worker's request is built (a fresh request id, the
  client's headers or gRPC metadata, its inputs, its weight in batch items, whether it asks
  for an explanation) and queued with its deadline (the model's ``response_timeout``, or the
  client's own, ``X-Request-Timeout`` or the gRPC deadline, when sooner: 504 at the deadline,
  never dispatched after it); a stateful model's request is named by its sequence first (a
  new one when it names none), which ``call.sequence_id`` holds for the transport to return;
* ``outcome`` awaits the answer (a transport in callbacks adds one to ``call.job.future``);
* ``end`` tells the call's observers that it ended (its metrics, access-log line and trace:
  whoever the server subscribed to ``call_ended``), exactly once.

A workflow's request (``/wfpredict``) is a call too, whose DAG runs elsewhere
(frontend/ops/workflow_runs.py) as calls of the nodes' models: ``end`` records it as the
workflow's.

``predict`` runs both phases and the outcome, for the transports that have the whole request
at once (gRPC).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from typing import Any

from frontend.errors import BadRequest, ModelNotFound, ServeError, expired, quoted
from frontend.models.model import Model as Model
from frontend.models.registry import ModelRegistry
from frontend.observe import timing
from frontend.observe.events import WORKFLOW_VERSION as WORKFLOW_VERSION
from frontend.observe.events import CallFacts, Observers
from frontend.observe.events import Origin as Origin
from frontend.observe.logs import AccessLog
from frontend.observe.timing import SERVER_TIMING as SERVER_TIMING
from frontend.ops.ids import new_request_id
from frontend.ops.tenants import Tenancy
from frontend.serving.batching import Job
from frontend.serving.sequences import SEQUENCE_ID_HEADER as SEQUENCE_ID_HEADER
from frontend.serving.sequences import name_sequence
from frontend.serving.streams import ResponseStream as ResponseStream
from protos import worker_pb2

# NOTE: Model, Origin, SEQUENCE_ID_HEADER, ResponseStream and SERVER_TIMING are imported "as"
# themselves: the transports take them from here (the model a call resolved to, who asked,
# the header that names a sequence, a streamed answer, the header or trailing metadata that
# says where its time went), as they import nothing below ops/.

#: A client's own deadline for its prediction, in seconds (HTTP header, lower case).
REQUEST_TIMEOUT_HEADER = "x-request-timeout"
_REQUEST_TIMEOUT_NAME = REQUEST_TIMEOUT_HEADER.encode()
#: The header TorchServe's handlers look at to explain instead of predict ("True").
EXPLAIN_HEADER = "explain"
#: What a job holds until its request is built.
_NO_REQUEST = worker_pb2.Request()

Answer = worker_pb2.Response | ResponseStream


class Call(CallFacts):
    """One prediction in the plane, from ``begin`` to ``end`` (what its observers are told of
    it: ``CallFacts``)."""

    __slots__ = ("ended", "model", "sequence_id", "timer", "wants_timing")
    job: Job

    def __init__(self, origin: Origin, job: Job) -> None:
        super().__init__(origin, job, time.perf_counter())
        self.model: Model | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.ended = False
        #: A stateful model's request: its sequence (the transport returns it to the client).
        self.sequence_id: str | None = None
        #: Its answer carries Server-Timing (``server_timing``; the request asked, or always).
        self.wants_timing = False

    def fail(self, error: ServeError) -> None:
        """Answered with ``error``: its status, and why (for the refusal metrics)."""
        self.status = error.http_status
        self.error = error


def parse_timeout(value: str) -> float:
    """A client's deadline in seconds (finite, > 0), else BadRequest."""
    try:
        seconds = float(value)
    except ValueError:
        raise BadRequest(f"{REQUEST_TIMEOUT_HEADER} must be a number of seconds, got "
                         f"{quoted(value)}") from None
    if not 0 < seconds < math.inf:  # NaN and inf are refused too
        raise BadRequest(f"{REQUEST_TIMEOUT_HEADER} must be a finite number of seconds > 0, "
                         f"got {quoted(value)}")
    return seconds


def request_timeout(headers: Iterable[tuple[bytes, bytes]]) -> float | None:
    """A client's own deadline for its request, in seconds: its ``X-Request-Timeout`` (each
    one checked, the last wins); None without one. BadRequest for a bad value."""
    timeout_s = None
    for name, value in headers:
        if name == _REQUEST_TIMEOUT_NAME:
            timeout_s = parse_timeout(value.decode("latin-1"))
    return timeout_s


class InferencePlane:
    """Resolve, build, queue, await, record: see the module's docstring."""

    def __init__(self, registry: ModelRegistry, observers: Observers,
                 access: AccessLog, server_timing: str = timing.OFF,
                 tenancy: Tenancy | None = None) -> None:
        self.registry = registry
        #: Reads a request's tenant and priority (for models that tell them apart).
        self.tenancy = tenancy or Tenancy("", "")
        #: Told of each call as it ends (``observers.call_ended``: the metrics, the access
        #: log, the traces, as the server subscribed them).
        self._ended = observers.call_ended
        #: The access log, for the transports' lines of what is no prediction.
        self.access = access
        #: ``server_timing`` (config.properties, parsed): off, request (a request may ask)
        #: or always.
        self.server_timing = server_timing
        self._timing_on = self.server_timing != timing.OFF

    # -- the two phases ---------------------------------------------------------------------

    def begin(self, origin: Origin, loop: asyncio.AbstractEventLoop) -> Call:
        return Call(origin, Job(_NO_REQUEST, loop.create_future()))

    def open(self, call: Call, name: str, version: str | None = None,
             headers: Iterable[tuple[bytes, bytes]] = ()) -> Model:
        """Phase one, before the body is read: the model the call names (ModelNotFound), its
        tenant and priority from ``headers`` (BadRequest), and a refusal (503) now if its
        queue has no room for it."""
        model = call.model = self.registry.get(name, version or None)
        call.key = model.key
        call.version = version or None
        if model.tenanted:
            self.tenancy.stamp(call.job, headers)
        model.batcher.refuse_if_full(call.job)
        return model

    @staticmethod
    def refuse_if_full(model: Model) -> None:
        """503 now if ``model``'s queue has no room (a request refused before its body)."""
        model.batcher.refuse_if_full()

    @staticmethod
    def when_room(call: Call, resume: Callable[[], None]) -> bool:
        """For a call just refused (503): whether its model's queue is full, and if it is,
        ``resume`` is called once it has room (or its model closes), so that a transport may
        stop reading the refused client until then."""
        model = call.model
        if model is None or not model.batcher.is_full:
            return False
        model.batcher.when_room(resume)
        return True

    def open_model(self, call: Call, model: Model,
                   headers: Iterable[tuple[bytes, bytes]] = ()) -> Model:
        """Phase one for a call of this very version, which a caller holds rather than names
        (a workflow's node, with the workflow request's ``headers``: its tenant):
        ModelNotFound once it is no longer registered, and a refusal (503) now if its queue
        has no room. Its metrics say "default", as the version of a call naming none (as
        TorchServe's node calls)."""
        if not self.registry.holds(model):
            raise ModelNotFound(f"Model {model.name} version {model.version} is no longer "
                                "registered")
        call.model, call.key = model, model.key
        call.version = None
        if model.tenanted:
            self.tenancy.stamp(call.job, headers)
        model.batcher.refuse_if_full(call.job)
        return model

    def send(self, call: Call, headers: Sequence[tuple[bytes, bytes]],
             inputs: Iterable[tuple[str, bytes, str | None]], *,
             deadline_s: float | None = None, loop: asyncio.AbstractEventLoop | None = None,
             weight: int = 1, instances: bool = False,
             tensor_format: worker_pb2.TensorFormat = worker_pb2.TENSOR_FORMAT_NONE,
             sequence_id: str | None = None, explain: bool = False,
             priority: int = 0) -> None:
        """Phase two, once the request is read: build the call's worker request and queue it.

        ``inputs``: (name, bytes, content type or None) for each input; ``deadline_s``: a
        transport's own deadline (gRPC's); ``explain``: the request asks for an explanation
        (/explanations, KServe's explain); ``priority``: the level the body names (KServe
        v2's ``priority`` parameter; 0: none). Raises BadRequest for a bad
        ``X-Request-Timeout``.
        """
        assert call.model is not None, "open first"
        if priority:
            call.job.priority = priority
        timeout_s = self._build(call, headers, inputs, weight, instances, tensor_format,
                                sequence_id, explain)
        if self._timing_on:  # one attribute read per request when off
            call.wants_timing = self.server_timing == timing.ALWAYS or timing.asks(
                call.job.request.headers.get(timing.SERVER_TIMING_REQUEST))
        if deadline_s is not None:
            timeout_s = deadline_s if timeout_s is None else min(timeout_s, deadline_s)
        self._submit(call, timeout_s, loop or asyncio.get_running_loop())

    @staticmethod
    def _build(call: Call, headers: Sequence[tuple[bytes, bytes]],
               inputs: Iterable[tuple[str, bytes, str | None]], weight: int, instances: bool,
               tensor_format: worker_pb2.TensorFormat, sequence_id: str | None,
               explain: bool) -> float | None:
        """Make the call's worker request; returns the client's own deadline (seconds)."""
        request = call.job.request = worker_pb2.Request(
            request_id=new_request_id(), instances=instances, tensor_format=tensor_format)
        call.job.weight = weight
        for raw_name, raw_value in headers:
            request.headers[raw_name.decode("latin-1")] = raw_value.decode("latin-1")
        timeout_s = request_timeout(headers) if REQUEST_TIMEOUT_HEADER in request.headers \
            else None
        if sequence_id is not None:
            request.headers[SEQUENCE_ID_HEADER] = sequence_id
        if explain:
            request.headers[EXPLAIN_HEADER] = "True"
        elif EXPLAIN_HEADER in request.headers:
            # As TorchServe's frontend overrides it: a client's own header makes no prediction
            # an explanation.
            request.headers[EXPLAIN_HEADER] = "False"
        for name, data, content_type in inputs:
            request.inputs[name] = data
            if content_type is not None:
                request.content_types[name] = content_type
        return timeout_s

    def _submit(self, call: Call, timeout_s: float | None,
                loop: asyncio.AbstractEventLoop) -> None:
        """Queue the call's job with its deadline: the model's ``response_timeout``, or the
        client's own when that is sooner. Still queued at its deadline, it is answered 504
        and never reaches a worker; not answered by a worker by then, it is answered 504.

        A request whose client set no deadline may wait in the queue at most the model's
        ``clientTimeoutInMills`` (TorchServe's rule; it drops the request, we answer 504);
        once dispatched it has the rest of ``response_timeout``."""
        model = call.model
        assert model is not None, "open first"
        budget_s = float(model.settings.response_timeout_s)
        queue_s = budget_s
        if model.fair is not None:  # a priority level's timeoutMs, as a client's own
            scheduling = model.fair.scheduling
            level_s = scheduling.timeout_s(scheduling.level_of(call.job.priority))
            if level_s is not None:
                timeout_s = level_s if timeout_s is None else min(timeout_s, level_s)
        if timeout_s is not None:
            budget_s = queue_s = min(budget_s, timeout_s)
        elif model.settings.client_timeout_ms:
            queue_s = min(budget_s, model.settings.client_timeout_ms / 1000)
        job = call.job
        job.budget_s = queue_s
        job.deadline = time.monotonic() + queue_s
        if model.sequences is not None and not job.request.describe:
            call.sequence_id = name_sequence(job.request)
        model.submit(job)
        if queue_s < budget_s:
            call.timer = loop.call_later(queue_s, _expire_queued, call, budget_s - queue_s,
                                         budget_s, loop)
        else:
            call.timer = loop.call_later(budget_s, _expire, job, budget_s)

    async def outcome(self, call: Call, abandoned: asyncio.Future[Any] | None = None
                      ) -> Answer:
        """The call's answer; when ``abandoned`` completes first (the client went away) the
        job is cancelled, so the queue forgets it."""
        if abandoned is not None:
            abandoned.add_done_callback(lambda _: call.job.future.cancel())
        try:
            return await call.job.future
        finally:
            if call.timer is not None:
                call.timer.cancel()

    def end(self, call: Call) -> None:
        """The call ended (once, whatever its outcome): its time is taken and its observers
        are told."""
        if call.ended:
            return
        call.ended = True
        if call.timer is not None:
            call.timer.cancel()
        call.latency_s = time.perf_counter() - call.started
        for observer in self._ended:
            observer(call)

    @staticmethod
    def timing_header(call: Call) -> str | None:
        """The ``Server-Timing`` value for the call's answer, written now (None: the call does
        not want one)."""
        if not call.wants_timing:
            return None
        return timing.job_header(call.job, time.perf_counter() - call.started)

    async def ask(self, model: Model, request: worker_pb2.Request) -> Answer:
        """Send one request of the server's own (a describe) through the model's queue,
        unrecorded: it is not a client's prediction."""
        call = self.begin(Origin("-", "-", "-", "-"), asyncio.get_running_loop())
        call.model, call.key, call.job.request = model, model.key, request
        self._submit(call, None, asyncio.get_running_loop())
        return await self.outcome(call)

    # -- the whole sequence, for the async transports ------------------------------------------

    @contextlib.asynccontextmanager
    async def call(self, origin: Origin) -> AsyncIterator[Call]:
        """A call that is recorded however it ends: the transport sets ``status`` when it
        answers; a ServeError records its status, a cancellation 0 (the client left)."""
        call = self.begin(origin, asyncio.get_running_loop())
        try:
            yield call
        except ServeError as error:
            call.fail(error)
            raise
        except asyncio.CancelledError:
            call.status = 0
            raise
        finally:
            self.end(call)

    async def predict(self, call: Call, name: str, version: str | None,
                      headers: Sequence[tuple[bytes, bytes]],
                      inputs: Iterable[tuple[str, bytes, str | None]], *,
                      abandoned: asyncio.Future[Any] | None = None, **flags: Any) -> Answer:
        """Open, send and await, for a request read whole (``flags`` go to ``send``)."""
        self.open(call, name, version, headers)
        self.send(call, headers, inputs, **flags)
        return await self.outcome(call, abandoned)


def _expire(job: Job, budget_s: float) -> None:
    if not job.future.done():
        job.future.set_exception(expired(budget_s, job.dispatched))


def _expire_queued(call: Call, rest_s: float, budget_s: float,
                   loop: asyncio.AbstractEventLoop) -> None:
    """The queue deadline passed: expire the job if still queued, else give it the rest of
    its whole budget."""
    job = call.job
    if job.dispatched:
        call.timer = loop.call_later(rest_s, _expire, job, budget_s)
    else:
        _expire(job, job.budget_s)
