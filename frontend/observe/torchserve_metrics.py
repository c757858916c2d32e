"""TorchServe's metrics, exactly as TorchServe writes them: those of its metrics configuration
(``metrics_config``; its default ``metrics.yaml`` unless set: ``metric_specs.py``), each with
its name, type, unit and labels in TorchServe's order, and kept as ``metrics_mode`` says
(``families.py``):

* ``ts_metrics``, the frontend's: ``Requests2XX/4XX/5XX`` (every HTTP response on every
  port, as TorchServe counts them, plus gRPC predictions' answers);
  ``ts_inference_requests_total`` (each prediction that named a known model),
  ``ts_inference_latency_microseconds``, ``ts_queue_latency_microseconds`` (each answered by
  a worker), labelled ``model_name``, ``model_version`` (the version the request named, or
  ``default``) and ``hostname``; ``QueueTime`` (the last answered request's wait, whole ms),
  ``WorkerThreadTime`` (the frontend's own time on the last batch, ms), ``WorkerLoadTime``
  (per worker, ms from its start to its model loaded); the host's metrics every
  ``metric_time_interval`` (``system.py``) unless ``disable_system_metrics``.
* ``model_metrics``: what handlers report through ``context.metrics``, sent by the workers
  with each batch's result (never read from what a worker prints) and labelled by the
  metric's own dimensions and ``Hostname`` (TorchServe adds no model label: the same metric
  of several models or workers is one series). One the configuration does not declare is
  kept only with ``model_metrics_auto_detect``, under the type, unit and dimensions it was
  reported with. Names, bounds and what is refused: ``model_metrics.py``.

They are kept from the serving core's events (frontend/observe/events.py): a call ended, a
batch ended, a worker loaded.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

from frontend.errors import ConfigError
from frontend.observe import families as ts_families
from frontend.observe.events import Batch, CallFacts, JobFacts, ModelKey
from frontend.observe.exposition import Family
from frontend.observe.families import LEGACY, TsMetric
from frontend.observe.metric_log import (
    MODEL_METRICS_LOG,
    TS_METRICS_LOG,
    TS_METRICS_LOGGER,
    TS_MODEL_METRICS_LOGGER,
    MetricLog,
)
from frontend.observe.metric_specs import (
    METRIC_TYPES,
    SERVER_PREFIX,
    MetricsConfig,
    MetricSpec,
    NameClaims,
    load_metrics_config,
    prometheus_problem,
    torchserve_ts_metrics,
)
from frontend.observe.model_metrics import ModelMetrics
from frontend.observe.system import Reading, SystemSampler
from protos import worker_pb2

logger = logging.getLogger("frontend.observe.metrics")

HOSTNAME = socket.gethostname()
METRICS_MODES = ("prometheus", "log", "legacy")
_HOST_LABELS = ("Host", HOSTNAME)


class _RequestSeries:
    """What a request of one model and named version updates: its labels, and with
    TorchServe's default metrics the running totals of its three counters (``fast``)."""

    __slots__ = ("count", "fast", "labels", "latency", "queue")

    def __init__(self, labels: tuple[str, ...], count: list[float] | None,
                 latency: list[float] | None, queue: list[float] | None) -> None:
        self.labels = labels
        self.count, self.latency, self.queue = count, latency, queue
        self.fast = count is not None and latency is not None and queue is not None


