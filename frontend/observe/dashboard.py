"""The live page's data (``GET /dashboard/data`` on the management port): what each model
is doing now, and a per-second history of the last minutes.

A sampler task, started with the server, takes one sample a second from what the server
counts anyway: the metrics' histograms and counters (request latency, batch sizes, refusals;
and, where the server keeps them, the request phases, batch fill and dispatch reasons, found
by their names), each model version's status (its queue depth, its workers and their batches
in flight: ``ModelStatus``), each worker's busy time (``BusyTime``: one addition per batch
that ended, from the serving core's events, and the batch it is on now), the host's CPU and,
where there are GPUs, their utilisation and memory (read in a thread, every few seconds).
Nothing else runs on a request's path. A sample holds rates and percentiles over the second
before it; the last ``window_s`` of them are kept in a ring (bounded memory; at most
``MAX_MODELS`` models are followed).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import psutil

from frontend.observe import timeseries
from frontend.observe.batches import BucketCounts, ModelBatches
from frontend.observe.events import Batch, JobFacts, ModelKey
from frontend.observe.metrics import ServerMetrics
from frontend.observe.status import ModelStatus, Statuses
from frontend.observe.system import Reading, read_gpus
from frontend.observe.timeseries import Buckets, ByModel, Ring
from protos import worker_pb2

logger = logging.getLogger(__name__)

#: Our families the page reads (those of the request phases, the batch fill and the dispatch
#: reasons exist where the server keeps them; until then their plots say "no data yet"). The
#: fill and the reasons are read from each model's own ``DispatchStats`` where the metrics
#: have them, which is what the metrics page writes them from: building the page each second
#: would hold the event loop for milliseconds.
LATENCY = "batchserve_request_latency_seconds"
BATCH_SIZE = "batchserve_batch_size"
PHASES = "batchserve_request_phase_seconds"
FILL = "batchserve_batch_fill"
REASONS = ("batchserve_dispatch_total", "batchserve_dispatch")
WANTED = frozenset({LATENCY, BATCH_SIZE, PHASES, FILL, *REASONS})
#: How often the metrics page is searched for a family it has not had yet, in seconds.
RESCAN_S = 10.0
#: The models whose history is kept, at most (the first by name); the rest are listed only.
MAX_MODELS = 32
QUANTILES = (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))
Sample = dict[str, object]


def _round(value: float | None, digits: int = 4) -> float | None:
    """``value`` to ``digits`` significant digits (a smaller page), None for nothing."""
    if value is None or not math.isfinite(value):
        return None
    if value == 0:
        return 0.0
    return round(value, max(0, digits - 1 - math.floor(math.log10(abs(value)))))


def _ms(seconds: float | None) -> float | None:
    return _round(seconds * 1000) if seconds is not None else None


@dataclass(slots=True)
class _Reading:
    """One model's counters at one moment (a sample is the difference of two)."""

    latency: Buckets | None = None
    batches: Buckets | None = None
    fill: Buckets | None = None
    phases: dict[str, Buckets] = field(default_factory=dict)
    reasons: dict[str, float] = field(default_factory=dict)
    #: The families it was read from (a rate needs the family in both readings: one that
    #: has just been found holds everything since the server started).
    families: frozenset[str] = frozenset()
    refused: float = 0.0
    busy_s: dict[str, float] = field(default_factory=dict)
    #: Its batches that ran padded to batch buckets, their hits, rows and padded rows.
    buckets: tuple[int, int, int, int] = (0, 0, 0, 0)


def _histogram(readings: ByModel[Buckets], model: ModelStatus) -> Buckets | None:
    return next((value for _, value in
                 timeseries.of_model(readings, model.name, model.version)), None)


class BusyTime:
    """Seconds each worker slot has spent on batches, over all its lives: each batch that
    ended adds the time its worker had it (answered, failed or lost). Subscribed to the batch
    events by the server; the batch a worker is on now is its status's ``working_since``."""

    def __init__(self) -> None:
        #: Worker id -> seconds.
        self.seconds: dict[str, float] = {}

    def batch_ended(self, key: ModelKey, batch: Batch, jobs: Sequence[JobFacts],
                    result: worker_pb2.PredictResult | None) -> None:
        if batch.worker:
            self.seconds[batch.worker] = self.seconds.get(batch.worker, 0.0) + batch.service_s


