"""ModelService: one loaded model; turns a PredictBatch into a PredictResult.

A batch is planned into runs (``_plan``): explanations apart from predictions (a handler
explains or predicts a whole batch: TorchServe looks at the first request's header), and,
with a service envelope that does not join requests, one run per request. Each run calls the
handler once: every request of it becomes its rows through its codec (backend/codecs/rows.py:
TorchServe's request, KServe v1 instances, v2 tensors, an envelope), the rows of all go to
the handler together, and each request's results come back through its codec (``_run``).
When the handler raises for a whole run of several requests, the run is re-run in smaller
groups to find the request(s) at fault (``_isolate``), so that the others still get their
predictions; a failure it cannot isolate is raised, and ``backend.errors.classify`` maps it
to an ErrorCode. The runs' answers, handler time and metrics are merged in the batch's order.
It returns messages, never wire bytes.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from backend.codecs import open_inference, v2_outputs
from backend.codecs.envelopes import Envelope, make_envelope
from backend.codecs.rows import (
    Codec,
    EnvelopeCodec,
    InstancesCodec,
    PlainCodec,
    Segment,
    TensorsCodec,
    decode_request,
    encode_result,
    failed,
    is_explanation,
)
from backend.context import (
    SEQUENCE_ID_HEADER,
    Context,
    read_manifest,
    read_model_yaml_config,
)
from backend.errors import (
    HandlerLoadError,
    InvalidInput,
    Unsupported,
    describe,
    is_prediction_exception,
)
from backend.metrics.cache import MetricsCacheYamlImpl
from backend.metrics.errors import MetricsCacheKeyError, MetricsCacheValueError
from backend.metrics.sink import DEFAULT_SINK, MetricSink
from backend.service import sagemaker, workflow_functions
from backend.service.loader import (
    EntryPoint,
    add_dependency_dirs,
    load_entry_point,
    one_result_each,
)
from backend.service.phases import instrument
from protos import worker_pb2

__all__ = ["ModelService", "Prepared", "encode_result", "load_service"]

logger = logging.getLogger(__name__)

#: Re-running a failed run in groups stops after this share of the response timeout (from
#: the batch's start), leaving the rest to answer in time...
ISOLATION_TIME_SHARE = 0.5
#: ...or once it has re-run this many times the batch's requests.
ISOLATION_WORK = 3


class ModelService:
    """Runs batches through one initialised handler entry point."""

    def __init__(
        self, entry_point: EntryPoint, context: Context, *, decode_input_request: bool = True,
        model_version: str = "", response_timeout_s: float = 120.0,
        envelope: Envelope | None = None,
    ) -> None:
        self.entry_point = entry_point
        self.context = context
        #: service_envelope: every request's body is unwrapped into rows, its results wrapped.
        self.envelope = envelope
        self.decode_input_request = decode_input_request
        self.model_version = model_version
        self.response_timeout_s = response_timeout_s
        #: v2 output datatypes declared in model-config.yaml (``outputs``).
        self.declared_outputs = v2_outputs.declared_datatypes(context.model_yaml_config)
        # The handler's optional steps, looked up once: a step ahead of the batch (both
        # halves, or neither) and TorchServe's describe_handle().
        handler = getattr(entry_point.handle, "__self__", None)
        prepare_batch = _method(handler, "prepare_batch")
        handle_prepared = _method(handler, "handle_prepared")
        self._ahead = ((prepare_batch, handle_prepared)
                       if prepare_batch and handle_prepared and envelope is None else None)
        self._describe_handle = _method(handler, "describe_handle")
        #: Times the handler's preprocess/inference/postprocess (None: it has not all three,
        #: and its whole time is reported as its inference: backend/service/phases.py).
        self._steps = instrument(handler)
        #: One of our built-in handlers: it does not time itself, and TorchServe's built-in
        #: handlers report HandlerTime, so the service reports it for them.
        self._builtin = type(handler).__module__.startswith("backend.handlers.")
        name = entry_point.name
        self._plain = PlainCodec(decode_input_request, name)
        self._instances = InstancesCodec(name)
        self._tensors = TensorsCodec(name, self.declared_outputs, model_version)
        self._enveloped = (EnvelopeCodec(envelope, decode_input_request, name)
                           if envelope is not None else None)

    def prepare(self, batch: worker_pb2.PredictBatch) -> Prepared | None:
        """What of ``batch`` can be done ahead, while the batch before it runs (the worker's
        reader thread calls this): its requests decoded and, for a handler with a
        ``prepare_batch`` step (the vision handlers: images decoded and moved to the model's
        device), that step. None when there is nothing to do ahead of time."""
        if self._ahead is None or any(
                r.describe or r.instances or r.tensor_format or is_explanation(r)
                for r in batch.requests):
            return None
        start = time.perf_counter()
        data = [decode_request(r, decode=self.decode_input_request) for r in batch.requests]
        staged = self._ahead[0](data)
        return Prepared(data, staged, (time.perf_counter() - start) * 1000.0)

    # -- plan, run, merge ---------------------------------------------------------------------

    def predict(self, batch: worker_pb2.PredictBatch, prepared: Prepared | None = None
                ) -> worker_pb2.PredictResult:
        """Run one batch (``prepared`` by ``prepare``, or not). Raises when a run failed as a
        whole and the failure could not be pinned on some of its requests (see
        ``errors.classify``)."""
        requests = list(batch.requests)
        described, predicted, explained = [], [], []
        stateful = False
        for request in requests:  # one pass: protobuf fields are slow to read
            if request.describe:
                described.append(request)
            elif is_explanation(request):
                explained.append(request)
            else:
                predicted.append(request)
            stateful = stateful or SEQUENCE_ID_HEADER in request.headers
        isolation = _Isolation(
            work_left=ISOLATION_WORK * len(requests),
            deadline=time.monotonic() + ISOLATION_TIME_SHARE * self.response_timeout_s,
            # A stateful handler's request must not run twice (its state would count it
            # twice): a sequence's batch fails as a whole, as in TorchServe.
            allowed=len(requests) >= 2 and not described and not stateful)
        runs = self._plan(predicted, explained)
        if not described and len(runs) == 1:  # the common batch: one run, nothing to merge
            return self._run_isolated(runs[0], prepared, isolation).result(
                batch.batch_id, requests)
        merged = self._describe(described)
        for run in runs:
            merged.add(self._run_isolated(run, None, isolation))
        return merged.result(batch.batch_id, requests)

    def _plan(self, predicted: list[worker_pb2.Request], explained: list[worker_pb2.Request]
              ) -> list[list[worker_pb2.Request]]:
        """The runs of a batch: its predictions, then its explanations; one per request with
        an envelope that does not join requests."""
        if self._enveloped is not None and not self._enveloped.envelope.joins_requests:
            return [[request] for request in (*predicted, *explained)]
        return [part for part in (predicted, explained) if part]

    def _run_isolated(self, run: list[worker_pb2.Request], prepared: Prepared | None,
                      isolation: _Isolation) -> _Merged:
        try:
            return self._run(run, prepared)
        except Exception as exc:
            if not isolation.allowed or self.context.partials_sent:
                raise
            return self._isolate(run, exc, isolation)

    def _isolate(self, run: list[worker_pb2.Request], error: Exception, isolation: _Isolation
                 ) -> _Merged:
        """The handler raised for the whole run: re-run its requests in halves, and halves
        of the halves that fail, down to single requests, so that each good request gets its
        prediction and only the request at fault its error (TorchServe fails them all).

        The extra work is capped: the requests re-run add up to at most ISOLATION_WORK times
        the batch (one bad request among 8 re-runs 4 + 4 + 2 + 2 + 1 + 1 = 14 requests, two
        among 8 at most 24), and nothing is re-run after ISOLATION_TIME_SHARE of the response
        timeout; requests still grouped then get their group's error. A group that streamed
        intermediate responses is not re-run.
        """
        merged = _Merged()
        if len(run) == 1:
            merged.fail(run, error, self.entry_point.name)
            return merged
        logger.warning("%s failed a batch of %d requests (%s); re-running it in smaller groups "
                       "to find the request(s) at fault", self.entry_point.name, len(run),
                       describe(error))
        pending = deque((half, error) for half in _halves(run))
        while pending:
            group, group_error = pending.popleft()
            if len(group) > isolation.work_left or time.monotonic() >= isolation.deadline:
                merged.fail(group, group_error, self.entry_point.name)
                continue
            isolation.work_left -= len(group)
            try:
                merged.add(self._run(group, None))
            except Exception as exc:
                if len(group) == 1 or self.context.partials_sent:
                    merged.fail(group, exc, self.entry_point.name)
                else:
                    pending.extend((half, exc) for half in _halves(group))
        return merged

    def _run(self, run: list[worker_pb2.Request], prepared: Prepared | None) -> _Merged:
        """Call the handler once on the rows of ``run``'s requests; their answers."""
        segments = [Segment(request, self._codec_for(request)) for request in run]
        rows: list[Any] = []
        ids: list[str] = []
        headers: list[Mapping[str, str]] = []
        plain = True  # TorchServe's requests only: the common run, with no v2 parameters
        for index, segment in enumerate(segments):
            request = segment.request
            plain = plain and segment.codec is self._plain
            try:
                if prepared is not None:
                    segment.rows = [prepared.data[index]]
                else:
                    segment.codec.decode(segment)
            except InvalidInput as exc:
                segment.error, segment.rows = exc, []
            segment.start = len(rows)
            rows.extend(segment.rows)
            count = len(segment.rows)
            ids.extend([request.request_id] * count)
            headers.extend([dict(request.headers)] * count)
        merged = _Merged()
        if not rows:  # nothing could be decoded: the handler is not called
            for segment in segments:
                merged.fail([segment.request], segment.error or InvalidInput("no rows"),
                            self.entry_point.name)
            return merged
        context = self.context
        context.begin_batch(ids, headers)
        tensors = [] if plain else [s for s in segments if s.codec is self._tensors
                                    and s.tensors is not None and s.error is None]
        if tensors:
            self._merge_parameters(tensors)
        results, merged.handler_time_ms = self._handle(rows, "requests" if plain else "rows",
                                                       prepared)
        self._time_steps(merged, prepared)
        if tensors:
            self._split_parameters(tensors)
        answers = merged.answers
        for segment in segments:
            if segment.error is not None:
                merged.fail([segment.request], segment.error, self.entry_point.name)
            else:
                items = results[segment.start:segment.start + len(segment.rows)]
                answers[id(segment.request)] = segment.codec.encode(segment, items, context)
        merged.metrics = self.drain_metrics()
        return merged

    def _time_steps(self, merged: _Merged, prepared: Prepared | None) -> None:
        """Where the handler's time on a run went: its steps, as timed; else all of it as
        inference (preprocessing done ahead counts as preprocess either way)."""
        clock = self._steps
        if clock is not None and clock.called:
            seconds = clock.seconds
            merged.preprocess_ms = seconds[0] * 1000.0
            merged.inference_ms = seconds[1] * 1000.0
            merged.postprocess_ms = seconds[2] * 1000.0
            merged.steps = True
        else:
            merged.inference_ms = merged.handler_time_ms
        if prepared is not None:
            merged.preprocess_ms += prepared.prepare_ms
            merged.steps = True

    def drain_metrics(self) -> list[worker_pb2.Metric]:
        """The metric values reported since the last drain (through ``context.metrics`` and
        through metric objects of the handler's own), to send to the frontend."""
        sink = getattr(self.context.metrics, "sink", None)
        drained = sink.drain() if isinstance(sink, MetricSink) else []
        if DEFAULT_SINK:
            drained.extend(DEFAULT_SINK.drain())
        return drained

    def _codec_for(self, request: worker_pb2.Request) -> Codec:
        if self._enveloped is not None:
            return self._enveloped
        if request.instances:
            return self._instances
        if request.tensor_format:
            return self._tensors
        return self._plain

    def _merge_parameters(self, tensors: list[Segment]) -> None:
        """The v2 requests' parameters as the handler reads them: merged into lists
        (MLServer's rule), the request's and each input's."""
        requests = [s.tensors for s in tensors if s.tensors is not None]
        self.context.request_parameters = open_inference.merge_parameters(
            [t.parameters for t in requests])
        by_input: dict[str, list[dict[str, Any]]] = {}
        for request in requests:
            for tensor in request.inputs:
                by_input.setdefault(tensor.name, []).append(tensor.parameters)
        self.context.input_parameters = {
            name: open_inference.merge_parameters(values) for name, values in by_input.items()}

    def _split_parameters(self, tensors: list[Segment]) -> None:
        """The output parameters the handler set, split back per v2 request."""
        outputs = {name: open_inference.split_parameters(values, len(tensors))
                   for name, values in self.context.output_parameters.items()}
        for position, segment in enumerate(tensors):
            segment.output_parameters = {name: parts[position]
                                         for name, parts in outputs.items()}

    def _handle(self, data: list[Any], unit: str, prepared: Prepared | None
                ) -> tuple[list[Any], float]:
        """Call the handler once on ``data`` (or on what ``prepare`` made of it); one result
        per item, and the time it took."""
        if self._steps is not None:
            self._steps.reset()
        start = time.perf_counter()
        try:
            if prepared is None or self._ahead is None:
                results = self.entry_point.handle(data, self.context)
            else:
                results = self._ahead[1](prepared.staged, self.context)
        except Exception as exc:
            if not (is_prediction_exception(exc) or isinstance(exc, Unsupported)):
                raise
            # TorchServe's PredictionException(message, error_code) fails every request of the
            # batch with the handler's own HTTP status, so keep it per request (and the 501 of
            # an explanation the handler cannot give).
            logger.warning("%s raised %s", self.entry_point.name, describe(exc))
            results = [exc] * len(data)
        handler_time_ms = (time.perf_counter() - start) * 1000.0
        metrics = self.context.metrics
        if self._builtin:
            metrics.add_time("HandlerTime", round(handler_time_ms, 2), None, "ms")
        metrics.add_time("PredictionTime", round(handler_time_ms, 2))
        return one_result_each(results, len(data), self.entry_point.name, unit), handler_time_ms

    def _describe(self, requests: list[worker_pb2.Request]) -> _Merged:
        """Describe requests, answered with the handler's ``describe_handle()`` (TorchServe's
        ``?customized=true``)."""
        merged = _Merged()
        if not requests:
            return merged
        metadata = self._describe_handle() if self._describe_handle is not None else {}
        body, content_type = encode_result(metadata)
        for request in requests:
            merged.answers[id(request)] = worker_pb2.Response(
                request_id=request.request_id, status=200, body=body, content_type=content_type)
        return merged


