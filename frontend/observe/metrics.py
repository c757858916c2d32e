"""The server's metrics: TorchServe's, exactly as TorchServe writes them, then ours.

TorchServe's are those of its metrics configuration (``metrics_config``; its default
``metrics.yaml`` unless set: see ``metric_specs.py``), each with its name, type, unit and
labels in TorchServe's order, and kept as ``metrics_mode`` says (``families.py``):

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

Ours, in every mode but ``legacy``, named ``batchserve_*``: per-model histograms of batch size,
queue wait, end-to-end latency and handler time, the queue depth, workers, worker restarts,
and requests refused (503) or expired (504). The request path costs a few dictionary updates;
the page is formatted when scraped.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import logging
import socket
from collections.abc import Iterable, Iterator, Sequence, Sized
from pathlib import Path
from typing import Protocol

from frontend.errors import ConfigError
from frontend.observe import families as ts_families
from frontend.observe.exposition import Family, java_double, render
from frontend.observe.families import LEGACY as LEGACY
from frontend.observe.families import TsMetric
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
from frontend.observe.timing import PHASES, Timing, frontend_s
from protos import worker_pb2

logger = logging.getLogger(__name__)

HOSTNAME = socket.gethostname()
MODEL_LABELS = ("model_name", "model_version")
WORKFLOW_LABELS = ("workflow",)
METRICS_MODES = ("prometheus", "log", "legacy")
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
_TIME_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                 5.0, 10.0, 30.0, 120.0)
#: Phases of a request's time are shorter than whole requests: finer buckets at the bottom.
_PHASE_BUCKETS = (0.0001, 0.00025, *_TIME_BUCKETS)
#: Labels of the batching families shared with the dashboard and Grafana (docs/batches.md).
PHASE_LABELS = (*MODEL_LABELS, "phase")
DISPATCH_LABELS = (*MODEL_LABELS, "reason")
FILL_LABELS = MODEL_LABELS
_HOST_LABELS = ("Host", HOSTNAME)
_REFUSALS = ("queue_full", "unavailable", "deadline")


class _Depth(Protocol):
    @property
    def depth(self) -> int: ...


class Dispatches(Protocol):
    """What the metrics read of why a model's batches left (``batching.DispatchStats``)."""

    @property
    def enabled(self) -> bool: ...

    @property
    def reasons(self) -> dict[str, int]: ...

    @property
    def fill_counts(self) -> list[int]: ...

    @property
    def fill_sum(self) -> float: ...

    @property
    def bounds(self) -> tuple[float, ...]: ...


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

    @property
    def dispatch(self) -> Dispatches: ...

    def restarts_total(self) -> int: ...


class Job(Protocol):
    """What the metrics read of a request that was batched (``frontend.serving.batching.Job``)."""

    @property
    def queue_wait_s(self) -> float: ...

    @property
    def form_s(self) -> float: ...

    @property
    def timing(self) -> Timing | None: ...


#: What begins a metric line in a TorchServe worker's output. No line is read as a metric here
#: (``frontend/serving/workers.py`` says why); a worker that prints one is told so once.
METRICS_MARK = "[METRICS]"


class _Series:
    """One label set's histogram: a count per bucket (the last: above every bound) and the
    sum. An observation is a list increment: no lock (the event loop is the only writer) and
    no work at all until a scrape reads it."""

    __slots__ = ("counts", "total")

    def __init__(self, buckets: int) -> None:
        self.counts = [0] * (buckets + 1)
        self.total = 0.0


class _Histogram:
    """One of our histograms, per model version (labels ``model_name``, ``model_version``, or
    those given)."""

    def __init__(self, name: str, documentation: str, bounds: tuple[float, ...],
                 labels: tuple[str, ...] = MODEL_LABELS) -> None:
        self.name = name
        self.documentation = documentation
        self.bounds = bounds
        self.labels = labels
        self._le = [*map(java_double, bounds), "+Inf"]
        self.series: dict[tuple[str, ...], _Series] = {}

    def of(self, key: tuple[str, ...]) -> _Series:
        series = self.series.get(key)
        if series is None:
            series = self.series[key] = _Series(len(self.bounds))
        return series

    def observe(self, key: tuple[str, ...], value: float) -> None:
        series = self.of(key)
        series.counts[bisect.bisect_left(self.bounds, value)] += 1
        series.total += value

    def observe_n(self, key: tuple[str, ...], value: float, count: int) -> None:
        """Observe ``value`` ``count`` times (the requests of one batch)."""
        series = self.of(key)
        series.counts[bisect.bisect_left(self.bounds, value)] += count
        series.total += value * count

    def observe_all(self, key: tuple[str, ...], values: Iterable[float]) -> None:
        """Observe each of ``values`` (one series lookup for them all)."""
        series, bounds = self.of(key), self.bounds
        counts, total = series.counts, 0.0
        for value in values:
            counts[bisect.bisect_left(bounds, value)] += 1
            total += value
        series.total += total

    def family(self) -> Family:
        family = Family(self.name, self.documentation, "histogram")
        for key, series in list(self.series.items()):
            add_histogram_series(family, self.labels, key, self._le, series.counts,
                                 series.total)
        return family


