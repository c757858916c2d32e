"""After each HTTP prediction: its metrics and its access-log line, whatever its outcome."""

from __future__ import annotations

from frontend.batching import Job
from frontend.http.common import Scope
from frontend.logs import AccessLog
from frontend.metrics import ServerMetrics
from frontend.registry import Model


def record_http_request(metrics: ServerMetrics, access: AccessLog, scope: Scope,
                        model: Model | None, status: int, latency_s: float, job: Job) -> None:
    metrics.record_request(model, status, latency_s)
    client = scope.get("client") or ("-", 0)
    access.write(f"/{client[0]}:{client[1]}", scope["method"], scope["path"],
                 f"HTTP/{scope.get('http_version', '1.1')}", status, latency_s,
                 model.name if model else "-", model.version if model else "-",
                 job.queue_wait_s, job.batch_size)