def load_service(message: worker_pb2.LoadModel) -> ModelService:
    """Build the context, import and initialise the handler named by a LOAD message."""
    model_dir = Path(message.model_dir)
    if not model_dir.is_dir():
        raise HandlerLoadError(f"model directory {model_dir} does not exist")
    manifest = read_manifest(message.manifest_json)
    metrics = model_metrics(message.metrics_config, message.model_name)
    # NOTE: read the YAML config before the model directory joins sys.path, so that the lazy
    # `import yaml` cannot pick up a yaml.py shipped in the archive.
    context = Context(
        model_name=message.model_name,
        model_dir=str(model_dir),
        manifest=manifest,
        batch_size=message.batch_size,
        gpu=message.gpu_id if message.gpu_id >= 0 else None,
        mms_version=message.server_version,
        limit_max_image_pixels=message.limit_max_image_pixels,
        model_yaml_config=read_model_yaml_config(model_dir, manifest),
        cpu_threads=message.cpu_threads or None,
        metrics=metrics,
    )
    add_dependency_dirs(message.dependency_dirs)
    entry_point = sagemaker.adapt(load_entry_point(message.handler, model_dir, context), context)
    if message.workflow_function:
        entry_point = workflow_functions.adapt(entry_point)
    return ModelService(entry_point, context, decode_input_request=message.decode_input_request,
                        model_version=message.model_version,
                        response_timeout_s=message.response_timeout_ms / 1000 or 120.0,
                        envelope=make_envelope(message.envelope, context))


