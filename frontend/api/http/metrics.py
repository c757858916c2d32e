"""The metrics API (port 8082): GET /metrics in Prometheus text format."""

from __future__ import annotations

from urllib.parse import parse_qsl

from prometheus_client import CONTENT_TYPE_LATEST

from frontend.api.http import common
from frontend.errors import MethodNotAllowed, RouteNotFound
from frontend.observe.metrics import LEGACY, ServerMetrics
from frontend.ops.services import Services


class MetricsApp(common.Routes):
    def __init__(self, services: Services) -> None:
        self.metrics: ServerMetrics = services.metrics
        #: metrics_mode=legacy: only TorchServe's three ts_* counters, as TorchServe.
        self.legacy = services.config.metrics_mode == "legacy"

    async def route(self, scope: common.Scope, receive: common.Receive,
                    send: common.Send) -> bool:
        if scope["path"] != "/metrics":
            raise RouteNotFound()
        if scope["method"] != "GET":
            raise MethodNotAllowed()
        names = [value for key, value in parse_qsl(scope.get("query_string", b"").decode())
                 if key in ("name[]", "name")]
        if self.legacy:  # only the legacy counters, whatever else the filter names
            wanted = set(names) & set(LEGACY) if names else set(LEGACY)
            body = self.metrics.exposition(wanted) if wanted else b""
        else:
            body = self.metrics.exposition(set(names))
        await common.send_bytes(send, 200, body, CONTENT_TYPE_LATEST.encode())
        return True
