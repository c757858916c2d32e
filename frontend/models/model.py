"""One registered model version at run time: its settings, job queue and workers.

A ``Model`` is built by the loader (frontend/models/loader.py) and looked up through the
registry; it owns every change to itself (scaling changes its worker settings with its
workers). It keeps no record of its batches: they publish what happened to them through the
hooks its launch carries (``WorkerLaunch.events``, frontend/observe/events.py), and what it is
doing now is ``status()``.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from frontend.errors import ServiceUnavailable
from frontend.models import archive as archives
from frontend.models.dependencies import NO_ENVIRONMENT, ModelEnvironment
from frontend.models.residence import LOADED, PAGED_OUT, Residence
from frontend.observe.status import DeviceStatus, ModelStatus, WorkerStatus
from frontend.serving import buckets
from frontend.serving.batching import Batcher, Job
from frontend.serving.fairness import FairQueue, LevelPolicy, Scheduling
from frontend.serving.placement import Placement
from frontend.serving.policies import make_policy
from frontend.serving.sequences import SequenceBatcher
from frontend.serving.workers import Worker, WorkerLaunch
from frontend.settings import ModelSettings
from protos import worker_pb2


@dataclass(frozen=True, slots=True)
class TensorMetadata:
    """The Open Inference Protocol tensors of model-config.yaml (``inputs``, ``outputs``)."""

    inputs: list[dict[str, Any]] = field(default_factory=list)
    outputs: list[dict[str, Any]] = field(default_factory=list)


class Model:
    """One registered model version: its archive, settings, job queue and workers."""

    def __init__(
        self,
        name: str,
        version: str,
        unpacked: archives.UnpackedArchive,
        handler: str,
        settings: ModelSettings,
        launch: WorkerLaunch,
        placement: Placement,
        model_log: logging.Logger,
        loaded_at_startup: bool = False,
        tensors: TensorMetadata = TensorMetadata(),
        environment: ModelEnvironment = NO_ENVIRONMENT,
        workflow: str | None = None,
        tenants: Mapping[str, float] | None = None,
    ) -> None:
        self.name = name
        #: The workflow this model is a node of (registered and removed with it), or None.
        self.workflow = workflow
        #: A workflow's function node (its handler is a function of the workflow's file).
        self.is_workflow_function = launch.load.workflow_function
        self.version = version
        #: (name, version): what its observers know it by.
        self.key = (name, version)
        self.archive = unpacked
        self.handler = handler
        self.settings = settings
        self.tensors = tensors
        #: Its own packages (install_py_dep_per_model, useVenv), shared by its workers.
        self.environment = environment
        self.loaded_at_startup = loaded_at_startup
        self.launch = launch
        self._placement = placement
        self._model_log = model_log
        policy = functools.partial(make_policy, settings.batch_policy, settings.batch_size,
                                   settings.max_batch_delay_ms / 1000)
        #: A stateful model's queue (its sequences, a lane per worker); None otherwise.
        self.sequences: SequenceBatcher | None = None
        #: Its requests are told apart by tenant and priority (the plane stamps their jobs):
        #: the server names tenants (``tenants``: their weights), or it has priority levels.
        self.tenanted = tenants is not None or settings.priority_levels > 0
        #: Its fair queue (docs/scheduling.md); None: FIFO (and always for a stateful model,
        #: whose sequences keep their order on their lanes).
        self.fair: FairQueue[Job] | None = None
        if self.tenanted and not settings.sequence_batching:
            self.fair = FairQueue(Scheduling(
                dict(tenants or {}), settings.priority_levels, settings.default_priority_level,
                {level: LevelPolicy(size, timeout_ms)
                 for level, size, timeout_ms in settings.priority_queue_policy}),
                settings.job_queue_size)
        self.batcher: Batcher | SequenceBatcher
        if settings.sequence_batching:
            self.batcher = self.sequences = SequenceBatcher(
                model=name, max_batch_size=settings.batch_size, policy=policy,
                max_sequences=settings.max_num_sequence,
                max_waiting=settings.max_sequence_job_queue_size,
                max_idle_s=settings.sequence_max_idle_ms / 1000,
                max_duration_s=settings.sequence_timeout_ms / 1000 or None,
                on_formed=launch.events.formed)
        else:
            self.batcher = Batcher(max_batch_size=settings.batch_size,
                                   capacity=settings.job_queue_size, policy=policy(),
                                   on_formed=launch.events.formed, fair=self.fair)
        self.workers: list[Worker] = []
        #: The batch buckets in effect (``buckets.in_effect`` of its workers' reports; empty:
        #: none), known to its batcher's policy once a worker has loaded.
        self.buckets = buckets.NO_BUCKETS
        #: Set when a worker fails: all of them may be down (only then is it worked out).
        self._maybe_down = False
        #: Its residency when residency limits are on (frontend/models/residency.py), else
        #: None: it is loaded while registered.
        self.residence: Residence | None = None

    def restarts_total(self) -> int:
        return sum(worker.restarts for worker in self.workers)

    def _sequences_go_on(self, jobs: list[Job], result: worker_pb2.PredictResult | None
                         ) -> None:
        """A stateful model's batch came back (before the worker takes its next one): its
        sequences go on."""
        assert self.sequences is not None
        self.sequences.finished(jobs, result.responses if result is not None else None)

    def submit(self, job: Job) -> None:
        residence = self.residence
        if not self.workers:
            if residence is None:
                raise ServiceUnavailable(
                    f'Model "{self.name}" has no worker to serve inference request. '
                    "Please use scale workers API to add workers.")
            # Paged out (or being paged out): it waits in the queue, within its deadline and
            # job_queue_size, while the model is paged in (once, however many wait).
            self.batcher.submit(job)
            residence.used(time.time())
            residence.page_in(job.future)
            return
        if self._maybe_down:  # only after a worker failed: no cost on the hot path
            if self._all_workers_down():
                raise self._down_error()
            self._maybe_down = False
        self.batcher.submit(job)
        if residence is not None:  # only with residency limits on
            residence.used(time.time())

    def _all_workers_down(self) -> bool:
        return bool(self.workers) and all(worker.is_down for worker in self.workers)

    def _down_error(self) -> ServiceUnavailable:
        reasons = sorted({w.last_error for w in self.workers if w.last_error})
        return ServiceUnavailable(
            f'Model "{self.name}" has no working worker: they keep failing and are being '
            f"restarted ({'; '.join(reasons) or 'no reason given'})",
            headers={"Retry-After": "1"})

    def _worker_down(self) -> None:
        """A worker died or failed to start: when none is left that could take a batch soon,
        what waits in the queue is answered now (503) instead of at its deadline."""
        self._maybe_down = True
        if self._all_workers_down() and self.batcher.depth:
            self.batcher.fail_queued(self._down_error())

    def _worker_loaded(self) -> None:
        """A worker (re)loaded the model: the buckets in effect are those its workers that are
        up report (docs/batching.md, "Batch buckets"); they are kept while none is up."""
        reports = [worker.execution.buckets for worker in self.workers
                   if worker.is_up and worker.execution is not None]
        if not reports:
            return
        self.buckets = buckets.in_effect(reports)
        batchers = {id(worker.batcher): worker.batcher for worker in self.workers}
        if isinstance(self.batcher, Batcher):
            batchers[id(self.batcher)] = self.batcher
        for batcher in batchers.values():
            batcher.use_buckets(self.buckets)

    def start_workers(self, count: int) -> list[Worker]:
        started = []
        threads = self._placement.threads(count)
        for _ in range(count):
            # A stateful model's worker takes batches from its own lane of the sequences.
            lane = self.sequences.add_lane() if self.sequences is not None else None
            batcher = lane.batcher if lane is not None else self.batcher
            assert isinstance(batcher, Batcher)
            worker = Worker(self.launch, batcher, self._placement.worker_id(),
                            self._placement.gpu(self.settings.device_ids)
                            if self.uses_gpus else None,
                            self._placement.cpus(), threads,
                            self._sequences_go_on if self.sequences is not None else None,
                            self._worker_down, self._model_log, lane, self._worker_loaded)
            self.workers.append(worker)
            started.append(worker)
        if self.fair is not None:
            self.fair.workers = len(self.workers)
        return started

    async def scale(self, min_workers: int, max_workers: int,
                    drain_timeout_s: float | None) -> list[Worker]:
        """Run ``min_workers`` workers (starting or stopping some) and keep both bounds in the
        settings; return the workers started. TooManyWorkers (nothing changed) beyond the
        worker caps."""
        self._placement.admit(self.name, min_workers, max_workers, len(self.workers))
        self.settings = self.settings.with_workers(min_workers, max_workers)
        if self.residence is not None and self.residence.state != LOADED:
            return []  # not loaded: the workers it is paged in with (residency limits)
        if min_workers > len(self.workers):
            return self.start_workers(min_workers - len(self.workers))
        surplus = self.workers[min_workers:]
        del self.workers[min_workers:]
        if self.fair is not None:
            self.fair.workers = max(1, min_workers)
        self._worker_loaded()  # the workers left may agree on more buckets
        if self.residence is not None and not self.workers:
            self.residence.state = PAGED_OUT  # scaled to none: its next request pages it in
        await asyncio.gather(*(worker.stop(drain_timeout_s) for worker in surplus))
        return []

    def page_out(self, drain_timeout_s: float | None) -> asyncio.Future[list[None]]:
        """Stop its workers after the batches they hold (within ``drain_timeout_s``), keeping
        its queue, settings and registration: it is paged in again on demand. The workers
        leave it at once (a request from now on asks for a page-in); the future is their
        stop."""
        workers, self.workers = self.workers, []
        return asyncio.gather(*(worker.stop(drain_timeout_s) for worker in workers))

    def is_idle(self) -> bool:
        """Nothing queued, nothing in a worker, no open sequence: it may be paged out."""
        return (not self.batcher.depth and not any(w.in_flight for w in self.workers)
                and (self.sequences is None or not self.sequences.open_sequences))

    async def stop(self, drain_timeout_s: float | None) -> None:
        """Let the workers take what is queued (bounded), then stop them."""
        deadline = None if drain_timeout_s is None else time.monotonic() + drain_timeout_s
        if any(worker.first_start.done() for worker in self.workers):
            await self.batcher.wait_empty(drain_timeout_s)
        self.batcher.close(ServiceUnavailable(f'Model "{self.name}" is being unregistered'))
        workers, self.workers = self.workers, []
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        await asyncio.gather(*(worker.stop(remaining) for worker in workers))

    @property
    def uses_gpus(self) -> bool:
        """Its workers run on GPUs: the server has some, and its model-config.yaml does not
        say ``deviceType: cpu``."""
        return self._placement.gpus.count > 0 and self.settings.device_type != "cpu"

    @property
    def device_ids(self) -> list[int] | None:
        """Its ``deviceIds`` as TorchServe's describe shows them: None when not set, or when
        one names no GPU of the server's (TorchServe then ignores the list)."""
        ids = self.settings.device_ids
        if not ids or any(i >= self._placement.gpus.count for i in ids):
            return None
        return list(ids)

    def health(self) -> str:
        """TorchServe's words: Healthy, Partial Healthy (some workers keep dying) or Unhealthy
        (fewer live workers than min_workers and some keep dying)."""
        failing = sum(1 for w in self.workers if w.is_unhealthy)
        if not failing:
            return "Healthy"
        live = sum(1 for w in self.workers
                   if w.is_up and not w.is_unhealthy)
        return "Partial Healthy" if live >= max(1, self.settings.min_workers) else "Unhealthy"

    def is_healthy(self) -> bool:
        return self.health() != "Unhealthy"

    def is_ready(self) -> bool:
        """Ready when one of its workers can take a batch, or it is paged out or being paged
        in (a request pages it in: residency limits)."""
        return any(worker.is_up for worker in self.workers) or self._on_demand()

    def _on_demand(self) -> bool:
        """Not loaded, and loaded by its next request (residency limits)."""
        return self.residence is not None and self.residence.state != LOADED

    def has_min_workers_up(self) -> bool:
        """As many workers up as ``min_workers`` (at least one): what a pod's readiness asks,
        so that a replica takes its share of traffic only with all of its batch capacity."""
        if self._on_demand():
            return True
        up = sum(1 for worker in self.workers if worker.is_up)
        return up >= max(1, self.settings.min_workers)

    def status(self) -> ModelStatus:
        """What it and its workers are doing now, as plain facts (for the observers)."""
        settings = self.settings
        return ModelStatus(
            self.name, self.version, self.health(), settings.batch_policy.value,
            settings.batch_size, settings.max_batch_delay_ms, self.batcher.depth,
            self.batcher.capacity,
            tuple(WorkerStatus(worker.id, worker.state.value, worker.is_up, worker.in_flight,
                               worker.restarts, worker.pid, worker.gpu_id,
                               worker.working_since, worker.execution)
                  for worker in self.workers), self.buckets, self.device_status(),
            self.residence.state if self.residence is not None else LOADED,
            self.residence.last_used if self.residence is not None else None)

    def device_status(self) -> DeviceStatus | None:
        """Its share of its device group's time now (None: it names no ``deviceGroup``)."""
        share = self.launch.device
        if share is None:
            return None
        return DeviceStatus(share.group.name, share.weight, share.used_s, share.share,
                            share.running, len(share.waiting))