def model_metrics(metrics_config: str, model_name: str) -> MetricsCacheYamlImpl:
    """The handler's ``context.metrics``, as TorchServe's worker makes it: the model metrics
    of the server's metrics configuration (``metrics_config``; "" declares none), and a
    request id of its own while the model loads, so that what ``initialize`` reports carries
    ``ModelName`` and ``Level:Model``."""
    if not metrics_config:
        cache = MetricsCacheYamlImpl.without_config()
    else:
        cache = MetricsCacheYamlImpl(metrics_config)
        try:
            cache.initialize_cache()
        except (MetricsCacheKeyError, MetricsCacheValueError) as exc:
            # TorchServe's worker would not start; the frontend checked the file already, so
            # this is a configuration without model metrics: none are declared.
            logger.warning("%s declares no model metrics (%s)", metrics_config, exc)
    cache.model_name = model_name
    cache.set_request_ids(str(uuid.uuid4()))
    return cache


@dataclass(frozen=True, slots=True)
class Prepared:
    """A batch as far as it could be taken ahead: its requests as the handler sees them, and
    what the handler's ``prepare_batch`` made of them."""

    data: list[Any]
    staged: Any
    #: How long it took, in ms (it counts as the batch's preprocess).
    prepare_ms: float = 0.0


@dataclass(slots=True)
class _Isolation:
    """What is left of a batch's budget for re-running requests (``ModelService._isolate``)."""

    work_left: int
    deadline: float
    #: False: no request of this batch may run twice (one request, a describe, a sequence).
    allowed: bool


