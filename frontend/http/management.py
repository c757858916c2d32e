"""The management API (port 8081): register, list, describe, scale, set-default, unregister.

Paths, parameters, status codes and bodies follow TorchServe's management API; where we
differ it is noted (a duplicate registration is 409 here, 500 in TorchServe).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import replace

from frontend.auth import KeyKind
from frontend.batching import Job
from frontend.errors import BadRequest, InternalError, MethodNotAllowed, ServeError
from frontend.http import common
from frontend.http.openapi import management_description
from frontend.registry import Model, RegisterRequest
from frontend.services import Services
from protos import worker_pb2

logger = logging.getLogger(__name__)

MAX_LIST_LIMIT = 100


class ManagementApp:
    """ASGI app for TorchServe's management API."""

    def __init__(self, services: Services) -> None:
        self.config = services.config
        self.registry = services.registry
        self.auth = services.auth
        self.snapshots = services.snapshots

    async def __call__(self, scope: common.Scope, receive: common.Receive,
                       send: common.Send) -> None:
        if scope["type"] != "http":
            return
        try:
            await self.route(scope, receive, send)
        except common.ClientDisconnected:
            return
        except ServeError as error:
            await common.send_error(send, error)

    async def route(self, scope: common.Scope, receive: common.Receive,
                    send: common.Send) -> bool:
        if common.is_api_description(scope):
            await common.send_json(send, 200, management_description())
            return True
        parts = common.path_parts(scope)
        if parts == ["token"]:
            await self.token(scope, send)
            return True
        if not parts or parts[0] != "models" or len(parts) > 4:
            raise common.not_found()
        if self.auth is not None:
            self.auth.check(KeyKind.MANAGEMENT, scope["headers"])
        method: str = scope["method"]
        params = common.query_params(scope)
        if len(parts) == 1:
            if method == "GET":
                await common.send_json(send, 200, self.list_models(params))
            elif method == "POST":
                self._require_model_api()
                await self.register(params, send)
            else:
                raise common.method_not_allowed()
            return True
        name = parts[1]
        version = parts[2] if len(parts) >= 3 else None
        if len(parts) == 4:
            if parts[3] != "set-default" or method != "PUT":
                raise common.not_found() if parts[3] != "set-default" else \
                    common.method_not_allowed()
            assert version is not None
            self.registry.set_default(name, version)
            self.snapshots.save(self.registry)
            await common.send_json(send, 200, {
                "status": f'Default version successfully updated for model "{name}" '
                          f'to "{version}"'})
            return True
        if method == "GET":
            customized = common.bool_param(params, "customized", False)
            await common.send_json(send, 200, await self.describe(name, version, customized))
        elif method == "PUT":
            await self.scale(name, version, params, send)
        elif method == "DELETE":
            self._require_model_api()
            model = await self.registry.unregister(name, version)
            self.snapshots.save(self.registry)
            suffix = f' version "{version}"' if version else ""
            await common.send_json(send, 200, {
                "status": f'Model "{model.name}"{suffix} unregistered'})
        else:
            raise common.method_not_allowed()
        return True

    async def token(self, scope: common.Scope, send: common.Send) -> None:
        """Rotate the inference or management key (authorised by the API key)."""
        if self.auth is None:
            raise BadRequest("token authorization is disabled on this server")
        if scope["method"] != "GET":
            raise common.method_not_allowed()
        self.auth.check(KeyKind.API, scope["headers"])
        kind = common.query_params(scope).get("type", "")
        await common.send_json(send, 200, {kind: self.auth.rotate(kind)})

    def _require_model_api(self) -> None:
        if not self.config.enable_model_api:
            raise MethodNotAllowed(
                "Model API is disabled: start with --enable-model-api (or "
                "enable_model_api=true) to register or unregister models at runtime.")

    def list_models(self, params: dict[str, str]) -> dict[str, object]:
        limit = common.int_param(params, "limit", MAX_LIST_LIMIT) or 0
        limit = MAX_LIST_LIMIT if limit <= 0 or limit > MAX_LIST_LIMIT else limit
        start = common.int_param(params, "next_page_token", 0) or 0
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
                description["customizedMetadata"] = await _customized_metadata(model)
        return descriptions

    async def register(self, params: dict[str, str], send: common.Send) -> None:
        if not params.get("url"):
            raise BadRequest("Parameter url is required.")
        runtime = params.get("runtime", "python")
        if runtime not in ("python", "python3"):
            raise BadRequest(f"unsupported runtime {runtime!r}: only python is supported")
        request = RegisterRequest(
            url=params["url"],
            model_name=params.get("model_name") or None,
            handler=params.get("handler") or None,
            batch_size=common.int_param(params, "batch_size"),
            max_batch_delay_ms=common.int_param(params, "max_batch_delay"),
            initial_workers=common.int_param(params, "initial_workers"),
            response_timeout_s=common.int_param(params, "response_timeout"),
            startup_timeout_s=common.int_param(params, "startup_timeout"),
            # TorchServe's code defaults synchronous to true for REST (its docs say false).
            synchronous=common.bool_param(params, "synchronous", True),
        )
        model = await self.registry.register(request)
        self.snapshots.save(self.registry)
        await common.send_json(send, 200 if request.synchronous else 202,
                               {"status": _registered_message(model, request.synchronous)})

    async def scale(self, name: str, version: str | None, params: dict[str, str],
                    send: common.Send) -> None:
        model = self.registry.get(name, version)
        if common.int_param(params, "number_gpu", 0) < 0:  # type: ignore[operator]
            raise BadRequest("number_gpu must be >= 0")
        min_worker = common.int_param(params, "min_worker", 1)
        max_worker = common.int_param(params, "max_worker", min_worker)
        assert min_worker is not None and max_worker is not None
        if min_worker < 0:
            raise BadRequest("min_worker must be >= 0")
        if max_worker < min_worker:
            raise BadRequest("max_worker cannot be less than min_worker.")
        synchronous = common.bool_param(params, "synchronous", False)
        timeout = common.int_param(params, "timeout", -1)
        assert timeout is not None
        model.settings = replace(model.settings, min_workers=min_worker, max_workers=max_worker)
        started = await model.scale(min_worker, None if timeout < 0 else float(timeout))
        self.snapshots.save(self.registry)
        if not synchronous:
            await common.send_json(send, 202, {"status": "Processing worker updates..."})
            return
        failures = [f for f in [await w.first_start for w in started] if f is not None]
        if failures:
            raise InternalError(f"Failed to start workers for model {name}: {failures[0]}")
        suffix = f", version: {version}" if version else ""
        await common.send_json(send, 200, {
            "status": f"Workers scaled to {min_worker} for model: {name}{suffix}"})


async def _customized_metadata(model: Model) -> object:
    """Ask a worker for the handler's describe_handle() output, through the model's queue."""
    request = worker_pb2.Request(request_id=str(uuid.uuid4()), describe=True)
    job = Job(request, asyncio.get_running_loop().create_future(),
              deadline=time.monotonic() + model.settings.response_timeout_s)
    model.submit(job)
    response = await job.future
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
