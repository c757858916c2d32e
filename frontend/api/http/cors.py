"""Cross-origin resource sharing (CORS) on every HTTP port, as TorchServe applies it.

TorchServe's three keys (``cors_allowed_origin``, ``cors_allowed_methods``,
``cors_allowed_headers``) become ``Access-Control-Allow-Origin``, ``-Methods`` and ``-Headers``
on every response, unless the response sets that header itself (a handler may). A browser's
preflight (``OPTIONS`` with ``Origin`` and ``Access-Control-Request-Method``) is answered
200 with them on any path, before token authorization (a browser never sends credentials with
a preflight); the browser then checks the method and headers it wants against them.

One refinement over TorchServe, which writes the configured origin on every response: a
request whose ``Origin`` is not the configured one (or one of a comma-separated list, which
TorchServe would send verbatim and no browser accepts) gets no CORS headers at all, and a
listed origin is answered with itself and ``Vary: Origin``. ``*`` allows every origin; a
request without ``Origin`` (not a browser's cross-origin request) gets TorchServe's headers.

With none of the keys set, nothing here runs: the listeners are not wrapped and the fast
path is the plain one (``frontend/api/http/fast.py``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from frontend.api.http import common
from frontend.config import ServerConfig

ALLOW_ORIGIN = b"access-control-allow-origin"
ALLOW_METHODS = b"access-control-allow-methods"
ALLOW_HEADERS = b"access-control-allow-headers"
_CORS_NAMES = frozenset({ALLOW_ORIGIN, ALLOW_METHODS, ALLOW_HEADERS})
_VARY_ORIGIN = (b"vary", b"Origin")


@dataclass(frozen=True, slots=True)
class CorsPolicy:
    """The configured CORS headers and the origins they are given to."""

    #: ``cors_allowed_origin`` as configured (b"": not set).
    origin: bytes
    #: The origins allowed by name; None: any (``*``, or no origin configured).
    origins: frozenset[bytes] | None
    #: ``Access-Control-Allow-Methods`` and ``-Headers``, where configured.
    others: tuple[tuple[bytes, bytes], ...]

    @classmethod
    def from_config(cls, config: ServerConfig) -> CorsPolicy | None:
        """The policy of the CORS keys; None when none of them is set."""
        origin = config.cors_allowed_origin.strip()
        methods = config.cors_allowed_methods.strip()
        headers = config.cors_allowed_headers.strip()
        if not (origin or methods or headers):
            return None
        named = frozenset(item.strip().encode("latin-1") for item in origin.split(",")
                          if item.strip())
        others = tuple((name, value.encode("latin-1")) for name, value in
                       ((ALLOW_METHODS, methods), (ALLOW_HEADERS, headers)) if value)
        return cls(origin.encode("latin-1"), None if not named or b"*" in named else named,
                   others)

    def headers_for(self, origin: bytes | None) -> tuple[tuple[bytes, bytes], ...] | None:
        """The CORS headers for a request from ``origin`` (None: it named none); None when
        that origin is not allowed (it gets no CORS headers)."""
        if self.origins is None or origin is None:
            if not self.origin:
                return self.others
            return ((ALLOW_ORIGIN, self.origin), *self.others)
        if origin not in self.origins:
            return None
        return ((ALLOW_ORIGIN, origin), _VARY_ORIGIN, *self.others)

    def for_request(self, request_headers: Iterable[tuple[bytes, bytes]]
                    ) -> tuple[tuple[bytes, bytes], ...] | None:
        """``headers_for`` the request's ``Origin`` header."""
        for name, value in request_headers:
            if name == b"origin":
                return self.headers_for(value)
        return self.headers_for(None)


def with_cors(headers: list[tuple[bytes, bytes]], cors: Iterable[tuple[bytes, bytes]]
              ) -> list[tuple[bytes, bytes]]:
    """``headers`` plus the CORS headers the response does not set itself (names compared
    in lower case: a handler's header names reach here as it wrote them)."""
    present = {name.lower() for name, _ in headers if name.lower() in _CORS_NAMES}
    return [*headers, *((name, value) for name, value in cors if name not in present)]


def is_preflight(scope: common.Scope) -> bool:
    """A browser's CORS preflight: OPTIONS naming the method it wants to send."""
    return scope["method"] == "OPTIONS" and any(
        name == b"access-control-request-method" for name, _ in scope["headers"])


class CorsApp:
    """An ASGI app with CORS: preflights answered, the headers added to every response."""

    def __init__(self, app: common.AsgiApp, policy: CorsPolicy) -> None:
        self.app = app
        self.policy = policy

    async def __call__(self, scope: common.Scope, receive: common.Receive,
                       send: common.Send) -> None:
        cors = self.policy.for_request(scope["headers"])
        if cors is None:  # an origin not allowed: no CORS headers, the browser blocks it
            await self.app(scope, receive, send)
            return
        if is_preflight(scope):
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-length", b"0"), *cors]})
            await send({"type": "http.response.body", "body": b""})
            return

        async def send_with_cors(message: common.Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = with_cors(list(message.get("headers", ())), cors)
            await send(message)

        await self.app(scope, receive, send_with_cors)
