"""The metrics API (port 8082): GET /metrics in Prometheus text format."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from frontend.errors import ServeError
from frontend.http import common
from frontend.metrics import ServerMetrics
from frontend.services import Services


class MetricsApp:
    def __init__(self, services: Services) -> None:
        self.metrics: ServerMetrics = services.registry.metrics

    async def __call__(self, scope: common.Scope, receive: common.Receive,
                       send: common.Send) -> None:
        if scope["type"] != "http":
            return
        try:
            await self.route(scope, receive, send)
        except ServeError as error:
            await common.send_error(send, error)

    async def route(self, scope: common.Scope, receive: common.Receive,
                    send: common.Send) -> bool:
        if scope["path"] != "/metrics":
            raise common.not_found()
        if scope["method"] != "GET":
            raise common.method_not_allowed()
        body = generate_latest(self.metrics.registry)
        await common.send_bytes(send, 200, body, CONTENT_TYPE_LATEST.encode())
        return True
