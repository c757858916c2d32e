"""Prometheus metrics: TorchServe's names first, then what TorchServe lacks.

TorchServe's dashboards read ``ts_inference_requests_total``,
``ts_inference_latency_microseconds`` and ``ts_queue_latency_microseconds`` (counters of
summed microseconds, labels ``model_name``, ``model_version``, ``hostname``), the
``Requests2XX/4XX/5XX`` counters and the host gauges (``CPUUtilization``, ``MemoryUsed``, …);
those keep their exact names, in HELP, TYPE and samples alike, as TorchServe's Prometheus
client writes them (``_LegacyCounter``: no ``_total`` added). ``Requests2XX/4XX/5XX`` count
every HTTP response on every port, as TorchServe counts them (pings, management and metrics
calls included), plus the answers of gRPC prediction RPCs (TorchServe does not count gRPC).
Ours are ``batchserve_*``: per-model histograms of batch size,
queue wait, end-to-end latency and handler time, the queue depth, worker restarts, and
rejected (503) and expired (504) requests. Custom metrics that handlers report through
``context.metrics`` arrive with each batch's results and are exported under their own names.
"""

from __future__ import annotations

import bisect
import re
import shutil
import socket
from collections.abc import Callable, Iterable, Iterator, Sequence, Sized
from typing import Protocol

import psutil
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from protos import worker_pb2

HOSTNAME = socket.gethostname()
MODEL_LABELS = ("model_name", "model_version")
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
_TIME_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                 5.0, 10.0, 30.0, 120.0)
_INVALID = re.compile(r"[^a-zA-Z0-9_:]")


class _Depth(Protocol):
    @property
    def depth(self) -> int: ...


class Model(Protocol):
    """What the metrics read of a model version (``frontend.models.model.Model``): this layer
    records the layers above it without importing them."""

    @property
    def name(self) -> str: ...

    @property
    def version(self) -> str: ...

    @property
    def batcher(self) -> _Depth: ...

    @property
    def workers(self) -> Sized: ...

    def restarts_total(self) -> int: ...


class Job(Protocol):
    """What the metrics read of a request that was batched (``frontend.serving.batching.Job``)."""

    @property
    def queue_wait_s(self) -> float: ...


#: The only metrics exported in ``metrics_mode=legacy`` (TorchServe's rule).
LEGACY = ("ts_inference_requests_total", "ts_inference_latency_microseconds",
          "ts_queue_latency_microseconds")


class _LegacyCounter(Metric):
    """A counter under its exact name (``Requests2XX``, ``ts_inference_latency_microseconds``,
    a handler's ``InferenceRequestCount``): TorchServe's simpleclient writes counters so, and
    its users' dashboards query those names. prometheus_client would name the HELP and TYPE
    lines ``<name>_total`` over samples without it, which parsers then file as untyped."""

    def __init__(self, name: str, documentation: str) -> None:
        super().__init__(name, documentation, "counter")


class _One:
    """A collector of one family, to format it on its own."""

    def __init__(self, family: Metric) -> None:
        self._family = family

    def collect(self) -> Iterator[Metric]:
        yield self._family


def exposition(families: Iterable[Metric]) -> bytes:
    """Prometheus text (format 0.0.4) of ``families``, by prometheus_client, with the HELP
    and TYPE lines of legacy counters under their own names."""
    parts = []
    for family in families:
        text = generate_latest(_One(family))
        if isinstance(family, _LegacyCounter):
            name = family.name.encode()
            text = text.replace(b"# HELP " + name + b"_total ", b"# HELP " + name + b" ", 1) \
                .replace(b"# TYPE " + name + b"_total ", b"# TYPE " + name + b" ", 1)
        parts.append(text)
    return b"".join(parts)


def _metric_name(name: str) -> str:
    cleaned = _INVALID.sub("_", name)
    return cleaned if cleaned[:1].isalpha() or cleaned[:1] in "_:" else f"_{cleaned}"


