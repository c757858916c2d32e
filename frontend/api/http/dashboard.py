"""The live page on the management port: ``GET /dashboard`` and ``GET /dashboard/data``.

``/dashboard`` is one static HTML file (``dashboard.html``, package data) that holds no data
and no secret, so a browser loads it without a token; it draws its plots itself as SVG and
polls ``/dashboard/data`` every second, which needs what the management API needs: the
management key as ``Authorization: Bearer <key>`` when token authorization is on. The page
takes the key from its URL's fragment (``/dashboard#token=<key>``: a fragment is never sent
to the server, so it is in no log; the page then removes it from the address bar) or from a
form, and keeps it in memory only.

The page is served with a strict Content-Security-Policy: its one inline script and style are
allowed by their SHA-256 hashes, computed here when the file is read, and it may connect only
to its own origin.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.resources
import json
import math
import re

from frontend.api.http import common
from frontend.api.http.routes import Target
from frontend.errors import BadRequest, MethodNotAllowed, ServiceUnavailable
from frontend.observe.dashboard import Dashboard
from frontend.ops.auth import KeyKind, TokenAuthority

PAGE_FILE = "dashboard.html"
HTML = b"text/html; charset=utf-8"


def _hashes(page: str, tag: str) -> list[str]:
    """CSP source expressions allowing each inline ``<tag>`` of ``page`` by its hash."""
    found = re.findall(rf"<{tag}>(.*?)</{tag}>", page, flags=re.DOTALL)
    return [f"'sha256-{base64.b64encode(hashlib.sha256(text.encode()).digest()).decode()}'"
            for text in found]


def page_headers(page: bytes) -> common.Headers:
    """The page's security headers: its CSP (its own inline script and style only, requests
    to its own origin only, no frames, forms or plugins), no sniffing, caching or referrer."""
    text = page.decode()
    policy = "; ".join((
        "default-src 'none'",
        "script-src " + " ".join(_hashes(text, "script")),
        "style-src " + " ".join(_hashes(text, "style")),
        "connect-src 'self'",
        "img-src 'self'",
        "base-uri 'none'",
        "form-action 'none'",
        "frame-ancestors 'none'",
    ))
    return [(b"content-security-policy", policy.encode()),
            (b"x-content-type-options", b"nosniff"),
            (b"x-frame-options", b"DENY"),
            (b"referrer-policy", b"no-referrer"),
            (b"cache-control", b"no-store")]


class DashboardRoutes:
    """Serves the page and its data (see the module docstring)."""

    def __init__(self, dashboard: Dashboard | None, auth: TokenAuthority | None) -> None:
        self.dashboard = dashboard
        self.auth = auth
        self.page = importlib.resources.files("frontend.api.http").joinpath(PAGE_FILE).read_bytes()
        self.headers = page_headers(self.page)

    async def route(self, target: Target, scope: common.Scope, receive: common.Receive,
                    send: common.Send) -> None:
        """``/dashboard`` or ``/dashboard/data`` (the route table's ``DASHBOARD``)."""
        parts = target.parts
        if len(parts) == 2 and self.auth is not None:
            self.auth.check(KeyKind.MANAGEMENT, scope["headers"])
        if scope["method"] != "GET":
            raise MethodNotAllowed()
        if len(parts) == 1:
            await common.send_bytes(send, 200, self.page, HTML, self.headers)
            return
        if self.dashboard is None:
            raise ServiceUnavailable("the live page's sampler is not running on this server")
        since_text = common.query_params(scope).get("since")
        since = None
        if since_text is not None:
            try:
                since = float(since_text)
                if not math.isfinite(since):
                    raise ValueError(since_text)
            except ValueError:
                raise BadRequest("since must be a time in seconds (a sample's t)") from None
        body = json.dumps(self.dashboard.document(since), separators=(",", ":")).encode()
        await common.send_bytes(send, 200, body, common.JSON, [(b"cache-control", b"no-store")])
