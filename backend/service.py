"""ModelService: one loaded model; turns a PredictBatch into a PredictResult.

It decodes the inputs as TorchServe does, calls the handler once per batch, checks that it
returned one result per request and encodes each result. It returns messages, never wire
bytes. When the handler raises for a whole batch of several requests, the batch is re-run in
smaller groups to find the request(s) at fault (``_isolate``), so that the others still get
their predictions; a failure it cannot isolate is raised, and ``backend.errors.classify``
maps it to an ErrorCode. Requests that ask for explanations (TorchServe's ``explain`` header)
and predictions that share a batch run as two batches (``_apart``).
"""

from __future__ import annotations

import io
import json
import logging
import sys
import time
from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from backend import open_inference
from backend.context import (
    CONTENT_TYPE,
    EXPLAIN_HEADER,
    SEQUENCE_ID_HEADER,
    Context,
    read_manifest,
    read_model_yaml_config,
)
from backend.envelopes import Envelope, Unwrapped, grpc_answer, make_envelope, v2_document
from backend.errors import (
    BatchSizeMismatch,
    HandlerLoadError,
    InvalidHandlerOutput,
    InvalidInput,
    Unsupported,
    describe,
    is_prediction_exception,
    request_message,
    request_status,
)
from backend.loader import EntryPoint, add_dependency_dirs, load_entry_point
from protos import worker_pb2

logger = logging.getLogger(__name__)