#: prometheus_client's formatting of a bucket bound ("0.005", "1.0", "+Inf"), typed.
_go_float: Callable[[float], str] = floatToGoString


class _Series:
    """One label set's histogram: a count per bucket (the last: above every bound) and the
    sum. An observation is a list increment: no lock (the event loop is the only writer) and
    no work at all until a scrape reads it."""

    __slots__ = ("counts", "total")

    def __init__(self, buckets: int) -> None:
        self.counts = [0] * (buckets + 1)
        self.total = 0.0


class _Histogram(Collector):
    """A Prometheus histogram per model version, kept as plain counts on the request path and
    formatted by prometheus_client at scrape time (``HistogramMetricFamily``)."""

    def __init__(self, name: str, documentation: str, bounds: tuple[float, ...]) -> None:
        self.name = name
        self.documentation = documentation
        self.bounds = bounds
        self._le = [_go_float(bound) for bound in bounds]
        self.series: dict[tuple[str, str], _Series] = {}

    def of(self, key: tuple[str, str]) -> _Series:
        series = self.series.get(key)
        if series is None:
            series = self.series[key] = _Series(len(self.bounds))
        return series

    def observe(self, key: tuple[str, str], value: float) -> None:
        series = self.of(key)
        series.counts[bisect.bisect_left(self.bounds, value)] += 1
        series.total += value

    def observe_all(self, key: tuple[str, str], values: Iterable[float]) -> None:
        """Observe each of ``values`` (one series lookup for them all)."""
        series, bounds = self.of(key), self.bounds
        counts, total = series.counts, 0.0
        for value in values:
            counts[bisect.bisect_left(bounds, value)] += 1
            total += value
        series.total += total

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=MODEL_LABELS)
        for key, series in list(self.series.items()):
            buckets, seen = [], 0
            for le, count in zip([*self._le, "+Inf"], series.counts, strict=True):
                seen += count
                buckets.append((le, float(seen)))
            family.add_metric(list(key), buckets, sum_value=series.total)
        yield family


class _TorchServeCounters(Collector):
    """TorchServe's counters, exposed under their exact names (no ``_total`` added). The
    per-model ones are read at scrape time from the histograms that count the same events:
    requests and their latency from ``latency``, the time in the queue from ``queue_wait``."""

    def __init__(self, latency: _Histogram, queue_wait: _Histogram) -> None:
        self._latency = latency
        self._queue_wait = queue_wait
        self.by_status = {"Requests2XX": 0, "Requests4XX": 0, "Requests5XX": 0}

    def _per_model(self) -> Iterator[tuple[tuple[str, str], tuple[float, float, float]]]:
        """(model, version) -> (requests, latency µs, queue µs)."""
        latency, queue_wait = dict(self._latency.series), dict(self._queue_wait.series)
        for key in {**latency, **queue_wait}:
            answered, queued = latency.get(key), queue_wait.get(key)
            yield key, (float(sum(answered.counts)) if answered else 0.0,
                        answered.total * 1e6 if answered else 0.0,
                        queued.total * 1e6 if queued else 0.0)

    def collect(self) -> Iterator[Metric]:
        labels = ["model_name", "model_version", "hostname"]
        families = [
            _LegacyCounter("ts_inference_requests_total",
                           "Torchserve prometheus counter metric with unit: Count"),
            _LegacyCounter("ts_inference_latency_microseconds",
                           "Torchserve prometheus counter metric with unit: Microseconds"),
            _LegacyCounter("ts_queue_latency_microseconds",
                           "Torchserve prometheus counter metric with unit: Microseconds"),
        ]
        for (model, version), values in self._per_model():
            label_values = dict(zip(labels, (model, version, HOSTNAME), strict=True))
            for family, value in zip(families, values, strict=True):
                family.add_sample(family.name, label_values, value)
        yield from families
        for name, count in self.by_status.items():
            family = _LegacyCounter(name, "Torchserve prometheus counter metric with unit: Count")
            family.add_sample(name, {"Level": "Host", "Hostname": HOSTNAME}, count)
            yield family


