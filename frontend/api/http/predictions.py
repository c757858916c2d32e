"""TorchServe's prediction routes in their two phases, and their answers: /predictions and
/explanations (``/{route}/{model}[/{version}]``), the legacy ``/{model}[/{version}]/predict``
(whose query parameters are inputs too, as TorchServe passes them), and SageMaker's
``/invocations`` and ``/models/{model}/invoke`` (as the legacy routes, the model named as
frontend/ops/sagemaker.py says).

Shared by the connection's fast path (frontend/api/http/fast.py), which serves nearly every
prediction, and the inference app's ASGI route (frontend/api/http/inference.py), which serves
the rest (explanations, a pipelined request, an upgrade); the inference plane does the work.
Which route a request is, and what its path names, the route table said
(frontend/api/http/routes.py). No payload is decoded here.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from urllib.parse import parse_qsl

from frontend.api.http import common
from frontend.api.http.calls import response_headers
from frontend.api.http.forms import is_form, parse_form
from frontend.api.http.routes import INVOCATIONS, Target
from frontend.config import ServerConfig
from frontend.errors import (
    BadRequest,
    MethodNotAllowed,
    RouteNotFound,
    ServeError,
    error_body,
    torchserve_body,
    type_for_status,
)
from frontend.ops import sagemaker
from frontend.ops.auth import KeyKind, TokenAuthority
from frontend.ops.plane import SEQUENCE_ID_HEADER, Call, InferencePlane, ResponseStream
from protos import worker_pb2

Inputs = Sequence[tuple[str, bytes, str | None]]


class PredictionRoutes:
    """The phases of a prediction request: ``open`` once its head is read, ``send`` once its
    body is; ``answer`` (or ``respond_in_parts``) renders what the worker said."""

    def __init__(self, config: ServerConfig, auth: TokenAuthority | None,
                 plane: InferencePlane) -> None:
        self.config = config
        self.auth = auth
        self.plane = plane
        self.registry = plane.registry
        self.max_body_bytes = config.max_request_size_bytes

    def open(self, call: Call, target: Target, scope: common.Scope) -> None:
        """Phase one, before the body is read (ServeError: wrong method, token or path; no
        such model; a full queue; a body declared too big): the call's model is opened as
        soon as the request names it, which is now for every route but an ``/invocations``
        request that names none (neither its query nor the start-up models): then its form
        body must (``send`` opens it), and anything else is refused now."""
        route = target.route
        if route.methods is not None and scope["method"] not in route.methods:
            raise MethodNotAllowed()
        if self.auth is not None:
            self.auth.check(KeyKind.INFERENCE, scope["headers"])
        name = target.name
        if route is INVOCATIONS:
            name = sagemaker.implied_model(self.registry, self._query_model(target, scope))
            if name is None:
                # Only a form can still name it (a request parameter, as TorchServe).
                if not is_form(content_type(scope)):
                    raise BadRequest(sagemaker.MODEL_NAME_REQUIRED)
                common.check_content_length(scope, self.max_body_bytes)
                return
        elif name is None:
            raise RouteNotFound()
        self.plane.open(call, name, target.version, scope["headers"])
        common.check_content_length(scope, self.max_body_bytes)

    def send(self, call: Call, target: Target, scope: common.Scope, body: bytes,
             loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Phase two, once the body is read: the call's inputs (form fields, or the body; a
        legacy or SageMaker route's query parameters first) sent through the plane, to the
        model a form names when ``open`` left it to it."""
        inputs = request_inputs(scope, body, self.config.max_request_inputs)
        if call.model is None:
            self.plane.open(call, sagemaker.model_from_fields(inputs), None, scope["headers"])
        route = target.route
        if route.query_inputs and scope["query_string"]:
            inputs = [*self.query_inputs(target, scope), *inputs]
        self.plane.send(call, scope["headers"], inputs, explain=route.explain, loop=loop)

    def _query_model(self, target: Target, scope: common.Scope) -> str | None:
        """The first ``model_name`` query parameter of an ``/invocations`` request."""
        if not scope["query_string"]:
            return None
        for name, value, _ in self.query_inputs(target, scope):
            if name == sagemaker.MODEL_NAME:
                return value.decode()
        return None

    def query_inputs(self, target: Target, scope: common.Scope
                     ) -> list[tuple[str, bytes, str | None]]:
        """The request's query parameters as inputs (TorchServe passes each as an input of
        that name, without a content type: the handler gets bytes; a later input of the same
        name, the body, wins), read once per request (``target.query``)."""
        if target.query is not None:
            return target.query
        limit = self.config.max_request_inputs
        try:
            pairs = parse_qsl(scope["query_string"].decode("latin-1"), keep_blank_values=True,
                              max_num_fields=limit)
        except ValueError:
            raise BadRequest(f"a request may carry at most {limit} query parameters "
                             "(max_request_inputs)") from None
        target.query = [(name, value.encode(), None) for name, value in pairs]
        return target.query

    @staticmethod
    def answer(response: worker_pb2.Response, request_id: str,
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

    @staticmethod
    async def respond_in_parts(stream: ResponseStream, request_id: str, send: common.Send,
                               sequence_id: str | None = None) -> int:
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


def request_inputs(scope: common.Scope, body: bytes, max_inputs: int) -> Inputs:
    """A request body as a prediction's inputs: a form's fields, each by its name, or the
    body as ``body`` with the request's Content-Type (every route that takes TorchServe's
    bodies: the predictions and ``/wfpredict``)."""
    kind = content_type(scope)
    if kind and is_form(kind):
        return parse_form(kind, body, max_inputs)
    return [("body", body, kind or None)]


def content_type(scope: common.Scope) -> str:
    """The request's Content-Type ("" without one; the last, when it has several)."""
    found = ""
    for name, value in scope["headers"]:
        if name == b"content-type":
            found = value.decode("latin-1")
    return found