@dataclass(slots=True)
class _Merged:
    """Answers of some of a batch's requests, with the handler time and metrics they took.

    Keyed by the request objects of the batch's one list (``predict``'s): request ids may
    repeat."""

    answers: dict[int, worker_pb2.Response] = field(default_factory=dict)
    handler_time_ms: float = 0.0
    metrics: list[worker_pb2.Metric] = field(default_factory=list)
    #: The handler's steps (backend/service/phases.py), in ms; ``steps`` False: only its whole time,
    #: as ``inference_ms``.
    steps: bool = False
    preprocess_ms: float = 0.0
    inference_ms: float = 0.0
    postprocess_ms: float = 0.0

    def add(self, other: _Merged) -> None:
        self.answers.update(other.answers)
        self.handler_time_ms += other.handler_time_ms
        self.metrics.extend(other.metrics)
        self.steps = self.steps or other.steps
        self.preprocess_ms += other.preprocess_ms
        self.inference_ms += other.inference_ms
        self.postprocess_ms += other.postprocess_ms

    def fail(self, requests: Iterable[worker_pb2.Request], error: BaseException,
             handler: str) -> None:
        for request in requests:
            self.answers[id(request)] = failed(
                worker_pb2.Response(request_id=request.request_id), error, handler)

    def result(self, batch_id: int, requests: list[worker_pb2.Request]
               ) -> worker_pb2.PredictResult:
        """The batch's result: one response per request, in the batch's order."""
        result = worker_pb2.PredictResult(
            batch_id=batch_id, handler_time_ms=self.handler_time_ms, metrics=self.metrics,
            responses=[self.answers[id(request)] for request in requests])
        # Set in place, zeros left out: a message built and copied in costs more per batch.
        phases = result.phases
        phases.inference_ms = self.inference_ms
        if self.steps:
            phases.steps = True
            phases.preprocess_ms = self.preprocess_ms
            phases.postprocess_ms = self.postprocess_ms
        return result


def _method(owner: object, name: str) -> Callable[..., Any] | None:
    """``owner``'s method ``name``, if it has one."""
    method = getattr(owner, name, None)
    return method if callable(method) else None


def _halves(requests: list[worker_pb2.Request]) -> list[list[worker_pb2.Request]]:
    middle = len(requests) // 2
    return [requests[:middle], requests[middle:]]
