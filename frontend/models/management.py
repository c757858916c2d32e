"""The management operations, shared by the REST API and the gRPC ManagementAPIsService.

Each operation takes TorchServe's parameters as strings (REST query parameters; the gRPC
servicer converts its request message into the same form) and returns the HTTP status and
the JSON body, so both transports answer with the same text.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import replace

from frontend.api.params import bool_param, int_param
from frontend.errors import BadRequest, InternalError, MethodNotAllowed
from frontend.models.registry import Model, RegisterRequest
from frontend.services import Services
from frontend.serving.plane import InferencePlane
from frontend.serving.policies import batch_settings_from_aliases
from protos import worker_pb2

MAX_LIST_LIMIT = 100
Body = dict[str, object] | list[dict[str, object]]


class ManagementOps:
    """Register, list, describe, scale, set-default and unregister models."""

    def __init__(self, services: Services) -> None:
        self.config = services.config
        self.registry = services.registry
        self.plane = services.plane
        self.snapshots = services.snapshots

    def _require_model_api(self) -> None:
        if not self.config.enable_model_api:
            raise MethodNotAllowed(
                "Model API is disabled: start with --enable-model-api (or "
                "enable_model_api=true) to register or unregister models at runtime.")

    def list_models(self, params: dict[str, str]) -> dict[str, object]:
        limit = int_param(params, "limit", MAX_LIST_LIMIT) or 0
        limit = MAX_LIST_LIMIT if limit <= 0 or limit > MAX_LIST_LIMIT else limit
        start = int_param(params, "next_page_token", 0) or 0
        if start < 0:
            raise BadRequest("next_page_token must be >= 0")
        names = self.registry.names()
        page = names[start:start + limit]
        body: dict[str, object] = {}
        if start + limit < len(names):
            body["nextPageToken"] = str(start + limit)
        body["models"] = [
            {"modelName": name, "modelUrl": self.registry.get(name).archive.url}
            for name in page
        ]
        return body

    async def describe(self, name: str, version: str | None,
                       customized: bool) -> list[dict[str, object]]:
        models = (self.registry.versions(name) if version == "all"
                  else [self.registry.get(name, version)])
        descriptions = [model.describe() for model in models]
        if customized:
            for model, description in zip(models, descriptions, strict=True):
                description["customizedMetadata"] = await _customized_metadata(self.plane,
                                                                               model)
        return descriptions

    async def register(self, params: dict[str, str]) -> tuple[int, Body]:
        self._require_model_api()
        if not params.get("url"):
            raise BadRequest("Parameter url is required.")
        runtime = params.get("runtime", "python")
        if runtime not in ("python", "python3"):
            raise BadRequest(f"unsupported runtime {runtime!r}: only python is supported")
        try:  # MLServer's and KServe's names for the batch settings are accepted too
            aliases = batch_settings_from_aliases(params)
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
        request = RegisterRequest(
            url=params["url"],
            model_name=params.get("model_name") or None,
            handler=params.get("handler") or None,
            batch_size=int_param(params, "batch_size", aliases.get("batch_size")),
            max_batch_delay_ms=int_param(params, "max_batch_delay",
                                         aliases.get("max_batch_delay_ms")),
            initial_workers=int_param(params, "initial_workers"),
            response_timeout_s=int_param(params, "response_timeout"),
            startup_timeout_s=int_param(params, "startup_timeout"),
            batch_policy=params.get("batch_policy") or None,
            # TorchServe's code defaults synchronous to true for REST (its docs say false).
            synchronous=bool_param(params, "synchronous", True),
        )
        model = await self.registry.register(request)
        self.snapshots.save(self.registry)
        return (200 if request.synchronous else 202,
                {"status": _registered_message(model, request.synchronous)})

    async def scale(self, name: str, version: str | None,
                    params: dict[str, str]) -> tuple[int, Body]:
        model = self.registry.get(name, version)
        if int_param(params, "number_gpu", 0) < 0:  # type: ignore[operator]
            raise BadRequest("number_gpu must be >= 0")
        min_worker = int_param(params, "min_worker", 1)
        max_worker = int_param(params, "max_worker", min_worker)
        assert min_worker is not None and max_worker is not None
        if min_worker < 0:
            raise BadRequest("min_worker must be >= 0")
        if max_worker < min_worker:
            raise BadRequest("max_worker cannot be less than min_worker.")
        synchronous = bool_param(params, "synchronous", False)
        timeout = int_param(params, "timeout", -1)
        assert timeout is not None
        model.settings = replace(model.settings, min_workers=min_worker, max_workers=max_worker)
        started = await model.scale(min_worker, None if timeout < 0 else float(timeout))
        self.snapshots.save(self.registry)
        if not synchronous:
            return 202, {"status": "Processing worker updates..."}
        failures = [f for f in [await w.first_start for w in started] if f is not None]
        if failures:
            raise InternalError(f"Failed to start workers for model {name}: {failures[0]}")
        suffix = f", version: {version}" if version else ""
        return 200, {"status": f"Workers scaled to {min_worker} for model: {name}{suffix}"}


    def set_default(self, name: str, version: str) -> Body:
        self.registry.set_default(name, version)
        self.snapshots.save(self.registry)
        return {"status": f'Default version successfully updated for model "{name}" '
                          f'to "{version}"'}

    async def unregister(self, name: str, version: str | None) -> Body:
        self._require_model_api()
        model = await self.registry.unregister(name, version)
        self.snapshots.save(self.registry)
        suffix = f' version "{version}"' if version else ""
        return {"status": f'Model "{model.name}"{suffix} unregistered'}


async def _customized_metadata(plane: InferencePlane, model: Model) -> object:
    """Ask a worker for the handler's describe_handle() output, through the model's queue."""
    response = await plane.ask(model, worker_pb2.Request(request_id=str(uuid.uuid4()),
                                                         describe=True))
    if not isinstance(response, worker_pb2.Response):
        raise InternalError("describe_handle() must not stream")
    if response.error:
        raise InternalError(f"describe failed: {response.error}")
    if response.content_type.startswith("application/json"):
        return json.loads(response.body)
    return response.body.decode("utf-8", "replace")


def _registered_message(model: Model, synchronous: bool) -> str:
    workers = len(model.workers)
    text = f'Model "{model.name}" Version: {model.version} registered with {workers} ' \
           "initial workers"
    if workers == 0:
        text += ". Use scale workers API to add workers for the model."
    elif not synchronous:
        text += ". Processing worker updates..."
    return text