class Dashboard:
    """Samples the server once a ``interval_s`` and answers the page's data requests."""

    def __init__(self, models: Statuses, metrics: ServerMetrics, *,
                 busy: BusyTime | None = None, gpu_count: int = 0,
                 interval_s: float = 1.0, window_s: float = 300.0, gpu_interval_s: float = 2.0,
                 clock: Callable[[], float] = time.time,
                 monotonic: Callable[[], float] = time.monotonic,
                 gpu_reader: Callable[[int], list[Reading]] = read_gpus) -> None:
        """``models``: the model versions now; ``busy``: the workers' busy time (what the
        server subscribed to its batches)."""
        self._models = models
        self._metrics = metrics
        self.busy = busy if busy is not None else BusyTime()
        self.gpu_count = gpu_count
        self.interval_s = interval_s
        self.window_s = window_s
        self._gpu_interval_s = gpu_interval_s
        self._clock = clock
        self._monotonic = monotonic
        self._read_gpus = gpu_reader
        self.samples: Ring[Sample] = Ring(max(1, math.ceil(window_s / interval_s)))
        self._before: dict[tuple[str, str], _Reading] = {}
        self._before_at: float | None = None
        #: The wanted families the metrics page has had, and when to look for the others.
        self._on_page: set[str] = set()
        self._rescan_at = 0.0
        self._cpu_before = psutil.cpu_times()
        #: The GPUs' last reading, for each sample until the next.
        self._gpus: list[dict[str, float]] = []
        self._tasks: list[asyncio.Task[None]] = []

    # -- running ------------------------------------------------------------------------------

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks.append(loop.create_task(self._sample_forever(), name="dashboard-sampler"))
        if self.gpu_count > 0:
            self._tasks.append(loop.create_task(self._read_gpus_forever(), name="dashboard-gpus"))

    async def close(self) -> None:
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _sample_forever(self) -> None:
        while True:
            try:
                self.tick()
            except Exception:  # one bad sample must not end the history
                logger.exception("the live page's sampler failed")
            await asyncio.sleep(self.next_delay_s(self._monotonic()))

    def next_delay_s(self, now: float) -> float:
        """How long until the next sample: to the next interval boundary (whatever the time
        one sample took), at least half an interval away (a timer that fires a little early
        must not take a second sample at once: its rates would be over a moment)."""
        delay = self.interval_s - now % self.interval_s
        return delay + self.interval_s if delay < self.interval_s / 2 else delay

    async def _read_gpus_forever(self) -> None:
        while True:
            try:
                readings = await asyncio.to_thread(self._read_gpus, self.gpu_count)
            except Exception as exc:  # no driver, no nvidia-smi: say it once, stop asking
                logger.warning("the live page shows no GPU readings: %s", exc)
                return
            self._gpus = _gpu_rows(readings)
            await asyncio.sleep(self._gpu_interval_s)

    # -- sampling -----------------------------------------------------------------------------

    def _statuses(self) -> list[ModelStatus]:
        """Every model version now, by name and version."""
        return sorted(self._models(), key=lambda m: (m.name, m.version))

    def followed(self) -> list[ModelStatus]:
        """The models whose history is kept."""
        return self._statuses()[:MAX_MODELS]

    def tick(self) -> Sample | None:
        """Take one sample (the first only sets the baseline: there is no second before it)."""
        now = self._monotonic()
        elapsed = None if self._before_at is None else now - self._before_at
        models = self._statuses()
        histograms, counters = self._read_families(models)
        readings: dict[tuple[str, str], _Reading] = {}
        rows: list[Sample] = []
        for model in models[:MAX_MODELS]:
            key = (model.name, model.version)
            reading = readings[key] = self._read(model, histograms, counters)
            before = self._before.get(key)
            row = self._row(model, reading, before, elapsed)
            rows.append(row)
        self._before, self._before_at = readings, now
        cpu = self._cpu_percent()
        if elapsed is None or elapsed <= 0:
            return None
        taken = round(self._clock(), 3)
        sample: Sample = {"t": taken, "models": rows, "cpu": cpu}
        if self._gpus:
            sample["gpus"] = self._gpus
        self.samples.append(taken, sample)
        return sample

    def _read_families(self, models: list[ModelStatus]
                       ) -> tuple[dict[str, ByModel[Buckets]], dict[str, ByModel[float]]]:
        """The families the page reads, by name. The server's histograms kept as ours are
        (latency and batch sizes, in every metrics_mode) are read directly; the others from
        the metrics page, each second once it has them, and every ``RESCAN_S`` until then
        (building the page is what costs)."""
        metrics = self._metrics
        kept = {name: histogram for histogram in metrics.histograms()
                if (name := histogram.name) in WANTED}
        histograms = {name: timeseries.by_model(timeseries.read_kept_histogram(histogram))
                      for name, histogram in kept.items()}
        counters: dict[str, ByModel[float]] = {}
        missing = WANTED - kept.keys()
        records = metrics.records
        if all(records.of(model.name, model.version) is not None for model in models):
            missing -= {FILL, *REASONS}  # read from the models' records (``_read``)
        now = self._monotonic()
        if metrics.mode == "legacy" or not missing or (
                not missing & self._on_page and now < self._rescan_at):
            return histograms, counters
        self._rescan_at = now + RESCAN_S
        for family in metrics.families():
            if family.name not in missing:
                continue
            self._on_page.add(family.name)
            if family.type == "histogram":
                histograms[family.name] = timeseries.by_model(
                    timeseries.read_histograms(family))
            else:
                counters[family.name] = timeseries.by_model(timeseries.read_counters(family))
        return histograms, counters

    def _read(self, model: ModelStatus, histograms: dict[str, ByModel[Buckets]],
              counters: dict[str, ByModel[float]]) -> _Reading:
        reading = _Reading(
            latency=_histogram(histograms.get(LATENCY, {}), model),
            batches=_histogram(histograms.get(BATCH_SIZE, {}), model),
            fill=_histogram(histograms.get(FILL, {}), model),
            families=frozenset((*histograms, *counters)))
        if PHASES in histograms:
            reading.phases = timeseries.by_label(
                timeseries.of_model(histograms[PHASES], model.name, model.version), "phase")
        batches = self._metrics.records.of(model.name, model.version)
        if batches is not None:
            counts = batches.buckets
            reading.buckets = (counts.batches, counts.hits, counts.rows, counts.padded_rows)
            stats = batches.dispatch
            if stats.enabled:  # dispatch_stats=false: nothing kept, no plot
                reading.fill = Buckets(tuple(stats.bounds),
                                       tuple(itertools.accumulate(list(stats.fill_counts))),
                                       stats.fill_sum)
                reading.reasons = {reason: float(count)
                                   for reason, count in list(stats.reasons.items())}
                reading.families = reading.families | {FILL, REASONS[0]}
            return self._add_refused_and_busy(model, reading)
        for name in REASONS:
            if name in counters:
                reading.reasons = timeseries.by_label(
                    timeseries.of_model(counters[name], model.name, model.version), "reason")
        return self._add_refused_and_busy(model, reading)

    def _add_refused_and_busy(self, model: ModelStatus, reading: _Reading) -> _Reading:
        refused = self._metrics.refused
        reading.refused = float(sum(count for (name, version, _), count in list(refused.items())
                                    if name == model.name and version == model.version))
        busy, now = self.busy.seconds, self._monotonic()
        reading.busy_s = {
            worker.id: busy.get(worker.id, 0.0) + (
                now - worker.working_since if worker.working_since is not None else 0.0)
            for worker in model.workers}
        return reading

    def _row(self, model: ModelStatus, now: _Reading, before: _Reading | None,
             elapsed: float | None) -> Sample:
        """One model's line of a sample: its state now and its rates over ``elapsed``."""
        row: Sample = {
            "model": model.name, "version": model.version, "queue": model.queue_depth,
            "inFlight": model.in_flight,
            "workersUp": sum(1 for worker in model.workers if worker.is_up),
            "residency": model.residency,
        }
        if before is None or elapsed is None or elapsed <= 0:
            return row

        def per_s(count: float) -> float | None:
            return _round(max(0.0, count) / elapsed)

        latency = now.latency.since(before.latency) if now.latency is not None else None
        row["requests"] = per_s(latency.count) if latency is not None else 0.0
        row["refused"] = per_s(now.refused - before.refused)
        row["latencyMs"] = {name: _ms(latency.quantile(q)) for name, q in QUANTILES
                            } if latency is not None and latency.count else None
        batches = now.batches.since(before.batches) if now.batches is not None else None
        row["batches"] = per_s(batches.count) if batches is not None else 0.0
        row["meanBatch"] = _round(batches.mean()) if batches is not None else None
        both = now.families & before.families
        if now.fill is not None and FILL in both:
            row["fill"] = _round(now.fill.since(before.fill).mean())
        if now.phases and PHASES in both:
            row["phasesMs"] = {
                phase: {"mean": _ms(spent.mean()),
                        **{name: _ms(spent.quantile(q)) for name, q in QUANTILES}}
                for phase, buckets in now.phases.items()
                if (spent := buckets.since(before.phases.get(phase))).count}
        if now.reasons and both & set(REASONS):
            row["reasons"] = {reason: per_s(count - before.reasons.get(reason, 0.0))
                              for reason, count in now.reasons.items()}
        bucketed, hits, rows, padded = (later - earlier for later, earlier in
                                        zip(now.buckets, before.buckets, strict=True))
        if bucketed > 0 and rows > 0:  # batches ran padded to buckets in the second
            row["buckets"] = {"batches": per_s(bucketed), "hitShare": _round(hits / bucketed),
                              "paddingShare": _round(padded / rows)}
        busy = {worker: _round(min(1.0, max(0.0, (spent - before.busy_s.get(worker, spent))
                                             / elapsed)), 3)
                for worker, spent in now.busy_s.items()}
        row["busy"] = busy
        row["utilisation"] = _round(sum(v or 0.0 for v in busy.values()) / len(busy), 3
                                    ) if busy else None
        return row

    def _cpu_percent(self) -> float | None:
        """The host's CPU use since the last sample (its own baseline: TorchServe's
        CPUUtilization, read every minute, keeps psutil's)."""
        times = psutil.cpu_times()
        before, self._cpu_before = self._cpu_before, times

        def spent(reading: object) -> tuple[float, float]:
            """(all time, idle time); guest time is in user time already (Linux)."""
            values = reading._asdict()  # type: ignore[attr-defined]
            total = sum(values.values()) - values.get("guest", 0.0) - values.get(
                "guest_nice", 0.0)
            return total, values["idle"] + values.get("iowait", 0.0)

        (total, idle), (total_before, idle_before) = spent(times), spent(before)
        if total <= total_before:
            return None
        return _round(100.0 * (1.0 - (idle - idle_before) / (total - total_before)), 3)

    # -- the page's data ----------------------------------------------------------------------

    def document(self, since: float | None = None) -> dict[str, object]:
        """What the page polls: the models now, and the samples taken after ``since``."""
        return {
            "now": round(self._clock(), 3),
            "intervalS": self.interval_s,
            "windowS": self.window_s,
            "gpus": self.gpu_count,
            "models": [_model_state(model, self._metrics.records.of(model.name, model.version))
                       for model in self._statuses()],
            "samples": [sample for _, sample in self.samples.since(since)],
            # Device groups' models and each model's tenants: their device time and share
            # (docs/devices.md).
            "devices": self._metrics.devices.device_rows(),
            "tenants": self._metrics.devices.tenant_rows(),
        }


