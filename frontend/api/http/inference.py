"""The inference API (port 8080): /ping, /predictions/{model}[/{version}], and KServe's
v1/v2 protocols (frontend/api/http/kserve.py).

This is the hot path: a request is read, turned into one worker_pb2.Request, queued on its
model's batcher, and answered with the worker's bytes. No payload is decoded here.
"""

from __future__ import annotations

import logging

from frontend.api.auth import KeyKind
from frontend.api.http import common
from frontend.api.http.forms import is_form, parse_form
from frontend.api.http.kserve import KServeRoutes
from frontend.api.http.observe import (
    copy_headers,
    observed,
    response_headers,
    submit_unless_gone,
)
from frontend.api.http.openapi import inference_description
from frontend.errors import (
    MethodNotAllowed,
    RouteNotFound,
    ServeError,
    error_body,
    torchserve_body,
    type_for_status,
)
from frontend.models.registry import Model
from frontend.services import Services
from frontend.serving.batching import Job
from frontend.serving.ids import new_request_id
from frontend.serving.streams import ResponseStream
from protos import worker_pb2

logger = logging.getLogger(__name__)

_INFERENCE_METHODS = ("POST", "PUT")


class InferenceApp(common.Routes):
    """ASGI app for TorchServe's inference API."""

    def __init__(self, services: Services) -> None:
        self.config = services.config
        self.registry = services.registry
        self.auth = services.auth
        self.snapshots = services.snapshots
        self.metrics = services.registry.metrics
        self.access = services.access
        self.kserve = KServeRoutes(services)

    async def route(self, scope: common.Scope, receive: common.Receive,
                    send: common.Send) -> bool:
        """Serve the request if it is ours; return False when no route matches."""
        path: str = scope["path"]
        if path.startswith("/predictions/"):
            await self.observed_predict(scope, receive, send)
            return True
        if path == "/ping":
            await self.ping(send)
            return True
        if await self.kserve.route(scope, receive, send):
            return True
        if common.is_api_description(scope):
            await common.send_json(send, 200, inference_description())
            return True
        raise RouteNotFound()

    async def ping(self, send: common.Send) -> None:
        healthy = all(model.is_healthy() for model in self.registry)
        status = "Healthy" if healthy else "Unhealthy"
        await common.send_json(send, 200 if healthy else 500, {"status": status})

    # The steps of a prediction, shared by the ASGI route below and by the connection-level
    # fast path (frontend/api/http/fast.py), which serves nearly every /predictions request.

    def model_for(self, scope: common.Scope) -> Model:
        """The model a /predictions request names (ServeError: wrong method, token or name)."""
        if scope["method"] not in _INFERENCE_METHODS:
            raise MethodNotAllowed()
        if self.auth is not None:
            self.auth.check(KeyKind.INFERENCE, scope["headers"])
        parts = common.path_parts(scope)
        if len(parts) not in (2, 3):
            raise RouteNotFound()
        return self.registry.get(parts[1], parts[2] if len(parts) == 3 else None)

    def admit(self, model: Model, scope: common.Scope) -> None:
        """Refuse a request before its body is read: full queue, or a body declared too big."""
        model.batcher.refuse_if_full()
        common.check_content_length(scope, self.config.max_request_size_bytes)

    def worker_request(self, scope: common.Scope, body: bytes, job: Job) -> float | None:
        """Fill ``job.request`` from the HTTP request; returns the client's own deadline."""
        request = job.request = worker_pb2.Request(request_id=new_request_id())
        timeout_s = copy_headers(scope, request)
        content_type = request.headers.get("content-type", "")
        if content_type and is_form(content_type):
            for field_name, data, field_type in parse_form(content_type, body,
                                                           self.config.max_request_inputs):
                request.inputs[field_name] = data
                request.content_types[field_name] = field_type
        else:
            request.inputs["body"] = body
            request.content_types["body"] = content_type
        return timeout_s

    def answer(self, response: worker_pb2.Response, request_id: str
               ) -> tuple[int, bytes, bytes, common.Headers]:
        """The worker's response as (status, content type, body, other headers)."""
        headers = response_headers(request_id, response)
        if response.error:
            status = response.status or 500
            return (status, common.JSON, torchserve_body(status, type_for_status(status),
                                                         response.error), headers)
        content_type = (response.content_type or "application/json").encode("latin-1")
        return response.status or 200, content_type, response.body, headers

    async def observed_predict(self, scope: common.Scope, receive: common.Receive,
                               send: common.Send) -> None:
        """A prediction, with its metrics and access-log line, whatever its outcome."""

        async def run(model: Model, job: Job) -> int:
            self.admit(model, scope)
            return await self.predict(model, scope, receive, send, job)

        await observed(self.metrics, self.access, scope, lambda: self.model_for(scope), run)

    async def predict(self, model: Model, scope: common.Scope, receive: common.Receive,
                      send: common.Send, job: Job) -> int:
        """Run one prediction and answer it; returns the HTTP status sent (0: client gone)."""
        body = await common.read_body(receive, self.config.max_request_size_bytes)
        timeout_s = self.worker_request(scope, body, job)
        result = await submit_unless_gone(model, job.request, timeout_s, receive, job)
        if result is None:
            return 0  # the client went away
        request_id = job.request.request_id
        if isinstance(result, ResponseStream):
            return await self.respond_in_parts(result, request_id, send)
        status, content_type, body, headers = self.answer(result, request_id)
        await common.send_bytes(send, status, body, content_type, headers)
        return status

    async def respond_in_parts(self, stream: ResponseStream, request_id: str,
                               send: common.Send) -> int:
        """Intermediate responses as they come: HTTP/1.1 chunked transfer encoding."""
        started = False
        status = 200
        try:
            async for part in stream:
                if not started:
                    content_type = (part.content_type or "application/json").encode("latin-1")
                    status = part.status or 200
                    await send({"type": "http.response.start", "status": status,
                                "headers": [(b"content-type", content_type),
                                            (b"x-request-id", request_id.encode())]})
                    started = True
                body = part.body
                if part.error:
                    status = part.status or 500
                    body = torchserve_body(status, type_for_status(status), part.error)
                await send({"type": "http.response.body", "body": body, "more_body": True})
        except ServeError as error:
            if not started:
                raise
            # The status line is gone already: end the stream with the error as its last part.
            await send({"type": "http.response.body", "body": error_body(error),
                        "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return status
