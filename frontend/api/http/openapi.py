"""OpenAPI 3.0.1 descriptions of our two HTTP APIs, as served by ``GET /api-description``.

TorchServe answers ``OPTIONS /`` and ``GET /api-description`` on each port with such a
document. Ours describes the endpoints batchserve really has, with the status codes and
bodies that frontend/api/http/inference.py and frontend/api/http/management.py really send; when one
of those changes, change its description here too.

Each call returns a fresh copy, so a caller may modify what it gets.
"""

from __future__ import annotations

import copy
from typing import Any

from frontend.settings import INT32_MAX, MAX_TIMEOUT_S

Json = dict[str, Any]

OPENAPI_VERSION = "3.0.1"
API_VERSION = "0.1.0"

_PUBLIC: list[Json] = []
"""``security`` of an operation that needs no token (/ping, the description itself)."""

_ERROR_SCHEMA: Json = {
    "type": "object",
    "description": "The body of every error response (frontend/errors.py).",
    "required": ["code", "type", "message"],
    "properties": {
        "code": {"type": "integer", "description": "The HTTP status code, repeated."},
        "type": {
            "type": "string",
            "description": "The error class, as TorchServe names it "
                           "(e.g. ModelNotFoundException).",
        },
        "message": {"type": "string", "description": "What went wrong, for a person."},
    },
}

_STATUS_SCHEMA: Json = {
    "type": "object",
    "required": ["status"],
    "properties": {"status": {"type": "string", "description": "What was done."}},
}


# ---- small builders ---------------------------------------------------------------------

def _ref(schema_name: str) -> Json:
    return {"$ref": f"#/components/schemas/{schema_name}"}


def _json_response(description: str, schema: Json) -> Json:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _error(description: str) -> Json:
    return _json_response(description, _ref("Error"))


def _status(description: str) -> Json:
    return _json_response(description, _ref("Status"))


def _param(location: str, name: str, description: str, schema: Json, *,
           required: bool = False) -> Json:
    return {"name": name, "in": location, "description": description,
            "required": required, "schema": schema}


def _query(name: str, description: str, schema: Json, *, required: bool = False) -> Json:
    return _param("query", name, description, schema, required=required)


def _path(name: str, description: str) -> Json:
    return _param("path", name, description, {"type": "string"}, required=True)


def _integer(default: int | None = None, minimum: int | None = None,
             maximum: int = INT32_MAX) -> Json:
    """A whole number parameter, in its range (what the server checks: 400 outside)."""
    schema: Json = {"type": "integer"}
    if default is not None:
        schema["default"] = default
    if minimum is not None:
        schema["minimum"] = minimum
    schema["maximum"] = maximum
    return schema


def _boolean(default: bool) -> Json:
    return {"type": "boolean", "default": default}


def _document(title: str, description: str, paths: Json, schemas: Json,
              security_schemes: Json) -> Json:
    # Deep-copied because the module-level schemas are shared between calls.
    return copy.deepcopy({
        "openapi": OPENAPI_VERSION,
        "info": {"title": title, "description": description, "version": API_VERSION},
        "paths": paths,
        "components": {"schemas": schemas, "securitySchemes": security_schemes},
    })


def _bearer_scheme(key_name: str) -> Json:
    return {
        "type": "http",
        "scheme": "bearer",
        "description": f"The {key_name} key from key_file.json, sent as "
                       "'Authorization: Bearer <key>'. Checked only while token "
                       "authorization is enabled (the default; --disable-token-auth "
                       "turns it off).",
    }


def _description_paths(port_name: str) -> Json:
    """``OPTIONS /`` and ``GET /api-description``: both answer with this very document."""
    ok = _json_response(
        f"This OpenAPI {OPENAPI_VERSION} description of the {port_name} API.",
        {
            "type": "object",
            "required": ["openapi", "info", "paths"],
            "properties": {
                "openapi": {"type": "string"},
                "info": {"type": "object"},
                "paths": {"type": "object"},
                "components": {"type": "object"},
            },
        },
    )
    return {
        "/": {
            "options": {
                "summary": "Describe this API (TorchServe's OPTIONS /).",
                "operationId": "describeApiOptions",
                "security": _PUBLIC,
                "responses": {"200": ok},
            },
        },
        "/api-description": {
            "get": {
                "summary": "Describe this API.",
                "operationId": "describeApi",
                "security": _PUBLIC,
                "responses": {"200": ok},
            },
        },
    }


