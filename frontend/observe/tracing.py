"""OpenTelemetry traces of predictions: optional (``otel_traces=true``, or the standard
``OTEL_TRACES_EXPORTER=otlp``), with the ``otel`` extra installed (docs/batches.md, "Traces").

Only ``server.py`` imports this module, and only when tracing is on: a server without it
imports no OpenTelemetry module and subscribes no tracing to any event, so neither its
requests nor its batches pay anything for it.

The spans are made after the fact, from the facts the serving core publishes
(frontend/observe/events.py), so nothing is timed twice and no span is open while a request
waits:

* when a batch ended with a reply (``batch_ended``), its own span ``batch {model}`` (a root: a
  batch serves requests of many traces) from the moment it left the queue to its reply; what
  it was is kept by the batch (weakly) for its requests' spans;
* when a request ends (``call_ended``), its span (kind SERVER; a child of the caller's context
  when its headers or gRPC metadata carry a W3C ``traceparent``, with its ``tracestate``),
  linked to its batch's span, with three children: ``queue`` (waiting to be dispatched),
  ``batch`` (its time in its batch: sent to the worker until the reply is read) and
  ``worker`` (the handler's time on the batch, as the worker reports it, ending at the
  reply).

Spans leave through the SDK's ``BatchSpanProcessor``: a background thread exports them over
OTLP (HTTP or gRPC), off the event loop; when its queue is full, spans are dropped, never
waited for.
"""

from __future__ import annotations

import logging
import random
import re
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import DEFAULT_ON, Decision
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import (
    Link,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
    TraceState,
)

from frontend import __version__
from frontend.errors import ConfigError
from frontend.observe.events import Batch, CallFacts, JobFacts, ModelKey, Observers
from protos import worker_pb2

if TYPE_CHECKING:
    from frontend.config import ServerConfig

logger = logging.getLogger(__name__)

#: The longest a stopping server waits for its last spans to be exported.
CLOSE_TIMEOUT_S = 5.0
#: The instrumentation scope the spans are reported under.
SCOPE = "batchserve"
#: Attribute names (ours under ``batchserve.``; the HTTP and RPC ones are OpenTelemetry's).
MODEL = "batchserve.model.name"
VERSION = "batchserve.model.version"
BATCH_ID = "batchserve.batch.id"
BATCH_SIZE = "batchserve.batch.size"
BATCH_REQUESTS = "batchserve.batch.requests"
REQUEST_ID = "batchserve.request.id"
STATUS = "batchserve.response.status"
HANDLER_MS = "batchserve.handler_time_ms"


@dataclass(frozen=True, slots=True)
class BatchTrace:
    """A batch's span and times, as its requests' spans read them."""

    #: Its span (None: not sampled, so its requests link to nothing, and still show their
    #: time in it).
    context: SpanContext | None
    #: When it left the queue, and when its reply was read (ns since the epoch).
    sent_ns: int
    replied_ns: int
    #: The handler's time on it, as the worker reports it (0: failed as a whole).
    handler_ms: float


class _Clock:
    """Times of time.monotonic() and time.perf_counter(), in ns since the epoch (what spans
    carry), read against one reading of each clock."""

    __slots__ = ("monotonic", "perf", "wall_ns")

    def __init__(self) -> None:
        self.wall_ns = time.time_ns()
        self.monotonic = time.monotonic()
        self.perf = time.perf_counter()

    def of_monotonic(self, at: float) -> int:
        return self.wall_ns - int((self.monotonic - at) * 1e9)

    def of_perf(self, at: float) -> int:
        return self.wall_ns - int((self.perf - at) * 1e9)


#: W3C Trace Context's traceparent: version, trace id, parent id, flags (lower-case hex); a
#: later version may append fields.
_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?")
_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
_UNSET = Status(StatusCode.UNSET)


def caller_context(headers: Mapping[str, str]) -> SpanContext | None:
    """The caller's span in a request's ``traceparent`` (and ``tracestate``), as W3C Trace
    Context reads them; None when there is none, or it is malformed (the request then starts
    a trace of its own)."""
    value = headers.get("traceparent")
    if value is None:
        return None
    match = _TRACEPARENT.fullmatch(value.strip())
    if match is None:
        return None
    version, trace_id, span_id, flags, rest = match.groups()
    if version == "ff" or (version == "00" and rest) or trace_id == "0" * 32 or \
            span_id == "0" * 16:
        return None
    state = headers.get("tracestate")
    return SpanContext(int(trace_id, 16), int(span_id, 16), is_remote=True,
                       trace_flags=TraceFlags(int(flags, 16) & TraceFlags.SAMPLED),
                       trace_state=TraceState.from_header([state]) if state else None)


