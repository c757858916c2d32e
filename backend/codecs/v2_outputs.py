"""Open Inference Protocol (KServe v2) outputs: a handler's per-row results stacked back into
output tensors, and a request's response encoded the way the request came (REST JSON, with
the binary tensor extension where asked, or a serialized ``inference.ModelInferResponse``).

Pure Python (struct) on purpose, as backend/codecs/open_inference.py: the worker needs no numpy or
torch for this.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping, Sequence
from typing import Any

from backend.codecs.open_inference import (
    BINARY_DATA_SIZE,
    CONTENTS_FIELDS,
    DATATYPES,
    DEFAULT_OUTPUT,
    FLOATS,
    HEADER_LENGTH,
    InferRequest,
    Tensor,
    check_elements,
    pack,
)
from backend.errors import InvalidHandlerOutput, InvalidInput
from protos import open_inference_pb2, worker_pb2


def build_outputs(items: Sequence[Any], declared: Mapping[str, str]) -> list[Tensor]:
    """Stack one request's per-row results into tensors of shape ``[rows, ...]``.

    A row's result is ``{output_name: value}`` or a bare value (output ``DEFAULT_OUTPUT``);
    values may be scalars, nested lists, or anything with ``tolist()`` (numpy, torch). The
    datatype is the model-config.yaml's for that output, else inferred: BOOL, INT64, FP32 (for
    floats) or BYTES. Raises InvalidHandlerOutput.
    """
    columns: dict[str, list[Any]] = {}
    for index, item in enumerate(items):
        row = item if isinstance(item, Mapping) else {DEFAULT_OUTPUT: item}
        if index and row.keys() != columns.keys():
            raise InvalidHandlerOutput(f"row {index} has outputs {sorted(row)}, row 0 has "
                                       f"{sorted(columns)}")
        for name, value in row.items():
            columns.setdefault(str(name), []).append(_plain(value))
    outputs = []
    for name, values in columns.items():
        inner = _shape_of(values[0])
        flat: list[Any] = []
        for value in values:
            _flatten_checked(value, inner, flat, name)
        datatype = declared.get(name) or _infer_datatype(flat, name)
        outputs.append(Tensor(name, datatype, [len(values), *inner], coerce(datatype, flat,
                                                                             name)))
    return outputs


def _plain(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    tolist = getattr(value, "tolist", None)
    if callable(tolist):
        return tolist()
    return value


def _shape_of(value: Any) -> list[int]:
    if not isinstance(value, list):
        return []
    return [len(value), *(_shape_of(value[0]) if value else [])]


def _flatten_checked(value: Any, shape: list[int], out: list[Any], name: str) -> None:
    if not shape:
        if isinstance(value, list):
            raise InvalidHandlerOutput(f"output {name!r}: rows differ in shape")
        out.append(value)
        return
    if not isinstance(value, list) or len(value) != shape[0]:
        raise InvalidHandlerOutput(f"output {name!r}: rows differ in shape (not a rectangular "
                                   "array)")
    for item in value:
        _flatten_checked(item, shape[1:], out, name)


def _infer_datatype(flat: Sequence[Any], name: str) -> str:
    kinds = set()
    for item in flat:
        if isinstance(item, bool):
            kinds.add("BOOL")
        elif isinstance(item, int):
            kinds.add("INT64")
        elif isinstance(item, float):
            kinds.add("FP32")
        elif isinstance(item, (str, bytes, bytearray)):
            kinds.add("BYTES")
        else:
            raise InvalidHandlerOutput(f"output {name!r}: cannot encode a "
                                       f"{type(item).__name__} as a tensor element")
    if not kinds or (kinds <= {"INT64", "FP32"} and "FP32" in kinds):
        return "FP32"
    if len(kinds) == 1:
        return kinds.pop()
    raise InvalidHandlerOutput(f"output {name!r} mixes {sorted(kinds)} elements")


def coerce(datatype: str, flat: list[Any], name: str) -> list[Any]:
    """A flat list of output elements as ``datatype`` needs them. Raises InvalidHandlerOutput."""
    try:
        if datatype == "BYTES":
            return [item.encode("utf-8") if isinstance(item, str) else bytes(item)
                    for item in flat]
        if datatype in FLOATS:
            return [float(item) for item in flat]
        if datatype == "BOOL":
            check_elements(name, datatype, flat)
            return flat
        converted = [int(item) if isinstance(item, float) and item.is_integer() else item
                     for item in flat]
        check_elements(name, datatype, converted)
        return converted
    except (InvalidInput, TypeError, ValueError) as exc:
        raise InvalidHandlerOutput(f"output {name!r} does not fit {datatype}: {exc}") from None


def declared_datatypes(model_config: Mapping[str, Any]) -> dict[str, str]:
    """Output name -> datatype from the model-config.yaml ``outputs`` list."""
    declared = {}
    for entry in model_config.get("outputs") or ():
        if isinstance(entry, Mapping) and entry.get("datatype") in DATATYPES:
            declared[str(entry.get("name"))] = str(entry["datatype"])
    return declared


# ---- encoding ---------------------------------------------------------------------------------


def _selected(request: InferRequest, outputs: list[Tensor]) -> list[tuple[Tensor, bool]]:
    if not request.outputs:
        return [(tensor, request.is_binary_output) for tensor in outputs]
    by_name = {tensor.name: tensor for tensor in outputs}
    selected = []
    for wanted in request.outputs:
        tensor = by_name.get(wanted.name)
        if tensor is None:
            raise InvalidInput(f"unknown output {wanted.name!r}; the model produces "
                               f"{sorted(by_name)}")
        is_binary = request.is_binary_output if wanted.is_binary is None else wanted.is_binary
        selected.append((tensor, is_binary))
    return selected


def encode(request: InferRequest, outputs: list[Tensor], model_name: str,
           model_version: str, parameters: Mapping[str, Any] | None = None
           ) -> tuple[bytes, dict[str, str], str]:
    """The response to ``request``, in its own format: (body, headers, content type).

    Raises InvalidInput for an unknown requested output, InvalidHandlerOutput when an output
    cannot be encoded.
    """
    selected = _selected(request, outputs)
    if request.tensor_format == worker_pb2.TENSOR_FORMAT_GRPC:
        return _encode_grpc(request, selected, model_name, model_version, parameters or {}), \
            {}, "application/x-protobuf"
    document: dict[str, Any] = {"model_name": model_name, "model_version": model_version}
    if request.id:
        document["id"] = request.id
    if parameters:
        document["parameters"] = dict(parameters)
    entries = []
    blobs = []
    for tensor, is_binary in selected:
        entry: dict[str, Any] = {"name": tensor.name, "datatype": tensor.datatype,
                                 "shape": tensor.shape}
        tensor_parameters = dict(tensor.parameters)
        if is_binary:
            blob = _pack_output(tensor)
            tensor_parameters[BINARY_DATA_SIZE] = len(blob)
            blobs.append(blob)
        else:
            entry["data"] = _json_data(tensor)
        if tensor_parameters:
            entry["parameters"] = tensor_parameters
        entries.append(entry)
    document["outputs"] = entries
    header = json.dumps(document).encode("utf-8")
    if not blobs:
        return header, {}, "application/json"
    return header + b"".join(blobs), {HEADER_LENGTH: str(len(header))}, \
        "application/octet-stream"


def _pack_output(tensor: Tensor) -> bytes:
    try:
        return pack(tensor.datatype, tensor.data)
    except (struct.error, OverflowError) as exc:
        raise InvalidHandlerOutput(f"output {tensor.name!r} does not fit {tensor.datatype}: "
                                   f"{exc}") from None


def _json_data(tensor: Tensor) -> list[Any]:
    if tensor.datatype != "BYTES":
        return tensor.data
    try:
        return [item.decode("utf-8") for item in tensor.data]
    except UnicodeDecodeError:
        raise InvalidHandlerOutput(f"output {tensor.name!r} holds bytes that are not UTF-8 "
                                   "text: request it with binary_data") from None


def _encode_grpc(request: InferRequest, selected: list[tuple[Tensor, bool]], model_name: str,
                 model_version: str, parameters: Mapping[str, Any]) -> bytes:
    response = open_inference_pb2.ModelInferResponse(
        model_name=model_name, model_version=model_version, id=request.id)
    _set_grpc_parameters(response.parameters, parameters)
    # Raw contents are all or nothing; FP16 has no typed field.
    is_raw = request.is_binary_output or any(t.datatype == "FP16" for t, _ in selected)
    for tensor, _ in selected:
        output = response.outputs.add(name=tensor.name, datatype=tensor.datatype,
                                      shape=tensor.shape)
        _set_grpc_parameters(output.parameters, tensor.parameters)
        if is_raw:
            response.raw_output_contents.append(_pack_output(tensor))
        else:
            try:
                getattr(output.contents, CONTENTS_FIELDS[tensor.datatype]).extend(tensor.data)
            except (TypeError, ValueError) as exc:
                raise InvalidHandlerOutput(f"output {tensor.name!r} does not fit "
                                           f"{tensor.datatype}: {exc}") from None
    return bytes(response.SerializeToString())


def _set_grpc_parameters(target: Any, parameters: Mapping[str, Any]) -> None:
    for key, value in parameters.items():
        if isinstance(value, bool):
            target[key].bool_param = value
        elif isinstance(value, int):
            target[key].int64_param = value
        elif isinstance(value, str):
            target[key].string_param = value
        else:  # lists and floats have no InferParameter field: JSON text
            target[key].string_param = json.dumps(value)