BODY = "body"
OCTET_STREAM = "application/octet-stream"
TEXT_PLAIN = "text/plain; charset=utf-8"
APPLICATION_JSON = "application/json"
#: Re-running a failed batch in groups stops after this share of the response timeout (from
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
        self.declared_outputs = open_inference.declared_datatypes(context.model_yaml_config)

    def prepare(self, batch: worker_pb2.PredictBatch) -> Prepared | None:
        """What of ``batch`` can be done ahead, while the batch before it runs (the worker's
        reader thread calls this): its requests decoded and, for a handler with a
        ``prepare_batch`` step (the vision handlers: images decoded and moved to the model's
        device), that step. None when there is nothing to do ahead of time."""
        handler = getattr(self.entry_point.handle, "__self__", None)
        stage = getattr(handler, "prepare_batch", None)
        if (not callable(stage) or not callable(getattr(handler, "handle_prepared", None))
                or self.envelope is not None) or any(
                r.describe or r.instances or r.tensor_format or is_explanation(r)
                for r in batch.requests):
            return None
        data = [decode_request(r, decode=self.decode_input_request) for r in batch.requests]
        return Prepared(data, stage(data))

    def predict(self, batch: worker_pb2.PredictBatch, prepared: Prepared | None = None
                ) -> worker_pb2.PredictResult:
        """Run one batch (``prepared`` by ``prepare``, or not). Raises when the whole batch
        failed and the failure could not be pinned on some of its requests (see
        ``errors.classify``)."""
        started = time.monotonic()
        try:
            return self._predict(batch, prepared)
        except Exception as exc:
            if (len(batch.requests) < 2 or self.context.partials_sent
                    or any(r.describe or SEQUENCE_ID_HEADER in r.headers
                           for r in batch.requests)):
                # A stateful handler's request must not run twice (its state would count it
                # twice): a sequence's batch fails as a whole, as in TorchServe.
                raise
            return self._isolate(batch, exc, started + ISOLATION_TIME_SHARE
                                 * self.response_timeout_s)

    def _isolate(self, batch: worker_pb2.PredictBatch, error: Exception,
                 deadline: float) -> worker_pb2.PredictResult:
        """The handler raised for the whole batch: re-run its requests in halves, and halves
        of the halves that fail, down to single requests, so that each good request gets its
        prediction and only the request at fault its error (TorchServe fails them all).

        The extra work is capped: the requests re-run add up to at most ISOLATION_WORK times
        the batch (one bad request among 8 re-runs 4 + 4 + 2 + 2 + 1 + 1 = 14 requests, two
        among 8 at most 24), and nothing is re-run after ISOLATION_TIME_SHARE of the response
        timeout; requests still grouped then get their group's error. A group that streamed
        intermediate responses is not re-run.
        """
        requests = list(batch.requests)
        logger.warning("%s failed a batch of %d requests (%s); re-running it in smaller groups "
                       "to find the request(s) at fault", self.entry_point.name, len(requests),
                       describe(error))
        work_left = ISOLATION_WORK * len(requests)
        answers: dict[str, worker_pb2.Response] = {}
        handler_time_ms = 0.0
        metrics: list[worker_pb2.Metric] = []
        pending = deque((half, error) for half in _halves(requests))
        while pending:
            group, group_error = pending.popleft()
            if len(group) > work_left or time.monotonic() >= deadline:
                answers.update(self._failed(group, group_error))
                continue
            work_left -= len(group)
            try:
                result = self._predict(worker_pb2.PredictBatch(batch_id=batch.batch_id,
                                                               requests=group))
            except Exception as exc:
                if len(group) == 1 or self.context.partials_sent:
                    answers.update(self._failed(group, exc))
                else:
                    pending.extend((half, exc) for half in _halves(group))
                continue
            handler_time_ms += result.handler_time_ms
            metrics.extend(result.metrics)
            answers.update((response.request_id, response) for response in result.responses)
        return worker_pb2.PredictResult(
            batch_id=batch.batch_id, handler_time_ms=handler_time_ms, metrics=metrics,
            responses=[answers[request.request_id] for request in requests])

    def _failed(self, group: list[worker_pb2.Request], error: BaseException
                ) -> Iterator[tuple[str, worker_pb2.Response]]:
        for request in group:
            response = worker_pb2.Response(request_id=request.request_id)
            yield request.request_id, _fail(response, error, self.entry_point.name)

    def _predict(self, batch: worker_pb2.PredictBatch, prepared: Prepared | None = None
                 ) -> worker_pb2.PredictResult:
        if any(r.describe for r in batch.requests):
            return self._describe(batch)
        requests = list(batch.requests)
        explaining = [is_explanation(r) for r in requests]
        if any(explaining) and not all(explaining):
            return self._apart(batch, explaining)
        if self.envelope is not None:
            return self._predict_enveloped(batch, self.envelope)
        if any(r.instances or r.tensor_format for r in requests):
            return self._predict_rows(batch)
        self.context.begin_batch(
            [r.request_id for r in requests], [dict(r.headers) for r in requests]
        )
        if prepared is None:
            data = [decode_request(r, decode=self.decode_input_request) for r in requests]
        else:
            data = prepared.data
        results, handler_time_ms = self._handle(data, "requests", prepared)
        responses = [
            self._encode(idx, request, item)
            for idx, (request, item) in enumerate(zip(requests, results, strict=True))
        ]
        return self._result(batch, responses, handler_time_ms)

    def _handle(self, data: list[Any], unit: str, prepared: Prepared | None = None
                ) -> tuple[list[Any], float]:
        """Call the handler once on ``data`` (or on what ``prepare`` made of it); one result
        per item, and the time it took."""
        start = time.perf_counter()
        try:
            if prepared is None:
                results = self.entry_point.handle(data, self.context)
            else:
                handler = self.entry_point.handle.__self__  # type: ignore[attr-defined]
                results = handler.handle_prepared(prepared.staged, self.context)
        except Exception as exc:
            if not (is_prediction_exception(exc) or isinstance(exc, Unsupported)):
                raise
            # TorchServe's PredictionException(message, error_code) fails every request of the
            # batch with the handler's own HTTP status, so keep it per request (and the 501 of
            # an explanation the handler cannot give).
            logger.warning("%s raised %s", self.entry_point.name, describe(exc))
            results = [exc] * len(data)
        handler_time_ms = (time.perf_counter() - start) * 1000.0
        self.context.metrics.add_time("PredictionTime", handler_time_ms)

        if not isinstance(results, (list, tuple)):
            raise InvalidHandlerOutput(
                f"{self.entry_point.name} returned {type(results).__name__}, expected a list "
                f"of {len(data)} results"
            )
        if len(results) != len(data):
            raise BatchSizeMismatch(
                f"{self.entry_point.name} returned {len(results)} results for a batch of "
                f"{len(data)} {unit}"
            )
        return list(results), handler_time_ms

    def _result(self, batch: worker_pb2.PredictBatch, responses: list[worker_pb2.Response],
                handler_time_ms: float) -> worker_pb2.PredictResult:
        return worker_pb2.PredictResult(
            batch_id=batch.batch_id, responses=responses, handler_time_ms=handler_time_ms,
            metrics=[
                worker_pb2.Metric(name=record.name, unit=record.unit, type=record.metric_type,
                                  value=record.value, dimensions=dict(record.dimensions))
                for record in self.context.metrics.drain()
            ],
        )

    def _predict_rows(self, batch: worker_pb2.PredictBatch) -> worker_pb2.PredictResult:
        """A batch with KServe v1 instances or v2 tensors: every request's rows go to the handler
        in one call (a TorchServe request is one row), and the results are split back."""
        segments: list[_Segment] = []
        data: list[Any] = []
        ids: list[str] = []
        headers: list[Mapping[str, str]] = []
        for request in batch.requests:
            segment = _Segment(request, start=len(data))
            try:
                if request.instances:
                    rows = instance_rows(request)
                elif request.tensor_format:
                    segment.tensors = open_inference.decode(
                        request, _header(request.headers, open_inference.HEADER_LENGTH))
                    rows = open_inference.rows(segment.tensors)
                else:
                    rows = [decode_request(request, decode=self.decode_input_request)]
            except InvalidInput as exc:
                segment.error, rows = exc, []
            segment.count = len(rows)
            segments.append(segment)
            data.extend(rows)
            ids.extend([request.request_id] * len(rows))
            headers.extend([dict(request.headers)] * len(rows))
        self.context.begin_batch(ids, headers)
        tensors = [s.tensors for s in segments if s.tensors is not None and s.error is None]
        self.context.request_parameters = open_inference.merge_parameters(
            [t.parameters for t in tensors])
        by_input: dict[str, list[dict[str, Any]]] = {}
        for request_tensors in tensors:
            for tensor in request_tensors.inputs:
                by_input.setdefault(tensor.name, []).append(tensor.parameters)
        self.context.input_parameters = {
            name: open_inference.merge_parameters(values) for name, values in by_input.items()}
        results, handler_time_ms = self._handle(data, "rows") if data else ([], 0.0)
        output_parameters = {
            name: open_inference.split_parameters(values, len(tensors))
            for name, values in self.context.output_parameters.items()}
        responses = []
        position = 0  # among the v2 requests
        for segment in segments:
            items = results[segment.start:segment.start + segment.count]
            if segment.error is not None:
                response = _fail(worker_pb2.Response(request_id=segment.request.request_id),
                                 segment.error, self.entry_point.name)
            elif segment.request.instances:
                response = self._encode_instances(segment, items)
            elif segment.tensors is not None:
                response = self._encode_tensors(segment, items, {
                    name: parts[position] for name, parts in output_parameters.items()})
                position += 1
            else:
                response = self._encode(segment.start, segment.request, items[0])
            responses.append(response)
        return self._result(batch, responses, handler_time_ms)

    def _predict_enveloped(self, batch: worker_pb2.PredictBatch, envelope: Envelope
                           ) -> worker_pb2.PredictResult:
        """Every request unwrapped by the envelope into rows, the handler run on them (once for
        the batch, or once per request: ``Envelope.joins_requests``), each request's results
        wrapped into its answer. A gRPC ModelInfer request goes through the envelope as the
        JSON body KServe's TorchServe wrapper made of it, and its answer back into a
        ModelInferResponse."""
        segments: list[_Segment] = []
        for request in batch.requests:
            segment = _Segment(request, start=0)
            try:
                if request.tensor_format == worker_pb2.TENSOR_FORMAT_GRPC:
                    segment.tensors = open_inference.decode_grpc(request.inputs.get(BODY, b""))
                    data: dict[str, Any] = {BODY: v2_document(segment.tensors)}
                else:
                    data = decode_request(request, decode=self.decode_input_request)
                segment.unwrapped = envelope.unwrap(data, request.request_id)
            except InvalidInput as exc:
                segment.error = exc
            segments.append(segment)
        good = [segment for segment in segments if segment.unwrapped is not None]
        groups = [good] if envelope.joins_requests else [[segment] for segment in good]
        handler_time_ms = 0.0
        responses: dict[str, worker_pb2.Response] = {}
        for group in groups:
            rows: list[Any] = []
            ids: list[str] = []
            headers: list[Mapping[str, str]] = []
            for segment in group:
                assert segment.unwrapped is not None
                segment.start, segment.count = len(rows), len(segment.unwrapped.rows)
                rows.extend(segment.unwrapped.rows)
                ids.extend([segment.request.request_id] * segment.count)
                headers.extend([dict(segment.request.headers)] * segment.count)
            if not rows:
                continue
            self.context.begin_batch(ids, headers)
            results, took_ms = self._handle(rows, "rows")
            handler_time_ms += took_ms
            for segment in group:
                responses[segment.request.request_id] = self._wrap(
                    envelope, segment, results[segment.start:segment.start + segment.count])
        return self._result(batch, [
            responses.get(segment.request.request_id) or _fail(
                worker_pb2.Response(request_id=segment.request.request_id),
                segment.error or InvalidInput("the envelope found no rows"),
                self.entry_point.name)
            for segment in segments], handler_time_ms)

    def _wrap(self, envelope: Envelope, segment: _Segment, items: list[Any]
              ) -> worker_pb2.Response:
        response = self._row_response(segment)
        content_type = _pop_content_type(dict(
            self.context.request_processor[segment.start].get_response_headers()))
        failure = next((item for item in items if isinstance(item, BaseException)), None)
        if failure is not None:
            return _fail(response, failure, self.entry_point.name)
        assert segment.unwrapped is not None
        try:
            answer = envelope.wrap(items, segment.unwrapped, is_explanation(segment.request))
            if segment.tensors is not None:
                response.body = grpc_answer(answer, segment.tensors)
                response.content_type = "application/x-protobuf"
                return response
            body, default_type = encode_result(answer)
        except (InvalidInput, InvalidHandlerOutput, TypeError, ValueError, RecursionError
                ) as exc:
            return _fail(response, exc, self.entry_point.name)
        response.body = body
        response.content_type = content_type or default_type
        return response

    def _row_response(self, segment: _Segment) -> worker_pb2.Response:
        """The status and headers the handler set on the first row of a request."""
        processor = self.context.request_processor[segment.start]
        headers = dict(processor.get_response_headers())
        _pop_content_type(headers)
        return worker_pb2.Response(
            request_id=segment.request.request_id,
            status=processor.get_response_status_code(),
            reason=processor.get_response_status_phrase(),
            headers=headers,
        )

    def _encode_instances(self, segment: _Segment, items: list[Any]) -> worker_pb2.Response:
        """KServe v1: the JSON array of the request's predictions, in order."""
        response = self._row_response(segment)
        failure = next((item for item in items if isinstance(item, BaseException)), None)
        if failure is not None:
            return _fail(response, failure, self.entry_point.name)
        try:
            response.body = json.dumps(items, default=_json_default).encode("utf-8")
        except (TypeError, ValueError) as exc:
            return _fail(response, exc, self.entry_point.name)
        response.content_type = APPLICATION_JSON
        return response

    def _encode_tensors(self, segment: _Segment, items: list[Any],
                        output_parameters: dict[str, dict[str, Any]]) -> worker_pb2.Response:
        """Open Inference Protocol: the request's rows stacked back into output tensors."""
        response = self._row_response(segment)
        failure = next((item for item in items if isinstance(item, BaseException)), None)
        if failure is not None:
            return _fail(response, failure, self.entry_point.name)
        assert segment.tensors is not None
        try:
            outputs = open_inference.build_outputs(items, self.declared_outputs)
            for tensor in outputs:
                tensor.parameters = output_parameters.get(tensor.name, {})
            body, headers, content_type = open_inference.encode(
                segment.tensors, outputs, self.context.model_name, self.model_version)
        except (InvalidInput, InvalidHandlerOutput) as exc:
            return _fail(response, exc, self.entry_point.name)
        response.body = body
        response.headers.update(headers)
        response.content_type = content_type
        return response

    def _apart(self, batch: worker_pb2.PredictBatch, explaining: list[bool]
               ) -> worker_pb2.PredictResult:
        """Explanations and predictions that met in one batch run as two batches: a handler
        explains or predicts a whole batch (TorchServe's look at the first request's header)."""
        responses: dict[str, worker_pb2.Response] = {}
        handler_time_ms = 0.0
        metrics: list[worker_pb2.Metric] = []
        for wanted in (False, True):
            part = worker_pb2.PredictBatch(batch_id=batch.batch_id, requests=[
                r for r, explain in zip(batch.requests, explaining, strict=True)
                if explain is wanted])
            result = self.predict(part)
            handler_time_ms += result.handler_time_ms
            metrics.extend(result.metrics)
            responses.update((response.request_id, response) for response in result.responses)
        return worker_pb2.PredictResult(
            batch_id=batch.batch_id, handler_time_ms=handler_time_ms, metrics=metrics,
            responses=[responses[request.request_id] for request in batch.requests])

    def _describe(self, batch: worker_pb2.PredictBatch) -> worker_pb2.PredictResult:
        """Answer describe requests with the handler's ``describe_handle()`` (TorchServe's
        ``?customized=true``); predictions that share the batch run as a batch of their own."""
        handler = getattr(self.entry_point.handle, "__self__", None)
        describe_handle = getattr(handler, "describe_handle", None)
        metadata = describe_handle() if callable(describe_handle) else {}
        body, content_type = encode_result(metadata)
        rest = worker_pb2.PredictBatch(batch_id=batch.batch_id,
                                       requests=[r for r in batch.requests if not r.describe])
        predicted = iter(self.predict(rest).responses if rest.requests else [])
        return worker_pb2.PredictResult(batch_id=batch.batch_id, responses=[
            worker_pb2.Response(request_id=r.request_id, status=200, body=body,
                                content_type=content_type)
            if r.describe else next(predicted)
            for r in batch.requests])

    def _encode(self, idx: int, request: worker_pb2.Request, item: Any) -> worker_pb2.Response:
        processor = self.context.request_processor[idx]
        headers = dict(processor.get_response_headers())
        content_type = _pop_content_type(headers)
        response = worker_pb2.Response(
            request_id=request.request_id,
            status=processor.get_response_status_code(),
            reason=processor.get_response_status_phrase(),
            headers=headers,
        )
        if isinstance(item, BaseException):
            return _fail(response, item, self.entry_point.name)
        if isinstance(item, Iterator):
            # A generator streams its items as intermediate responses; the final response
            # then carries no body of its own.
            try:
                for part in item:
                    self.context.send_intermediate(idx, part)
            except Exception as exc:
                return _fail(response, exc, self.entry_point.name)
            response.content_type = content_type
            return response
        try:
            body, default_type = encode_result(item)
        except (TypeError, ValueError, RecursionError) as exc:
            return _fail(response, exc, self.entry_point.name)
        response.body = body
        response.content_type = content_type or default_type
        return response


