"""KServe v1 and Open Inference Protocol (v2) pieces shared by REST and gRPC.

Readiness and metadata are answered here from the registry and the archive's model-config.yaml;
predictions go through the model's batcher like any other request. The frontend reads just
enough of a request to know how many batch items it brings (its ``Job.weight``): the instances
of a v1 request, the first dimension of a v2 request's tensors. Tensors themselves are decoded
and encoded in the worker (backend/codecs/open_inference.py), so no tensor code runs here.
"""

from __future__ import annotations

from typing import Any

from frontend.errors import BadRequest, quoted
from frontend.models.model import Model
from frontend.models.registry import ModelRegistry
from frontend.ops.tenants import parse_priority
from protos import json_limits

SERVER_NAME = "batchserve"
#: Open Inference Protocol extensions we implement.
EXTENSIONS = ("binary_tensor_data", "parameters")
PLATFORM = "pytorch"
HEADER_LENGTH = "inference-header-content-length"


def is_server_ready(registry: ModelRegistry) -> bool:
    """Ready when every model the server was started with is registered and every registered
    model version has its ``min_workers`` up (so, with none registered). Stricter than each
    model's readiness (one worker up) because Kubernetes probes it: a replica short of workers
    would get a full share of traffic with part of its capacity, and a worker that keeps dying
    takes the replica out of the Service meanwhile."""
    return not registry.missing() and all(model.has_min_workers_up() for model in registry)


def server_metadata(version: str) -> dict[str, Any]:
    return {"name": SERVER_NAME, "version": version, "extensions": list(EXTENSIONS)}


def model_metadata(model: Model, versions: list[str]) -> dict[str, Any]:
    """OIP model metadata; the tensors come from the archive's model-config.yaml."""
    return {"name": model.name, "versions": versions, "platform": PLATFORM,
            "inputs": model.tensors.inputs, "outputs": model.tensors.outputs}


def parse_json(data: bytes) -> Any:
    """A request's JSON, its nesting bounded before it is parsed (protos/json_limits.py)."""
    try:
        return json_limits.loads(data)
    except ValueError as exc:
        raise BadRequest(f"malformed JSON: {exc}") from None


def v1_instances(body: bytes, max_instances: int) -> list[Any]:
    """The instances of a KServe v1 request: ``{"instances": [...]}`` or ``{"inputs": [...]}``."""
    payload = parse_json(body)
    instances = None
    if isinstance(payload, dict):
        instances = payload.get("instances", payload.get("inputs"))
    if not isinstance(instances, list) or not instances:
        raise BadRequest('the request must be {"instances": [...]} (or {"inputs": [...]}) with '
                         "at least one instance")
    if len(instances) > max_instances:
        raise BadRequest(f"a request may carry at most {max_instances} instances, this one "
                         f"has {len(instances)} (max_request_instances)")
    return instances


def split_v2_body(body: bytes, header_length: str | None) -> bytes:
    """The JSON part of a v2 REST request (all of it without the binary tensor extension)."""
    if header_length is None:
        return body
    try:
        length = int(header_length)
    except ValueError:
        raise BadRequest(f"{HEADER_LENGTH} must be an integer, got {quoted(header_length)}"
                         ) from None
    if not 0 <= length <= len(body):
        raise BadRequest(f"{HEADER_LENGTH} is {length}, but the body has {len(body)} bytes")
    return body[:length]


def v2_rows(payload: Any, max_inputs: int, max_rows: int) -> int:
    """How many batch rows a v2 JSON request brings: its tensors' first dimension."""
    inputs = payload.get("inputs") if isinstance(payload, dict) else None
    if not isinstance(inputs, list) or not inputs:
        raise BadRequest("the request must be a JSON object with a non-empty 'inputs' list")
    if len(inputs) > max_inputs:
        raise BadRequest(f"a request may carry at most {max_inputs} inputs "
                         "(max_request_inputs)")
    shapes = [tensor.get("shape") if isinstance(tensor, dict) else None for tensor in inputs]
    return _rows(shapes, max_rows)


def v2_priority(payload: Any) -> int:
    """The priority level a v2 request's ``parameters`` name (Triton's ``priority``; 0:
    none); BadRequest for one that is not a level."""
    parameters = payload.get("parameters") if isinstance(payload, dict) else None
    if not isinstance(parameters, dict) or parameters.get("priority") in (None, 0):
        return 0  # Triton: 0 is the model's default level
    return parse_priority("parameter priority", parameters["priority"])


def _rows(shapes: list[Any], max_rows: int) -> int:
    firsts = set()
    for shape in shapes:
        if (not isinstance(shape, (list, tuple)) or not shape or isinstance(shape[0], bool)
                or not isinstance(shape[0], int)):
            raise BadRequest("every input needs a 'shape' whose first dimension is the batch "
                             "(row) count")
        firsts.add(shape[0])
    if len(firsts) != 1:
        raise BadRequest(f"the inputs differ in their first (batch) dimension: "
                         f"{quoted(sorted(firsts))}")
    rows = firsts.pop()
    if rows < 1:
        raise BadRequest(f"the inputs hold no rows (the first dimension is {rows}: it must be "
                         f"from 1 to {max_rows})")
    if rows > max_rows:
        raise BadRequest(f"a request may carry at most {max_rows} rows, this one has {rows} "
                         "(max_request_instances)")
    return int(rows)


def v2_grpc_rows(shapes: list[list[int]], max_rows: int) -> int:
    """How many batch rows a ModelInferRequest brings (its inputs' shapes)."""
    if not shapes:
        raise BadRequest("the request has no inputs")
    return _rows(shapes, max_rows)
