"""Open Inference Protocol (KServe v2) tensors: requests to handler rows, rows back to tensors.

A v2 request reaches the worker as the client sent it: REST's JSON request followed by any
binary tensor data (the binary tensor extension), or a serialized ``inference.ModelInferRequest``
(gRPC). Both decode to one ``InferRequest``. Its tensors are split into rows along their first
dimension (the handler sees one ``{input_name: row value}`` dict per row, and the rows of every
request of a batch together), and the handler's per-row results are stacked back into output
tensors of shape ``[rows, ...]`` per request, encoded the way that request came
(backend/codecs/v2_outputs.py).

Pure Python (struct) on purpose: the worker needs no numpy or torch for this.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from backend.errors import InvalidInput
from protos import json_limits, open_inference_pb2, worker_pb2

#: Datatype -> struct format of one element (little-endian); BYTES is length-prefixed.
FORMATS: dict[str, str] = {
    "BOOL": "?", "INT8": "b", "INT16": "h", "INT32": "i", "INT64": "q",
    "UINT8": "B", "UINT16": "H", "UINT32": "I", "UINT64": "Q",
    "FP16": "e", "FP32": "f", "FP64": "d",
}
DATATYPES = (*FORMATS, "BYTES")
INTEGER_RANGES: dict[str, tuple[int, int]] = {
    name: (-(1 << (bits - 1)), (1 << (bits - 1)) - 1)
    for name, bits in (("INT8", 8), ("INT16", 16), ("INT32", 32), ("INT64", 64))
} | {
    name: (0, (1 << bits) - 1)
    for name, bits in (("UINT8", 8), ("UINT16", 16), ("UINT32", 32), ("UINT64", 64))
}
FLOATS = ("FP16", "FP32", "FP64")
#: gRPC's typed contents field of each datatype (FP16 travels only as raw contents).
CONTENTS_FIELDS: dict[str, str] = {
    "BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents",
    "INT32": "int_contents", "INT64": "int64_contents", "UINT8": "uint_contents",
    "UINT16": "uint_contents", "UINT32": "uint_contents", "UINT64": "uint64_contents",
    "FP32": "fp32_contents", "FP64": "fp64_contents", "BYTES": "bytes_contents",
}
#: The name of a handler's output when a row's result is a bare value, not a dict.
DEFAULT_OUTPUT = "output-0"
HEADER_LENGTH = "inference-header-content-length"
BINARY_DATA_SIZE = "binary_data_size"
#: Parameters that describe an encoding rather than data: MLServer keeps them as they are
#: when it merges a batch's parameters into lists.
UNMERGED_PARAMETERS = frozenset({"content_type", "headers"})
_LENGTH = struct.Struct("<I")
#: The most dimensions a tensor may have (numpy's limit).
MAX_DIMENSIONS = 32
#: How many nested lists and elements a request may expand into (``rows``), per byte of the
#: request. A tensor's elements take a byte each at least, and each element costs at most one
#: list per dimension, so no tensor with data reaches it; it bounds the tensors whose shape
#: promises more than their bytes hold: ``[1, 3000000, 0]`` is empty, yet its row would be
#: three million empty lists.
EXPANSION_PER_BYTE = MAX_DIMENSIONS


@dataclass(slots=True)
class Tensor:
    """One named tensor: its elements flattened in row-major order (BYTES as bytes)."""

    name: str
    datatype: str
    shape: list[int]
    data: list[Any]
    parameters: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class RequestedOutput:
    name: str
    #: The output's ``binary_data`` parameter; None: the request's default.
    is_binary: bool | None = None


@dataclass(slots=True)
class InferRequest:
    """One v2 inference request, decoded."""

    tensor_format: int  # worker_pb2.TensorFormat
    id: str
    inputs: list[Tensor]
    outputs: list[RequestedOutput]
    parameters: dict[str, Any]
    #: REST: the ``binary_data_output`` parameter; gRPC: the client sent raw contents.
    is_binary_output: bool
    rows: int


# ---- decoding ---------------------------------------------------------------------------------


def decode(request: worker_pb2.Request, header_length: str | None) -> InferRequest:
    """The v2 request a worker Request carries. Raises InvalidInput."""
    body = request.inputs.get("body", b"")
    if request.tensor_format == worker_pb2.TENSOR_FORMAT_GRPC:
        return decode_grpc(body)
    return decode_rest(body, header_length)


def decode_rest(body: bytes, header_length: str | None) -> InferRequest:
    """REST's JSON request, then the binary data of the inputs that have ``binary_data_size``."""
    json_part, binary = body, b""
    if header_length is not None:
        try:
            length = int(header_length)
        except ValueError:
            raise InvalidInput(f"{HEADER_LENGTH} must be an integer, got {header_length!r}") \
                from None
        if not 0 <= length <= len(body):
            raise InvalidInput(f"{HEADER_LENGTH} is {length}, but the body has {len(body)} bytes")
        json_part, binary = body[:length], body[length:]
    try:
        payload = json_limits.loads(json_part)
    except ValueError as exc:
        raise InvalidInput(f"malformed JSON request: {exc}") from None
    if not isinstance(payload, dict):
        raise InvalidInput("the request must be a JSON object with 'inputs'")
    raw_inputs = payload.get("inputs")
    if not isinstance(raw_inputs, list) or not raw_inputs:
        raise InvalidInput("'inputs' must be a non-empty list of tensors")
    inputs: list[Tensor] = []
    offset = 0
    budget = ShapeBudget(len(body))
    for index, raw in enumerate(raw_inputs):
        if not isinstance(raw, dict):
            raise InvalidInput(f"inputs[{index}] must be an object")
        name, datatype, shape = _tensor_header(raw, f"inputs[{index}]")
        budget.spend(name, shape)
        parameters = _parameters(raw.get("parameters"), f"input {name!r}")
        count = math.prod(shape)
        size = parameters.pop(BINARY_DATA_SIZE, None)
        if size is not None:
            if isinstance(size, bool) or not isinstance(size, int) or size < 0:
                raise InvalidInput(f"input {name!r}: {BINARY_DATA_SIZE} must be a byte count")
            chunk = binary[offset:offset + size]
            if len(chunk) != size:
                raise InvalidInput(f"input {name!r}: {BINARY_DATA_SIZE} is {size}, but only "
                                   f"{len(chunk)} bytes of binary data are left")
            offset += size
            data = unpack(datatype, chunk, count, name)
        elif "data" in raw:
            data = _json_elements(datatype, raw["data"], name)
        else:
            raise InvalidInput(f"input {name!r} has neither 'data' nor {BINARY_DATA_SIZE}")
        _check_count(name, shape, len(data))
        inputs.append(Tensor(name, datatype, shape, data, parameters))
    if offset != len(binary):
        raise InvalidInput(f"{len(binary) - offset} bytes of binary data belong to no input")
    parameters = _parameters(payload.get("parameters"), "the request")
    binary_output = parameters.pop("binary_data_output", False)
    outputs = []
    raw_outputs = payload.get("outputs") or []
    if not isinstance(raw_outputs, list):
        raise InvalidInput("'outputs' must be a list")
    for index, raw in enumerate(raw_outputs):
        if not isinstance(raw, dict) or not isinstance(raw.get("name"), str):
            raise InvalidInput(f"outputs[{index}] must be an object with a 'name'")
        output_parameters = _parameters(raw.get("parameters"), f"output {raw['name']!r}")
        is_binary = output_parameters.get("binary_data")
        outputs.append(RequestedOutput(raw["name"], None if is_binary is None
                                       else bool(is_binary)))
    request_id = payload.get("id", "")
    return _finish(InferRequest(worker_pb2.TENSOR_FORMAT_REST,
                                request_id if isinstance(request_id, str) else str(request_id),
                                inputs, outputs, parameters, bool(binary_output), 0))