def load_service(message: worker_pb2.LoadModel) -> ModelService:
    """Build the context, import and initialise the handler named by a LOAD message."""
    model_dir = Path(message.model_dir)
    if not model_dir.is_dir():
        raise HandlerLoadError(f"model directory {model_dir} does not exist")
    manifest = read_manifest(message.manifest_json)
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
    )
    add_dependency_dirs(message.dependency_dirs)
    entry_point = load_entry_point(message.handler, model_dir, context)
    return ModelService(entry_point, context, decode_input_request=message.decode_input_request,
                        model_version=message.model_version,
                        response_timeout_s=message.response_timeout_ms / 1000 or 120.0,
                        envelope=make_envelope(message.envelope, context))


@dataclass(frozen=True, slots=True)
class Prepared:
    """A batch as far as it could be taken ahead: its requests as the handler sees them, and
    what the handler's ``prepare_batch`` made of them."""

    data: list[Any]
    staged: Any


def is_explanation(request: worker_pb2.Request) -> bool:
    """Whether the request asks for an explanation (TorchServe's ``explain`` header)."""
    return request.headers.get(EXPLAIN_HEADER) == "True"


def _halves(requests: list[worker_pb2.Request]) -> list[list[worker_pb2.Request]]:
    middle = len(requests) // 2
    return [requests[:middle], requests[middle:]]