# ---- inference (port 8080) --------------------------------------------------------------

_MODEL_NAME = _path("model_name", "Name of a registered model. Paths without a version "
                    "act on its default version.")
_MODEL_VERSION = _path("model_version", "Version of the model.")

_PREDICTION_BODY: Json = {
    "description": "The input, passed to the handler unparsed. A multipart/form-data body "
                   "becomes one input per field (TorchServe clients use 'data' or 'body'); "
                   "any other body (e.g. 'curl -T file', application/json) becomes the "
                   "single input 'body', with its Content-Type.",
    "required": False,
    "content": {
        "multipart/form-data": {
            "schema": {
                "type": "object",
                "properties": {"data": {"type": "string", "format": "binary"}},
                "additionalProperties": {"type": "string", "format": "binary"},
            },
        },
        "application/json": {"schema": {}},
        "*/*": {"schema": {"type": "string", "format": "binary"}},
    },
}


def _prediction(operation_id: str, summary: str) -> Json:
    return {
        "summary": summary,
        "operationId": operation_id,
        "requestBody": _PREDICTION_BODY,
        "responses": {
            "200": {
                "description": "The handler's output. Its media type is the one the handler "
                               "set, application/json when it set none.",
                "headers": {
                    "X-Request-ID": {
                        "description": "The id this server gave the request.",
                        "schema": {"type": "string", "format": "uuid"},
                    },
                },
                "content": {"*/*": {"schema": {"type": "string", "format": "binary"}}},
            },
            "400": _error("Bad input: an unreadable body or Content-Length, or the handler "
                          "rejected the payload (InvalidInputException)."),
            "401": _error("The inference key is missing, wrong or expired."),
            "404": _error("No such model, or no such version of it."),
            "413": _error("The body is larger than max_request_size."),
            "500": _error("The handler raised, the worker died, or the response is larger "
                          "than max_response_size."),
            "503": {
                "description": "The model's job queue is full (with Retry-After), the model "
                               "has no worker, or it is being unregistered.",
                "headers": {
                    "Retry-After": {
                        "description": "Seconds to wait before retrying; sent when the queue "
                                       "is full.",
                        "schema": {"type": "integer"},
                    },
                },
                "content": {"application/json": {"schema": _ref("Error")}},
            },
            "504": _error("No answer within the model's response_timeout, counted from "
                          "arrival (time in the queue included)."),
            "507": _error("The worker ran out of memory on this batch."),
        },
        "security": [{"bearerAuth": []}],
    }


def _explanation(operation_id: str, summary: str) -> Json:
    """A prediction that asks the handler to explain (TorchServe's ``explain`` header)."""
    operation = _prediction(operation_id, summary)
    operation["responses"]["200"] = _json_response(
        "The handler's explanations. The built-in image classifiers answer Captum's "
        "IntegratedGradients attributions over the preprocessed image, as nested lists of "
        "its shape ([3, 224, 224]); a 'target' field or form field picks the class (0).",
        {})
    operation["responses"]["501"] = _error("The handler has no explanation path, or Captum "
                                           "is not installed (pip install captum).")
    return operation


def _health(status: str) -> Json:
    return {"type": "object", "required": ["status"],
            "properties": {"status": {"type": "string", "enum": [status]}}}


_KSERVE_ERROR_SCHEMA: Json = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {"type": "string", "description": "What went wrong."}},
}
_READY_SCHEMA: Json = {"type": "object", "required": ["ready"],
                       "properties": {"name": {"type": "string"}, "ready": {"type": "boolean"}}}


def _kserve_error(description: str) -> Json:
    return _json_response(description, _ref("KServeError"))