def decode_grpc(payload: bytes) -> InferRequest:
    """A serialized ``inference.ModelInferRequest``: typed contents or raw_input_contents."""
    try:
        message = open_inference_pb2.ModelInferRequest.FromString(payload)
    except Exception as exc:  # protobuf's DecodeError
        raise InvalidInput(f"malformed ModelInferRequest: {exc}") from None
    if not message.inputs:
        raise InvalidInput("the request has no inputs")
    raw = list(message.raw_input_contents)
    if raw and len(raw) != len(message.inputs):
        raise InvalidInput(f"raw_input_contents has {len(raw)} entries for "
                           f"{len(message.inputs)} inputs")
    inputs: list[Tensor] = []
    budget = ShapeBudget(len(payload))
    for index, tensor in enumerate(message.inputs):
        name, datatype = tensor.name, tensor.datatype
        _check_datatype(name, datatype)
        shape = list(tensor.shape)
        if not shape or any(dim < 0 for dim in shape):
            raise InvalidInput(f"input {name!r}: the shape must be a list of sizes, first the "
                               f"batch dimension; got {shown_shape(shape)}")
        budget.spend(name, shape)
        count = math.prod(shape)
        if raw:
            data = unpack(datatype, raw[index], count, name)
        elif datatype == "FP16":
            raise InvalidInput(f"input {name!r}: FP16 data must be sent as raw_input_contents")
        else:
            data = list(getattr(tensor.contents, CONTENTS_FIELDS[datatype]))
            check_elements(name, datatype, data)
        _check_count(name, shape, len(data))
        inputs.append(Tensor(name, datatype, shape, data, _grpc_parameters(tensor.parameters)))
    outputs = [RequestedOutput(output.name, _grpc_parameters(output.parameters).get(
        "binary_data")) for output in message.outputs]
    return _finish(InferRequest(worker_pb2.TENSOR_FORMAT_GRPC, message.id, inputs, outputs,
                                _grpc_parameters(message.parameters), bool(raw), 0))


