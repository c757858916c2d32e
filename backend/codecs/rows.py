"""The shapes a request takes on its way through a handler: how it becomes the handler's rows
and how the handler's results for those rows become its response.

- ``PlainCodec``: TorchServe's request, one row (its inputs decoded as TorchServe decodes
  them), one result, which may stream (a generator's items go as intermediate responses);
- ``InstancesCodec``: a KServe v1 request, one row per instance, answered with the JSON array
  of their predictions;
- ``TensorsCodec``: an Open Inference (v2) request, one row per element of its tensors' first
  dimension, answered with output tensors stacked back (backend/codecs/open_inference.py);
- ``EnvelopeCodec``: any request through TorchServe's service envelope (``kserve``,
  ``kservev2``, ``json``, ``body``): the body unwrapped into rows, the results wrapped back.

Each request of a batch becomes a ``Segment``: where its rows lie among the rows of its run,
and what its codec decoded of it. The service (backend/service/model_service.py) plans the
batch into runs, calls the handler once per run, and asks each segment's codec for its
response.
"""

from __future__ import annotations

import io
import json
import logging
import sys
from collections.abc import Iterator, Mapping
from typing import Any, Protocol

from backend.codecs import open_inference, v2_outputs
from backend.codecs.envelopes import Envelope, Unwrapped, grpc_answer, v2_document
from backend.context import CONTENT_TYPE, EXPLAIN_HEADER, Context
from backend.errors import (
    InvalidHandlerOutput,
    InvalidInput,
    describe,
    request_message,
    request_status,
)
from protos import json_limits, worker_pb2

logger = logging.getLogger(__name__)

BODY = "body"
OCTET_STREAM = "application/octet-stream"
TEXT_PLAIN = "text/plain; charset=utf-8"
APPLICATION_JSON = "application/json"


class Segment:
    """One request of a run: its codec, its rows and where they start among the run's rows.
    (A plain class: one is made per request.)"""

    __slots__ = ("codec", "error", "output_parameters", "request", "rows", "start", "tensors",
                 "unwrapped")

    def __init__(self, request: worker_pb2.Request, codec: Codec) -> None:
        self.request = request
        self.codec = codec
        self.rows: list[Any] = []
        self.start = 0
        #: The decoded v2 request (Open Inference requests, and gRPC ones through an envelope).
        self.tensors: open_inference.InferRequest | None = None
        #: Its rows as the service envelope unwrapped them (with an envelope only).
        self.unwrapped: Unwrapped | None = None
        #: The v2 output parameters the handler set for this request (``TensorsCodec``).
        self.output_parameters: dict[str, dict[str, Any]] = {}
        #: Why the request could not be decoded (it is answered with this error).
        self.error: BaseException | None = None


class Codec(Protocol):
    """How one shape of request is decoded into rows and its results encoded."""

    def decode(self, segment: Segment) -> None:
        """Fill ``segment.rows`` (and what else the codec keeps). Raises InvalidInput."""

    def encode(self, segment: Segment, items: list[Any], context: Context
               ) -> worker_pb2.Response:
        """The response to ``segment``'s request from the handler's ``items`` for its rows."""


class PlainCodec:
    """TorchServe's request: one row, one result (see the module docstring)."""

    def __init__(self, decode_input_request: bool, handler_name: str) -> None:
        self.decode_input_request = decode_input_request
        self.handler_name = handler_name

    def decode(self, segment: Segment) -> None:
        segment.rows = [decode_request(segment.request, decode=self.decode_input_request)]

    def encode(self, segment: Segment, items: list[Any], context: Context
               ) -> worker_pb2.Response:
        (item,) = items
        response, content_type = row_response(segment, context)
        if isinstance(item, BaseException):
            return failed(response, item, self.handler_name)
        if isinstance(item, Iterator):
            # A generator streams its items as intermediate responses; the final response
            # then carries no body of its own.
            try:
                for part in item:
                    context.send_intermediate(segment.start, part)
            except Exception as exc:
                return failed(response, exc, self.handler_name)
            response.content_type = content_type
            return response
        try:
            body, default_type = encode_result(item)
        except (TypeError, ValueError, RecursionError) as exc:
            return failed(response, exc, self.handler_name)
        response.body = body
        response.content_type = content_type or default_type
        return response