def _kserve_operation(operation_id: str, summary: str, ok: str, *, model: bool = False,
                      body: bool = False, public: bool = False, ready: bool = False) -> Json:
    """One KServe route: its errors in KServe's body ({"error": ...})."""
    responses: Json = {"200": _json_response(ok, _READY_SCHEMA if ready
                                             else {"type": "object"})}
    if ready:
        responses["503"] = _json_response("Not ready.", _READY_SCHEMA)
    if not public:
        responses["401"] = _kserve_error("The inference key is missing, wrong or expired.")
    if model:
        responses["404"] = _kserve_error("No such model, or no such version of it.")
    if body:
        responses["400"] = _kserve_error("The body is not a valid request of this protocol.")
        responses["500"] = _kserve_error("The handler raised or the worker died.")
        responses["503"] = _kserve_error("The model's job queue is full, or it has no "
                                         "worker.")
        responses["504"] = _kserve_error("No answer within the model's response_timeout.")
    operation: Json = {"summary": summary, "operationId": operation_id,
                       "responses": responses,
                       "security": _PUBLIC if public else [{"bearerAuth": []}]}
    if body:
        operation["requestBody"] = {"required": True, "content": {
            "application/json": {"schema": {"type": "object"}}}}
    return operation


def _kserve_explain(operation: Json) -> Json:
    """A KServe explain route: a prediction, or 501 from a model that cannot explain."""
    operation["responses"]["501"] = _kserve_error("The handler has no explanation path, or "
                                                  "Captum is not installed.")
    return operation


def _kserve_paths() -> Json:
    """KServe's v1 and v2 REST routes (frontend/api/http/kserve.py)."""
    model = [_MODEL_NAME]
    version = [_MODEL_NAME, _MODEL_VERSION]
    v2_model = _kserve_operation("v2ModelMetadata", "Open Inference model metadata.",
                                 "The model's name, versions, platform and tensors.",
                                 model=True)
    v2_ready = _kserve_operation("v2ModelReady", "Whether the model can serve.",
                                 "Ready: it has a live worker.", model=True, ready=True)
    v2_infer = _kserve_operation("v2Infer", "Open Inference (v2) inference request.",
                                 "The outputs, as tensors.", model=True, body=True)
    v2_explain = _kserve_explain(_kserve_operation(
        "v2Explain", "Open Inference (v2) request for explanations.",
        "The explanations, as tensors (the image classifiers': attributions of the "
        "preprocessed image's shape).", model=True, body=True))
    return {
        "/v1/models": {"get": _kserve_operation("v1Models", "KServe v1: the models served.",
                                                "Their names.")},
        "/v1/models/{model_name}": {"parameters": model, "get": _kserve_operation(
            "v1ModelReady", "KServe v1: whether the model is ready.", "Its readiness.",
            model=True, ready=True)},
        "/v1/models/{model_name}:predict": {"parameters": model, "post": _kserve_operation(
            "v1Predict", "KServe v1 prediction of 'instances'.", "The predictions.",
            model=True, body=True)},
        "/v1/models/{model_name}:explain": {"parameters": model, "post": _kserve_explain(
            _kserve_operation("v1Explain", "KServe v1 explanation of 'instances'.",
                              "The explanations.", model=True, body=True))},
        "/v2": {"get": _kserve_operation("v2ServerMetadata", "Open Inference server metadata.",
                                         "The server's name, version and extensions.")},
        "/v2/health/live": {"get": _kserve_operation(
            "v2Live", "Open Inference liveness.", "Live.", public=True)},
        "/v2/health/ready": {"get": _kserve_operation(
            "v2Ready", "Open Inference readiness: every startup model loaded, every model with "
            "its minimum workers up.", "Ready.", public=True, ready=True)},
        "/v2/models/{model_name}": {"parameters": model, "get": v2_model},
        "/v2/models/{model_name}/versions/{model_version}": {
            "parameters": version, "get": {**v2_model, "operationId": "v2VersionMetadata"}},
        "/v2/models/{model_name}/ready": {"parameters": model, "get": v2_ready},
        "/v2/models/{model_name}/versions/{model_version}/ready": {
            "parameters": version, "get": {**v2_ready, "operationId": "v2VersionReady"}},
        "/v2/models/{model_name}/infer": {"parameters": model, "post": v2_infer},
        "/v2/models/{model_name}/versions/{model_version}/infer": {
            "parameters": version, "post": {**v2_infer, "operationId": "v2VersionInfer"}},
        "/v2/models/{model_name}/explain": {"parameters": model, "post": v2_explain},
        "/v2/models/{model_name}/versions/{model_version}/explain": {
            "parameters": version, "post": {**v2_explain, "operationId": "v2VersionExplain"}},
    }


