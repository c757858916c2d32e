"""The per-request plumbing every HTTP prediction route shares (TorchServe's and KServe's):
who asked, response headers, and waiting for the answer while watching for a hang-up."""

from __future__ import annotations

import asyncio

from frontend.api.http import common
from frontend.errors import InternalError
from frontend.ops.plane import SERVER_TIMING, Answer, Call, InferencePlane, Origin
from protos import worker_pb2

#: The response header that says where a prediction's time went (docs/batches.md).
_SERVER_TIMING = SERVER_TIMING.encode("latin-1")


#: The scope key under which a prediction's route keeps its Origin: the plane writes its
#: access-log line, once its Origin is ``recorded`` (``app.CountedResponses`` writes every
#: other request's).
ORIGIN = "batchserve.origin"


def http_origin(scope: common.Scope) -> Origin:
    origin = Origin(peer(scope), scope["method"], scope["path"],
                    f"HTTP/{scope.get('http_version', '1.1')}", uri=request_target(scope))
    scope[ORIGIN] = origin
    return origin


def peer(scope: common.Scope) -> str:
    """The client's address as TorchServe's access log writes it: ``/127.0.0.1:41696``."""
    client = scope.get("client") or ("-", 0)
    return f"/{client[0]}:{client[1]}"


def request_target(scope: common.Scope) -> str:
    """The request line's target as the client sent it, its query included (TorchServe's
    access log writes it so)."""
    raw = scope.get("raw_path")
    target = raw.decode("latin-1") if raw else scope["path"]
    query = scope.get("query_string")
    return f"{target}?{query.decode('latin-1')}" if query else target


def response_headers(request_id: str, response: worker_pb2.Response) -> common.Headers:
    headers: common.Headers = [(b"x-request-id", request_id.encode())]
    # HTTP headers are latin-1; a handler's other characters become "?", not a 500.
    headers.extend((key.lower().encode("latin-1", "replace"),
                    value.encode("latin-1", "replace"))
                   for key, value in response.headers.items())
    return headers


def with_timing(call: Call, headers: common.Headers) -> common.Headers:
    """``headers`` with Server-Timing added when the call wants it (``server_timing``)."""
    value = InferencePlane.timing_header(call)
    if value is not None:
        headers.append((_SERVER_TIMING, value.encode("latin-1")))
    return headers


def check_response_size(body: bytes, limit_bytes: int) -> None:
    if len(body) > limit_bytes:
        raise InternalError(f"response of {len(body)} bytes exceeds max_response_size "
                            f"({limit_bytes} bytes)")


async def answer_unless_gone(plane: InferencePlane, call: Call, receive: common.Receive
                             ) -> Answer | None:
    """The call's answer; None when the client hung up meanwhile (its request then leaves
    the queue: the ASGI server answers a pending receive() with http.disconnect)."""
    disconnected = asyncio.ensure_future(receive())
    try:
        return await plane.outcome(call, abandoned=disconnected)
    except asyncio.CancelledError:
        if disconnected.done():
            return None  # nobody is listening for an answer
        raise
    finally:
        disconnected.cancel()
