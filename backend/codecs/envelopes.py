"""TorchServe's service envelopes (``service_envelope`` / ``TS_SERVICE_ENVELOPE``).

An envelope unwraps a request body in an orchestrator's format into the handler's rows and
wraps the handler's results back, around an unchanged handler, as TorchServe's
``ts/torch_handler/request_envelope`` modules do:

- ``kserve`` (KServe v1): ``{"instances": [...]}``, one row per instance as it is; answered
  ``{"predictions": [...]}`` (``{"explanations": [...]}`` for an explanation).
- ``kservev2`` (Open Inference Protocol): ``{"id", "inputs": [...]}``, one row per input
  tensor: the input object itself with its ``data`` reshaped to its ``shape`` (nested lists),
  or, for BYTES, the first element as it came (base64 text for an image); answered
  ``{"id", "model_name", "model_version", "outputs": [...]}``, output i named after input i,
  its data flattened, its datatype numpy's for it (``FP64`` for Python floats).
- ``json``: ``{"instances": [...]}`` rows, ``{"b64": ...}`` values decoded; answered with the
  text ``{"predictions": [...]}``. ``body``: the request body is the row, the result the answer.

Where TorchServe's kserve envelopes read only the first request of a batch (a batch of two
fails), each request is unwrapped and wrapped on its own here. The rows of several requests
share one handler call, except with ``kservev2``: its rows are one request's named inputs,
which a handler may read together (TorchServe's BERT v2 example takes ``input_ids`` and
``attention_masks`` from one request), so it calls the handler once per request.
"""

from __future__ import annotations

import base64
import binascii
import json
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from backend.codecs import open_inference, v2_outputs
from backend.context import Context
from backend.errors import HandlerLoadError, InvalidHandlerOutput, InvalidInput
from protos import json_limits

#: numpy dtype (its name, else its kind) -> v2 datatype, TorchServe's kservev2 table.
_DATATYPES = {
    "bool": "BOOL", "uint8": "UINT8", "uint16": "UINT16", "uint32": "UINT32",
    "uint64": "UINT64", "int8": "INT8", "int16": "INT16", "int32": "INT32", "int64": "INT64",
    "float16": "FP16", "float32": "FP32", "float64": "FP64", "object": "BYTES", "U": "BYTES",
}


@dataclass(slots=True)
class Unwrapped:
    """One request's rows for the handler, and what wrapping its results needs."""

    rows: list[Any]
    #: kservev2: the names of the request's inputs (output i is named after input i)...
    input_names: list[str] = field(default_factory=list)
    #: ...and the id its answer carries.
    answer_id: str = ""


class Envelope(ABC):
    name: ClassVar[str]
    #: The rows of several requests may go to one handler call.
    joins_requests: ClassVar[bool] = True

    def __init__(self, context: Context) -> None:
        self.context = context

    @abstractmethod
    def unwrap(self, data: Mapping[str, Any], request_id: str) -> Unwrapped:
        """The rows of one request (``data``: its inputs as the handler would see them).
        Raises InvalidInput."""

    @abstractmethod
    def wrap(self, results: list[Any], unwrapped: Unwrapped, explain: bool) -> Any:
        """One request's answer from the handler's results for its rows. Raises
        InvalidHandlerOutput."""


def _payload(data: Mapping[str, Any]) -> Any:
    """The request's value, as TorchServe's envelopes take it: ``data``, else ``body``."""
    return data.get("data") or data.get("body")


def _document(value: Any, envelope: str) -> Any:
    """A JSON body: decoded already (application/json), or bytes/text to decode."""
    if isinstance(value, (bytes, bytearray, str)):
        try:
            return json_limits.loads(value)
        except ValueError as exc:
            raise InvalidInput(f"the {envelope} envelope expects a JSON body: {exc}") from None
    return value


def _instances(document: Any, envelope: str) -> list[Any]:
    instances = document.get("instances") if isinstance(document, dict) else None
    if not isinstance(instances, list) or not instances:
        raise InvalidInput(f'the {envelope} envelope expects a JSON body {{"instances": [...]}} '
                           "with at least one instance")
    return instances