class _RowsCodec:
    """A codec whose request is answered from all its rows' results at once: a failed row
    fails the request; an encoding error fails it too."""

    #: The errors encoding the results may raise (each answered as the request's failure).
    encoding_errors: tuple[type[BaseException], ...] = (TypeError, ValueError)

    def __init__(self, handler_name: str) -> None:
        self.handler_name = handler_name

    def encode(self, segment: Segment, items: list[Any], context: Context
               ) -> worker_pb2.Response:
        response, content_type = row_response(segment, context)
        failure = next((item for item in items if isinstance(item, BaseException)), None)
        if failure is not None:
            return failed(response, failure, self.handler_name)
        try:
            self._fill(response, content_type, segment, items, context)
        except self.encoding_errors as exc:
            return failed(response, exc, self.handler_name)
        return response

    def _fill(self, response: worker_pb2.Response, content_type: str, segment: Segment,
              items: list[Any], context: Context) -> None:
        """Write the answer to ``segment``'s request into ``response``."""
        raise NotImplementedError


class InstancesCodec(_RowsCodec):
    """KServe v1: one row per instance; the JSON array of their predictions back."""

    def decode(self, segment: Segment) -> None:
        segment.rows = instance_rows(segment.request)

    def _fill(self, response: worker_pb2.Response, content_type: str, segment: Segment,
              items: list[Any], context: Context) -> None:
        response.body = json.dumps(items, default=_json_default).encode("utf-8")
        response.content_type = APPLICATION_JSON


class TensorsCodec(_RowsCodec):
    """Open Inference Protocol: the tensors' rows; output tensors stacked back."""

    encoding_errors = (InvalidInput, InvalidHandlerOutput)

    def __init__(self, handler_name: str, declared_outputs: Mapping[str, str],
                 model_version: str) -> None:
        super().__init__(handler_name)
        self.declared_outputs = declared_outputs
        self.model_version = model_version

    def decode(self, segment: Segment) -> None:
        request = segment.request
        segment.tensors = open_inference.decode(
            request, header(request.headers, open_inference.HEADER_LENGTH))
        segment.rows = open_inference.rows(segment.tensors)

    def _fill(self, response: worker_pb2.Response, content_type: str, segment: Segment,
              items: list[Any], context: Context) -> None:
        assert segment.tensors is not None
        outputs = v2_outputs.build_outputs(items, self.declared_outputs)
        for tensor in outputs:
            tensor.parameters = segment.output_parameters.get(tensor.name, {})
        response.body, headers, response.content_type = v2_outputs.encode(
            segment.tensors, outputs, context.model_name, self.model_version)
        response.headers.update(headers)


class EnvelopeCodec(_RowsCodec):
    """A service envelope around an unchanged handler. A gRPC ModelInfer request goes through
    it as the JSON body KServe's TorchServe wrapper made of it, and its answer back into a
    ModelInferResponse."""

    encoding_errors = (InvalidInput, InvalidHandlerOutput, TypeError, ValueError,
                       RecursionError)

    def __init__(self, envelope: Envelope, decode_input_request: bool,
                 handler_name: str) -> None:
        super().__init__(handler_name)
        self.envelope = envelope
        self.decode_input_request = decode_input_request

    def decode(self, segment: Segment) -> None:
        request = segment.request
        if request.tensor_format == worker_pb2.TENSOR_FORMAT_GRPC:
            segment.tensors = open_inference.decode_grpc(request.inputs.get(BODY, b""))
            data: dict[str, Any] = {BODY: v2_document(segment.tensors)}
        else:
            data = decode_request(request, decode=self.decode_input_request)
        segment.unwrapped = self.envelope.unwrap(data, request.request_id)
        segment.rows = list(segment.unwrapped.rows)
        if not segment.rows:
            raise InvalidInput("the envelope found no rows")

    def _fill(self, response: worker_pb2.Response, content_type: str, segment: Segment,
              items: list[Any], context: Context) -> None:
        assert segment.unwrapped is not None
        answer = self.envelope.wrap(items, segment.unwrapped, is_explanation(segment.request))
        if segment.tensors is not None:
            response.body = grpc_answer(answer, segment.tensors)
            response.content_type = "application/x-protobuf"
            return
        response.body, default_type = encode_result(answer)
        response.content_type = content_type or default_type


