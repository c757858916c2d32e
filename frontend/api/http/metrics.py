"""The metrics API (port 8082): GET /metrics in Prometheus text format."""

from __future__ import annotations

from typing import ClassVar
from urllib.parse import parse_qsl

from frontend.api.http import common, routes
from frontend.api.http.routes import Api, RoutedApp, RouteTable, Target
from frontend.errors import MethodNotAllowed
from frontend.observe.exposition import CONTENT_TYPE
from frontend.observe.metrics import ServerMetrics
from frontend.ops.services import Services


class MetricsApp(RoutedApp):
    """What the metrics page shows depends on ``metrics_mode`` (``ServerMetrics``): in
    ``legacy`` mode only TorchServe's three ``ts_*`` counters, as TorchServe."""

    api: ClassVar[Api] = "metrics"

    def __init__(self, services: Services) -> None:
        self.metrics: ServerMetrics = services.metrics
        super().__init__(RouteTable.of([self.api]), {routes.METRICS: self.page})

    async def page(self, target: Target, scope: common.Scope, receive: common.Receive,
                   send: common.Send) -> None:
        if scope["method"] != "GET":
            raise MethodNotAllowed()
        names = [value for key, value in parse_qsl(scope.get("query_string", b"").decode())
                 if key in ("name[]", "name")]
        body = self.metrics.exposition(set(names))
        await common.send_bytes(send, 200, body, CONTENT_TYPE)