class KServeEnvelope(Envelope):
    name = "kserve"

    def unwrap(self, data: Mapping[str, Any], request_id: str) -> Unwrapped:
        return Unwrapped(_instances(_document(_payload(data), self.name), self.name))

    def wrap(self, results: list[Any], unwrapped: Unwrapped, explain: bool) -> Any:
        return {"explanations" if explain else "predictions": results}


class KServeV2Envelope(Envelope):
    name = "kservev2"
    joins_requests = False

    def __init__(self, context: Context) -> None:
        super().__init__(context)
        # numpy shapes and types the tensors as TorchServe's envelope does; torchvision
        # depends on it, so it is there, but only this envelope's workers pay the import.
        import numpy

        self.numpy = numpy

    def unwrap(self, data: Mapping[str, Any], request_id: str) -> Unwrapped:
        document = _document(_payload(data), self.name)
        inputs = document.get("inputs") if isinstance(document, dict) else None
        if not isinstance(inputs, list) or not inputs:
            raise InvalidInput('the kservev2 envelope expects a JSON body {"inputs": [...]} with '
                               "at least one input")
        rows = [self._row(tensor, index) for index, tensor in enumerate(inputs)]
        answer_id = document.get("id")
        return Unwrapped(rows, [row["name"] for row in rows],
                         answer_id if isinstance(answer_id, str) and answer_id.strip()
                         else request_id)

    def _row(self, tensor: Any, index: int) -> dict[str, Any]:
        if not isinstance(tensor, dict) or not isinstance(tensor.get("name"), str):
            raise InvalidInput(f"input {index} must be an object with a 'name'")
        name, values = tensor["name"], tensor.get("data")
        if not isinstance(values, list) or not values:
            raise InvalidInput(f"input {name!r}: 'data' must be a non-empty list")
        row = dict(tensor)
        if tensor.get("datatype") == "BYTES":
            row["data"] = values[0]  # TorchServe passes the first element as it came
            return row
        shape = tensor.get("shape")
        if not isinstance(shape, list):
            raise InvalidInput(f"input {name!r}: 'shape' must be a list")
        try:
            array = self.numpy.array(values).reshape(tuple(shape))
        except (ValueError, TypeError) as exc:
            raise InvalidInput(f"input {name!r}: its data does not fit its shape "
                               f"{open_inference.shown_shape(shape)}: {exc}") from None
        # An empty array of a huge shape ([[]] as [1, 3000000, 0]) holds nothing, yet its
        # lists would be millions.
        open_inference.ShapeBudget(array.size, "elements").spend(name, list(array.shape))
        row["data"] = array.tolist()
        return row

    def wrap(self, results: list[Any], unwrapped: Unwrapped, explain: bool) -> Any:
        if len(results) > len(unwrapped.input_names):
            raise InvalidHandlerOutput(
                f"{len(results)} outputs for {len(unwrapped.input_names)} inputs: the kservev2 "
                "envelope names output i after input i")
        model = self.context.manifest.get("model") or {}
        return {
            "id": unwrapped.answer_id,
            "model_name": model.get("modelName"),
            "model_version": model.get("modelVersion"),
            "outputs": [self._output(item, name)
                        for item, name in zip(results, unwrapped.input_names, strict=False)],
        }

    def _output(self, item: Any, name: str) -> dict[str, Any]:
        if callable(getattr(item, "detach", None)):  # a torch tensor, maybe on a GPU
            item = item.detach().cpu()
        try:
            array = self.numpy.array(item).flatten()
        except (ValueError, TypeError) as exc:
            raise InvalidHandlerOutput(f"output {name!r} is not an array: {exc}") from None
        datatype = _DATATYPES.get(str(array.dtype)) or _DATATYPES.get(array.dtype.kind)
        if datatype is None:
            raise InvalidHandlerOutput(f"output {name!r}: no v2 datatype for numpy's "
                                       f"{array.dtype}")
        return {"name": name, "datatype": datatype, "data": array.tolist(),
                "shape": list(array.shape)}