def inference_description() -> Json:
    """The OpenAPI document of the inference API (port 8080)."""
    paths = _description_paths("inference")
    paths["/ping"] = {
        "get": {
            "summary": "Health check: healthy when every registered model is.",
            "operationId": "ping",
            "security": _PUBLIC,
            "responses": {
                "200": _json_response("Every model is healthy.", _health("Healthy")),
                "500": _json_response("At least one model is unhealthy.",
                                      _health("Unhealthy")),
            },
        },
    }
    paths["/predictions/{model_name}"] = {
        "parameters": [_MODEL_NAME],
        "post": _prediction("predictions", "Run inference on the default version."),
        "put": _prediction("predictionsPut", "Run inference on the default version (PUT)."),
    }
    paths["/predictions/{model_name}/{model_version}"] = {
        "parameters": [_MODEL_NAME, _MODEL_VERSION],
        "post": _prediction("versionPredictions", "Run inference on one model version."),
        "put": _prediction("versionPredictionsPut",
                           "Run inference on one model version (PUT)."),
    }
    paths["/explanations/{model_name}"] = {
        "parameters": [_MODEL_NAME],
        "post": _explanation("explanations", "Explain the default version's prediction."),
        "put": _explanation("explanationsPut",
                            "Explain the default version's prediction (PUT)."),
    }
    paths["/explanations/{model_name}/{model_version}"] = {
        "parameters": [_MODEL_NAME, _MODEL_VERSION],
        "post": _explanation("versionExplanations", "Explain one model version's prediction."),
        "put": _explanation("versionExplanationsPut",
                            "Explain one model version's prediction (PUT)."),
    }
    paths.update(_kserve_paths())
    return _document(
        "batchserve inference API",
        "Predictions, explanations and health of the models batchserve serves "
        "(TorchServe-compatible), and KServe's v1 and v2 (Open Inference) REST protocols on "
        "the same port.",
        paths,
        {"Error": _ERROR_SCHEMA, "Status": _STATUS_SCHEMA, "KServeError": _KSERVE_ERROR_SCHEMA},
        {"bearerAuth": _bearer_scheme("inference")},
    )



# ---- management (port 8081) -------------------------------------------------------------

_MANAGEMENT_AUTH: list[Json] = [{"bearerAuth": []}]

_MODEL_LIST_SCHEMA: Json = {
    "type": "object",
    "required": ["models"],
    "properties": {
        "nextPageToken": {
            "type": "string",
            "description": "Pass as next_page_token to get the next page; absent on the "
                           "last page.",
        },
        "models": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["modelName", "modelUrl"],
                "properties": {
                    "modelName": {"type": "string"},
                    "modelUrl": {"type": "string"},
                },
            },
        },
    },
}

_WORKER_SCHEMA: Json = {
    "type": "object",
    "required": ["id", "startTime", "status", "memoryUsage", "pid", "gpu"],
    "properties": {
        "id": {"type": "string"},
        "startTime": {"type": "string", "format": "date-time"},
        "status": {"type": "string", "enum": ["STARTING", "READY", "RESTARTING", "UNLOADING"]},
        "memoryUsage": {"type": "integer", "description": "Resident set size, in bytes."},
        "pid": {"type": "integer", "description": "-1 while no process runs."},
        "gpu": {"type": "boolean", "description": "Whether the worker was given a GPU."},
        "gpuUsage": {"type": "string",
                     "description": "nvidia-smi's utilization and memory of its GPU, N/A "
                                    "without one (TorchServe's format)."},
        "lastError": {"type": "string", "description": "Why the worker last failed, if it did."},
    },
}