class Tracing:
    """The server's spans, made finished (``ReadableSpan``: the SDK's own Tracer would open
    each span, lock its attributes and run its processors, for four spans per request that
    are all known at once) and handed to a ``BatchSpanProcessor``. The sampler is the SDK's
    (``OTEL_TRACES_SAMPLER``; by default the caller's decision, else sampled), asked once per
    request and per batch; a request's children share its decision."""

    def __init__(self, exporter: SpanExporter, resource: Resource | None = None) -> None:
        # The provider is made for what the SDK reads from OpenTelemetry's variables (the
        # sampler); its tracer is not used. Nothing is registered globally: several servers
        # can run in one process.
        provider = TracerProvider(resource=resource or service_resource(),
                                  shutdown_on_exit=False)
        self._resource = provider.resource
        self._sampler = provider.sampler
        self._scope = InstrumentationScope(SCOPE, __version__)
        self._processor = BatchSpanProcessor(exporter)
        #: What each batch's span was, for its requests' spans, while the batch is alive.
        self._batches: weakref.WeakKeyDictionary[Batch, BatchTrace] = \
            weakref.WeakKeyDictionary()
        _quieten_drops()

    def _sampled(self, parent: SpanContext | None, trace_id: int, name: str,
                 kind: SpanKind) -> tuple[bool, TraceState | None]:
        """The sampler's decision for a new span, and the trace state it carries."""
        if self._sampler is DEFAULT_ON:  # parent-based, always on: no need to ask
            return (parent.trace_flags.sampled if parent is not None else True,
                    parent.trace_state if parent is not None else None)
        decision = self._sampler.should_sample(
            trace.set_span_in_context(trace.NonRecordingSpan(parent))
            if parent is not None else None, trace_id, name, kind)
        return decision.decision is Decision.RECORD_AND_SAMPLE, decision.trace_state

    def _sampled_caller(self, job: JobFacts, name: str) -> bool:
        """Whether the job's request is sampled for its caller's sake (a caller that traces
        gets the batch its request rode in, whatever the sampler says of batches)."""
        if "traceparent" not in job.request.headers:
            return False
        caller = caller_context(job.request.headers)
        return caller is not None and \
            self._sampled(caller, caller.trace_id, name, SpanKind.SERVER)[0]

    def _emit(self, name: str, context: SpanContext, parent: SpanContext | None,
              kind: SpanKind, start_ns: int, end_ns: int, attributes: dict[str, Any],
              links: Sequence[Link] = (), status: Status = _UNSET) -> None:
        self._processor.on_end(ReadableSpan(
            name, context, parent, self._resource, attributes, (), links, kind, None, status,
            start_ns, end_ns, self._scope))

    def subscribe(self, observers: Observers) -> None:
        """Trace every batch that ended with a reply, and every call."""
        observers.batch_ended.append(self.batch_ended)
        observers.call_ended.append(self.call_ended)

    def batch_ended(self, key: ModelKey, batch: Batch, jobs: Sequence[JobFacts],
                    result: worker_pb2.PredictResult | None) -> None:
        """A batch ended (``result`` None: it failed as a whole): its span when its worker
        replied, kept by the batch for its requests' spans. (Never raises: it runs as the
        batch's answers are delivered.)"""
        try:
            # A describe (the server's own request, no client's) is no prediction to trace.
            if batch.replied and jobs and not jobs[0].request.describe:
                self._batch(key, batch, jobs, result)
        except Exception:
            logger.exception("tracing a batch of %s failed", key[0])

    def _batch(self, key: ModelKey, batch: Batch, jobs: Sequence[JobFacts],
               result: worker_pb2.PredictResult | None) -> None:
        clock = _Clock()
        first = jobs[0]
        trace_id = _new_trace_id()
        name = f"batch {key[0]}"
        sampled, state = self._sampled(None, trace_id, name, SpanKind.INTERNAL)
        sent_ns = clock.of_monotonic(batch.left_at)
        replied_ns = clock.of_monotonic(batch.ended_at)
        handler_ms = result.handler_time_ms if result is not None else 0.0
        context = None
        if sampled or any(self._sampled_caller(job, name) for job in jobs):
            context = SpanContext(trace_id, _new_span_id(), False, _SAMPLED, state)
            self._emit(name, context, None, SpanKind.INTERNAL, sent_ns, replied_ns, {
                MODEL: key[0], VERSION: key[1], BATCH_ID: first.batch_id,
                BATCH_SIZE: batch.items, BATCH_REQUESTS: len(jobs), HANDLER_MS: handler_ms},
                status=_UNSET if result is not None else
                Status(StatusCode.ERROR, "the batch failed as a whole"))
        self._batches[batch] = BatchTrace(context, sent_ns, replied_ns, handler_ms)

    def call_ended(self, call: CallFacts) -> None:
        """A request ended (its status 0 when the client left first): its span and children.
        (Never raises: the request is answered already.) A workflow's request has no span of
        its own: its node calls have theirs."""
        if call.workflow is not None:
            return
        try:
            self._request(call)
        except Exception:
            logger.exception("tracing a request failed")

    def _request(self, call: CallFacts) -> None:
        job, key, origin, status = call.job, call.key, call.origin, call.status
        request = job.request
        parent = caller_context(request.headers) if "traceparent" in request.headers else None
        trace_id = parent.trace_id if parent is not None else _new_trace_id()
        # Named by method and path once the path named a model (a name the server knows, not
        # whatever a client sent), else by the method alone: few names, as OpenTelemetry asks.
        method = origin.method
        name = f"{method} {origin.path}" if key is not None else method
        sampled, state = self._sampled(parent, trace_id, name, SpanKind.SERVER)
        if not sampled:
            return
        clock = _Clock()
        start_ns = clock.of_perf(call.started)
        end_ns = clock.of_perf(call.started + call.latency_s)
        batch = job.batch
        noted = self._batches.get(batch) if batch is not None else None
        links = (Link(noted.context),) if noted is not None and noted.context else ()
        attributes = _request_attributes(call)
        context = SpanContext(trace_id, _new_span_id(), False, _SAMPLED, state)
        self._emit(name, context, parent, SpanKind.SERVER, start_ns, end_ns, attributes, links,
                   _UNSET if 0 < status < 500 else Status(
                       StatusCode.ERROR, "the client left before its answer" if status == 0
                       else f"answered {status}"))
        if job.enqueued_at:
            left_ns = clock.of_monotonic(batch.left_at) if batch is not None else end_ns
            self._child("queue", context, clock.of_monotonic(job.enqueued_at), left_ns, {})
        if noted is not None:
            self._child("batch", context, noted.sent_ns, noted.replied_ns,
                        {BATCH_ID: job.batch_id, BATCH_SIZE: job.batch_size}, links)
            if noted.handler_ms:
                self._child("worker", context, noted.replied_ns - int(noted.handler_ms * 1e6),
                            noted.replied_ns, {HANDLER_MS: noted.handler_ms})

    def _child(self, name: str, parent: SpanContext, start_ns: int, end_ns: int,
               attributes: dict[str, Any], links: Sequence[Link] = ()) -> None:
        context = SpanContext(parent.trace_id, _new_span_id(), False, _SAMPLED,
                              parent.trace_state)
        self._emit(name, context, parent, SpanKind.INTERNAL, start_ns, end_ns, attributes,
                   links)

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Export what is left and stop the exporter, waiting at most ``timeout_s``: a
        receiver that is away (the exporter retries for up to its own timeout) must not hold
        up the server's stop. Blocking: run it off the event loop."""
        closing = threading.Thread(target=self._processor.shutdown, name="otel-close",
                                   daemon=True)
        closing.start()
        closing.join(timeout_s)
        if closing.is_alive():
            logger.warning("tracing: the spans still waiting to be exported were dropped (the "
                           "OTLP receiver did not take them within %g s)", timeout_s)