def add_histogram_series(family: Family, labels: tuple[str, ...], key: tuple[str, ...],
                         le: Sequence[str], counts: Iterable[int], total: float) -> None:
    """One series of a histogram ``family``: its buckets (``counts`` per bucket, the last above
    every bound, written cumulatively by their ``le``), its count and its sum."""
    bucket_labels = (*labels, "le")
    seen = 0
    for bound, count in zip(le, counts, strict=True):
        seen += count
        family.add(bucket_labels, (*key, bound), float(seen), "_bucket")
    family.add(labels, key, float(seen), "_count")
    family.add(labels, key, total, "_sum")


class _RequestSeries:
    """What a request of one model and named version updates: its labels, and with
    TorchServe's default metrics the running totals of its three counters (``fast``)."""

    __slots__ = ("count", "fast", "labels", "latency", "queue")

    def __init__(self, labels: tuple[str, ...], count: list[float] | None,
                 latency: list[float] | None, queue: list[float] | None) -> None:
        self.labels = labels
        self.count, self.latency, self.queue = count, latency, queue
        self.fast = count is not None and latency is not None and queue is not None


class ServerMetrics:
    """One server's metrics (several servers in one process stay apart)."""

    def __init__(self, models: Iterable[Model], *, mode: str = "prometheus",
                 config: MetricsConfig | None = None, auto_detect: bool = False,
                 log_dir: Path | None = None, system_metrics: bool = True, gpu_count: int = 0,
                 interval_s: float = 60.0, named_loggers: bool = False,
                 phases: bool = True) -> None:
        """``log_dir``: where the metric logs are (None: none); ``named_loggers``: they go to
        the loggers TS_METRICS and MODEL_METRICS instead (a log4j2 configuration set them);
        ``phases``: ``batchserve_request_phase_seconds`` is kept (``request_phases``)."""
        #: Each request's phases are observed (else the family stays empty).
        self.phases_on = phases
        if mode not in METRICS_MODES:
            raise ValueError(f"metrics_mode {mode!r}: expected one of {', '.join(METRICS_MODES)}")
        self.mode = mode
        self.config = config if config is not None else load_metrics_config()
        self.auto_detect = auto_detect
        self._models = models
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
        # Ours.
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
        self.phases = _Histogram(
            "batchserve_request_phase_seconds",
            "Where a prediction's time went, by phase: queue, batch_form, worker, preprocess, "
            "inference, postprocess, frontend (docs/batches.md)", _PHASE_BUCKETS, PHASE_LABELS)
        #: (model, version) -> the keys of its phases' series, in PHASES' order.
        self._phase_keys: dict[tuple[str, str], tuple[tuple[str, str, str], ...]] = {}
        #: (model, version, reason) -> requests answered without running.
        self.refused: dict[tuple[str, str, str], int] = {}
        # Workflows: each /wfpredict request, and each call of a node (whose model's own
        # metrics above count its requests, batches and latency as any model's).
        self.workflow_latency = _Histogram(
            "batchserve_workflow_latency_seconds",
            "End-to-end latency of a workflow prediction (/wfpredict), in the server",
            _TIME_BUCKETS, WORKFLOW_LABELS)
        #: (workflow, status code) -> workflow predictions answered.
        self.workflow_requests: dict[tuple[str, str], int] = {}
        #: (workflow, node, outcome) -> calls of a node: ok, error, timeout, unavailable.
        self.workflow_node_calls: dict[tuple[str, str, str], int] = {}

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

    def record_request(self, model: Model | None, latency_s: float, refused: str | None = None,
                       *, version: str | None = None, answered: Job | None = None) -> None:
        """One prediction request answered, or left by its client (``model`` None when it
        named no known model; ``refused`` why it was answered without running: "queue_full",
        "unavailable" or "deadline"; ``version`` the version it named; ``answered`` its job
        when a worker answered it)."""
        if model is None:
            return
        key = (model.name, model.version)
        self.latency.observe(key, latency_s)
        if answered is not None and self.phases_on:
            timing = answered.timing
            if timing is not None and timing.answered:
                self.phases.observe(self._phase_key(key)[6],
                                    frontend_s(answered.queue_wait_s, timing, latency_s))
        if refused is not None:
            refusal = (*key, refused)
            self.refused[refusal] = self.refused.get(refusal, 0) + 1
        series = self._request_series.get((model.name, version))
        if series is None:
            series = self._new_request_series(model.name, version)
        if series.fast:  # TorchServe's default: three Prometheus counters, added to in place
            series.count[0] += 1.0  # type: ignore[index]
            if answered is not None:
                queue_s = answered.queue_wait_s
                series.latency[0] += latency_s * 1e6  # type: ignore[index]
                series.queue[0] += queue_s * 1e6  # type: ignore[index]
                queue_time = self._queue_time_value
                if queue_time is not None:
                    queue_time[0] = queue_s * 1000 // 1  # whole ms, as TorchServe's
                elif self._queue_time is not None:
                    self._queue_time.add(_HOST_LABELS, queue_s * 1000 // 1)
                    self._queue_time_value = ts_families.gauge_value(self._queue_time,
                                                                     _HOST_LABELS)
            return
        self._record_request_slowly(series.labels, latency_s, answered)

    def _record_request_slowly(self, labels: tuple[str, ...], latency_s: float,
                               answered: Job | None) -> None:
        """``record_request``'s TorchServe metrics, each through its ``add``."""
        if self._requests is not None:
            self._requests.add(labels, 1.0)
        if answered is None:
            return
        if self._latency_us is not None:
            self._latency_us.add(labels, latency_s * 1e6)
        if self._queue_us is not None:
            self._queue_us.add(labels, answered.queue_wait_s * 1e6)
        if self._queue_time is not None:
            self._queue_time.add(_HOST_LABELS, float(int(answered.queue_wait_s * 1000)))

    def _new_request_series(self, name: str, version: str | None) -> _RequestSeries:
        labels = (name, version or "default", HOSTNAME)
        totals = [ts_families.counter_total(metric, labels)
                  for metric in (self._requests, self._latency_us, self._queue_us)]
        series = self._request_series[(name, version)] = _RequestSeries(labels, *totals)
        return series

    def record_batch(self, model: Model, jobs: Sequence[Job],
                     result: worker_pb2.PredictResult | None) -> None:
        """A batch came back from a worker (``result`` is None when it failed as a whole)."""
        key = (model.name, model.version)
        self.batch_size.observe(key, len(jobs))
        self.queue_wait.observe_all(key, [job.queue_wait_s for job in jobs])
        if result is not None:
            self.handler_time.observe(key, result.handler_time_ms / 1000)
            if result.metrics:
                self.record_model_metrics(result.metrics)
            if self.phases_on:
                self._record_phases(key, jobs)

    def _phase_key(self, key: tuple[str, str]) -> tuple[tuple[str, str, str], ...]:
        keys = self._phase_keys.get(key)
        if keys is None:
            keys = self._phase_keys[key] = tuple((*key, phase) for phase in PHASES)
        return keys

    def _record_phases(self, key: tuple[str, str], jobs: Sequence[Job]) -> None:
        """A batch's phases, once per request: the queue and the batch's forming as each job
        waited, the worker's and the handler's as the batch took them (the frontend's own time
        is recorded per request, once answered: ``record_request``)."""
        timing = jobs[0].timing if jobs else None
        if timing is None or not timing.answered:
            return
        keys = self._phase_key(key)
        phases = self.phases
        phases.observe_all(keys[0], (job.queue_wait_s - job.form_s for job in jobs))
        phases.observe_all(keys[1], (job.form_s for job in jobs))
        count = len(jobs)
        phases.observe_n(keys[2], timing.worker_s, count)
        if timing.steps:
            phases.observe_n(keys[3], timing.preprocess_s, count)
            phases.observe_n(keys[5], timing.postprocess_s, count)
        phases.observe_n(keys[4], timing.inference_s, count)

    def record_workflow(self, workflow: str, status: int, latency_s: float) -> None:
        """One workflow prediction answered with ``status`` (0: its client left)."""
        key = (workflow, str(status))
        self.workflow_requests[key] = self.workflow_requests.get(key, 0) + 1
        self.workflow_latency.observe((workflow,), latency_s)

    def record_workflow_node(self, workflow: str, node: str, outcome: str) -> None:
        """One call of a workflow's node: "ok", "error", "timeout" or "unavailable"."""
        key = (workflow, node, outcome)
        self.workflow_node_calls[key] = self.workflow_node_calls.get(key, 0) + 1

    def worker_loaded(self, worker: str, load_ms: float,
                      metrics: Iterable[worker_pb2.Metric] = ()) -> None:
        """A worker (TorchServe's name for it, ``W-9000-mnist_1.0``) loaded its model in
        ``load_ms``; ``metrics``: what its handler reported while initialising."""
        if self._load_time is not None:
            self._load_time.add((worker, "Host", HOSTNAME), float(int(load_ms)))
        self.record_model_metrics(metrics)

    def batch_overhead(self, overhead_ms: float) -> None:
        """The frontend's own time on a batch (TorchServe's WorkerThreadTime)."""
        if self._thread_time is not None:
            self._thread_time.add(_HOST_LABELS, float(int(overhead_ms)))

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

    # -- the page ---------------------------------------------------------------------------

    def families(self) -> Iterator[Family]:
        """The families of the metrics page, TorchServe's first."""
        for metric in list(self.frontend.values()):
            family = metric.family()
            if family is not None:
                yield family
        yield from self.handlers.families()
        if self.mode == "legacy":
            return
        yield from self._model_gauges()
        yield self._refused_family()
        for histogram in (self.batch_size, self.queue_wait, self.latency, self.handler_time,
                          self.phases):
            yield histogram.family()
        yield from self._dispatch_families()
        yield from self._workflow_families()

    def _workflow_families(self) -> Iterator[Family]:
        requests = Family("batchserve_workflow_requests_total",
                          "Workflow predictions (/wfpredict) answered, by status (0: the "
                          "client left first)", "counter")
        for key, count in list(self.workflow_requests.items()):
            requests.add((*WORKFLOW_LABELS, "code"), key, float(count))
        calls = Family("batchserve_workflow_node_calls_total",
                       "Calls of a workflow's node (retries included), by outcome: ok, error, "
                       "timeout, unavailable", "counter")
        for node_key, count in list(self.workflow_node_calls.items()):
            calls.add((*WORKFLOW_LABELS, "node", "outcome"), node_key, float(count))
        yield from (requests, calls, self.workflow_latency.family())

    def _model_gauges(self) -> Iterator[Family]:
        depth = Family("batchserve_queue_depth", "Requests waiting in a model's queue", "gauge")
        workers = Family("batchserve_workers", "Worker processes of a model", "gauge")
        restarts = Family("batchserve_worker_restarts_total",
                          "Worker restarts (crashes, hangs, failed loads)", "counter")
        for model in list(self._models):
            key = (model.name, model.version)
            depth.add(MODEL_LABELS, key, model.batcher.depth)
            workers.add(MODEL_LABELS, key, len(model.workers))
            restarts.add(MODEL_LABELS, key, model.restarts_total())
        yield from (depth, workers, restarts)

    def _dispatch_families(self) -> Iterator[Family]:
        """Why each model's batches left, and how full they were (read when scraped)."""
        reasons = Family("batchserve_dispatch_total",
                         "Batches dispatched, by why they left the queue: full, max_delay, "
                         "adaptive, deadline, slot_free, sequence (docs/batches.md)", "counter")
        fill = Family("batchserve_batch_fill",
                      "Fill of each dispatched batch: its size / batch_size", "histogram")
        for model in list(self._models):
            key = (model.name, model.version)
            stats = model.dispatch
            if not stats.enabled:  # dispatch_stats=false: no zeros that would read as counts
                continue
            for reason, count in list(stats.reasons.items()):
                reasons.add(DISPATCH_LABELS, (*key, reason), float(count))
            add_histogram_series(fill, FILL_LABELS, key,
                                 [*map(java_double, stats.bounds), "+Inf"],
                                 list(stats.fill_counts), stats.fill_sum)
        yield from (reasons, fill)

    def _refused_family(self) -> Family:
        family = Family("batchserve_refused_requests_total",
                        "Requests answered without running: queue full (503), no worker to take "
                        "them (503), or past their deadline while queued (504)", "counter")
        labels = (*MODEL_LABELS, "reason")
        for key, count in list(self.refused.items()):
            family.add(labels, key, float(count))
        return family

    def exposition(self, names: set[str] | None = None) -> bytes:
        """The metrics page; with ``names``, only the families TorchServe's ``?name[]=``
        filter names (a family's name, or a histogram's ``_bucket``/``_count``/``_sum``)."""
        families: Iterable[Family] = self.families()
        if names:
            families = (family for family in families if not names.isdisjoint(family.names()))
        return render(families)
