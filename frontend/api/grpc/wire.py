"""Bounded looks at prediction RPCs' request bytes, before (or instead of) decoding them.

grpc decodes a request in the event loop before a servicer sees it: one 5 MB
``PredictionsRequest`` with 400k ``input`` entries took a second to decode there, and every
other client waited. The prediction RPCs therefore receive their requests' bytes, and this
module looks at them within bounds: it walks at most a fixed number of top-level fields,
never decoding their values, so a request with too many inputs is refused (400 /
INVALID_ARGUMENT) before anything is built from it. A ``ModelInferRequest`` is never decoded
here at all: its name, version and input shapes are read from the walk, and its bytes go to
the worker as they came (the frontend moves bytes; the worker decodes tensors).

This walks protobuf's wire format only as far as the bound needs (tags and lengths);
decoding proper stays with the protobuf library.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from google.protobuf.message import DecodeError

from frontend.errors import BadRequest
from protos import inference_pb2

_VARINT, _FIXED64, _LENGTH, _FIXED32 = 0, 1, 2, 5
#: A tensor's dimensions: more is no tensor anyone sends.
MAX_DIMS = 64
#: Fields a message may carry besides the repeated ones that are counted.
_OTHER_FIELDS = 16


class WireError(BadRequest):
    """The request's bytes are not a valid message, or carry more than is allowed."""


def _varint(data: memoryview, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(data) or shift > 63:
            raise WireError("malformed request: a truncated or overlong varint")
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, pos
        shift += 7


def fields(data: bytes | memoryview, max_fields: int) -> Iterator[tuple[int, int | memoryview]]:
    """(field number, value) of each top-level field: the int of a varint, the bytes of a
    length-delimited field (fixed-size values as bytes too). WireError past ``max_fields``."""
    view = memoryview(data)
    pos = count = 0
    while pos < len(view):
        count += 1
        if count > max_fields:
            raise WireError(f"the request carries more than {max_fields} fields")
        tag, pos = _varint(view, pos)
        number, kind = tag >> 3, tag & 7
        if number == 0:
            raise WireError("malformed request: field number 0")
        if kind == _VARINT:
            value, pos = _varint(view, pos)
            yield number, value
            continue
        if kind == _LENGTH:
            size, pos = _varint(view, pos)
        elif kind in (_FIXED64, _FIXED32):
            size = 8 if kind == _FIXED64 else 4
        else:
            raise WireError(f"malformed request: wire type {kind}")
        if pos + size > len(view):
            raise WireError("malformed request: a field runs past the end")
        yield number, view[pos:pos + size]
        pos += size


def predictions_request(data: bytes, max_inputs: int) -> inference_pb2.PredictionsRequest:
    """A TorchServe ``PredictionsRequest``, decoded once its ``input`` entries are counted."""
    inputs = 0
    for number, _ in fields(data, max_inputs + _OTHER_FIELDS):
        if number == 3:  # map<string, bytes> input
            inputs += 1
            if inputs > max_inputs:
                raise WireError(f"a request may carry at most {max_inputs} inputs")
    try:
        return inference_pb2.PredictionsRequest.FromString(data)
    except DecodeError as exc:
        raise WireError(f"malformed PredictionsRequest: {exc}") from None


@dataclass(frozen=True, slots=True)
class InferHead:
    """What the frontend needs of a ``ModelInferRequest``: whom it is for, and its rows."""

    model_name: str = ""
    model_version: str = ""
    shapes: list[list[int]] = field(default_factory=list)


def _text(value: int | memoryview, what: str) -> str:
    if not isinstance(value, memoryview):
        raise WireError(f"malformed ModelInferRequest: {what} is not a string")
    try:
        return bytes(value).decode("utf-8")
    except UnicodeDecodeError:
        raise WireError(f"malformed ModelInferRequest: {what} is not UTF-8") from None


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def _shape(tensor: memoryview) -> list[int]:
    shape: list[int] = []
    for number, value in fields(tensor, MAX_DIMS + _OTHER_FIELDS):
        if number != 3:  # name, datatype, parameters, contents: the worker's business
            continue
        if isinstance(value, int):  # an unpacked dimension
            shape.append(_signed(value))
            continue
        pos = 0
        while pos < len(value):  # packed dimensions
            dim, pos = _varint(value, pos)
            shape.append(_signed(dim))
            if len(shape) > MAX_DIMS:
                break
        if len(shape) > MAX_DIMS:
            raise WireError(f"a tensor may have at most {MAX_DIMS} dimensions")
    return shape


def infer_request_head(data: bytes, max_inputs: int) -> InferHead:
    """The model, version and input shapes of a ``ModelInferRequest``, without decoding its
    tensors; WireError for more than ``max_inputs`` inputs or a malformed message."""
    name = version = ""
    shapes: list[list[int]] = []
    for number, value in fields(data, 3 * max_inputs + _OTHER_FIELDS):  # inputs, raw, outputs
        if number == 1:
            name = _text(value, "model_name")
        elif number == 2:
            version = _text(value, "model_version")
        elif number == 5:  # repeated InferInputTensor inputs
            if len(shapes) >= max_inputs:
                raise WireError(f"a request may carry at most {max_inputs} inputs")
            if not isinstance(value, memoryview):
                raise WireError("malformed ModelInferRequest: an input is not a message")
            shapes.append(_shape(value))
    return InferHead(name, version, shapes)
