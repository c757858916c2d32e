"""Registered models: names, versions, default versions, and each version's queue and workers."""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from frontend.api.kserve import tensor_metadata
from frontend.config import ModelDefaults, ServerConfig
from frontend.errors import (
    BadRequest,
    Conflict,
    Forbidden,
    InternalError,
    ModelNotFound,
    ModelVersionNotFound,
    ServiceUnavailable,
)
from frontend.models import archive as archives
from frontend.models.download import download_archive
from frontend.observe.metrics import ServerMetrics
from frontend.serving.batching import Batcher, Job
from frontend.serving.placement import CpuAssigner, GpuAssigner
from frontend.serving.policies import PolicyName, batch_settings_from_aliases, make_policy
from frontend.serving.workers import Worker, WorkerLaunch, WorkerStartError
from protos import worker_pb2

logger = logging.getLogger(__name__)

MODEL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
SERVER_VERSION = "0.1.0"


@dataclass(frozen=True, slots=True)
class ModelSettings:
    """The batching and worker settings in force for one model version."""

    batch_size: int
    max_batch_delay_ms: int
    min_workers: int
    max_workers: int
    response_timeout_s: int
    startup_timeout_s: int
    job_queue_size: int
    #: GPUs this model's workers may use (model-config.yaml ``deviceIds``); empty: any.
    device_ids: tuple[int, ...] = ()
    #: "adaptive" (default) or "fixed" (TorchServe's behaviour).
    batch_policy: str = PolicyName.ADAPTIVE.value

    def torchserve_fields(self) -> dict[str, int]:
        """The settings under TorchServe's JSON names (describe bodies and snapshots)."""
        return {
            "minWorkers": self.min_workers,
            "maxWorkers": self.max_workers,
            "batchSize": self.batch_size,
            "maxBatchDelay": self.max_batch_delay_ms,
            "responseTimeout": self.response_timeout_s,
            "startupTimeout": self.startup_timeout_s,
        }


@dataclass(frozen=True, slots=True)
class RegisterRequest:
    """A registration, from the management API or from the startup model list."""

    url: str
    model_name: str | None = None
    handler: str | None = None
    batch_size: int | None = None
    max_batch_delay_ms: int | None = None
    initial_workers: int | None = None
    response_timeout_s: int | None = None
    startup_timeout_s: int | None = None
    synchronous: bool = True
    loaded_at_startup: bool = False
    batch_policy: str | None = None


def _first(*values: Any) -> Any:
    return next((value for value in values if value is not None), None)


def _device_ids(config: dict[str, Any]) -> tuple[int, ...]:
    raw = config.get("deviceIds")
    if raw is None:
        return ()
    if not isinstance(raw, list) or not all(isinstance(i, int) and i >= 0 for i in raw):
        raise BadRequest(f"model-config.yaml: deviceIds must be a list of GPU ids, got {raw!r}")
    return tuple(raw)


def _yaml_int(config: dict[str, Any], key: str) -> int | None:
    value = config.get(key)
    if value is None:
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        raise BadRequest(f"model-config.yaml: {key} must be an integer, got {value!r}") from None