_MODEL_DESCRIPTION_SCHEMA: Json = {
    "type": "object",
    "required": ["modelName", "modelVersion", "modelUrl", "runtime", "minWorkers",
                 "maxWorkers", "batchSize", "maxBatchDelay", "responseTimeout",
                 "startupTimeout", "loadedAtStartup", "handler", "workers",
                 "jobQueueStatus", "batching"],
    "properties": {
        "modelName": {"type": "string"},
        "modelVersion": {"type": "string"},
        "modelUrl": {"type": "string"},
        "runtime": {"type": "string"},
        "minWorkers": {"type": "integer"},
        "maxWorkers": {"type": "integer"},
        "batchSize": {"type": "integer"},
        "maxBatchDelay": {"type": "integer", "description": "Milliseconds."},
        "responseTimeout": {"type": "integer", "description": "Seconds."},
        "startupTimeout": {"type": "integer", "description": "Seconds."},
        "maxRetryTimeoutInSec": {"type": "integer"},
        "clientTimeoutInMills": {
            "type": "integer",
            "description": "A request's deadline (ms) when its client sets none; 0: none."},
        "parallelType": {"type": "string"},
        "parallelLevel": {"type": "integer"},
        "deviceType": {"type": "string", "enum": ["cpu", "gpu"]},
        "deviceIds": {"type": "array", "items": {"type": "integer"}},
        "continuousBatching": {"type": "boolean"},
        "useJobTicket": {"type": "boolean"},
        "useVenv": {"type": "boolean"},
        "loadedAtStartup": {"type": "boolean"},
        "handler": {"type": "string"},
        "workers": {"type": "array", "items": _ref("Worker")},
        "jobQueueStatus": {
            "type": "object",
            "required": ["remainingCapacity", "pendingRequests"],
            "properties": {
                "remainingCapacity": {"type": "integer"},
                "pendingRequests": {"type": "integer"},
            },
        },
        "batching": {
            "type": "object",
            "description": "How requests are being batched (batchserve's own; not in "
                           "TorchServe).",
            "required": ["policy", "queueDepth", "inFlightBatches", "batchesTotal",
                         "requestsTotal", "recentBatchSizes", "meanBatchSize",
                         "dispatchReasons", "batchFill"],
            "properties": {
                "policy": {"type": "string"},
                "queueDepth": {"type": "integer"},
                "inFlightBatches": {"type": "integer"},
                "batchesTotal": {"type": "integer"},
                "requestsTotal": {"type": "integer"},
                "recentBatchSizes": {"type": "array", "items": {"type": "integer"}},
                "meanBatchSize": {"type": "number"},
                "dispatchReasons": {
                    "type": "object",
                    "description": "Why the recent batches left the queue: full, max_delay, "
                                   "adaptive, deadline, slot_free, sequence (only those "
                                   "that occurred), with their counts.",
                    "additionalProperties": {"type": "integer"},
                },
                "batchFill": {
                    "type": "object",
                    "description": "The recent batches' fill (size / batch_size): how many, "
                                   "their mean, and how many fell in each bucket (its upper "
                                   "bound).",
                    "required": ["batches", "mean", "buckets"],
                    "properties": {
                        "batches": {"type": "integer"},
                        "mean": {"type": "number"},
                        "buckets": {"type": "object",
                                    "additionalProperties": {"type": "integer"}},
                        "over": {"type": "integer"},
                    },
                },
            },
        },
        "customizedMetadata": {
            "description": "Only with customized=true: the handler's describe_handle() "
                           "output, parsed when it is application/json, else text.",
        },
    },
}

_TOKEN_ENTRY_SCHEMA: Json = {
    "type": "object",
    "required": ["key", "expiration time"],
    "properties": {
        "key": {"type": "string"},
        "expiration time": {"type": "string", "description": "UTC, ISO 8601."},
    },
}


