"""KServe's REST protocols on the inference port: v1 (``/v1/models/...``) and the Open
Inference Protocol, v2 (``/v2/...``). Their explain verbs (v1 ``:explain``, v2 ``/explain``)
are predictions with TorchServe's ``explain`` header, answered in the same shape.

v1 predictions batch by instance, as KServe's batcher does: a request is one job that weighs
as many batch items as it has instances, so the instances of several requests fill one batch up
to the model's batch_size (KServe's maxBatchSize), and each request gets back exactly its own
predictions plus the id of the batch it rode in. v2 requests batch by the rows of their tensors'
first dimension. Errors answer KServe's ``{"error": "..."}``.

With a service envelope (``service_envelope``/``TS_SERVICE_ENVELOPE``), v1 and v2 predictions
are what TorchServe's frontend made of them: the body goes to the worker as it came, one batch
item, and the envelope there unwraps it and writes the whole answer.
"""

from __future__ import annotations

import json

from frontend import __version__
from frontend.api.http import common
from frontend.api.http.calls import (
    answer_unless_gone,
    check_response_size,
    http_origin,
    response_headers,
    with_timing,
)
from frontend.api.http.routes import KSERVE_V1, Target
from frontend.errors import (
    InternalError,
    MethodNotAllowed,
    RouteNotFound,
    ServeError,
    header_pairs,
    kserve_body,
)
from frontend.ops import kserve
from frontend.ops.auth import KeyKind
from frontend.ops.plane import Call, ResponseStream
from frontend.ops.services import Services
from protos import worker_pb2

V1_MODELS = "/v1/models"


async def send_kserve_error(send: common.Send, status: int, message: str,
                            headers: common.Headers | None = None) -> None:
    await common.send_bytes(send, status, kserve_body(message), common.JSON, headers)


def _compact(value: object) -> bytes:
    return json.dumps(value).encode()