class JsonEnvelope(Envelope):
    name = "json"

    def unwrap(self, data: Mapping[str, Any], request_id: str) -> Unwrapped:
        document = _document(_payload(data) or dict(data), self.name)
        rows = _instances(document, self.name)
        if isinstance(rows[0], dict):
            rows = [_b64_decoded(row) for row in rows]
        return Unwrapped(rows)

    def wrap(self, results: list[Any], unwrapped: Unwrapped, explain: bool) -> Any:
        try:
            return json.dumps({"predictions": results})
        except (TypeError, ValueError) as exc:
            raise InvalidHandlerOutput(f"the predictions are not JSON: {exc}") from None


def _b64_decoded(row: Any) -> Any:
    """TensorFlow Serving's binary values: ``{"b64": "..."}`` as a row or a column value."""
    if not isinstance(row, dict):
        return row
    if list(row) == ["b64"]:
        return _b64(row["b64"])
    return {column: _b64(value["b64"]) if isinstance(value, dict) and list(value) == ["b64"]
            else value for column, value in row.items()}


def _b64(text: Any) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError, TypeError):
        raise InvalidInput(f"{str(text)[:40]!r} is not base64") from None


class BodyEnvelope(Envelope):
    name = "body"

    def unwrap(self, data: Mapping[str, Any], request_id: str) -> Unwrapped:
        return Unwrapped([_payload(data)])

    def wrap(self, results: list[Any], unwrapped: Unwrapped, explain: bool) -> Any:
        return results[0]


ENVELOPES: dict[str, type[Envelope]] = {
    envelope.name: envelope
    for envelope in (KServeEnvelope, KServeV2Envelope, JsonEnvelope, BodyEnvelope)
}


def make_envelope(name: str, context: Context) -> Envelope | None:
    """The envelope named by ``service_envelope`` ("" for none)."""
    if not name:
        return None
    try:
        return ENVELOPES[name](context)
    except KeyError:
        raise HandlerLoadError(f"unknown service_envelope {name!r}: use one of "
                               f"{', '.join(ENVELOPES)}") from None


# ---- gRPC ModelInfer through the kservev2 envelope -------------------------------------------


def v2_document(request: open_inference.InferRequest) -> dict[str, Any]:
    """A ModelInferRequest as the JSON body KServe's TorchServe wrapper made of it: BYTES
    elements as base64 text, other data as flat lists (raw contents decoded too)."""
    return {"id": request.id, "inputs": [
        {"name": tensor.name, "shape": tensor.shape, "datatype": tensor.datatype,
         "data": [base64.b64encode(item).decode("ascii") for item in tensor.data]
         if tensor.datatype == "BYTES" else tensor.data}
        for tensor in request.inputs]}


def grpc_answer(answer: Any, request: open_inference.InferRequest) -> bytes:
    """A serialized ModelInferResponse from a kservev2 answer (as the wrapper converted
    TorchServe's JSON): BYTES elements that are not text or bytes travel as JSON text."""
    outputs = answer.get("outputs") if isinstance(answer, dict) else None
    if not isinstance(outputs, list):
        raise InvalidHandlerOutput("ModelInfer needs the kservev2 envelope's answer "
                                   '({"outputs": [...]}); set service_envelope=kservev2')
    tensors = []
    for output in outputs:
        datatype, data = output["datatype"], output["data"]
        if datatype == "BYTES":
            data = [item if isinstance(item, bytes) else
                    (item if isinstance(item, str) else json.dumps(item)).encode("utf-8")
                    for item in data]
        tensors.append(open_inference.Tensor(output["name"], datatype, list(output["shape"]),
                                             v2_outputs.coerce(datatype, data,
                                                                   output["name"])))
    request.id = str(answer.get("id") or "")
    body, _, _ = v2_outputs.encode(request, tensors, str(answer.get("model_name") or ""),
                                       str(answer.get("model_version") or ""))
    return body