def _register_operation() -> Json:
    parameters = [
        _query("url", "The model archive: a file name in the model store, a path or an "
               "http(s) URL allowed by allowed_urls.", {"type": "string"}, required=True),
        _query("model_name", "Overrides the name in the archive's MANIFEST.json.",
               {"type": "string"}),
        _query("handler", "Overrides the handler in the archive's MANIFEST.json.",
               {"type": "string"}),
        _query("runtime", "Only python is supported.",
               {"type": "string", "enum": ["python", "python3"], "default": "python"}),
        _query("batch_size", "Largest batch sent to a worker.", _integer(minimum=1)),
        _query("max_batch_delay", "Longest wait, in milliseconds, to fill a batch.",
               _integer(minimum=0)),
        _query("initial_workers", "Workers started at registration.", _integer(minimum=0)),
        _query("synchronous", "Answer once the initial workers have started (200) rather "
               "than at once (202).", _boolean(True)),
        _query("response_timeout", "Seconds a request may take, queue included.",
               _integer(minimum=1, maximum=MAX_TIMEOUT_S)),
        _query("startup_timeout", "Seconds a worker may take to load the model.",
               _integer(minimum=1, maximum=MAX_TIMEOUT_S)),
    ]
    return {
        "summary": "Register a model archive.",
        "operationId": "registerModel",
        "parameters": parameters,
        "responses": {
            "200": _status("Registered; its initial workers have started."),
            "202": _status("Registered; its workers are still starting."),
            "400": _error("A parameter is missing or invalid, or the archive is unusable."),
            "401": _error("The management key is missing, wrong or expired."),
            "403": _error("The url, or a redirect from it, is not allowed by "
                          "allowed_urls."),
            "405": _error("The model API is disabled (start with --enable-model-api)."),
            "409": _error("This version of the model is already registered."),
            "500": _error("A worker failed to start."),
        },
        "security": _MANAGEMENT_AUTH,
    }


def _describe_operation(operation_id: str) -> Json:
    return {
        "summary": "Describe a model version, or every version of it.",
        "operationId": operation_id,
        "parameters": [
            _query("customized", "Also ask a worker for the handler's "
                   "customizedMetadata.",
                   _boolean(False)),
        ],
        "responses": {
            "200": _json_response("The model's versions: one, or all of them.",
                                  {"type": "array", "items": _ref("ModelDescription")}),
            "400": _error("customized is not a boolean."),
            "401": _error("The management key is missing, wrong or expired."),
            "404": _error("No such model, or no such version of it."),
            "500": _error("customized=true: the handler's describe_handle() failed."),
            "503": _error("customized=true: the model has no worker, or its queue is full."),
            "504": _error("customized=true: no answer within the model's "
                          "response_timeout."),
        },
        "security": _MANAGEMENT_AUTH,
    }


def _scale_operation(operation_id: str) -> Json:
    return {
        "summary": "Set the number of workers of a model version.",
        "operationId": operation_id,
        "parameters": [
            _query("min_worker", "Workers to keep running.", _integer(default=1, minimum=0)),
            _query("max_worker", "Most workers; defaults to min_worker.", _integer(minimum=0)),
            _query("number_gpu", "Accepted for TorchServe compatibility; the server "
                   "assigns GPUs to workers itself.",
                   _integer(minimum=0)),
            _query("synchronous", "Answer once the new workers have started (200) rather "
                   "than at once (202).", _boolean(False)),
            _query("timeout", "Seconds to let a removed worker finish its work: -1 waits "
                   "as long as it takes, 0 kills it at once.", _integer(default=-1, minimum=-1)),
        ],
        "responses": {
            "200": _status("The workers were scaled and have started."),
            "202": _status("Scaling goes on in the background."),
            "400": _error("A parameter is invalid (e.g. max_worker < min_worker)."),
            "401": _error("The management key is missing, wrong or expired."),
            "404": _error("No such model, or no such version of it."),
            "500": _error("A new worker failed to start."),
        },
        "security": _MANAGEMENT_AUTH,
    }