class Model:
    """One registered model version: its archive, settings, job queue and workers."""

    def __init__(
        self,
        name: str,
        version: str,
        unpacked: archives.UnpackedArchive,
        handler: str,
        settings: ModelSettings,
        config: ServerConfig,
        run_dir: Path,
        gpus: GpuAssigner,
        cpus: CpuAssigner | None,
        metrics: ServerMetrics,
        loaded_at_startup: bool,
        cpu_share: Callable[[int], int] = lambda adding: 0,
    ) -> None:
        self.name = name
        self.version = version
        self.archive = unpacked
        self.handler = handler
        self.settings = settings
        self.loaded_at_startup = loaded_at_startup
        self.registered_at = time.time()
        self._gpus = gpus
        self._cpus = cpus
        self._metrics = metrics
        #: Each new worker's share of the cores, given how many are being added.
        self._cpu_share = cpu_share
        self.batcher = Batcher(
            max_batch_size=settings.batch_size,
            capacity=settings.job_queue_size,
            policy=make_policy(settings.batch_policy, settings.batch_size,
                               settings.max_batch_delay_ms / 1000),
        )
        self.launch = WorkerLaunch(
            load=worker_pb2.LoadModel(
                model_name=name,
                model_version=version,
                model_dir=str(unpacked.model_dir),
                handler=handler,
                batch_size=settings.batch_size,
                manifest_json=unpacked.manifest_json,
                limit_max_image_pixels=config.limit_max_image_pixels,
                envelope=config.service_envelope,
                decode_input_request=config.decode_input_request,
                server_version=SERVER_VERSION,
                response_timeout_ms=settings.response_timeout_s * 1000,
            ),
            run_dir=run_dir,
            startup_timeout_s=settings.startup_timeout_s,
            response_timeout_s=settings.response_timeout_s,
            max_response_bytes=config.max_response_size_bytes,
            batches_in_flight=config.batches_in_flight,
        )
        self.workers: list[Worker] = []
        #: Set when a worker fails: all of them may be down (only then is it worked out).
        self._maybe_down = False
        self.recent_batch_sizes: collections.deque[int] = collections.deque(maxlen=64)
        self.batches_total = 0
        self.requests_total = 0

    def restarts_total(self) -> int:
        return sum(worker.restarts for worker in self.workers)

    def _record_batch(self, jobs: list[Job], result: worker_pb2.PredictResult | None) -> None:
        self.recent_batch_sizes.append(len(jobs))
        self.batches_total += 1
        self.requests_total += len(jobs)
        self._metrics.record_batch(self, jobs, result)

    def submit(self, job: Job) -> None:
        if not self.workers:
            raise ServiceUnavailable(
                f'Model "{self.name}" has no worker to serve inference request. '
                "Please use scale workers API to add workers.")
        if self._maybe_down:  # only after a worker failed: no cost on the hot path
            if self._all_workers_down():
                raise self._down_error()
            self._maybe_down = False
        self.batcher.submit(job)

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

    def start_workers(self, count: int) -> list[Worker]:
        started = []
        threads = self._cpu_share(count)
        for _ in range(count):
            gpu = self._gpus.next(self.settings.device_ids)
            cpus = self._cpus.next() if self._cpus is not None else None
            worker = Worker(self.launch, self.batcher, gpu, cpus, threads, self._record_batch,
                            self._worker_down)
            self.workers.append(worker)
            started.append(worker)
        return started

    async def scale(self, target: int, drain_timeout_s: float | None) -> list[Worker]:
        """Start or stop workers until ``target`` run; return the ones started."""
        if target > len(self.workers):
            return self.start_workers(target - len(self.workers))
        surplus = self.workers[target:]
        del self.workers[target:]
        await asyncio.gather(*(worker.stop(drain_timeout_s) for worker in surplus))
        return []

    async def stop(self, drain_timeout_s: float | None) -> None:
        """Let the workers take what is queued (bounded), then stop them."""
        deadline = None if drain_timeout_s is None else time.monotonic() + drain_timeout_s
        if any(worker.first_start.done() for worker in self.workers):
            await self.batcher.wait_empty(drain_timeout_s)
        self.batcher.close(ServiceUnavailable(f'Model "{self.name}" is being unregistered'))
        workers, self.workers = self.workers, []
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        await asyncio.gather(*(worker.stop(remaining) for worker in workers))

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

    def describe(self) -> dict[str, object]:
        s = self.settings
        sizes = list(self.recent_batch_sizes)
        return {
            "modelName": self.name,
            "modelVersion": self.version,
            "modelUrl": self.archive.url,
            "runtime": self.archive.manifest.runtime or "python",
            **s.torchserve_fields(),
            "loadedAtStartup": self.loaded_at_startup,
            "status": self.health(),
            **({"deviceIds": list(s.device_ids)} if s.device_ids else {}),
            "handler": self.handler,
            "workers": [worker.describe() for worker in self.workers],
            "jobQueueStatus": {
                "remainingCapacity": self.batcher.remaining_capacity,
                "pendingRequests": self.batcher.depth,
            },
            "batching": {
                "policy": s.batch_policy,
                "queueDepth": self.batcher.depth,
                "inFlightBatches": sum(w.in_flight for w in self.workers),
                "batchesTotal": self.batches_total,
                "requestsTotal": self.requests_total,
                "recentBatchSizes": sizes,
                "meanBatchSize": round(sum(sizes) / len(sizes), 3) if sizes else 0.0,
            },
        }


