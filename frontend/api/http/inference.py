"""The inference API (port 8080) as an ASGI app: the inference routes of the route table
(frontend/api/http/routes.py), each with its handler here. /ping; TorchServe's prediction
routes (frontend/api/http/predictions.py: served here when the connection's fast path does
not serve them, and /explanations always); SageMaker's /execution-parameters; Vertex AI's
health and predict routes (``AIP_HEALTH_ROUTE``, ``AIP_PREDICT_ROUTE``); KServe's v1/v2
protocols (frontend/api/http/kserve.py); TorchServe's workflow predictions,
/wfpredict/{workflow} (frontend/ops/workflow_runs.py); the API's OpenAPI description.
"""

from __future__ import annotations

import asyncio
from typing import ClassVar

from frontend.api.http import common, routes
from frontend.api.http.calls import answer_unless_gone, http_origin, with_timing
from frontend.api.http.kserve import KServeRoutes
from frontend.api.http.openapi import inference_description
from frontend.api.http.predictions import PredictionRoutes, request_inputs
from frontend.api.http.routes import Api, RoutedApp, RouteTable, Target
from frontend.config.vertex import MODEL_NAME as VERTEX_MODEL
from frontend.errors import MethodNotAllowed, RouteNotFound
from frontend.ops import health, sagemaker
from frontend.ops.auth import KeyKind
from frontend.ops.plane import ResponseStream
from frontend.ops.services import Services
from frontend.ops.workflow_runs import WorkflowRunner


class InferenceApp(RoutedApp):
    """ASGI app for TorchServe's inference API."""

    api: ClassVar[Api] = "inference"

    def __init__(self, services: Services) -> None:
        self.config = services.config
        self.registry = services.registry
        self.auth = services.auth
        self.plane = services.plane
        self.predictions = PredictionRoutes(services.config, services.auth, services.plane)
        self.kserve = KServeRoutes(services)
        self.workflows = WorkflowRunner(services.workflows.registry, services.plane,
                                        services.metrics)
        predict = self.predict
        config = self.config
        #: Vertex AI's health and predict routes (frontend/config/vertex.py), when set.
        vertex = routes.vertex_routes(config.vertex_health_route, config.vertex_predict_route,
                                      VERTEX_MODEL)
        handlers: dict[routes.Route, routes.Handler] = {
            route: self.ping if route.name == "vertex-health" else predict for route in vertex}
        super().__init__(RouteTable.of([self.api], kserve=bool(config.kserve_protocol),
                                       first=vertex), {
            **handlers,
            routes.PREDICTIONS: predict, routes.EXPLANATIONS: predict, routes.LEGACY: predict,
            routes.INVOCATIONS: predict, routes.INVOKE: predict,
            routes.PING: self.ping,
            routes.WFPREDICT: self.workflow_predict,
            routes.EXECUTION_PARAMETERS: self.execution_parameters,
            routes.KSERVE_LIVE: self.kserve.live,
            routes.KSERVE_V1: self.kserve.serve, routes.KSERVE_V2: self.kserve.serve,
            routes.INFERENCE_DESCRIPTION: self.describe,
        })

    async def ping(self, target: Target, scope: common.Scope, receive: common.Receive,
                   send: common.Send) -> None:
        healthy, body = health.ping(self.registry)
        await common.send_json(send, 200 if healthy else 500, body)

    async def describe(self, target: Target, scope: common.Scope, receive: common.Receive,
                       send: common.Send) -> None:
        await common.send_json(send, 200, inference_description())

    async def execution_parameters(self, target: Target, scope: common.Scope,
                                   receive: common.Receive, send: common.Send) -> None:
        """SageMaker batch transform's ``GET /execution-parameters`` (a key as /predictions)."""
        if scope["method"] != "GET":
            raise MethodNotAllowed()
        if self.auth is not None:
            self.auth.check(KeyKind.INFERENCE, scope["headers"])
        await common.send_json(send, 200,
                               sagemaker.execution_parameters(self.config, self.registry))

    async def predict(self, target: Target, scope: common.Scope, receive: common.Receive,
                      send: common.Send) -> None:
        """A prediction through the ASGI cycle (a request pipelined behind another, or an
        upgrade): the same phases as the fast path; or an explanation (only ever here)."""
        predictions = self.predictions
        async with self.plane.call(http_origin(scope)) as call:
            predictions.open(call, target, scope)
            body = await common.read_body(receive, self.config.max_request_size_bytes)
            predictions.send(call, target, scope, body)
            result = await answer_unless_gone(self.plane, call, receive)
            if result is None:
                call.status = 0  # the client went away
                return
            request_id = call.job.request.request_id
            if isinstance(result, ResponseStream):
                call.status = await predictions.respond_in_parts(result, request_id, send,
                                                                 call.sequence_id)
                return
            status, content_type, body, headers = predictions.answer(result, request_id,
                                                                     call.sequence_id)
            await common.send_bytes(send, status, body, content_type,
                                    with_timing(call, headers))
            call.status = status

    async def workflow_predict(self, target: Target, scope: common.Scope,
                               receive: common.Receive, send: common.Send) -> None:
        """``/wfpredict/{workflow}``: the same body forms as /predictions (a body, or form
        fields), answered by running the workflow's DAG (frontend/ops/workflow_runs.py) in a
        call of the plane, which records it. Any method, as TorchServe's route."""
        if target.name is None:
            raise RouteNotFound()
        if self.auth is not None:
            self.auth.check(KeyKind.INFERENCE, scope["headers"])
        workflow = self.workflows.open(target.name)
        limit = self.config.max_request_size_bytes
        common.check_content_length(scope, limit)
        body = await common.read_body(receive, limit)
        inputs = request_inputs(scope, body, self.config.max_request_inputs)
        async with self.plane.call(http_origin(scope)) as call:
            run = asyncio.ensure_future(self.workflows.run(call, workflow, scope["headers"],
                                                           inputs))
            disconnected = asyncio.ensure_future(receive())
            try:
                await asyncio.wait({run, disconnected}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                disconnected.cancel()
                if not run.done():
                    run.cancel()  # the client went away: its node calls leave their queues
                    await asyncio.wait({run})
            if run.cancelled():
                call.status = 0
                return
            answer = run.result()  # a ServeError is recorded by the call, answered by the app
            call.status = 200
            await common.send_bytes(send, 200, answer.body,
                                    answer.content_type.encode("latin-1", "replace"))