def _finish(request: InferRequest) -> InferRequest:
    names = [tensor.name for tensor in request.inputs]
    if len(set(names)) != len(names):
        raise InvalidInput(f"input names repeat: {names}")
    rows = {tensor.name: tensor.shape[0] for tensor in request.inputs}
    if len(set(rows.values())) != 1:
        raise InvalidInput(f"the inputs differ in their first (batch) dimension: {rows}")
    request.rows = request.inputs[0].shape[0]
    if request.rows < 1:
        raise InvalidInput("the inputs hold no rows (the first dimension is 0)")
    return request


def _tensor_header(raw: Mapping[str, Any], where: str) -> tuple[str, str, list[int]]:
    name = raw.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidInput(f"{where} needs a 'name'")
    datatype = raw.get("datatype")
    _check_datatype(name, datatype)
    assert isinstance(datatype, str)
    shape = raw.get("shape")
    if (not isinstance(shape, list) or not shape
            or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
        raise InvalidInput(f"input {name!r}: 'shape' must be a list of sizes, first the batch "
                           f"dimension; got {shown_shape(shape)}")
    return name, datatype, shape


class ShapeBudget:
    """What a request's shapes may cost as nested lists (``rows``): bounded by its size
    (``size`` of ``unit``: its bytes, or the elements it holds)."""

    def __init__(self, size: int, unit: str = "bytes") -> None:
        self.size = f"{size} {unit}"
        self.left = EXPANSION_PER_BYTE * max(size, 1)

    def spend(self, name: str, shape: list[int]) -> None:
        """Count a tensor of ``shape``: each prefix of it is that many lists (or elements).
        Raises InvalidInput past the request's budget (work O(len(shape)) at most)."""
        if len(shape) > MAX_DIMENSIONS:
            raise InvalidInput(f"input {name!r} has {len(shape)} dimensions; at most "
                               f"{MAX_DIMENSIONS}")
        product = 1
        for size in shape:
            product *= size
            if product == 0:
                break
            self.left -= product
            if self.left < 0:
                raise InvalidInput(
                    f"input {name!r}: its shape {shown_shape(shape)} describes more rows and "
                    f"nested lists than a request of {self.size} can hold (an empty tensor's "
                    "dimensions count too)")


def shown_shape(shape: object) -> str:
    """A shape for an error message, cut short."""
    text = repr(shape)
    return text if len(text) <= 80 else text[:80] + "...]"


def _check_datatype(name: str, datatype: object) -> None:
    if datatype not in DATATYPES:
        raise InvalidInput(f"input {name!r}: unknown datatype {datatype!r}; use one of "
                           f"{', '.join(DATATYPES)}")


def _check_count(name: str, shape: list[int], count: int) -> None:
    expected = math.prod(shape)
    if count != expected:
        raise InvalidInput(f"input {name!r} has {count} elements, but its shape "
                           f"{shown_shape(shape)} holds {expected}")


def _parameters(raw: object, where: str) -> dict[str, Any]:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise InvalidInput(f"the parameters of {where} must be an object")
    return dict(raw)


def _grpc_parameters(raw: Mapping[str, open_inference_pb2.InferParameter]) -> dict[str, Any]:
    values = {}
    for key, parameter in raw.items():
        choice = parameter.WhichOneof("parameter_choice")
        values[key] = getattr(parameter, choice) if choice else None
    return values


def _json_elements(datatype: str, data: Any, name: str) -> list[Any]:
    """JSON ``data`` (flat or nested lists) as a flat list of checked elements."""
    flat: list[Any] = []
    _flatten_into(data, flat)
    if datatype == "BYTES":
        flat = [item.encode("utf-8") if isinstance(item, str) else item for item in flat]
    check_elements(name, datatype, flat)
    if datatype in FLOATS:
        flat = [float(item) for item in flat]
    return flat


def _flatten_into(value: Any, out: list[Any]) -> None:
    """Append the leaves of nested lists in order (a loop: JSON may nest as deep as the
    parser allows, deeper than Python's recursion limit leaves room for here)."""
    stack = [iter([value])]
    while stack:
        for item in stack[-1]:
            if isinstance(item, list):
                stack.append(iter(item))
                break
            out.append(item)
        else:
            stack.pop()


def check_elements(name: str, datatype: str, data: Sequence[Any]) -> None:
    if datatype == "BOOL":
        bad = next((x for x in data if not isinstance(x, bool)), None)
        expected = "true or false"
    elif datatype == "BYTES":
        bad = next((x for x in data if not isinstance(x, bytes)), None)
        expected = "strings"
    elif datatype in FLOATS:
        bad = next((x for x in data
                    if isinstance(x, bool) or not isinstance(x, (int, float))), None)
        expected = "numbers"
    else:
        low, high = INTEGER_RANGES[datatype]
        bad = next((x for x in data if isinstance(x, bool) or not isinstance(x, int)
                    or not low <= x <= high), None)
        expected = f"integers in [{low}, {high}]"
    if bad is not None:
        raise InvalidInput(f"input {name!r} ({datatype}) holds {bad!r}; expected {expected}")


def unpack(datatype: str, chunk: bytes, count: int, name: str) -> list[Any]:
    """Binary tensor data (little-endian, row-major; BYTES length-prefixed) as a flat list."""
    if datatype == "BYTES":
        elements: list[Any] = []
        position = 0
        while position < len(chunk):
            if position + _LENGTH.size > len(chunk):
                raise InvalidInput(f"input {name!r}: BYTES data ends inside a length prefix")
            (size,) = _LENGTH.unpack_from(chunk, position)
            position += _LENGTH.size
            if position + size > len(chunk):
                raise InvalidInput(f"input {name!r}: BYTES element of {size} bytes runs past "
                                   "the end of the data")
            elements.append(bytes(chunk[position:position + size]))
            position += size
        return elements
    element = struct.calcsize("<" + FORMATS[datatype])
    if len(chunk) != count * element:
        raise InvalidInput(f"input {name!r}: {len(chunk)} bytes of {datatype} data, but its "
                           f"shape needs {count * element}")
    return list(struct.unpack(f"<{count}{FORMATS[datatype]}", chunk))


def pack(datatype: str, data: Sequence[Any]) -> bytes:
    """The binary form of a flat list of elements (see ``unpack``)."""
    if datatype == "BYTES":
        return b"".join(_LENGTH.pack(len(item)) + item for item in data)
    return struct.pack(f"<{len(data)}{FORMATS[datatype]}", *data)


# ---- rows -------------------------------------------------------------------------------------


def rows(request: InferRequest) -> list[dict[str, Any]]:
    """One ``{input_name: value}`` per element of the first dimension (values as nested lists,
    scalars for 1-D inputs, BYTES as bytes)."""
    columns = []
    for tensor in request.inputs:
        inner = tensor.shape[1:]
        size = math.prod(inner)
        columns.append((tensor.name, [_nest(tensor.data[row * size:(row + 1) * size], inner)
                                      for row in range(request.rows)]))
    return [{name: values[row] for name, values in columns} for row in range(request.rows)]


def _nest(flat: list[Any], shape: list[int]) -> Any:
    if not shape:
        return flat[0]
    if len(shape) == 1:
        return list(flat)
    step = math.prod(shape[1:])
    return [_nest(flat[i * step:(i + 1) * step], shape[1:]) for i in range(shape[0])]


# ---- MLServer's parameter merge and split ----------------------------------------------------


def merge_parameters(per_request: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The parameters of a batch's requests, each merged into the list of its values (in
    request order); ``content_type`` and ``headers`` keep their first value."""
    merged: dict[str, Any] = {}
    for parameters in per_request:
        for key, value in parameters.items():
            if key in UNMERGED_PARAMETERS:
                merged.setdefault(key, value)
            else:
                merged.setdefault(key, []).append(value)
    return merged


def split_parameters(parameters: Mapping[str, Any], count: int) -> list[dict[str, Any]]:
    """Batched parameters back per request: item i of a list goes to request i (a shorter list
    leaves the last requests without it); any other value goes to every request."""
    parts: list[dict[str, Any]] = [{} for _ in range(count)]
    for key, value in parameters.items():
        if isinstance(value, list) and key not in UNMERGED_PARAMETERS:
            for part, item in zip(parts, value, strict=False):
                part[key] = item
        else:
            for part in parts:
                part[key] = value
    return parts