#: The SDK's span processor logs a warning for every span it drops (its queue full: the
#: receiver is slow or away), a flood under load; this logger is where it does.
_DROPS_LOGGER = "opentelemetry.sdk._shared_internal"
#: At most one such warning per this many seconds.
DROP_WARNING_EVERY_S = 60.0


class _OncePerInterval(logging.Filter):
    """Lets a repeated message through once per ``every_s``, saying how many it held back."""

    def __init__(self, every_s: float) -> None:
        super().__init__()
        self._every_s = every_s
        self._last = -every_s
        self._held = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING or "dropping" not in str(record.msg):
            return True
        now = time.monotonic()
        if now - self._last < self._every_s:
            self._held += 1
            return False
        if self._held:
            record.msg = f"{record.msg} ({self._held} more spans dropped since the last warning)"
        self._last, self._held = now, 0
        return True


def _request_attributes(call: CallFacts) -> dict[str, Any]:
    """The attributes of a request's span: its answer, its HTTP request or RPC, its model
    version, its id and its batch."""
    origin, status, job = call.origin, call.status, call.job
    attributes: dict[str, Any] = {STATUS: status}
    if origin.method == "gRPC":
        attributes["rpc.system"] = "grpc"
    else:
        attributes["http.request.method"] = origin.method
        attributes["url.path"] = origin.path
        attributes["network.protocol.version"] = origin.protocol.removeprefix("HTTP/")
        if status:
            attributes["http.response.status_code"] = status
    if call.key is not None:
        attributes[MODEL], attributes[VERSION] = call.key
    if job.request.request_id:
        attributes[REQUEST_ID] = job.request.request_id
    if job.batch is not None:
        attributes[BATCH_ID] = job.batch_id
        attributes[BATCH_SIZE] = job.batch_size
    return attributes