class KServeRoutes:
    """The /v1 and /v2 routes of the inference app."""

    def __init__(self, services: Services) -> None:
        self.config = services.config
        self.registry = services.registry
        self.auth = services.auth
        self.plane = services.plane

    async def live(self, target: Target, scope: common.Scope, receive: common.Receive,
                   send: common.Send) -> None:
        """``GET /`` under KServe (only then a route): its model server's v1 liveness, which
        KServe's clients ask; elsewhere TorchServe's 404."""
        await common.send_json(send, 200, {"status": "alive"})

    async def serve(self, target: Target, scope: common.Scope, receive: common.Receive,
                    send: common.Send) -> None:
        """A /v1 or /v2 request (the route table's ``KSERVE_V1``, ``KSERVE_V2``), its errors
        in KServe's body."""
        try:
            if target.route is KSERVE_V1:
                await self.v1(scope, receive, send)
            else:
                await self.v2(target.parts[1:], scope, receive, send)
        except ServeError as error:
            await send_kserve_error(send, error.http_status, error.message, header_pairs(error))

    def _check_auth(self, scope: common.Scope) -> None:
        if self.auth is not None:
            self.auth.check(KeyKind.INFERENCE, scope["headers"])

    @staticmethod
    def _expect(scope: common.Scope, method: str) -> None:
        if scope["method"] != method:
            raise MethodNotAllowed()

    # ---- v1 ---------------------------------------------------------------------------------

    async def v1(self, scope: common.Scope, receive: common.Receive, send: common.Send) -> None:
        path: str = scope["path"]
        self._check_auth(scope)
        if path == V1_MODELS:
            self._expect(scope, "GET")
            await common.send_json(send, 200, {"models": self.registry.names()})
            return
        if not path.startswith(V1_MODELS + "/"):
            raise RouteNotFound()
        name, _, verb = path[len(V1_MODELS) + 1:].partition(":")
        if not verb:
            self._expect(scope, "GET")
            ready = self.registry.get(name).is_ready()
            # 503 when not ready, as KServe's model server (and its clients expect).
            await common.send_json(send, 200 if ready else 503, {"name": name, "ready": ready})
            return
        if verb not in ("predict", "explain"):
            raise RouteNotFound()
        self._expect(scope, "POST")
        async with self.plane.call(http_origin(scope)) as call:
            self.plane.open(call, name, None, scope["headers"])
            call.status = await self._v1_predict(call, scope, receive, send,
                                                 verb == "explain")

    async def _v1_predict(self, call: Call, scope: common.Scope, receive: common.Receive,
                          send: common.Send, explain: bool) -> int:
        body = await self._read(scope, receive)
        if self.config.service_envelope:
            return await self._enveloped(call, scope, receive, send, body, explain)
        instances = kserve.v1_instances(body, self.config.max_request_instances)
        self.plane.send(call, scope["headers"],
                        [("body", _compact(instances), "application/json")],
                        weight=len(instances), instances=True, explain=explain)
        response = await self._answer(call, receive)
        if response is None:
            return 0
        headers, failed = await self._send_error(send, call.job.request, response)
        if failed:
            return failed
        headers = with_timing(call, headers)
        key = b"explanations" if explain else b"predictions"
        answer = b'{"' + key + b'": ' + response.body + b', "batchId": ' + \
            _compact(call.job.batch_id) + b"}"
        check_response_size(answer, self.config.max_response_size_bytes)
        await common.send_bytes(send, response.status or 200, answer, common.JSON, headers)
        return response.status or 200

    # ---- v2 ---------------------------------------------------------------------------------

    async def v2(self, parts: list[str], scope: common.Scope, receive: common.Receive,
                 send: common.Send) -> None:
        """``parts``: the path's segments after ``v2``."""
        if parts and parts[0] == "health":
            self._expect(scope, "GET")
            if parts == ["health", "live"]:
                await common.send_json(send, 200, {"live": True})
                return
            if parts == ["health", "ready"]:
                ready = kserve.is_server_ready(self.registry)
                await common.send_json(send, 200 if ready else 503, {"ready": ready})
                return
            raise RouteNotFound()
        self._check_auth(scope)
        if not parts:
            self._expect(scope, "GET")
            await common.send_json(send, 200, kserve.server_metadata(__version__))
            return
        if parts[0] != "models" or len(parts) < 2:
            raise RouteNotFound()
        name, rest = parts[1], parts[2:]
        version = None
        if rest[:1] == ["versions"]:
            if len(rest) < 2:
                raise RouteNotFound()
            version, rest = rest[1], rest[2:]
        if not rest:
            self._expect(scope, "GET")
            model = self.registry.get(name, version)
            versions = [m.version for m in self.registry.versions(name)]
            await common.send_json(send, 200, kserve.model_metadata(model, versions))
        elif rest == ["ready"]:
            self._expect(scope, "GET")
            model = self.registry.get(name, version)
            ready = model.is_ready()
            await common.send_json(send, 200 if ready else 503, {"name": name, "ready": ready})
        elif rest in (["infer"], ["explain"]):
            self._expect(scope, "POST")
            async with self.plane.call(http_origin(scope)) as call:
                self.plane.open(call, name, version, scope["headers"])
                call.status = await self._v2_infer(call, scope, receive, send,
                                                   rest == ["explain"])
        else:
            raise RouteNotFound()

    async def _v2_infer(self, call: Call, scope: common.Scope, receive: common.Receive,
                        send: common.Send, explain: bool) -> int:
        body = await self._read(scope, receive)
        if self.config.service_envelope:
            return await self._enveloped(call, scope, receive, send, body, explain)
        length = next((value.decode("latin-1") for name, value in scope["headers"]
                       if name == kserve.HEADER_LENGTH.encode()), None)
        header = kserve.parse_json(kserve.split_v2_body(body, length))
        rows = kserve.v2_rows(header, self.config.max_request_inputs,
                              self.config.max_request_instances)
        self.plane.send(call, scope["headers"], [("body", body, None)], weight=rows,
                        tensor_format=worker_pb2.TENSOR_FORMAT_REST, explain=explain,
                        priority=kserve.v2_priority(header))
        return await self._answer_as_is(call, receive, send)

    async def _enveloped(self, call: Call, scope: common.Scope, receive: common.Receive,
                         send: common.Send, body: bytes, explain: bool) -> int:
        self.plane.send(call, scope["headers"], [("body", body, None)], explain=explain)
        return await self._answer_as_is(call, receive, send)

    async def _answer_as_is(self, call: Call, receive: common.Receive, send: common.Send
                            ) -> int:
        """Send the worker's answer as it wrote it (or KServe's error body)."""
        response = await self._answer(call, receive)
        if response is None:
            return 0
        headers, failed = await self._send_error(send, call.job.request, response)
        if failed:
            return failed
        headers = with_timing(call, headers)
        content_type = (response.content_type or "application/json").encode("latin-1")
        await common.send_bytes(send, response.status or 200, response.body, content_type,
                                headers)
        return response.status or 200

    # ---- shared -----------------------------------------------------------------------------

    async def _read(self, scope: common.Scope, receive: common.Receive) -> bytes:
        limit = self.config.max_request_size_bytes
        common.check_content_length(scope, limit)
        return await common.read_body(receive, limit)

    @staticmethod
    async def _send_error(send: common.Send, request: worker_pb2.Request,
                          response: worker_pb2.Response) -> tuple[common.Headers, int]:
        """The response headers, and the status of the KServe error sent for a failed
        response (0 when it did not fail and nothing was sent)."""
        headers = response_headers(request.request_id, response)
        if not response.error:
            return headers, 0
        status = response.status or 500
        await send_kserve_error(send, status, response.error, headers)
        return headers, status

    async def _answer(self, call: Call, receive: common.Receive) -> worker_pb2.Response | None:
        """The sent call's answer; None when the client went away meanwhile."""
        result = await answer_unless_gone(self.plane, call, receive)
        if isinstance(result, ResponseStream):
            raise InternalError("the handler sent intermediate responses, which KServe's "
                                "protocols cannot carry")
        return result

