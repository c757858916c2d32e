"""The metrics API (port 8082): GET /metrics in Prometheus text format."""

from __future__ import annotations

from urllib.parse import parse_qsl

from frontend.api.http import common
from frontend.errors import MethodNotAllowed, RouteNotFound
from frontend.observe.exposition import CONTENT_TYPE
from frontend.observe.metrics import ServerMetrics
from frontend.ops.services import Services


class MetricsApp(common.Routes):
    """What the metrics page shows depends on ``metrics_mode`` (``ServerMetrics``): in
    ``legacy`` mode only TorchServe's three ``ts_*`` counters, as TorchServe."""

    def __init__(self, services: Services) -> None:
        self.metrics: ServerMetrics = services.metrics

    async def route(self, scope: common.Scope, receive: common.Receive,
                    send: common.Send) -> bool:
        if scope["path"] != "/metrics":
            raise RouteNotFound()
        if scope["method"] != "GET":
            raise MethodNotAllowed()
        names = [value for key, value in parse_qsl(scope.get("query_string", b"").decode())
                 if key in ("name[]", "name")]
        body = self.metrics.exposition(set(names))
        await common.send_bytes(send, 200, body, CONTENT_TYPE)
        return True
