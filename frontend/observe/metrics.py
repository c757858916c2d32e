"""The server's metrics page: TorchServe's metrics, exactly as TorchServe writes them, then
ours, each kept by an observer of the serving core's events (frontend/observe/events.py) by
what it measures:

* ``torchserve_metrics.TorchServeMetrics``: TorchServe's frontend metrics (``ts_metrics``), what
  handlers report (``model_metrics``), the metric logs and the host's readings;
* ``our_metrics.RequestMetrics``, ``BatchMetrics``, ``WorkflowMetrics``: ``batchserve_*``
  latency, refusals, batch sizes, queue waits, handler time, workflows;
* ``timing.PhaseMetrics``: where each request's time went (``request_phases``);
* ``batches.BatchRecords``: why batches left and how full they were (``dispatch_stats``), and
  describe's recent batches;
* and, read when scraped, each model version's queue depth, workers and restarts (its
  ``ModelStatus``: status.py).

``ServerMetrics`` holds them for one server (several servers in one process stay apart),
subscribes them to the events (``subscribe``: an observer that is off is not subscribed, and
does nothing), and writes the page.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from frontend.observe.batches import BatchRecords
from frontend.observe.device_metrics import DeviceMetrics
from frontend.observe.events import Observers
from frontend.observe.exposition import Family, render
from frontend.observe.families import LEGACY as LEGACY
from frontend.observe.histograms import MODEL_LABELS, Histogram
from frontend.observe.metric_specs import MetricsConfig
from frontend.observe.our_metrics import BatchMetrics, RequestMetrics, WorkflowMetrics
from frontend.observe.residency import ResidencyMetrics
from frontend.observe.status import Statuses, no_models
from frontend.observe.tenant_metrics import TenantMetrics
from frontend.observe.timing import PhaseMetrics
from frontend.observe.torchserve_metrics import HOSTNAME as HOSTNAME
from frontend.observe.torchserve_metrics import METRICS_MODES as METRICS_MODES
from frontend.observe.torchserve_metrics import TorchServeMetrics


class ServerMetrics:
    """One server's metrics (see the module docstring)."""

    def __init__(self, models: Statuses = no_models, *, mode: str = "prometheus",
                 config: MetricsConfig | None = None, auto_detect: bool = False,
                 log_dir: Path | None = None, system_metrics: bool = True, gpu_count: int = 0,
                 interval_s: float = 60.0, named_loggers: bool = False,
                 phases: bool = True, dispatch_stats: bool = True,
                 tenants: bool = False, residency: bool = False) -> None:
        """``models``: the model versions now (for the gauges); ``log_dir``: where the metric
        logs are (None: none); ``named_loggers``: they go to the loggers TS_METRICS and
        MODEL_METRICS instead (a log4j2 configuration set them); ``phases``:
        ``batchserve_request_phase_seconds`` is kept (``request_phases``);
        ``dispatch_stats``: the dispatch reasons and batch fill are; ``tenants``: each
        tenant's requests are counted (the server tells tenants apart); ``residency``: the
        residency metrics are (residency limits are on)."""
        self.torchserve = TorchServeMetrics(
            mode=mode, config=config, auto_detect=auto_detect, log_dir=log_dir,
            system_metrics=system_metrics, gpu_count=gpu_count, interval_s=interval_s,
            named_loggers=named_loggers)
        self.workflows = WorkflowMetrics()
        self.requests = RequestMetrics(self.workflows)
        self.batches = BatchMetrics()
        self.timing = PhaseMetrics()
        self.records = BatchRecords(dispatch_stats)
        self.tenants = TenantMetrics()
        self.tenants_on = tenants
        #: Device time per device group's model and per tenant (docs/devices.md).
        self.devices = DeviceMetrics(models)
        #: Page-ins and evictions (None: no residency limits, nothing pages).
        self.residency = ResidencyMetrics() if residency else None
        #: Each request's phases are observed (else the family stays empty).
        self.phases_on = phases
        self.mode = mode
        #: Requests each front process brought (number_of_netty_threads > 1): the server
        #: sets it; ``batchserve_front_requests_total``.
        self.front_requests: Callable[[], dict[int, int]] = dict
        #: gRPC calls each front relayed: ``batchserve_front_grpc_requests_total``.
        self.front_grpc_requests: Callable[[], dict[int, int]] = dict
        self._models = models
        # What the rest of the server and the tests read and call, by the names they know.
        self.config = self.torchserve.config
        self.handlers = self.torchserve.handlers
        self.latency = self.requests.latency
        self.refused = self.requests.refused
        self.phases = self.timing.histogram
        self.count_response = self.torchserve.count_response
        self.worker_loaded = self.torchserve.worker_loaded
        self.batch_overhead = self.torchserve.batch_overhead
        self.record_model_metrics = self.torchserve.record_model_metrics
        self.record_system = self.torchserve.record_system
        self.record_workflow = self.workflows.record_workflow
        self.record_workflow_node = self.workflows.record_workflow_node

    def subscribe(self, observers: Observers) -> None:
        """Subscribe each part to the events it keeps its metrics from: the phases only with
        ``request_phases``, the dispatch reasons and fill only with ``dispatch_stats``, the
        frontend's time per batch only where WorkerThreadTime is kept."""
        torchserve, records = self.torchserve, self.records
        observers.call_ended += [torchserve.call_ended, self.requests.call_ended]
        observers.batch_ended += [torchserve.batch_ended, self.batches.batch_ended,
                                  records.batch_ended]
        observers.worker_loaded.append(
            lambda key, worker, load_ms, metrics: torchserve.worker_loaded(worker, load_ms,
                                                                           metrics))
        observers.model_registered.append(records.registered)
        observers.model_removed += [records.removed, self.devices.removed]
        observers.frontend_time = observers.frontend_time or torchserve.reads_frontend_time
        if self.phases_on:
            observers.batch_ended.append(self.timing.batch_ended)
            observers.call_ended.append(self.timing.call_ended)
        if records.dispatch_stats:
            observers.batch_formed.append(records.batch_formed)
        if self.tenants_on:  # each tenant's requests, and its share of the device time
            observers.call_ended.append(self.tenants.call_ended)
            observers.batch_ended.append(self.devices.batch_ended)
        if self.residency is not None:
            observers.paged_in.append(self.residency.paged_in)
            observers.evicted.append(self.residency.evicted)
            observers.page_in_timed.append(self.residency.timed)

    def histograms(self) -> tuple[Histogram, ...]:
        """Our histograms per model version, as kept (the live page reads them directly)."""
        batches = self.batches
        return (batches.batch_size, batches.queue_wait, self.latency, batches.handler_time,
                self.phases)

    # -- running ----------------------------------------------------------------------------

    async def start(self) -> None:
        """Open the metric logs and start measuring the host (``TorchServeMetrics.start``)."""
        await self.torchserve.start()

    async def close(self) -> None:
        await self.torchserve.close()

    # -- the page ---------------------------------------------------------------------------

    def families(self) -> Iterator[Family]:
        """The families of the metrics page, TorchServe's first."""
        yield from self.torchserve.families()
        if self.mode == "legacy":
            return
        yield from self._model_gauges()
        yield self.requests.refused_family()
        for histogram in self.histograms():
            yield histogram.family()
        yield from self.records.families()
        yield from self.workflows.families()
        for name, help_text, fronts in (
                ("batchserve_front_requests_total",
                 "Predictions a front process parsed and sent to this one",
                 self.front_requests()),
                ("batchserve_front_grpc_requests_total",
                 "Inference gRPC calls a front process relayed to this one",
                 self.front_grpc_requests())):
            if fronts:
                family = Family(name, help_text, "counter")
                for number, count in sorted(fronts.items()):
                    family.add(("front",), (str(number),), count)
                yield family
        if self.tenants_on:
            yield from self.tenants.families()
        yield from self.devices.families()
        if self.residency is not None:
            yield from self.residency.families(self._models)

    def _model_gauges(self) -> Iterator[Family]:
        depth = Family("batchserve_queue_depth", "Requests waiting in a model's queue", "gauge")
        workers = Family("batchserve_workers", "Worker processes of a model", "gauge")
        restarts = Family("batchserve_worker_restarts_total",
                          "Worker restarts (crashes, hangs, failed loads)", "counter")
        for model in list(self._models()):
            key = (model.name, model.version)
            depth.add(MODEL_LABELS, key, model.queue_depth)
            workers.add(MODEL_LABELS, key, len(model.workers))
            restarts.add(MODEL_LABELS, key, model.restarts)
        yield from (depth, workers, restarts)

    def exposition(self, names: set[str] | None = None) -> bytes:
        """The metrics page; with ``names``, only the families TorchServe's ``?name[]=``
        filter names (a family's name, or a histogram's ``_bucket``/``_count``/``_sum``)."""
        families: Iterable[Family] = self.families()
        if names:
            families = (family for family in families if not names.isdisjoint(family.names()))
        return render(families)