@dataclass(slots=True)
class _Segment:
    """One request of a row batch: where its rows lie among the handler's data."""

    request: worker_pb2.Request
    start: int
    count: int = 0
    #: The decoded v2 request (Open Inference Protocol requests only).
    tensors: open_inference.InferRequest | None = None
    #: Its rows as the service envelope unwrapped them (with an envelope only).
    unwrapped: Unwrapped | None = None
    #: Why the request could not be turned into rows (it is answered with this error).
    error: BaseException | None = None


def instance_rows(request: worker_pb2.Request) -> list[Any]:
    """KServe v1: one row per instance, the instance itself when it is an object, else
    ``{"data": instance}``."""
    try:
        instances = json.loads(request.inputs.get(BODY, b""))
    except ValueError as exc:
        raise InvalidInput(f"instances are not valid JSON: {exc}") from None
    except RecursionError:
        raise InvalidInput("instances are nested too deeply") from None
    if not isinstance(instances, list):
        raise InvalidInput("instances must be a JSON array")
    return [item if isinstance(item, dict) else {"data": item} for item in instances]


def _json_default(value: Any) -> Any:
    """JSON for what handlers commonly return: tensors and arrays as lists, bytes as text."""
    tolist = getattr(value, "tolist", None)
    if callable(tolist):
        return tolist()
    if isinstance(value, (bytes, bytearray)):
        return bytes(value).decode("utf-8")
    raise TypeError(f"a {type(value).__name__} cannot be a KServe prediction (not JSON)")


