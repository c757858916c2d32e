"""Prometheus metrics, TorchServe's names first, then what TorchServe lacks (batch sizes)."""

from __future__ import annotations

import socket
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from frontend.batching import Job
    from frontend.registry import Model

HOSTNAME = socket.gethostname()
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class _QueueCollector(Collector):
    def __init__(self, models: Iterable[Model]) -> None:
        self._models = models

    def collect(self) -> Iterator[GaugeMetricFamily]:
        depth = GaugeMetricFamily("batchserve_queue_depth", "Requests waiting in a model's queue",
                                  labels=["model_name", "model_version"])
        workers = GaugeMetricFamily("batchserve_workers", "Worker processes of a model",
                                    labels=["model_name", "model_version"])
        for model in self._models:
            depth.add_metric([model.name, model.version], model.batcher.depth)
            workers.add_metric([model.name, model.version], len(model.workers))
        yield depth
        yield workers


class ServerMetrics:
    """One registry per server, so tests with several servers in a process stay apart."""

    def __init__(self, models: Iterable[Model]) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name", "model_version", "hostname"]
        self.requests = Counter("ts_inference_requests", "Torchserve prometheus counter metric "
                                "with unit: Count", labels, registry=self.registry)
        self.queue_latency = Counter(
            "ts_queue_latency_microseconds",
            "Torchserve prometheus counter metric with unit: Microseconds", labels,
            registry=self.registry)
        self.batch_size = Histogram("batchserve_batch_size", "Requests per dispatched batch",
                                    ["model_name", "model_version"], buckets=_BATCH_BUCKETS,
                                    registry=self.registry)
        self.registry.register(_QueueCollector(models))

    def record_batch(self, model: Model, jobs: list[Job]) -> None:
        key = (model.name, model.version, HOSTNAME)
        self.requests.labels(*key).inc(len(jobs))
        self.queue_latency.labels(*key).inc(sum(job.queue_wait_s for job in jobs) * 1e6)
        self.batch_size.labels(model.name, model.version).observe(len(jobs))