def _quieten_drops() -> None:
    target = logging.getLogger(_DROPS_LOGGER)
    if not any(isinstance(f, _OncePerInterval) for f in target.filters):
        target.addFilter(_OncePerInterval(DROP_WARNING_EVERY_S))


def _new_trace_id() -> int:
    """A random trace id (never the invalid 0), as the SDK's RandomIdGenerator makes it."""
    return random.getrandbits(128) or 1


def _new_span_id() -> int:
    return random.getrandbits(64) or 1


def service_resource(environ: Mapping[str, str] | None = None) -> Resource:
    """The resource the spans come from: OpenTelemetry's own (``OTEL_SERVICE_NAME``,
    ``OTEL_RESOURCE_ATTRIBUTES``), named ``batchserve`` where they name no service."""
    resource = Resource.create({"service.version": __version__})
    name = resource.attributes.get("service.name")
    if not isinstance(name, str) or name.startswith("unknown_service"):
        resource = resource.merge(Resource({"service.name": SCOPE}))
    return resource


def otlp_exporter(config: ServerConfig, environ: Mapping[str, str]) -> SpanExporter:
    """The OTLP exporter ``config`` asks for (``otel_exporter_otlp_protocol`` and
    ``_endpoint``, else OpenTelemetry's own variables, which the exporters read)."""
    protocol = (config.otel_exporter_otlp_protocol
                or environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "").strip()
                or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "").strip() or "http/protobuf")
    endpoint = config.otel_exporter_otlp_endpoint or None
    if protocol == "grpc":
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
                OTLPSpanExporter as GrpcExporter,
            )
        except ImportError as exc:
            raise ConfigError(f"OTLP over gRPC needs the otel extra (pip install "
                              f"'batchserve[otel]'): {exc}") from None
        return GrpcExporter(endpoint=endpoint)
    if protocol != "http/protobuf":
        raise ConfigError(f"OTLP protocol {protocol!r}: expected http/protobuf or grpc")
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
            OTLPSpanExporter as HttpExporter,
        )
    except ImportError as exc:
        raise ConfigError(f"OTLP over HTTP needs the otel extra (pip install "
                          f"'batchserve[otel]'): {exc}") from None
    return HttpExporter(endpoint=endpoint.rstrip("/") + "/v1/traces" if endpoint else None)


def start_tracing(config: ServerConfig, environ: Mapping[str, str]) -> Tracing:
    """The server's tracing, exporting where ``config`` says."""
    exporter = otlp_exporter(config, environ)
    logger.info("tracing is on: spans are exported over OTLP by %s", type(exporter).__module__)
    return Tracing(exporter)