class _ModelGauges(Collector):
    """Read at scrape time from the registry: queue depth, workers, restarts."""

    def __init__(self, models: Iterable[Model]) -> None:
        self._models = models

    def collect(self) -> Iterator[Metric]:
        depth = GaugeMetricFamily("batchserve_queue_depth", "Requests waiting in a model's queue",
                                  labels=MODEL_LABELS)
        workers = GaugeMetricFamily("batchserve_workers", "Worker processes of a model",
                                    labels=MODEL_LABELS)
        restarts = CounterMetricFamily("batchserve_worker_restarts",
                                       "Worker restarts (crashes, hangs, failed loads)",
                                       labels=MODEL_LABELS)
        for model in self._models:
            key = [model.name, model.version]
            depth.add_metric(key, model.batcher.depth)
            workers.add_metric(key, len(model.workers))
            restarts.add_metric(key, model.restarts_total())
        yield from (depth, workers, restarts)


class _HostGauges(Collector):
    """TorchServe's system metrics, measured when scraped (psutil; GPUs via nvidia-ml-py)."""

    def __init__(self, disk_path: str) -> None:
        self._disk_path = disk_path
        psutil.cpu_percent(interval=None)  # the first call only starts the measurement

    def collect(self) -> Iterator[Metric]:
        memory = psutil.virtual_memory()
        disk = shutil.disk_usage(self._disk_path)
        values = {
            "CPUUtilization": ("Percent", psutil.cpu_percent(interval=None)),
            "MemoryUsed": ("Megabytes", memory.used / 2**20),
            "MemoryAvailable": ("Megabytes", memory.available / 2**20),
            "MemoryUtilization": ("Percent", memory.percent),
            "DiskUsage": ("Gigabytes", disk.used / 2**30),
            "DiskAvailable": ("Gigabytes", disk.free / 2**30),
            "DiskUtilization": ("Percent", 100.0 * disk.used / disk.total if disk.total else 0),
        }
        for name, (unit, value) in values.items():
            family = GaugeMetricFamily(
                name, f"Torchserve prometheus gauge metric with unit: {unit}",
                labels=["Level", "Hostname"])
            family.add_metric(["Host", HOSTNAME], value)
            yield family
        yield from _gpu_gauges()


def _gpu_gauges() -> Iterator[Metric]:
    try:
        import pynvml  # nvidia-ml-py, optional: present where GPUs are
    except ImportError:
        return
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return
    try:
        utilisation = GaugeMetricFamily(
            "GPUUtilization", "Torchserve prometheus gauge metric with unit: Percent",
            labels=["Level", "DeviceId", "Hostname"])
        memory_pct = GaugeMetricFamily(
            "GPUMemoryUtilization", "Torchserve prometheus gauge metric with unit: Percent",
            labels=["Level", "DeviceId", "Hostname"])
        memory_mb = GaugeMetricFamily(
            "GPUMemoryUsed", "Torchserve prometheus gauge metric with unit: Megabytes",
            labels=["Level", "DeviceId", "Hostname"])
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            rates = pynvml.nvmlDeviceGetUtilizationRates(handle)
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            labels = ["Host", str(index), HOSTNAME]
            utilisation.add_metric(labels, rates.gpu)
            memory_pct.add_metric(labels, 100.0 * memory.used / memory.total)
            memory_mb.add_metric(labels, memory.used / 2**20)
        yield from (utilisation, memory_pct, memory_mb)
    finally:
        pynvml.nvmlShutdown()


