"""Amazon SageMaker's container contract, as TorchServe 0.12 serves it on the inference port.

SageMaker sends its traffic to ``POST /invocations`` (one model per container) and, for a
multi-model endpoint, ``POST /models/{name}/invoke``; batch transform may first ask
``GET /execution-parameters`` how to call the container. The routes themselves are parsed in
frontend/api/http/inference.py; this module holds the two rules they follow:

* which model an ``/invocations`` request means (TorchServe's ``handleInvocations`` and
  ``predict``): the ``model_name`` query parameter; else the one model loaded at start-up
  (``load_models`` / ``--models``), when exactly one was; else a ``model_name`` form field;
  else 400 "Parameter model_name is required.";
* what ``/execution-parameters`` answers. TorchServe 0.12 answers it only with its optional
  endpoint plugin (``plugins/endpoints``' ``ExecutionParameters``, loaded through
  ``plugins_path``), which the SageMaker toolkit does not load: there it is a 404 and batch
  transform falls back to its own defaults (one request at a time). Here it is always
  answered, in that plugin's format, from what this server can really take: see
  ``execution_parameters``.
"""

from __future__ import annotations

from collections.abc import Iterable

from frontend.config import ServerConfig
from frontend.errors import BadRequest
from frontend.models.registry import ModelRegistry

#: The query parameter (and form field) that names the model of an ``/invocations`` request.
MODEL_NAME = "model_name"
#: TorchServe's message when an ``/invocations`` request names no model and none is implied.
MODEL_NAME_REQUIRED = "Parameter model_name is required."
#: SageMaker's largest payload for batch transform (MaxPayloadInMB's upper bound).
MAX_PAYLOAD_MB = 100
_MB = 1024 * 1024


def implied_model(registry: ModelRegistry, named: str | None) -> str | None:
    """The model an ``/invocations`` request means before its body is read: ``named`` (its
    ``model_name`` query parameter) unless that is missing or empty, else the one model
    loaded at start-up when exactly one was; None when the body must name it (a form field).

    An empty ``model_name`` with no single start-up model stays the empty name (a 404 "Model
    not found: "), as TorchServe looks it up."""
    if named:
        return named
    if len(registry.startup_models) == 1:
        return next(iter(registry.startup_models))
    return named


def model_from_fields(fields: Iterable[tuple[str, bytes, str | None]]) -> str:
    """The model a form names in its first ``model_name`` field (UTF-8), as TorchServe reads
    a request parameter; BadRequest when it names none."""
    for name, value, _ in fields:
        if name == MODEL_NAME:
            return value.decode("utf-8", "replace")
    raise BadRequest(MODEL_NAME_REQUIRED)


def execution_parameters(config: ServerConfig, registry: ModelRegistry) -> dict[str, object]:
    """``GET /execution-parameters``: TorchServe's plugin format (``MaxConcurrentTransforms``,
    ``BatchStrategy``, ``MaxPayloadInMB``), with values this server can take.

    * ``MaxConcurrentTransforms``: how many requests the server can be running at once, the
      workers of each model's default version times its ``batch_size`` (at least 1): what
      keeps every worker's batches full. (TorchServe's plugin reads a ``NUM_WORKERS``
      property that nothing sets, so it says 1.)
    * ``BatchStrategy``: ``MULTI_RECORD``, as the plugin: a request may carry many records.
    * ``MaxPayloadInMB``: ``max_request_size`` in whole MiB, as the plugin computes it, kept
      within SageMaker's range (1 to 100): a larger body would be refused with 413.
    """
    slots = 0
    for name in registry.names():
        model = registry.get(name)
        slots += len(model.workers) * model.settings.batch_size
    payload_mb = min(max(config.max_request_size_bytes // _MB, 1), MAX_PAYLOAD_MB)
    return {"MaxConcurrentTransforms": max(slots, 1), "BatchStrategy": "MULTI_RECORD",
            "MaxPayloadInMB": payload_mb}