class TorchServeMetrics:
    """TorchServe's metrics of one server (see the module docstring)."""

    def __init__(self, *, mode: str = "prometheus", config: MetricsConfig | None = None,
                 auto_detect: bool = False, log_dir: Path | None = None,
                 system_metrics: bool = True, gpu_count: int = 0, interval_s: float = 60.0,
                 named_loggers: bool = False) -> None:
        """``log_dir``: where the metric logs are (None: none); ``named_loggers``: they go to
        the loggers TS_METRICS and MODEL_METRICS instead (a log4j2 configuration set them)."""
        if mode not in METRICS_MODES:
            raise ValueError(f"metrics_mode {mode!r}: expected one of {', '.join(METRICS_MODES)}")
        self.mode = mode
        self.config = config if config is not None else load_metrics_config()
        self.auto_detect = auto_detect
        self._interval_s = interval_s
        self._sampler = SystemSampler(gpu_count) if system_metrics else None
        self._system_task: asyncio.Task[None] | None = None
        if named_loggers:
            self._logs = (MetricLog(None, logging.getLogger(TS_METRICS_LOGGER)),
                          MetricLog(None, logging.getLogger(TS_MODEL_METRICS_LOGGER)))
        else:
            self._logs = (MetricLog((log_dir or Path("logs")) / TS_METRICS_LOG),
                          MetricLog((log_dir or Path("logs")) / MODEL_METRICS_LOG))
        self._open_logs = named_loggers or log_dir is not None
        self.frontend = {name: self._build(spec) for name, spec in self.config.ts_metrics.items()}
        #: What handlers report (``model_metrics.py``).
        self.handlers = ModelMetrics(self.config, mode, self._logs, self._server_claims(),
                                     HOSTNAME, auto_detect=auto_detect)
        get = self.frontend.get
        self._by_status = [get(bucket) for bucket in ("Requests2XX", "Requests4XX",
                                                      "Requests5XX")]
        #: Their totals, once counted (TorchServe shows a status's sample once it counts).
        self._status_totals: list[list[float] | None] = [None, None, None]
        #: QueueTime's value, once set (a Prometheus gauge's, set in place).
        self._queue_time_value: list[float] | None = None
        #: (model, version named) -> what its requests update.
        self._request_series: dict[tuple[str, str | None], _RequestSeries] = {}
        self._requests = get("ts_inference_requests_total")
        self._latency_us = get("ts_inference_latency_microseconds")
        self._queue_us = get("ts_queue_latency_microseconds")
        self._queue_time = get("QueueTime")
        self._thread_time = get("WorkerThreadTime")
        self._load_time = get("WorkerLoadTime")

    @property
    def reads_frontend_time(self) -> bool:
        """WorkerThreadTime is kept: each batch's frontend time must be marked."""
        return self._thread_time is not None

    def _server_claims(self) -> NameClaims:
        """The names the server's metrics take: those of the configuration's ``ts_metrics``
        (none beginning with ``batchserve_``, none taking another's), then, as every type
        (whatever the mode shows), theirs and those of TorchServe's own frontend metrics.
        Ours are kept from handlers by their prefix (``metric_specs.handler_problem``)."""
        claims = NameClaims()
        for spec in self.config.ts_metrics.values():
            problem = (f"names beginning with {SERVER_PREFIX} are the server's own metrics"
                       if spec.name.startswith(SERVER_PREFIX)
                       else claims.conflict(spec.name, spec.type))
            if problem is not None:
                raise ConfigError(f"metrics_config {self.config.path}: ts_metrics: {problem}")
            claims.take(spec.name, (spec.type,))
        for name in (*self.config.ts_metrics, *torchserve_ts_metrics()):
            claims.take(name, METRIC_TYPES)
        return claims

    def _build(self, spec: MetricSpec) -> TsMetric:
        if self.mode == "prometheus" or (self.mode == "legacy" and spec.name in LEGACY):
            problem = prometheus_problem(spec)
            if problem is not None:
                raise ConfigError(f"metrics_config {self.config.path}: {problem}")
        return ts_families.build(spec, self.mode, self._logs)

    # -- what happened ----------------------------------------------------------------------

    def count_response(self, status: int) -> None:
        """One response sent: an HTTP response on any port, or a gRPC prediction's answer
        (TorchServe's Requests2XX/4XX/5XX; as TorchServe, what is neither 2xx nor 4xx is 5XX).
        """
        bucket = 0 if 200 <= status < 300 else 1 if 400 <= status < 500 else 2
        total = self._status_totals[bucket]
        if total is not None:
            total[0] += 1.0
            return
        metric = self._by_status[bucket]
        if metric is not None:
            self._status_totals[bucket] = ts_families.counter_total(metric, _HOST_LABELS)
            if self._status_totals[bucket] is None:  # not a Prometheus counter: its own way
                metric.add(_HOST_LABELS, 1.0)
            else:
                self.count_response(status)

    def call_ended(self, call: CallFacts) -> None:
        """One prediction request answered, or left by its client: its answer counted when
        its transport does not (gRPC), and, when it named a known model, its request; its
        latency and wait when a worker answered it."""
        if call.origin.count_status and call.status:
            self.count_response(call.status)
        key = call.key
        if key is None:
            return
        series = self._request_series.get((key[0], call.version))
        if series is None:
            series = self._new_request_series(key[0], call.version)
        # Its wait in the queue when a worker answered it (``CallFacts.answered``, inline:
        # this runs for every request), else None.
        job = call.job
        batch = job.batch
        queue_s = batch.left_at - job.enqueued_at if (
            batch is not None and call.error is None and call.status) else None
        if series.fast:  # TorchServe's default: three Prometheus counters, added to in place
            series.count[0] += 1.0  # type: ignore[index]
            if queue_s is not None:
                series.latency[0] += call.latency_s * 1e6  # type: ignore[index]
                series.queue[0] += queue_s * 1e6  # type: ignore[index]
                queue_time = self._queue_time_value
                if queue_time is not None:
                    queue_time[0] = queue_s * 1000 // 1  # whole ms, as TorchServe's
                elif self._queue_time is not None:
                    self._queue_time.add(_HOST_LABELS, queue_s * 1000 // 1)
                    self._queue_time_value = ts_families.gauge_value(self._queue_time,
                                                                     _HOST_LABELS)
            return
        self._record_request_slowly(series.labels, call.latency_s, queue_s)

    def _record_request_slowly(self, labels: tuple[str, ...], latency_s: float,
                               queue_s: float | None) -> None:
        """``call_ended``'s TorchServe metrics, each through its ``add`` (``queue_s``: the
        wait of a request a worker answered, None for another)."""
        if self._requests is not None:
            self._requests.add(labels, 1.0)
        if queue_s is None:
            return
        if self._latency_us is not None:
            self._latency_us.add(labels, latency_s * 1e6)
        if self._queue_us is not None:
            self._queue_us.add(labels, queue_s * 1e6)
        if self._queue_time is not None:
            self._queue_time.add(_HOST_LABELS, float(int(queue_s * 1000)))

    def _new_request_series(self, name: str, version: str | None) -> _RequestSeries:
        labels = (name, version or "default", HOSTNAME)
        totals = [ts_families.counter_total(metric, labels)
                  for metric in (self._requests, self._latency_us, self._queue_us)]
        series = self._request_series[(name, version)] = _RequestSeries(labels, *totals)
        return series

    def batch_ended(self, key: ModelKey, batch: Batch, jobs: Sequence[JobFacts],
                    result: worker_pb2.PredictResult | None) -> None:
        """A batch ended: what its handler reported, and the frontend's own time on it."""
        if result is not None and result.metrics:
            self.handlers.record(result.metrics)
        marks = batch.frontend_marks
        if marks is not None and len(marks) == 4:
            self.batch_overhead((marks[1] - marks[0] + marks[3] - marks[2]) * 1000)

    def batch_overhead(self, overhead_ms: float) -> None:
        """The frontend's own time on a batch (TorchServe's WorkerThreadTime): its frame, its
        reply, its answers."""
        if self._thread_time is not None:
            self._thread_time.add(_HOST_LABELS, float(int(overhead_ms)))

    def worker_loaded(self, worker: str, load_ms: float,
                      metrics: Iterable[worker_pb2.Metric] = ()) -> None:
        """A worker (TorchServe's name for it, ``W-9000-mnist_1.0``) loaded its model in
        ``load_ms``; ``metrics``: what its handler reported while initialising."""
        if self._load_time is not None:
            self._load_time.add((worker, "Host", HOSTNAME), float(int(load_ms)))
        self.record_model_metrics(metrics)

    def record_model_metrics(self, metrics: Iterable[worker_pb2.Metric]) -> None:
        """Values handlers reported (``ModelMetrics.record``)."""
        self.handlers.record(metrics)

    def record_system(self, readings: Iterable[Reading]) -> None:
        """One reading of the host's metrics (those the configuration declares)."""
        for name, values, value in readings:
            metric = self.frontend.get(name)
            if metric is not None:
                metric.add((*values, HOSTNAME), value)

    # -- running ----------------------------------------------------------------------------

    async def start(self) -> None:
        """Open the metric logs (created whatever the mode, as TorchServe's are) and start
        measuring the host every ``metric_time_interval``."""
        if self._open_logs:
            for log in self._logs:
                log.open()
        if self._sampler is not None:
            self._system_task = asyncio.get_running_loop().create_task(
                self._run_system_metrics(self._sampler), name="system-metrics")

    async def _run_system_metrics(self, sampler: SystemSampler) -> None:
        while True:
            try:
                self.record_system(await asyncio.to_thread(sampler.read))
            except Exception:  # never stop measuring because one reading failed
                logger.exception("reading the system metrics failed")
            await asyncio.sleep(self._interval_s)

    async def close(self) -> None:
        if self._system_task is not None:
            self._system_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._system_task
            self._system_task = None
        for log in self._logs:
            log.close()

    def families(self) -> Iterator[Family]:
        """TorchServe's families of the metrics page: the frontend's, then the handlers'."""
        for metric in list(self.frontend.values()):
            family = metric.family()
            if family is not None:
                yield family
        yield from self.handlers.families()