def _model_state(model: ModelStatus, batches: ModelBatches | None) -> dict[str, object]:
    return {
        "model": model.name,
        "version": model.version,
        "status": model.health,
        "residency": model.residency,
        "lastUsed": round(model.last_used, 3) if model.last_used is not None else None,
        "policy": model.policy,
        "batchSize": model.batch_size,
        "maxBatchDelayMs": model.max_batch_delay_ms,
        "queueDepth": model.queue_depth,
        "queueCapacity": model.queue_capacity,
        "inFlightBatches": model.in_flight,
        "batchesTotal": batches.batches_total if batches is not None else 0,
        "requestsTotal": batches.requests_total if batches is not None else 0,
        "recentBatchSizes": list(batches.recent_sizes) if batches is not None else [],
        "buckets": {"sizes": list(model.buckets),
                    **(batches.buckets if batches is not None else BucketCounts()).fields()},
        "workers": [{"id": worker.id, "state": worker.state, "inFlight": worker.in_flight,
                     "restarts": worker.restarts, "pid": worker.pid, "gpuId": worker.gpu_id,
                     **({"execution": worker.execution.fields()}
                        if worker.execution is not None else {})}
                    for worker in model.workers],
    }


def _gpu_rows(readings: list[Reading]) -> list[dict[str, float]]:
    """The system sampler's GPU readings as one row per GPU."""
    rows: dict[str, dict[str, float]] = {}
    names = {"GPUUtilization": "util", "GPUMemoryUtilization": "memUtil",
             "GPUMemoryUsed": "memUsedMiB"}
    for name, labels, value in readings:
        if name in names and len(labels) >= 2:
            rows.setdefault(labels[1], {"id": int(labels[1])})[names[name]] = value
    return list(rows.values())