# ---- pieces the codecs share ------------------------------------------------------------------


def row_response(segment: Segment, context: Context) -> tuple[worker_pb2.Response, str]:
    """A response with the status and headers the handler set on the request's first row,
    and the content type it set (taken out of the headers; "" when none)."""
    processor = context.request_processor[segment.start]
    headers = dict(processor.get_response_headers())
    content_type = _pop_content_type(headers)
    return worker_pb2.Response(
        request_id=segment.request.request_id,
        status=processor.get_response_status_code(),
        reason=processor.get_response_status_phrase(),
        headers=headers,
    ), content_type


def failed(response: worker_pb2.Response, exc: BaseException, handler: str
           ) -> worker_pb2.Response:
    """``response`` as the failure ``exc`` (its status and message), body dropped."""
    logger.warning("%s: request %s failed: %s", handler, response.request_id or "?",
                   describe(exc))
    response.status = request_status(exc)
    response.error = request_message(exc)
    response.error_type = type(exc).__name__
    response.body = b""
    response.content_type = ""
    return response


def is_explanation(request: worker_pb2.Request) -> bool:
    """Whether the request asks for an explanation (TorchServe's ``explain`` header)."""
    return request.headers.get(EXPLAIN_HEADER) == "True"


def instance_rows(request: worker_pb2.Request) -> list[Any]:
    """KServe v1: one row per instance, the instance itself when it is an object, else
    ``{"data": instance}``."""
    try:
        instances = json_limits.loads(request.inputs.get(BODY, b""))
    except ValueError as exc:
        raise InvalidInput(f"instances are not valid JSON: {exc}") from None
    if not isinstance(instances, list):
        raise InvalidInput("instances must be a JSON array")
    return [item if isinstance(item, dict) else {"data": item} for item in instances]


def decode_request(request: worker_pb2.Request, *, decode: bool) -> dict[str, Any]:
    """One request as a handler sees it: input name -> bytes, str or decoded JSON."""
    data: dict[str, Any] = {}
    for name, value in request.inputs.items():
        if not decode:
            data[name] = value
            continue
        content_type = request.content_types.get(name)
        if not content_type and name == BODY:
            content_type = header(request.headers, CONTENT_TYPE)
        data[name] = decode_value(value, content_type or "")
    return data


def decode_value(value: bytes, content_type: str) -> Any:
    """JSON to objects and text/* to str (TorchServe's decode_input_request); else bytes.

    A value that fails to decode is passed on as bytes for the handler to judge; JSON nested
    deeper than protos/json_limits.py allows is refused (InvalidInput: 400), as the frontend
    refuses it on the routes where it reads JSON itself.
    """
    media_type = content_type.split(";", 1)[0].strip().lower()
    if media_type == APPLICATION_JSON:
        try:
            return json_limits.loads(value)
        except json_limits.JsonTooDeep as exc:
            raise InvalidInput(f"the JSON input is {exc}") from None
        except ValueError:
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


def header(headers: Mapping[str, str], name: str) -> str | None:
    """A request header by its lower-case name, whatever case the client wrote."""
    value = headers.get(name)
    if value is not None:
        return value
    for key, candidate in headers.items():
        if key.lower() == name:
            return candidate
    return None


def _json_default(value: Any) -> Any:
    """JSON for what handlers commonly return: tensors and arrays as lists, bytes as text."""
    tolist = getattr(value, "tolist", None)
    if callable(tolist):
        return tolist()
    if isinstance(value, (bytes, bytearray)):
        return bytes(value).decode("utf-8")
    raise TypeError(f"a {type(value).__name__} cannot be a KServe prediction (not JSON)")


def _pop_content_type(headers: dict[str, str]) -> str:
    content_type = ""
    for name in [n for n in headers if n.lower() == CONTENT_TYPE]:
        content_type = headers.pop(name)
    return content_type