class _CustomMetrics(Collector):
    """Metrics handlers report through ``context.metrics``: counters add up, gauges keep the
    last value. Labels: the model, plus the metric's own dimensions."""

    def __init__(self) -> None:
        # (name, type) -> {label tuple: value}
        self.values: dict[tuple[str, str], dict[tuple[tuple[str, str], ...], float]] = {}
        self.units: dict[tuple[str, str], str] = {}

    def record(self, model: Model, metric: worker_pb2.Metric) -> None:
        kind = "counter" if metric.type == "counter" else "gauge"
        key = (_metric_name(metric.name), kind)
        labels = tuple(sorted({"model_name": model.name, "model_version": model.version,
                               **{_metric_name(k): v for k, v in metric.dimensions.items()}}
                              .items()))
        series = self.values.setdefault(key, {})
        self.units[key] = metric.unit
        series[labels] = series.get(labels, 0.0) + metric.value if kind == "counter" \
            else metric.value

    def collect(self) -> Iterator[Metric]:
        for (name, kind), series in list(self.values.items()):
            documentation = f"Handler metric with unit: {self.units[(name, kind)]}"
            family = _LegacyCounter(name, documentation) if kind == "counter" \
                else Metric(name, documentation, kind)
            for labels, value in series.items():
                family.add_sample(name, dict(labels), value)
            yield family


class ServerMetrics:
    """One registry per server, so tests with several servers in a process stay apart."""

    def __init__(self, models: Iterable[Model], disk_path: str = ".") -> None:
        self.registry = CollectorRegistry()
        self._custom = _CustomMetrics()
        self.batch_size = _Histogram("batchserve_batch_size", "Requests per dispatched batch",
                                     _BATCH_BUCKETS)
        self.queue_wait = _Histogram("batchserve_queue_wait_seconds",
                                     "Time a request waited in its model's queue", _TIME_BUCKETS)
        self.latency = _Histogram("batchserve_request_latency_seconds",
                                  "End-to-end latency of a prediction request, in the server",
                                  _TIME_BUCKETS)
        self.handler_time = _Histogram("batchserve_handler_seconds",
                                       "Time a worker's handler spent on one batch",
                                       _TIME_BUCKETS)
        self._ts = _TorchServeCounters(self.latency, self.queue_wait)
        for collector in (self._ts, _ModelGauges(models), _HostGauges(disk_path),
                          self._custom, self.batch_size, self.queue_wait, self.latency,
                          self.handler_time):
            self.registry.register(collector)
        self.refused = Counter("batchserve_refused_requests",
                               "Requests answered without running: queue full (503), no "
                               "worker to take them (503), or past their deadline while "
                               "queued (504)", [*MODEL_LABELS, "reason"],
                               registry=self.registry)

    def record_batch(self, model: Model, jobs: Sequence[Job], result: worker_pb2.PredictResult |
                     None) -> None:
        """A batch came back from a worker (``result`` is None when it failed as a whole)."""
        key = (model.name, model.version)
        self.batch_size.observe(key, len(jobs))
        self.queue_wait.observe_all(key, [job.queue_wait_s for job in jobs])
        if result is not None:
            self.handler_time.observe(key, result.handler_time_ms / 1000)
            for metric in result.metrics:
                self._custom.record(model, metric)

    def count_response(self, status: int) -> None:
        """One response sent: an HTTP response on any port, or a gRPC prediction's answer
        (TorchServe's Requests2XX/4XX/5XX; as TorchServe, what is neither 2xx nor 4xx is 5XX).
        """
        bucket = "Requests2XX" if 200 <= status < 300 else "Requests4XX" \
            if 400 <= status < 500 else "Requests5XX"
        self._ts.by_status[bucket] += 1

    def exposition(self, names: set[str] | None = None) -> bytes:
        """The metrics page; with ``names``, only the families TorchServe's ``?name[]=``
        filter names (matched on a family's or one of its samples' names)."""
        families = self.registry.collect()
        if names:
            families = (family for family in families if family.name in names
                        or any(sample.name in names for sample in family.samples))
        return exposition(families)

    def record_request(self, model: Model | None, latency_s: float,
                       refused: str | None = None) -> None:
        """One prediction request answered, or left by its client (``model`` None when it
        named no known model; ``refused`` why it was answered without running: "queue_full",
        "unavailable" or "deadline")."""
        if model is None:
            return
        key = (model.name, model.version)
        self.latency.observe(key, latency_s)
        if refused is not None:
            self.refused.labels(*key, refused).inc()
