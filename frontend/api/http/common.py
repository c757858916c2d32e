"""Lean ASGI plumbing shared by our apps: bodies, JSON and error responses, query params.

The inference hot path goes through these functions only; no framework layers.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any
from urllib.parse import parse_qs

from frontend.errors import BadRequest, PayloadTooLarge, ServeError, error_body, header_pairs

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
Headers = list[tuple[bytes, bytes]]
AsgiApp = Callable[[Scope, Receive, Send], Awaitable[None]]

JSON = b"application/json"


class ClientDisconnected(Exception):
    """The HTTP client went away before we had read its request."""


async def read_body(receive: Receive, limit_bytes: int) -> bytes:
    """The whole request body, or PayloadTooLarge past ``limit_bytes``."""
    message = await receive()
    if message["type"] == "http.disconnect":
        raise ClientDisconnected()
    body: bytes = message.get("body", b"")
    if not message.get("more_body", False):
        if len(body) > limit_bytes:
            raise PayloadTooLarge(f"request body exceeds max_request_size ({limit_bytes} bytes)")
        return body
    chunks = [body]
    size = len(body)
    if size > limit_bytes:
        raise PayloadTooLarge(f"request body exceeds max_request_size ({limit_bytes} bytes)")
    while message.get("more_body", False):
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnected()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit_bytes:
            raise PayloadTooLarge(f"request body exceeds max_request_size ({limit_bytes} bytes)")
        chunks.append(chunk)
    return b"".join(chunks)


def check_content_length(scope: Scope, limit_bytes: int) -> None:
    """Refuse an oversize body from its Content-Length header, before reading it."""
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                declared = int(value)
            except ValueError:
                raise BadRequest("invalid Content-Length header") from None
            if declared > limit_bytes:
                raise PayloadTooLarge(
                    f"request body of {declared} bytes exceeds max_request_size "
                    f"({limit_bytes} bytes)")
            return


async def send_bytes(send: Send, status: int, body: bytes, content_type: bytes,
                     headers: Headers | None = None) -> None:
    response_headers: Headers = [(b"content-type", content_type),
                                 (b"content-length", str(len(body)).encode())]
    if headers:
        response_headers.extend(headers)
    await send({"type": "http.response.start", "status": status, "headers": response_headers})
    await send({"type": "http.response.body", "body": body})


def pretty_json(value: object) -> bytes:
    """TorchServe's response style: two-space indented JSON with a trailing newline."""
    return (json.dumps(value, indent=2) + "\n").encode()


async def send_json(send: Send, status: int, value: object,
                    headers: Headers | None = None) -> None:
    await send_bytes(send, status, pretty_json(value), JSON, headers)


async def send_error(send: Send, error: ServeError, headers: Headers | None = None) -> None:
    await send_bytes(send, error.http_status, error_body(error), JSON,
                     [*header_pairs(error), *(headers or [])])


def query_params(scope: Scope) -> dict[str, str]:
    """Query string as name -> last value."""
    raw = scope.get("query_string", b"")
    if not raw:
        return {}
    return {key: values[-1] for key, values in parse_qs(raw.decode("latin-1")).items()}


class HeadAsGet:
    """HTTP's HEAD (RFC 9110, 9.3.2): the answer GET would get, status and headers (its
    Content-Length too), without the content, on every route that answers GET.

    The app below sees GET; the connection sends no content for HEAD: uvicorn's cycle keeps
    the request's own scope, whose method is still HEAD, and writes no body bytes for it
    (tests/unit/test_uvicorn_contract.py holds it to that). TorchServe answers HEAD where its
    route takes any method (/ping, /metrics, /api-description, KServe's health and metadata),
    and 405 where it checks for GET (/models); here every GET route takes HEAD, as HTTP
    requires of a server. Except ``/token``: its GET rotates a key that only the answer
    carries, so a HEAD there is refused with 405 (TorchServe rotates the key and drops the
    answer).
    """

    def __init__(self, app: AsgiApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("method") == "HEAD":
            scope = {**scope, "method": "GET", _HEAD: True}
        await self.app(scope, receive, send)


#: The scope key that marks a HEAD request the apps see as GET (``is_head``).
_HEAD = "batchserve.head"


def is_head(scope: Scope) -> bool:
    """Whether this GET is a HEAD (``HeadAsGet``): for a GET route whose work only its answer
    delivers, which a HEAD would do for nothing (``GET /token`` rotates a key)."""
    return bool(scope.get(_HEAD, False))
