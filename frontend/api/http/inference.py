"""The inference API (port 8080): /ping, /predictions/{model}[/{version}],
/explanations/{model}[/{version}] (a prediction with TorchServe's ``explain`` header),
TorchServe's legacy /{model}/predict and /{model}/{version}/predict (a prediction whose query
parameters are inputs too, as TorchServe passes them), SageMaker's /invocations and
/models/{model}/invoke (predictions as the legacy routes, the model named as
frontend/ops/sagemaker.py says) and /execution-parameters, KServe's v1/v2 protocols
(frontend/api/http/kserve.py), and TorchServe's workflow predictions, /wfpredict/{workflow}
(frontend/ops/workflow_runs.py).

This is the hot path: a request is read, turned into one worker_pb2.Request, queued on its
model's batcher, and answered with the worker's bytes. No payload is decoded here.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from urllib.parse import parse_qsl

from frontend.api.http import common
from frontend.api.http.calls import (
    answer_unless_gone,
    http_origin,
    response_headers,
    with_timing,
)
from frontend.api.http.forms import is_form, parse_form
from frontend.api.http.kserve import KServeRoutes
from frontend.api.http.openapi import inference_description
from frontend.errors import (
    BadRequest,
    MethodNotAllowed,
    RouteNotFound,
    ServeError,
    error_body,
    torchserve_body,
    type_for_status,
)
from frontend.ops import health, sagemaker
from frontend.ops.auth import KeyKind
from frontend.ops.plane import SEQUENCE_ID_HEADER, Call, Model, ResponseStream
from frontend.ops.services import Services
from frontend.ops.workflow_runs import WorkflowRunner
from protos import worker_pb2

logger = logging.getLogger(__name__)

_INFERENCE_METHODS = ("POST", "PUT")
#: Paths of TorchServe's own routes: theirs, never a legacy /{model}/predict.
_TORCHSERVE_PREFIXES = ("/predictions/", "/explanations/")
#: First path segments TorchServe routes elsewhere, so never a model's legacy route.
_NOT_LEGACY = frozenset({"predictions", "explanations", "ping", "models", "invocations",
                         "wfpredict"})
#: SageMaker batch transform's question (frontend/ops/sagemaker.py).
_EXECUTION_PARAMETERS = ["execution-parameters"]


class InferenceApp(common.Routes):
    """ASGI app for TorchServe's inference API."""

    def __init__(self, services: Services) -> None:
        self.config = services.config
        self.registry = services.registry
        self.auth = services.auth
        self.plane = services.plane
        self.kserve = KServeRoutes(services)
        self.workflows = WorkflowRunner(services.workflows.registry, services.plane,
                                        services.metrics)

    async def route(self, scope: common.Scope, receive: common.Receive,
                    send: common.Send) -> bool:
        """Serve the request if it is ours; return False when no route matches."""
        path: str = scope["path"]
        if path.startswith("/predictions/"):
            await self.predict(scope, receive, send)
            return True
        if path.startswith("/explanations/"):
            await self.predict(scope, receive, send, explain=True)
            return True
        if path == "/ping":
            await self.ping(send)
            return True
        parts = common.path_parts(scope)
        if parts and parts[0] == "wfpredict":
            await self.workflow_predict(scope, receive, send, parts)
            return True
        if self.is_sagemaker(parts):
            await self.predict(scope, receive, send)
            return True
        if parts == _EXECUTION_PARAMETERS:
            await self.execution_parameters(scope, send)
            return True
        if await self.kserve.route(scope, receive, send):
            return True
        if path.endswith("/predict") and self.legacy_target(parts):
            await self.predict(scope, receive, send)
            return True
        if common.is_api_description(scope):
            await common.send_json(send, 200, inference_description())
            return True
        raise RouteNotFound()

    async def ping(self, send: common.Send) -> None:
        healthy, body = health.ping(self.registry)
        await common.send_json(send, 200 if healthy else 500, body)

    async def execution_parameters(self, scope: common.Scope, send: common.Send) -> None:
        """SageMaker batch transform's ``GET /execution-parameters`` (a key as /predictions)."""
        if scope["method"] != "GET":
            raise MethodNotAllowed()
        if self.auth is not None:
            self.auth.check(KeyKind.INFERENCE, scope["headers"])
        await common.send_json(send, 200,
                               sagemaker.execution_parameters(self.config, self.registry))

    # The two phases of a /predictions request, shared by the ASGI route below and by the
    # connection-level fast path (frontend/api/http/fast.py), which serves nearly all of
    # them; the inference plane does the rest.

    def open(self, scope: common.Scope, call: Call) -> Model | None:
        """Phase one of a /predictions request, before its body is read: the model it names
        (ServeError: wrong method, token or name; a full queue; a body declared too big);
        None for an /invocations request whose form body names it (``send`` opens it)."""
        if scope["method"] not in _INFERENCE_METHODS:
            raise MethodNotAllowed()
        if self.auth is not None:
            self.auth.check(KeyKind.INFERENCE, scope["headers"])
        parts = common.path_parts(scope)
        if parts[0] in ("predictions", "explanations"):
            if len(parts) not in (2, 3):
                raise RouteNotFound()
            name, version = parts[1], parts[2] if len(parts) == 3 else None
        elif self.is_sagemaker(parts):
            if parts[0] == "models":  # /models/{name}/invoke
                name, version = parts[1], None
            else:
                implied = sagemaker.implied_model(self.registry, self._query_model(scope))
                if implied is None:
                    # Only a form can still name it (a request parameter, as TorchServe).
                    if not is_form(_content_type(scope)):
                        raise BadRequest(sagemaker.MODEL_NAME_REQUIRED)
                    common.check_content_length(scope, self.config.max_request_size_bytes)
                    return None
                name, version = implied, None
        else:
            target = self.legacy_target(parts)
            if target is None:
                raise RouteNotFound()
            name, version = target
        model = self.plane.open(call, name, version)
        common.check_content_length(scope, self.config.max_request_size_bytes)
        return model

    def send(self, scope: common.Scope, body: bytes, call: Call, explain: bool = False,
             loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Phase two, once the body is read: the call's inputs (form fields, or the body)
        sent through the plane (to the model a form names, when ``open`` left it to it)."""
        inputs = request_inputs(scope, body, self.config.max_request_inputs)
        if call.model is None:
            self.plane.open(call, sagemaker.model_from_fields(inputs))
        if scope["query_string"] and not scope["path"].startswith(_TORCHSERVE_PREFIXES):
            inputs = [*self._query_inputs(scope["query_string"]), *inputs]
        self.plane.send(call, scope["headers"], inputs, explain=explain, loop=loop)

    @staticmethod
    def is_sagemaker(parts: list[str]) -> bool:
        """SageMaker's prediction routes (``parts``: the path's segments): ``/invocations``
        and ``/models/{name}/invoke``. Any other ``/models/...`` path is not the inference
        API's: on a listener that serves management too, it is management's."""
        if parts == ["invocations"]:
            return True
        return len(parts) == 3 and parts[0] == "models" and parts[2] == "invoke"

    def _query_model(self, scope: common.Scope) -> str | None:
        """The first ``model_name`` query parameter of an ``/invocations`` request."""
        if not scope["query_string"]:
            return None
        for name, value, _ in self._query_inputs(scope["query_string"]):
            if name == sagemaker.MODEL_NAME:
                return value.decode()
        return None

    @staticmethod
    def legacy_target(parts: list[str]) -> tuple[str, str | None] | None:
        """The model and version of TorchServe's legacy ``/{model}/predict`` or
        ``/{model}/{version}/predict`` (``parts``: the path's segments); None for another
        path. Paths TorchServe routes elsewhere (``/models/...``, KServe's ``/v1/models/...``
        and ``/v2/models/...``) are not legacy routes."""
        if len(parts) not in (2, 3) or parts[-1] != "predict" or parts[0] in _NOT_LEGACY:
            return None
        if len(parts) == 3:
            if parts[0] in ("v1", "v2") and parts[1] == "models":
                return None
            return parts[0], parts[1]
        return parts[0], None

    def _query_inputs(self, query: bytes) -> list[tuple[str, bytes, str | None]]:
        """A legacy route's query parameters as inputs (TorchServe passes each as an input
        of that name, without a content type: the handler gets bytes); a later input of the
        same name (the body) wins."""
        limit = self.config.max_request_inputs
        try:
            pairs = parse_qsl(query.decode("latin-1"), keep_blank_values=True,
                              max_num_fields=limit)
        except ValueError:
            raise BadRequest(f"a request may carry at most {limit} query parameters "
                             "(max_request_inputs)") from None
        return [(name, value.encode(), None) for name, value in pairs]

    def answer(self, response: worker_pb2.Response, request_id: str,
               sequence_id: str | None = None) -> tuple[int, bytes, bytes, common.Headers]:
        """The worker's response as (status, content type, body, other headers); a stateful
        model's answer names its sequence (the client learns an id the server made)."""
        headers = response_headers(request_id, response)
        if sequence_id is not None and SEQUENCE_ID_HEADER not in response.headers:
            headers.append((SEQUENCE_ID_HEADER.encode(), sequence_id.encode("latin-1")))
        if response.error:
            status = response.status or 500
            return (status, common.JSON, torchserve_body(status, type_for_status(status),
                                                         response.error), headers)
        content_type = (response.content_type or "application/json").encode("latin-1")
        return response.status or 200, content_type, response.body, headers

    async def predict(self, scope: common.Scope, receive: common.Receive,
                      send: common.Send, explain: bool = False) -> None:
        """A prediction through the ASGI cycle (a request pipelined behind another, or an
        upgrade): the same steps as the fast path; or an explanation (only ever here)."""
        async with self.plane.call(http_origin(scope)) as call:
            self.open(scope, call)
            body = await common.read_body(receive, self.config.max_request_size_bytes)
            self.send(scope, body, call, explain)
            result = await answer_unless_gone(self.plane, call, receive)
            if result is None:
                call.status = 0  # the client went away
                return
            request_id = call.job.request.request_id
            if isinstance(result, ResponseStream):
                call.status = await self.respond_in_parts(result, request_id, send,
                                                          call.sequence_id)
                return
            status, content_type, body, headers = self.answer(result, request_id,
                                                              call.sequence_id)
            await common.send_bytes(send, status, body, content_type,
                                    with_timing(call, headers))
            call.status = status

    async def workflow_predict(self, scope: common.Scope, receive: common.Receive,
                               send: common.Send, parts: list[str]) -> None:
        """``/wfpredict/{workflow}``: the same body forms as /predictions (a body, or form
        fields), answered by running the workflow's DAG (frontend/ops/workflow_runs.py) in a
        call of the plane, which records it. Any method, as TorchServe's route."""
        if len(parts) != 2:
            raise RouteNotFound()
        if self.auth is not None:
            self.auth.check(KeyKind.INFERENCE, scope["headers"])
        workflow = self.workflows.open(parts[1])
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

    async def respond_in_parts(self, stream: ResponseStream, request_id: str,
                               send: common.Send, sequence_id: str | None = None) -> int:
        """Intermediate responses as they come: HTTP/1.1 chunked transfer encoding."""
        started = False
        status = 200
        try:
            async for part in stream:
                if not started:
                    content_type = (part.content_type or "application/json").encode("latin-1")
                    status = part.status or 200
                    headers = [(b"content-type", content_type),
                               (b"x-request-id", request_id.encode())]
                    if sequence_id is not None:
                        headers.append((SEQUENCE_ID_HEADER.encode(),
                                        sequence_id.encode("latin-1")))
                    await send({"type": "http.response.start", "status": status,
                                "headers": headers})
                    started = True
                body = part.body
                if part.error:
                    code = part.status or 500
                    body = torchserve_body(code, type_for_status(code), part.error)
                await send({"type": "http.response.body", "body": body, "more_body": True})
        except ServeError as error:
            if not started:
                raise
            # The status line is gone already: end the stream with the error as its last part.
            await send({"type": "http.response.body", "body": error_body(error),
                        "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return status


def request_inputs(scope: common.Scope, body: bytes, max_inputs: int
                   ) -> Sequence[tuple[str, bytes, str | None]]:
    """A request body as a prediction's inputs: a form's fields, each by its name, or the
    body as ``body`` with the request's Content-Type (/predictions and /wfpredict alike)."""
    content_type = _content_type(scope)
    if content_type and is_form(content_type):
        return parse_form(content_type, body, max_inputs)
    return [("body", body, content_type or None)]


def _content_type(scope: common.Scope) -> str:
    """The request's Content-Type ("" without one; the last, when it has several)."""
    content_type = ""
    for name, value in scope["headers"]:
        if name == b"content-type":
            content_type = value.decode("latin-1")
    return content_type
