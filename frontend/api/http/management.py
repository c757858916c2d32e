"""The management API (port 8081) over HTTP: TorchServe's paths and parameters.

The operations themselves live in frontend/ops/management.py (shared with gRPC). Where we
differ from TorchServe it is noted there (a duplicate registration is 409 here, 500 in
TorchServe).

A registration (``POST /models``) takes its parameters from the query, or, as TorchServe's
does, from a JSON object body when the request's Content-Type is application/json (the query
is then not read): SageMaker's agent registers the models of a multi-model endpoint so, with
``{"model_name": ..., "url": ...}``.

TorchServe's workflow routes (/workflows) are here too, their registration's parameters read
the same way; their operations are frontend/ops/workflow_management.py (TorchServe has no
gRPC for workflows).
"""

from __future__ import annotations

from typing import ClassVar

from frontend.api.http import common, routes
from frontend.api.http.dashboard import DashboardRoutes
from frontend.api.http.openapi import management_description
from frontend.api.http.routes import Api, RoutedApp, RouteTable, Target
from frontend.errors import BadRequest, MethodNotAllowed, RouteNotFound, quoted
from frontend.ops.auth import KeyKind
from frontend.ops.management import Body, ManagementOps
from frontend.ops.params import bool_param
from frontend.ops.services import Services
from frontend.ops.workflow_management import WorkflowOps
from protos import json_limits


class ManagementApp(RoutedApp):
    """ASGI app for TorchServe's management API: the management routes of the route table
    (frontend/api/http/routes.py); the work is ManagementOps."""

    api: ClassVar[Api] = "management"

    def __init__(self, services: Services) -> None:
        self.auth = services.auth
        self.ops = ManagementOps(services)
        self.workflows = WorkflowOps(services)
        self.max_body_bytes = services.config.max_request_size_bytes
        #: The live page and its data (frontend/api/http/dashboard.py).
        self.dashboard = DashboardRoutes(services.dashboard, services.auth)
        super().__init__(RouteTable.of([self.api]), {
            routes.MANAGEMENT_DESCRIPTION: self.describe,
            routes.TOKEN: self.token,
            routes.DASHBOARD: self.dashboard.route,
            routes.WORKFLOWS: self.workflow_routes,
            routes.MODELS: self.models,
        })

    async def describe(self, target: Target, scope: common.Scope, receive: common.Receive,
                       send: common.Send) -> None:
        await common.send_json(send, 200, management_description())

    async def workflow_routes(self, target: Target, scope: common.Scope,
                              receive: common.Receive, send: common.Send) -> None:
        if self.auth is not None:
            self.auth.check(KeyKind.MANAGEMENT, scope["headers"])
        status, body = await self._workflows(scope, receive, target.parts)
        await common.send_json(send, status, body)

    async def models(self, target: Target, scope: common.Scope, receive: common.Receive,
                     send: common.Send) -> None:
        if self.auth is not None:
            self.auth.check(KeyKind.MANAGEMENT, scope["headers"])
        params = common.query_params(scope)
        parts = target.parts
        if scope["method"] == "POST" and len(parts) == 1 and _is_json(scope):
            params = await self._json_params(scope, receive)
        status, body = await self._dispatch(scope["method"], parts, params)
        await common.send_json(send, status, body)

    async def _dispatch(self, method: str, parts: list[str],
                        params: dict[str, str]) -> tuple[int, Body]:
        ops = self.ops
        if len(parts) == 1:
            if method == "GET":
                return 200, ops.list_models(params)
            if method == "POST":
                return await ops.register(params)
            raise MethodNotAllowed()
        name = parts[1]
        version = parts[2] if len(parts) >= 3 else None
        if len(parts) == 4:
            if parts[3] != "set-default":
                raise RouteNotFound()
            if method != "PUT":
                raise MethodNotAllowed()
            assert version is not None
            return 200, ops.set_default(name, version)
        if method == "GET":
            customized = bool_param(params, "customized", False)
            return 200, await ops.describe(name, version, customized)
        if method == "PUT":
            return await ops.scale(name, version, params)
        if method == "DELETE":
            return 200, await ops.unregister(name, version)
        raise MethodNotAllowed()

    async def _workflows(self, scope: common.Scope, receive: common.Receive,
                         parts: list[str]) -> tuple[int, Body]:
        """TorchServe's /workflows routes (frontend/ops/workflow_management.py)."""
        method = scope["method"]
        ops = self.workflows
        if len(parts) == 1:
            if method == "GET":
                return 200, ops.list_workflows(common.query_params(scope))
            if method == "POST":
                params = common.query_params(scope)
                if _is_json(scope):  # TorchServe's RegisterWorkflowRequest as JSON
                    params = await self._json_params(scope, receive)
                return 200, await ops.register(params)
            raise MethodNotAllowed()
        if method == "GET":
            return 200, ops.describe(parts[1])
        if method == "DELETE":
            return 200, await ops.unregister(parts[1])
        raise MethodNotAllowed()

    async def _json_params(self, scope: common.Scope, receive: common.Receive
                           ) -> dict[str, str]:
        """A JSON registration body's parameters: its size bounded before it is read (413),
        its nesting before it is parsed (``json_params``)."""
        common.check_content_length(scope, self.max_body_bytes)
        return json_params(await common.read_body(receive, self.max_body_bytes))

    async def token(self, target: Target, scope: common.Scope, receive: common.Receive,
                    send: common.Send) -> None:
        """Rotate the inference or management key (authorised by the API key)."""
        if self.auth is None:
            raise BadRequest("token authorization is disabled on this server")
        if scope["method"] != "GET" or common.is_head(scope):
            raise MethodNotAllowed()  # HEAD too: it would rotate a key nobody receives
        self.auth.check(KeyKind.API, scope["headers"])
        kind = common.query_params(scope).get("type", "")
        await common.send_json(send, 200, {kind: self.auth.rotate(kind)})


def _is_json(scope: common.Scope) -> bool:
    for name, value in scope["headers"]:
        if name == b"content-type":
            return bytes(value).split(b";")[0].strip().lower() == common.JSON
    return False


def json_params(body: bytes) -> dict[str, str]:
    """A JSON object body as registration parameters (TorchServe's RegisterModelRequest
    fields: model_name, url, handler, batch_size, initial_workers, synchronous, ...), each
    value as the query would carry it; null is absent. Its nesting is bounded before it is
    parsed (protos/json_limits.py)."""
    try:
        value = json_limits.loads(body)
    except json_limits.JsonTooDeep as exc:
        raise BadRequest(f"the request body's JSON is {exc}") from None
    except ValueError:
        raise BadRequest("the request body is not valid JSON") from None
    if not isinstance(value, dict):
        raise BadRequest("the request body must be a JSON object of registration parameters")
    params = {}
    for key, item in value.items():
        if item is None:
            continue
        if isinstance(item, bool):
            params[key] = "true" if item else "false"
        elif isinstance(item, (str, int, float)):
            params[key] = str(item)
        else:
            raise BadRequest(f"registration parameter {quoted(key)} must be a string, number or "
                             "boolean")
    return params