def _unregister_operation(operation_id: str) -> Json:
    return {
        "summary": "Unregister a model version (the default one when no version is given).",
        "operationId": operation_id,
        "responses": {
            "200": _status("Unregistered."),
            "401": _error("The management key is missing, wrong or expired."),
            "403": _error("The default version cannot be removed while other versions "
                          "are registered."),
            "404": _error("No such model, or no such version of it."),
            "405": _error("The model API is disabled (start with --enable-model-api)."),
        },
        "security": _MANAGEMENT_AUTH,
    }


def _list_operation() -> Json:
    return {
        "summary": "List registered models, a page at a time.",
        "operationId": "listModels",
        "parameters": [
            _query("limit", "Page size; a value outside 1..100 means 100.",
                   _integer(default=100, minimum=1, maximum=100)),
            _query("next_page_token", "Where the page starts: nextPageToken from the "
                   "previous page.", _integer(default=0, minimum=0)),
        ],
        "responses": {
            "200": _json_response("One page of models.", _ref("ModelList")),
            "400": _error("limit or next_page_token is not a valid integer."),
            "401": _error("The management key is missing, wrong or expired."),
        },
        "security": _MANAGEMENT_AUTH,
    }


def _token_operation() -> Json:
    return {
        "summary": "Replace the inference or management key.",
        "operationId": "rotateToken",
        "parameters": [
            _query("type", "Which key to replace.",
                   {"type": "string", "enum": ["inference", "management"]},
                   required=True),
        ],
        "responses": {
            "200": _json_response(
                "The new key, keyed by type; key_file.json is rewritten too.",
                {
                    "type": "object",
                    "minProperties": 1,
                    "maxProperties": 1,
                    "properties": {"inference": _TOKEN_ENTRY_SCHEMA,
                                   "management": _TOKEN_ENTRY_SCHEMA},
                },
            ),
            "400": _error("type is not inference or management, or token "
                          "authorization is disabled."),
            "401": _error("The API key is missing or wrong."),
        },
        "security": [{"apiKeyAuth": []}],
    }


def management_description() -> Json:
    """The OpenAPI document of the management API (port 8081)."""
    version = _path("model_version", "Version of the model; GET also takes 'all'.")
    paths = _description_paths("management")
    paths["/models"] = {"get": _list_operation(), "post": _register_operation()}
    paths["/models/{model_name}"] = {
        "parameters": [_MODEL_NAME],
        "get": _describe_operation("describeModel"),
        "put": _scale_operation("scaleModel"),
        "delete": _unregister_operation("unregisterModel"),
    }
    paths["/models/{model_name}/{model_version}"] = {
        "parameters": [_MODEL_NAME, version],
        "get": _describe_operation("describeModelVersion"),
        "put": _scale_operation("scaleModelVersion"),
        "delete": _unregister_operation("unregisterModelVersion"),
    }
    paths["/models/{model_name}/{model_version}/set-default"] = {
        "parameters": [_MODEL_NAME, _MODEL_VERSION],
        "put": {
            "summary": "Make this version the model's default.",
            "operationId": "setDefaultVersion",
            "responses": {
                "200": _status("The default version was changed."),
                "401": _error("The management key is missing, wrong or expired."),
                "404": _error("No such model, or no such version of it."),
            },
            "security": _MANAGEMENT_AUTH,
        },
    }
    paths["/token"] = {"get": _token_operation()}
    return _document(
        "batchserve management API",
        "Register, describe, scale and unregister the models batchserve serves "
        "(TorchServe-compatible).",
        paths,
        {
            "Error": _ERROR_SCHEMA,
            "Status": _STATUS_SCHEMA,
            "ModelList": _MODEL_LIST_SCHEMA,
            "ModelDescription": _MODEL_DESCRIPTION_SCHEMA,
            "Worker": _WORKER_SCHEMA,
        },
        {"bearerAuth": _bearer_scheme("management"), "apiKeyAuth": _bearer_scheme("API")},
    )