class ModelRegistry:
    """All registered models by name and version, and which version is the default."""

    def __init__(self, config: ServerConfig, run_dir: Path, gpus: GpuAssigner) -> None:
        self.config = config
        self.run_dir = run_dir
        self.archive_dir = run_dir / "models"
        self.archive_dir.mkdir(mode=0o700, exist_ok=True)
        self._gpus = gpus
        self._cpus = CpuAssigner.detect(config.cpu_cores_per_worker) if config.cpu_affinity \
            else None
        self._models: dict[str, dict[str, Model]] = {}
        self._cores = len(os.sched_getaffinity(0))
        self._defaults: dict[str, str] = {}
        self.metrics = ServerMetrics(self, str(config.model_store or "."))

    # ---- lookup -------------------------------------------------------------------------

    def get(self, name: str, version: str | None = None) -> Model:
        versions = self._models.get(name)
        if not versions:
            raise ModelNotFound(f"Model not found: {name}")
        if version is None:
            return versions[self._defaults[name]]
        try:
            return versions[version]
        except KeyError:
            raise ModelVersionNotFound(
                f"Model version {version} does not exist for model {name}") from None

    def versions(self, name: str) -> list[Model]:
        versions = self._models.get(name)
        if not versions:
            raise ModelNotFound(f"Model not found: {name}")
        return list(versions.values())

    def names(self) -> list[str]:
        return sorted(self._models)

    def default_version(self, name: str) -> str:
        self.get(name)
        return self._defaults[name]

    def __iter__(self) -> Iterator[Model]:
        for versions in self._models.values():
            yield from versions.values()

    # ---- lifecycle ----------------------------------------------------------------------

    def _settings(self, name: str, version: str, request: RegisterRequest,
                  model_config: dict[str, Any]) -> ModelSettings:
        config = self.config
        from_props = config.models.get(name, {}).get(version) or ModelDefaults()
        try:  # MLServer's / KServe's names in model-config.yaml, below TorchServe's own
            aliases = batch_settings_from_aliases(model_config)
        except ValueError as exc:
            raise BadRequest(f"model-config.yaml: {exc}") from None
        workers = _first(request.initial_workers, _yaml_int(model_config, "minWorkers"),
                         from_props.min_workers, self._default_workers())
        max_workers = _first(_yaml_int(model_config, "maxWorkers"), from_props.max_workers, workers)
        settings = ModelSettings(
            batch_size=_first(request.batch_size, _yaml_int(model_config, "batchSize"),
                              aliases.get("batch_size"), from_props.batch_size,
                              config.default_batch_size),
            max_batch_delay_ms=_first(request.max_batch_delay_ms,
                                      _yaml_int(model_config, "maxBatchDelay"),
                                      aliases.get("max_batch_delay_ms"),
                                      from_props.max_batch_delay_ms,
                                      config.default_max_batch_delay_ms),
            min_workers=workers,
            max_workers=max(workers, max_workers),
            response_timeout_s=_first(request.response_timeout_s,
                                      _yaml_int(model_config, "responseTimeout"),
                                      from_props.response_timeout_s,
                                      config.default_response_timeout_s),
            startup_timeout_s=_first(request.startup_timeout_s,
                                     _yaml_int(model_config, "startupTimeout"),
                                     from_props.startup_timeout_s,
                                     config.default_startup_timeout_s),
            job_queue_size=_first(_yaml_int(model_config, "jobQueueSize"), config.job_queue_size),
            device_ids=_device_ids(model_config),
            batch_policy=_first(request.batch_policy, model_config.get("batchPolicy"),
                                from_props.batch_policy, config.default_batch_policy),
        )
        if settings.batch_policy not in {p.value for p in PolicyName}:
            raise BadRequest(f"batch_policy must be one of "
                             f"{', '.join(p.value for p in PolicyName)}, "
                             f"got {settings.batch_policy!r}")
        if settings.batch_size < 1:
            raise BadRequest(f"batch_size must be >= 1, got {settings.batch_size}")
        if settings.max_batch_delay_ms < 0:
            raise BadRequest(f"max_batch_delay must be >= 0, got {settings.max_batch_delay_ms}")
        if settings.min_workers < 0:
            raise BadRequest(f"initial_workers must be >= 0, got {settings.min_workers}")
        if settings.response_timeout_s < 1 or settings.startup_timeout_s < 1:
            raise BadRequest("response_timeout and startup_timeout must be >= 1 second")
        return settings

    def _cpu_share(self, adding: int) -> int:
        """Threads for each of ``adding`` new workers: the cores this process may use, shared
        among every worker of every model on this host (the new ones included)."""
        workers = sum(len(model.workers) for model in self) + adding
        return max(1, self._cores // max(1, workers))

    def _default_workers(self) -> int:
        if self.config.default_workers_per_model > 0:
            return self.config.default_workers_per_model
        return self._gpus.count or os.cpu_count() or 1

    async def register(self, request: RegisterRequest) -> Model:
        """Unpack, validate and add a model version; start its workers.

        With ``synchronous`` it returns once every initial worker has loaded the model, and
        a model whose workers fail to load is removed again (nothing stays half-registered).
        """
        url = request.url
        downloaded: Path | None = None
        if url.lower().startswith(("http://", "https://")):
            if self.config.model_store is None:
                raise BadRequest("no model store is configured to download the archive into")
            downloaded = await asyncio.to_thread(
                download_archive, url, self.config.model_store, self.config.allowed_urls,
                self.config.max_archive_size_bytes)
            logger.info("downloaded %s into the model store as %s", url, downloaded.name)
            url = downloaded.name  # snapshots restore it from the store
        try:
            return await self._register(request, url)
        except BaseException:
            if downloaded is not None:
                # A refused registration leaves nothing behind in the model store.
                downloaded.unlink(missing_ok=True)
            raise

    async def _register(self, request: RegisterRequest, url: str) -> Model:
        source = archives.resolve_url(url, self.config.model_store, self.config.allowed_urls)
        unpacked = await asyncio.to_thread(archives.unpack, url, source, self.archive_dir)
        try:
            model = self._add(request, unpacked)
        except BaseException:
            archives.remove_unpacked(unpacked, self.archive_dir)
            raise
        workers = model.start_workers(model.settings.min_workers)
        if not request.synchronous or not workers:
            return model
        outcomes = await asyncio.gather(*(worker.first_start for worker in workers))
        failures = [outcome for outcome in outcomes if outcome is not None]
        if failures:
            await self._remove(model, drain_timeout_s=0)
            raise InternalError(str(failures[0]))
        return model

    def _add(self, request: RegisterRequest, unpacked: archives.UnpackedArchive) -> Model:
        manifest = unpacked.manifest
        name = request.model_name or manifest.model_name
        if not name or not MODEL_NAME.match(name):
            raise BadRequest(f"invalid model name {name!r}: use letters, digits, '_', '-', '.'")
        version = manifest.model_version or "1.0"
        if version in self._models.get(name, {}):
            raise Conflict(f"Model version {version} is already registered for model {name}")
        handler = request.handler or manifest.handler or self.config.default_service_handler
        if not handler:
            raise BadRequest(f"model {name!r} names no handler: pass handler=")
        settings = self._settings(name, version, request, unpacked.model_config)
        for key in ("inputs", "outputs"):  # Open Inference Protocol metadata; fail early
            tensor_metadata(unpacked.model_config, key)
        model = Model(name, version, unpacked, handler, settings, self.config, self.run_dir,
                      self._gpus, self._cpus, self.metrics, request.loaded_at_startup,
                      self._cpu_share)
        versions = self._models.setdefault(name, {})
        versions[version] = model
        is_default = self.config.models.get(name, {}).get(version, ModelDefaults())
        if name not in self._defaults or is_default.is_default_version:
            self._defaults[name] = version
        logger.info("registered model %s version %s (batch_size=%d, max_batch_delay=%d ms, "
                    "workers=%d)", name, version, settings.batch_size,
                    settings.max_batch_delay_ms, settings.min_workers)
        return model

    async def unregister(self, name: str, version: str | None = None) -> Model:
        model = self.get(name, version)
        if (version is not None and self._defaults.get(name) == version
                and len(self._models[name]) > 1):
            raise Forbidden(f"Cannot remove default version {version} for model {name}")
        await self._remove(model, self.config.unregister_model_timeout_s)
        return model

    async def _remove(self, model: Model, drain_timeout_s: float | None) -> None:
        versions = self._models.get(model.name, {})
        if versions.get(model.version) is model:
            del versions[model.version]
            if not versions:
                del self._models[model.name]
                self._defaults.pop(model.name, None)
            elif self._defaults.get(model.name) == model.version:
                self._defaults[model.name] = next(iter(versions))
        await model.stop(drain_timeout_s)
        archives.remove_unpacked(model.archive, self.archive_dir)
        logger.info("unregistered model %s version %s", model.name, model.version)

    def set_default(self, name: str, version: str) -> None:
        self.get(name, version)
        self._defaults[name] = version

    async def close(self, drain_timeout_s: float) -> None:
        """Stop every model, draining in-flight requests within ``drain_timeout_s``."""
        await asyncio.gather(*(self._remove(model, drain_timeout_s) for model in list(self)))

    async def wait_started(self, models: list[Model]) -> list[WorkerStartError]:
        outcomes = await asyncio.gather(*(w.first_start for m in models for w in m.workers))
        return [outcome for outcome in outcomes if outcome is not None]