def decode_request(request: worker_pb2.Request, *, decode: bool) -> dict[str, Any]:
    """One request as a handler sees it: input name -> bytes, str or decoded JSON."""
    data: dict[str, Any] = {}
    for name, value in request.inputs.items():
        if not decode:
            data[name] = value
            continue
        content_type = request.content_types.get(name)
        if not content_type and name == BODY:
            content_type = _header(request.headers, CONTENT_TYPE)
        data[name] = decode_value(value, content_type or "")
    return data


def decode_value(value: bytes, content_type: str) -> Any:
    """JSON to objects and text/* to str (TorchServe's decode_input_request); else bytes.

    A value that fails to decode is passed on as bytes for the handler to judge.
    """
    media_type = content_type.split(";", 1)[0].strip().lower()
    if media_type == APPLICATION_JSON:
        try:
            return json.loads(value)
        except (ValueError, RecursionError):
            logger.warning("input declared %s is not valid JSON; passing bytes", content_type)
            return value
    if media_type.startswith("text/"):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            logger.warning("input declared %s is not UTF-8; passing bytes", content_type)
            return value
    return value


def encode_result(item: Any) -> tuple[bytes, str]:
    """One handler result as bytes and the content type to use if the handler set none.

    Raises TypeError or ValueError when the item cannot be serialised.
    """
    if isinstance(item, (bytes, bytearray, memoryview)):
        return bytes(item), OCTET_STREAM
    if isinstance(item, str):
        return item.encode("utf-8"), TEXT_PLAIN
    torch = sys.modules.get("torch")  # never import torch for a handler that did not
    if torch is not None and isinstance(item, torch.Tensor):
        buffer = io.BytesIO()
        torch.save(item, buffer)
        return buffer.getvalue(), OCTET_STREAM
    # TorchServe pretty-prints; clients comparing bodies byte for byte rely on it.
    return json.dumps(item, indent=2).encode("utf-8"), APPLICATION_JSON


def _fail(response: worker_pb2.Response, exc: BaseException, handler: str) -> worker_pb2.Response:
    logger.warning("%s: request %s failed: %s", handler, response.request_id or "?", describe(exc))
    response.status = request_status(exc)
    response.error = request_message(exc)
    response.error_type = type(exc).__name__
    response.body = b""
    response.content_type = ""
    return response


def _pop_content_type(headers: dict[str, str]) -> str:
    content_type = ""
    for name in [n for n in headers if n.lower() == CONTENT_TYPE]:
        content_type = headers.pop(name)
    return content_type


def _header(headers: Mapping[str, str], name: str) -> str | None:
    value = headers.get(name)
    if value is not None:
        return value
    for key, candidate in headers.items():
        if key.lower() == name:
            return candidate
    return None
