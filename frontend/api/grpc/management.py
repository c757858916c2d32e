"""TorchServe's ``org.pytorch.serve.grpc.management.ManagementAPIsService``: the same
operations as REST (frontend/ops/management.py), answering the same JSON."""

from __future__ import annotations

import json
from typing import Any

from frontend.api.grpc.common import Context, Servicer, unary
from frontend.ops.auth import KeyKind
from frontend.ops.management import ManagementOps
from frontend.ops.services import Services
from protos import management_pb2, management_pb2_grpc


def _response(body: object) -> Any:
    """REST's JSON body, as TorchServe's gRPC management answers it."""
    return management_pb2.ManagementResponse(msg=json.dumps(body, indent=2))


def _set_numbers(request: Any, *names: str) -> dict[str, str]:
    """The ``optional`` number fields the client set (0 included), as REST parameters."""
    return {name: str(getattr(request, name)) for name in names if request.HasField(name)}


def _params(**values: object) -> dict[str, str]:
    """gRPC fields as REST query parameters; proto3's zero values mean "not given"."""
    params: dict[str, str] = {}
    for name, value in values.items():
        if isinstance(value, bool):
            params[name] = "true" if value else "false"
        elif value not in (0, "", None):
            params[name] = str(value)
    return params


class ManagementServicer(Servicer, management_pb2_grpc.ManagementAPIsServiceServicer):
    """Each RPC needs the management key and answers REST's JSON as ``msg``."""

    service = management_pb2.DESCRIPTOR.services_by_name["ManagementAPIsService"].full_name

    def __init__(self, services: Services) -> None:
        super().__init__(services)
        self.ops = ManagementOps(services)

    @unary(KeyKind.MANAGEMENT)
    async def DescribeModel(self, request: Any, context: Context) -> Any:
        return _response(await self.ops.describe(
            request.model_name, request.model_version or None, request.customized))

    @unary(KeyKind.MANAGEMENT)
    async def ListModels(self, request: Any, context: Context) -> Any:
        params = _params(limit=request.limit, next_page_token=request.next_page_token)
        return _response(self.ops.list_models(params))

    @unary(KeyKind.MANAGEMENT)
    async def RegisterModel(self, request: Any, context: Context) -> Any:
        params = {**_params(url=request.url, model_name=request.model_name,
                            handler=request.handler, runtime=request.runtime,
                            synchronous=request.synchronous),
                  **_set_numbers(request, "batch_size", "max_batch_delay", "initial_workers",
                                 "response_timeout", "startup_timeout")}
        _, body = await self.ops.register(params)
        return _response(body)

    @unary(KeyKind.MANAGEMENT)
    async def ScaleWorker(self, request: Any, context: Context) -> Any:
        # NOTE: an unset timeout means "wait for the batch in flight" (-1); only a timeout
        # of 0 the client set kills busy workers at once.
        params = {**_params(synchronous=request.synchronous),
                  **_set_numbers(request, "min_worker", "max_worker", "number_gpu", "timeout")}
        _, body = await self.ops.scale(request.model_name, request.model_version or None,
                                       params)
        return _response(body)

    @unary(KeyKind.MANAGEMENT)
    async def SetDefault(self, request: Any, context: Context) -> Any:
        return _response(self.ops.set_default(request.model_name, request.model_version))

    @unary(KeyKind.MANAGEMENT)
    async def UnregisterModel(self, request: Any, context: Context) -> Any:
        return _response(await self.ops.unregister(request.model_name,
                                                   request.model_version or None))
